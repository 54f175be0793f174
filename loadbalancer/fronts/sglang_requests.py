"""SGLang's native ``/generate`` bodies -> the balancer's ``GenerateRequest`` messages, checked field by field.

The body is SGLang's ``GenerateReqInput`` as slime and SGLang's router send it: ``input_ids`` (one prompt or a
list of them) or ``text`` (a string or a list), ``sampling_params`` (one dict for every prompt, or one per
prompt) in SGLang's names, ``return_logprob``, ``return_text_in_logprobs``, ``stream``, ``rid``. A null value is
the default, as SGLang takes it. Sampling fields that would change the output and that rollmesh's engines do
not implement (penalties, ``min_p``, ``min_new_tokens``, grammars, ``stop_regex``, ``logit_bias``, custom logit
processors, prompt logprobs, top logprobs, images, LoRA) are refused by name, never ignored; fields that only
concern presentation (``spaces_between_special_tokens``: the fast tokenizers rollmesh decodes with print the
same either way; ``stream_interval``, ``custom_params``) or another server's internals (data-parallel ranks,
disaggregation bootstrap, priorities, metrics logging) are accepted and have no effect. ``n`` samples each
prompt ``n`` times, prompt-major, as SGLang orders them.

rollmesh's extra: ``min_weight_version`` at the top level (every sample's tokens come from that version or a
newer one).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any

from mesh_runtime.chat import ChatTokenizer
from mesh_runtime.validate import ID_MAX_LENGTH, ID_PATTERN, quote
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb

from .openai_requests import ApiError, bad

DEFAULT_MAX_NEW_TOKENS = 128      # SGLang's SamplingParams default
MAX_N = 128
MAX_BATCH = 1024
MAX_STOPS = 16

# sampling fields that change the output, with the value that leaves it unchanged
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
            "min_new_tokens": 0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
            "stop_regex": None, "logit_bias": None}
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
                  "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed",
                  "custom_params", "stream_interval", *_NEUTRAL}
# top-level fields that change the output, with the value that leaves it unchanged
_TOP_NEUTRAL = {"image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
                "lora_path": None, "lora_id": None, "custom_logit_processor": None, "top_logprobs_num": 0,
                "token_ids_logprob": None, "return_hidden_states": False, "return_routed_experts": False,
                "session_params": None}
_TOP_KEYS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
             "return_text_in_logprobs", "stream", "min_weight_version",
             # another server's internals: accepted, no effect here
             "data_parallel_rank", "routed_dp_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room",
             "priority", "log_metrics", "extra_key", "background", "stream_output",
             *_TOP_NEUTRAL}


@dataclasses.dataclass
class Sample:
    """One generation of a ``/generate`` call: output ``index`` of the response."""

    index: int
    request: pb.GenerateRequest
    prompt: list[int]
    stop: list[str]
    skip_special_tokens: bool
    no_stop_trim: bool


@dataclasses.dataclass
class GeneratePlan:
    """What one ``/generate`` call asks for."""

    samples: list[Sample]
    batched: bool                    # the answer is a list (several prompts, or n > 1)
    stream: bool
    return_logprob: bool
    text_in_logprobs: bool


def parse_generate(body: Any, tokenizer: ChatTokenizer, *, routing_key: str) -> GeneratePlan:
    """The plan of a ``/generate`` body; ``routing_key``: the ``X-SMG-Routing-Key`` header (the session that
    keeps a trajectory's requests on one replica)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - _TOP_KEYS)
    if unknown:
        raise bad(unknown[0], "is not a field of SGLang's /generate that rollmesh knows")
    for key, neutral in _TOP_NEUTRAL.items():
        value = body.get(key)
        if value is not None and value != neutral and value != [] and value != {}:
            raise bad(key, f"is not supported by rollmesh's engines; got {quote(value)}")
    start = body.get("logprob_start_len")
    if start is not None and start != -1:
        raise bad("logprob_start_len", f"prompt logprobs are not supported: leave it unset or -1; got {quote(start)}")
    prompts, single = _prompts(body, tokenizer)
    params = body.get("sampling_params")
    if isinstance(params, list):
        if single or len(params) != len(prompts):
            raise bad("sampling_params", f"a list must hold one dict per prompt ({len(prompts)}); "
                                         f"got {len(params)}")
        per_prompt = params
    else:
        per_prompt = [params] * len(prompts)
    return_logprob = _flag(body, "return_logprob", per_prompt=len(prompts))
    text_in_logprobs = _flag(body, "return_text_in_logprobs", per_prompt=len(prompts))
    stream = _flag(body, "stream", per_prompt=1)
    min_version = body.get("min_weight_version")
    if min_version is not None and (isinstance(min_version, bool) or not isinstance(min_version, int)
                                    or min_version < 0):
        raise bad("min_weight_version", f"must be an integer >= 0, got {quote(min_version)}")
    parsed = [_sampling(p, tokenizer, prompt) for p, prompt in zip(per_prompt, prompts)]
    total = sum(n for _, _, n in parsed)
    if total > MAX_BATCH:
        raise bad("input_ids" if "input_ids" in body else "text",
                  f"asks for {total} generations; at most {MAX_BATCH} per call")
    rids = _rids(body.get("rid"), total, single and total == 1)
    samples: list[Sample] = []
    for prompt, (sampling, meta, n) in zip(prompts, parsed):
        for _ in range(n):
            index = len(samples)
            request = pb.GenerateRequest(request_id=rids[index], prompt_token_ids=prompt, sampling_params=sampling,
                                         session_id=routing_key, partial_rollout=True)
            request.sampling_params.logprobs = True   # kept for the segments whatever the caller asked
            if min_version is not None:
                request.min_weight_version = min_version
            samples.append(Sample(index=index, request=request, prompt=prompt, **meta))
    return GeneratePlan(samples=samples, batched=not (single and total == 1), stream=stream,
                        return_logprob=return_logprob, text_in_logprobs=text_in_logprobs)


def _prompts(body: dict[str, Any], tokenizer: ChatTokenizer) -> tuple[list[list[int]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise bad("input_ids", "give exactly one of input_ids and text")
    vocab = tokenizer.core.get_vocab_size(with_added_tokens=True)
    if ids is not None:
        single = isinstance(ids, list) and bool(ids) and not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_BATCH:
            raise bad("input_ids", f"must be a list of token ids or a list of 1-{MAX_BATCH} such lists; "
                                   f"got {quote(ids)}")
        for prompt in prompts:
            if not isinstance(prompt, list) or not prompt or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise bad("input_ids", f"each prompt must be a non-empty list of token ids in [0, {vocab}); "
                                       f"got {quote(prompt)}")
        return prompts, single
    single = isinstance(text, str)
    texts = [text] if single else text
    if not isinstance(texts, list) or not texts or len(texts) > MAX_BATCH or \
            not all(isinstance(t, str) and t for t in texts):
        raise bad("text", f"must be a non-empty string or a list of 1-{MAX_BATCH} of them; got {quote(text)}")
    prompts = [tokenizer.encode(t) for t in texts]
    if not all(prompts):
        raise bad("text", "is empty after tokenization")
    return prompts, single


def _flag(body: dict[str, Any], key: str, *, per_prompt: int) -> bool:
    """A boolean, or (SGLang allows it) one per prompt, all the same."""
    value = body.get(key)
    if value is None:
        return False
    if isinstance(value, list) and len(value) == per_prompt and all(isinstance(v, bool) for v in value):
        if len(set(value)) > 1:
            raise bad(key, "must be the same for every prompt of one call")
        return value[0]
    if not isinstance(value, bool):
        raise bad(key, f"must be true or false, got {quote(value)}")
    return value


def _rids(value: Any, count: int, single: bool) -> list[str]:
    if value is None:
        base = uuid.uuid4().hex
        return [base] if single else [f"{base}/{i}" for i in range(count)]
    rids = [value] if isinstance(value, str) else value
    if not isinstance(rids, list) or not all(isinstance(r, str) for r in rids) or \
            (isinstance(value, list) and len(rids) != count):
        raise bad("rid", f"must be a string, or a list of one per generation ({count}); got {quote(value)}")
    if isinstance(value, str) and count > 1:
        rids = [f"{value}/{i}" for i in range(count)]
    for rid in rids:
        if len(rid) > ID_MAX_LENGTH or not ID_PATTERN.fullmatch(rid):
            raise bad("rid", f"must be 1-{ID_MAX_LENGTH} characters: a letter or digit, then letters, digits and "
                             f". _ - : / @ #; got {quote(rid)}")
    if len(set(rids)) != len(rids):
        raise bad("rid", f"ids must differ; got {quote(rids)}")
    return rids


def _sampling(params: Any, tokenizer: ChatTokenizer, prompt: list[int]
              ) -> tuple[generation_pb2.SamplingParams, dict[str, Any], int]:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad("sampling_params", f"must be an object, got {quote(params)}")
    unknown = sorted(set(params) - _SAMPLING_KEYS)
    if unknown:
        raise bad(f"sampling_params.{unknown[0]}", "is not a sampling parameter of SGLang that rollmesh knows")
    for key, neutral in _NEUTRAL.items():
        value = params.get(key)
        if value is not None and value != neutral and value != [] and value != {}:
            raise bad(f"sampling_params.{key}", f"is not supported by rollmesh's engines; got {quote(value)}")

    def get(key: str, default: Any) -> Any:
        value = params.get(key)
        return default if value is None else value

    max_new = get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise bad("sampling_params.max_new_tokens", f"must be an integer >= 0, got {quote(max_new)}")
    limit = tokenizer.max_model_len
    if limit is not None and len(prompt) + max_new > limit:
        raise bad("sampling_params.max_new_tokens", f"the prompt ({len(prompt)} tokens) plus max_new_tokens "
                                                    f"({max_new}) exceed the model's context of {limit} tokens")
    sampling = generation_pb2.SamplingParams(max_tokens=max_new)
    temperature = get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not math.isfinite(temperature) or temperature < 0:
        raise bad("sampling_params.temperature", f"must be a finite number >= 0, got {quote(temperature)}")
    sampling.temperature = float(temperature)
    top_p = get("top_p", 1.0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise bad("sampling_params.top_p", f"must be a number in (0, 1], got {quote(top_p)}")
    sampling.top_p = float(top_p)
    top_k = get("top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise bad("sampling_params.top_k", f"must be -1 (the whole vocabulary) or at least 1, got {quote(top_k)}")
    sampling.top_k = top_k if top_k > 0 else 0
    seed = params.get("sampling_seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise bad("sampling_params.sampling_seed", f"must be an integer >= 0, got {quote(seed)}")
        sampling.seed = seed
    stop_ids = get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise bad("sampling_params.stop_token_ids", f"must be a list of token ids, got {quote(stop_ids)}")
    sampling.stop_token_ids.extend(sorted(set(stop_ids)))
    stop = get("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise bad("sampling_params.stop", f"must be a non-empty string or a list of at most {MAX_STOPS}, "
                                          f"got {quote(stop)}")
    flags = {}
    for key, default in (("ignore_eos", False), ("skip_special_tokens", True), ("no_stop_trim", False),
                         ("spaces_between_special_tokens", True)):
        value = get(key, default)
        if not isinstance(value, bool):
            raise bad(f"sampling_params.{key}", f"must be true or false, got {quote(value)}")
        flags[key] = value
    sampling.ignore_eos = flags["ignore_eos"]
    n = get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad("sampling_params.n", f"must be an integer 1..{MAX_N}, got {quote(n)}")
    for key in ("custom_params",):
        if params.get(key) is not None and not isinstance(params[key], dict):
            raise bad(f"sampling_params.{key}", f"must be an object, got {quote(params[key])}")
    interval = params.get("stream_interval")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
        raise bad("sampling_params.stream_interval", f"must be an integer >= 1, got {quote(interval)}")
    meta = {"stop": stops, "skip_special_tokens": flags["skip_special_tokens"], "no_stop_trim": flags["no_stop_trim"]}
    return sampling, meta, n
