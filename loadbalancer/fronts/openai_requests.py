"""OpenAI request bodies -> the balancer's ``GenerateRequest`` messages, checked field by field.

A body is read once, here: every field the front honours is checked (a bad one is a 400 naming it, with
at most a short prefix of the value), fields that would change the output but are not supported are
refused rather than ignored (``echo``, ``best_of``, penalties, ``logit_bias``, more than the sampled
token's logprob), and fields that only concern presentation or other servers are ignored as OpenAI
clients send many. The result is a :class:`Plan`: one ``GenerateRequest`` per choice (``n`` per prompt)
plus what the response needs to know.

Extras beyond OpenAI's fields, vLLM's names where vLLM has one: ``top_k``, ``min_weight_version``,
``stop_token_ids``, ``ignore_eos``, ``session_id``, ``return_token_ids`` (accepted; token ids are always
returned), ``chat_template_kwargs``, ``add_generation_prompt``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from typing import Any

from mesh_runtime.chat import ChatError, ChatTokenizer
from mesh_runtime.durations import set_seconds
from mesh_runtime.errors import RollmeshError
from mesh_runtime.validate import ID_MAX_LENGTH, ID_PATTERN, SESSION_ID_MAX_LENGTH, quote
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb

MAX_N = 128
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
DEFAULT_COMPLETION_TOKENS = 16          # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 1024              # chat without max_tokens on a model whose context length is unknown


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error", 503: "service_unavailable",
             504: "timeout_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404,
               "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
               "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "ABORTED": 409, "CANCELLED": 499}


def api_error(err: RollmeshError) -> ApiError:
    """The HTTP form of a mesh error."""
    name = err.code
    status = HTTP_STATUS.get(name, 500)
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    return ApiError(status, err.message, param=(err.metadata or {}).get("field"),
                    code=str(err.reason).lower() if err.reason else name.lower(), headers=headers)


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_argument")


VERSION_POLICY_HEADER = "x-weight-version-policy"


def apply_version_policy(requests: list[pb.GenerateRequest], policy: str | None, newest: int) -> None:
    """A request's weight-version policy (the ``x-weight-version-policy`` header), as a floor on the versions
    its tokens may come from, on top of its own ``min_weight_version`` and the balancer's ``max_version_lag``:
    ``any`` (no floor), ``latest-only`` (the newest version a routed replica holds now, ``newest``),
    ``min-version:V``, ``max-staleness:K`` (at most K versions behind the newest)."""
    if policy is None:
        return
    text = policy.strip()
    floor: int | None = None
    kind, _, value = text.partition(":")
    if text == "latest-only":
        floor = newest
    elif kind in ("min-version", "max-staleness") and value.isdigit() and len(value) <= 18:
        floor = int(value) if kind == "min-version" else max(0, newest - int(value))
    elif text != "any":
        raise ApiError(400, f"{VERSION_POLICY_HEADER} must be any, latest-only, min-version:V or max-staleness:K; "
                            f"got {quote(policy)}", param=VERSION_POLICY_HEADER, code="invalid_argument")
    if floor is None:
        return
    for request in requests:
        if not request.HasField("min_weight_version") or request.min_weight_version < floor:
            request.min_weight_version = floor


EXPECTED_PAUSE_HEADER = "x-expected-pause"


def apply_expected_pause(requests: list[pb.GenerateRequest], value: str | None) -> None:
    """The ``x-expected-pause`` header: seconds until the session's next request (an agent about to run a
    tool), or 0 on its last turn; the replica holds the session's KV that long (``expected_pause``)."""
    if value is None:
        return
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= 86_400:
        raise ApiError(400, f"{EXPECTED_PAUSE_HEADER} must be seconds in [0, 86400], got {quote(value)}",
                       param=EXPECTED_PAUSE_HEADER, code="invalid_argument")
    for request in requests:
        if request.session_id:
            set_seconds(request.expected_pause, seconds)


@dataclasses.dataclass
class Plan:
    """What one HTTP request asks for."""

    kind: str                                   # "completion" or "chat"
    response_id: str
    model: str
    prompts: list[list[int]]
    requests: list[pb.GenerateRequest]          # choice i: requests[i], prompt i // n
    n: int
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    tools: list[dict[str, Any]] | None = None   # the chat's tools when the output is parsed for calls
    timeout_s: float | None = None

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]


class Fields:
    """Typed reads of a JSON body, each failure a 400 naming the field."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        self.body = body

    def get(self, key: str) -> Any:
        return self.body.get(key)

    def integer(self, key: str, default: int | None, *, low: int, high: int | None = None) -> int | None:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise bad(key, f"must be an integer {span}, got {quote(value)}")
        return value

    def number(self, key: str, *, low: float, high: float, low_open: bool = False) -> float | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value > high or value < low or (low_open and value == low):
            raise bad(key, f"must be a number in {'(' if low_open else '['}{low}, {high}], got {quote(value)}")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad(key, f"must be true or false, got {quote(value)}")
        return value

    def text(self, key: str, *, max_length: int = 1024) -> str | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or len(value) > max_length:
            raise bad(key, f"must be a string of at most {max_length} characters, got {quote(value)}")
        return value

    def refuse(self, key: str, allowed: tuple[Any, ...], why: str) -> None:
        """A 400 for ``key`` set to anything but null or one of ``allowed``."""
        value = self.body.get(key)
        if value is not None and value not in allowed:
            raise bad(key, f"{why}; got {quote(value)}")


def parse_completion(body: Any, tokenizer: ChatTokenizer, served: set[str], *, request_id: str,
                     session_id: str, timeout_s: float | None) -> Plan:
    f = Fields(body)
    model = _model(f, served)
    prompt = f.get("prompt")
    if prompt is None:
        raise bad("prompt", "required")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts_in = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts_in = prompt
    else:
        raise bad("prompt", f"must be a string, a list of token ids, or a non-empty list of either; got "
                            f"{quote(prompt)}")
    prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts_in]
    _check_prompts(prompts, tokenizer)
    f.refuse("echo", (False,), "echo is not supported (the prompt's token ids are returned as prompt_token_ids)")
    f.refuse("suffix", ("",), "suffix is not supported")
    if (best_of := f.integer("best_of", None, low=1)) is not None and best_of != (f.get("n") or 1):
        raise bad("best_of", "best_of other than n is not supported")
    logprobs = f.integer("logprobs", None, low=0, high=1)   # the sampled token's only: 0 or 1
    plan = _plan(f, "completion", model, prompts, tokenizer, request_id=request_id, session_id=session_id,
                 timeout_s=timeout_s, default_max=DEFAULT_COMPLETION_TOKENS, prefix="cmpl")
    plan.logprobs, plan.top_logprobs = logprobs is not None, logprobs or 0
    return _with_logprobs(plan)


def parse_chat(body: Any, tokenizer: ChatTokenizer, served: set[str], *, request_id: str, session_id: str,
               timeout_s: float | None) -> Plan:
    f = Fields(body)
    model = _model(f, served)
    messages = _messages(f.get("messages"))
    tools = _tools(f.get("tools"))
    tool_choice = f.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise bad("tool_choice", f"only 'auto' and 'none' are supported, got {quote(tool_choice)}")
    if tool_choice == "none":
        tools = None
    extra = f.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise bad("chat_template_kwargs", f"must be an object, got {quote(extra)}")
    try:
        prompt = tokenizer.encode_chat(messages, tools=tools,
                                       add_generation_prompt=f.flag("add_generation_prompt", True))
    except ChatError as err:
        raise bad("messages", str(err)) from None
    _check_prompts([prompt], tokenizer)
    if f.get("max_completion_tokens") is not None:
        f.body.setdefault("max_tokens", f.get("max_completion_tokens"))
    default_max = DEFAULT_CHAT_TOKENS
    if tokenizer.max_model_len is not None:
        default_max = max(1, tokenizer.max_model_len - len(prompt))
    plan = _plan(f, "chat", model, [prompt], tokenizer, request_id=request_id, session_id=session_id,
                 timeout_s=timeout_s, default_max=default_max, prefix="chatcmpl")
    plan.logprobs = f.flag("logprobs")
    plan.top_logprobs = f.integer("top_logprobs", 0, low=0, high=1) or 0
    if plan.top_logprobs and not plan.logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    plan.tools = tools
    return _with_logprobs(plan)


def _with_logprobs(plan: Plan) -> Plan:
    for request in plan.requests:
        request.sampling_params.logprobs = plan.logprobs
    return plan


def _model(f: Fields, served: set[str]) -> str:
    model = f.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"required: one of {', '.join(sorted(served))}")
    if model not in served:
        raise ApiError(404, f"model {quote(model)} is not served here; this balancer serves "
                            f"{', '.join(sorted(served))}", param="model", code="model_not_found")
    return model


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in value)


def _check_prompts(prompts: list[list[int]], tokenizer: ChatTokenizer) -> None:
    vocab = tokenizer.core.get_vocab_size(with_added_tokens=True)
    for prompt in prompts:
        if not prompt:
            raise bad("prompt", "is empty after tokenization")
        if any(t < 0 or t >= vocab for t in prompt):
            raise bad("prompt", f"token ids must be in [0, {vocab}); got {quote(prompt)}")


def _plan(f: Fields, kind: str, model: str, prompts: list[list[int]], tokenizer: ChatTokenizer, *,
          request_id: str, session_id: str, timeout_s: float | None, default_max: int, prefix: str) -> Plan:
    for key in ("presence_penalty", "frequency_penalty"):
        f.refuse(key, (0, 0.0), "penalties are not supported")
    if f.get("logit_bias"):
        raise bad("logit_bias", "is not supported")
    n = f.integer("n", 1, low=1, high=MAX_N) or 1
    max_tokens = f.integer("max_tokens", default_max, low=1) or default_max
    longest = max(len(p) for p in prompts)
    if tokenizer.max_model_len is not None and longest + max_tokens > tokenizer.max_model_len:
        raise bad("max_tokens", f"the prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceed the model's "
                                f"context of {tokenizer.max_model_len} tokens")
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens)
    temperature = f.number("temperature", low=0.0, high=2.0)
    if temperature is not None:
        sampling.temperature = temperature
    top_p = f.number("top_p", low=0.0, high=1.0, low_open=True)
    if top_p is not None:
        sampling.top_p = top_p
    top_k = f.integer("top_k", 0, low=-1) or 0
    sampling.top_k = top_k if top_k > 0 else 0
    if (seed := f.integer("seed", None, low=0, high=2**63 - 1)) is not None:
        sampling.seed = seed
    stop_ids = f.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise bad("stop_token_ids", f"must be a list of token ids, got {quote(stop_ids)}")
    sampling.stop_token_ids.extend(stop_ids)
    sampling.ignore_eos = f.flag("ignore_eos")
    stop = f.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > 16 or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"must be a non-empty string or a list of at most 16 of them, got {quote(stop)}")
    min_version = f.integer("min_weight_version", None, low=0)
    session = f.text("session_id", max_length=SESSION_ID_MAX_LENGTH) or session_id \
        or (f.text("user", max_length=SESSION_ID_MAX_LENGTH) or "")
    stream = f.flag("stream")
    options = f.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", f"must be an object, got {quote(options)}")
    f.flag("return_token_ids", True)   # accepted for vLLM's clients: token ids are always returned
    rid = request_id or uuid.uuid4().hex
    requests = []
    for choice in range(n * len(prompts)):
        request = pb.GenerateRequest(
            request_id=rid if n * len(prompts) == 1 else f"{rid}/{choice}", prompt_token_ids=prompts[choice // n],
            sampling_params=sampling, session_id=session, partial_rollout=True)
        if min_version is not None:
            request.min_weight_version = min_version
        requests.append(request)
    return Plan(kind=kind, response_id=f"{prefix}-{rid}", model=model, prompts=prompts, requests=requests, n=n,
                stream=stream, include_usage=bool(options.get("include_usage")), stop=stops, timeout_s=timeout_s)


def check_request_id(value: str) -> str:
    """The ``x-request-id`` header: an id as the mesh takes it (choices append ``/<index>``)."""
    if value and (len(value) > ID_MAX_LENGTH - 4 or not ID_PATTERN.fullmatch(value)):
        raise ApiError(400, f"x-request-id must be 1-{ID_MAX_LENGTH - 4} characters: a letter or digit, then "
                            f"letters, digits and . _ - : / @ #; got {quote(value)}", param="x-request-id",
                       code="invalid_id")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages", f"must be a non-empty list of messages, got {quote(value)}")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(sorted(CHAT_ROLES))}; got "
                                       f"{quote(message.get('role') if isinstance(message, dict) else message)}")
        content = message.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise bad(f"{where}.content", f"must be a string, a list of text parts or null, got {quote(content)}")
        if content is None and not message.get("tool_calls"):
            raise bad(f"{where}.content", "required unless the message has tool_calls")
        entry = {**message, "role": "system" if message["role"] == "developer" else message["role"],
                 "content": content}
        if message.get("tool_calls") is not None:
            entry["tool_calls"] = _message_tool_calls(message["tool_calls"], where)
        out.append(entry)
    return out


def _message_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls", f"must be a list, got {quote(calls)}")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{where}.tool_calls[{j}].function", f"needs a name and arguments, got {quote(call)}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                raise bad(f"{where}.tool_calls[{j}].function.arguments",
                          f"must be JSON text, got {quote(arguments)}") from None
        out.append({**call, "function": {"name": function["name"], "arguments": arguments}})
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise bad("tools", f"must be a list of function tools, got {quote(value)}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"tools[{i}]", f"must be {{type: function, function: {{name, parameters}}}}, got {quote(tool)}")
    return value
