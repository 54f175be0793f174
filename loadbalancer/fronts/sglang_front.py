"""SGLang's native HTTP API on the balancer's HTTP front: ``/generate``, ``/abort_request``, ``/flush_cache`` and
the server queries slime and SGLang's router call (``/health_generate``, ``/get_model_info``,
``/get_server_info``).

A ``/generate`` call (parsed in :mod:`.sglang_requests`) runs each of its generations through the same
:class:`~loadbalancer.balancer.Balancer` as gRPC ``Generate`` and the OpenAI API: the same routing (the
``X-SMG-Routing-Key`` header keys stickiness, as SMG's consistent hashing does), retries and resumes with
the tokens so far, ``min_weight_version``, deadlines (``x-request-timeout``). Answers are SGLang's: ``text``,
``output_ids`` and ``meta_info`` with ``id``, ``finish_reason`` (``{"type": "stop", "matched": token id or
string}``, ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}``), ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``e2e_latency``, ``weight_version`` (the version that made the last
token, as a string, SGLang's type) and, with ``return_logprob``, ``output_token_logprobs`` as
``[logprob, token id, text or null]``; rollmesh adds ``segments`` (runs of tokens by weight version and
replica). One prompt with ``n`` 1 answers an object, anything else a list in prompt-major order. Streamed
as SGLang streams by default: server-sent events, each holding the whole output so far (``index`` names the
generation of a batch), the last with its ``finish_reason``, then ``data: [DONE]``.

``/abort_request`` (``{"rid": ...}`` or ``{"abort_all": true}``) ends those generations that run through
this front: each ``/generate`` answers with what it generated so far and ``finish_reason`` ``abort``, as
SGLang does, so a caller (slime's partial rollout) can send prompt + partial output again.

Security, admission (``http_max_in_flight``) and errors are the front's (:mod:`.openai_front`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import propagate

from mesh_runtime.chat import ChatTokenizer
from mesh_runtime.errors import RollmeshError
from mesh_runtime.validate import SESSION_ID_MAX_LENGTH, quote
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1.loadbalancer_pb2 import GenerateRequest

from ..balancer import Balancer
from ..config import LoadBalancerConfig
from .detokenize import IncrementalDecoder
from .openai_choices import ChoiceRun
from .openai_requests import VERSION_POLICY_HEADER, ApiError, api_error, apply_version_policy, bad
from .sglang_requests import GeneratePlan, Sample, parse_generate

ROUTING_KEY = "X-SMG-Routing-Key"
HEALTH_TIMEOUT_S = 20.0


class Front(Protocol):
    """What these endpoints share with the HTTP front that serves them."""

    config: LoadBalancerConfig
    balancer: Balancer
    tokenizer: ChatTokenizer
    model_name: str

    def call_options(self, request: web.Request) -> dict[str, Any]: ...

    def admitted(self, count: int) -> contextlib.AbstractContextManager[None]: ...

    def require_control(self, request: web.Request) -> None: ...


@dataclasses.dataclass
class _Flight:
    """One generation in flight through this front."""

    task: asyncio.Task
    aborted: bool = False


class SglangApi:
    """See the module docstring. ``front``: the :class:`~loadbalancer.fronts.openai_front.OpenAIFront` whose
    listener, balancer, tokenizer and admission these endpoints share."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self._flights: dict[str, _Flight] = {}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_route("GET", "/flush_cache", self.flush_cache)
        app.router.add_route("POST", "/flush_cache", self.flush_cache)

    # ------------------------------------------------------------ generate
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        call = self.front.call_options(request)
        key = request.headers.get(ROUTING_KEY, "")
        if len(key) > SESSION_ID_MAX_LENGTH:
            raise bad(ROUTING_KEY, f"must be at most {SESSION_ID_MAX_LENGTH} characters, got {quote(key)}")
        plan = parse_generate(body, self.front.tokenizer, routing_key=key or call["session_id"])
        apply_version_policy([s.request for s in plan.samples], request.headers.get(VERSION_POLICY_HEADER),
                             self.front.balancer.table.newest_version)
        busy = [s.request.request_id for s in plan.samples if s.request.request_id in self._flights]
        if busy:
            raise ApiError(409, f"rid {quote(busy[0])} is already in flight", param="rid", code="request_in_flight")
        with self.front.admitted(len(plan.samples)):
            token = otel_context.attach(propagate.extract(dict(request.headers)))
            try:
                if plan.stream:
                    return await self._stream(request, plan, call["timeout_s"])
                outputs = await asyncio.gather(*(self._run(s, plan, call["timeout_s"]) for s in plan.samples))
                return web.json_response(outputs if plan.batched else outputs[0])
            finally:
                otel_context.detach(token)

    async def _run(self, sample: Sample, plan: GeneratePlan, timeout_s: float | None,
                   queue: asyncio.Queue | None = None) -> dict[str, Any]:
        """One generation to its end (or its abort); with ``queue``, every step's output goes there too."""
        started = time.monotonic()
        rid = sample.request.request_id
        run = ChoiceRun(sample.request, self.front.tokenizer, stop=sample.stop, parse_tools=False,
                        generate=lambda r: self.front.balancer.generate(r, timeout_s), call_prefix="",
                        text_deltas=False)
        state = {"version": 0}
        decoder = IncrementalDecoder(self.front.tokenizer, skip_special_tokens=sample.skip_special_tokens)

        async def consume() -> None:
            if sample.request.sampling_params.max_tokens == 0:   # SGLang's prefill-only call: nothing to make
                run.result.finish_reason = "length"
                return
            async for delta in run.deltas():
                state["version"] = delta.weight_version
                if queue is not None and delta.finish_reason is None:
                    decoder.extend(delta.token_ids)   # each chunk carries the whole text so far
                    await queue.put(self._output(sample, plan, run, state["version"], None, started, decoder.text))

        flight = _Flight(asyncio.get_running_loop().create_task(consume()))
        self._flights[rid] = flight
        try:
            await flight.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not flight.aborted or (current is not None and current.cancelling()):
                flight.task.cancel()
                raise
        finally:
            self._flights.pop(rid, None)
        reason = "aborted here" if flight.aborted else run.result.finish_reason
        out = self._output(sample, plan, run, state["version"], reason, started)
        if queue is not None:
            await queue.put(out)
        return out

    def _output(self, sample: Sample, plan: GeneratePlan, run: ChoiceRun, version: int, reason: str | None,
                started: float, text_so_far: str = "") -> dict[str, Any]:
        """One step's output (``reason`` None: ``text_so_far`` is its text, without a character still being
        decoded) or the last one (the whole completion decoded once)."""
        tokenizer = self.front.tokenizer
        result = run.result
        ids = list(result.token_ids)
        finish: dict[str, Any] | None = None
        text = text_so_far if reason is None else tokenizer.decode(ids, skip_special_tokens=sample.skip_special_tokens)
        if reason == "length":
            finish = {"type": "length", "length": len(ids)}
        elif reason in ("abort", "aborted here"):
            finish = {"type": "abort", "message": "aborted by /abort_request" if reason == "aborted here"
                      else "the fleet aborted the request"}
        elif reason is not None:
            matched = _matched_string(tokenizer.decode(ids), result.text, sample.stop)
            if matched is not None:
                finish = {"type": "stop", "matched": matched}
                if not sample.no_stop_trim:
                    cut = text.find(matched)
                    text = text[:cut] if cut >= 0 else text
            else:
                finish = {"type": "stop", "matched": ids[-1] if ids else None}
        if result.segments and reason is not None:
            version = result.segments[-1]["weight_version"]
        meta: dict[str, Any] = {"id": sample.request.request_id, "finish_reason": finish,
                                "prompt_tokens": len(sample.prompt), "completion_tokens": len(ids),
                                "cached_tokens": result.cached_tokens, "weight_version": str(version)}
        if plan.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, tokenizer.token_text(t) if plan.text_in_logprobs else None]
                for lp, t in zip(result.logprobs, ids)]
        if reason is not None:
            meta["e2e_latency"] = time.monotonic() - started
            meta["segments"] = result.segments
            versions = sorted({s["weight_version"] for s in result.segments})
            meta["weight_versions"] = versions
            meta["spans_versions"] = len(versions) > 1
        out: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
        if plan.batched and plan.stream:
            out["index"] = sample.index
        return out

    async def _stream(self, request: web.Request, plan: GeneratePlan, timeout_s: float | None
                      ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(sample: Sample) -> None:
            try:
                await self._run(sample, plan, timeout_s, queue)
            except BaseException as err:  # noqa: BLE001 - handed to the writer, which reports it
                await queue.put(err)

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(pump(s)) for s in plan.samples]
        try:
            item = await queue.get()   # an error before any output is an HTTP error, not a stream
            if isinstance(item, BaseException):
                raise item
            await response.prepare(request)
            open_samples = len(plan.samples)
            while True:
                if isinstance(item, BaseException):
                    error = _api_error(item)
                    await response.write(_sse(error.body()))
                    break
                await response.write(_sse(item))
                if item["meta_info"]["finish_reason"] is not None:
                    open_samples -= 1
                    if open_samples == 0:
                        break
                item = await queue.get()
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ abort
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str):
            raise bad("rid", f"must be a string, got {quote(rid)}")
        if not isinstance(abort_all, bool):
            raise bad("abort_all", f"must be true or false, got {quote(abort_all)}")
        if not rid and not abort_all:
            raise bad("rid", "give the rid of a generation, or abort_all: true")
        return web.json_response({"aborted": self.end(
            lambda r: abort_all or r == rid or r.startswith(f"{rid}/"))})

    def end(self, which: Callable[[str], bool]) -> list[str]:
        """Abort the generations in flight whose rid ``which`` accepts; their ids, sorted."""
        ended = sorted(r for r in self._flights if which(r))
        for r in ended:
            flight = self._flights[r]
            flight.aborted = True
            flight.task.cancel()
        return ended

    def running(self) -> list[str]:
        """The rids of the generations in flight through these endpoints."""
        return list(self._flights)

    # ------------------------------------------------------------ server queries
    async def health_generate(self, request: web.Request) -> web.Response:
        """Healthy when one token can be generated through the fleet now (within ``HEALTH_TIMEOUT_S``, the
        probe's deadline in the balancer)."""
        prompt = self.front.tokenizer.encode("ping") or [0]
        probe = GenerateRequest(request_id=f"health-{time.monotonic_ns()}", prompt_token_ids=prompt,
                                sampling_params=generation_pb2.SamplingParams(max_tokens=1, temperature=0.0))
        try:
            async for _ in self.front.balancer.generate(probe, HEALTH_TIMEOUT_S):
                pass
        except RollmeshError as err:
            raise ApiError(503, f"the fleet cannot generate: {err.message}", code="unhealthy") from None
        return web.json_response({})

    def _info(self) -> dict[str, Any]:
        front = self.front
        return {"model_path": front.config.model, "tokenizer_path": front.config.model,
                "served_model_name": front.model_name, "is_generation": True,
                "weight_version": str(front.balancer.table.newest_version),
                "context_length": front.tokenizer.max_model_len}

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self._info(), "preferred_sampling_params": None,
                                  "has_image_understanding": False, "has_audio_understanding": False})

    async def server_info(self, request: web.Request) -> web.Response:
        table = self.front.balancer.table
        return web.json_response({**self._info(), "router": "rollmesh", "skip_tokenizer_init": False,
                                  "routable_replicas": len(table.eligible(None)),
                                  "in_flight": self.front.balancer.in_flight})


    async def flush_cache(self, request: web.Request, replica_ids: list[str] | None = None) -> web.Response:
        """SGLang's ``/flush_cache`` on every routed replica (``replica_ids``: those): each drops its cached
        prefixes; one whose engine keeps its cache while requests hold blocks of it (SGLang, vLLM) makes the
        answer a 400 naming it, as SGLang's is, and the others are flushed."""
        self.front.require_control(request)
        ids = replica_ids if replica_ids is not None else sorted(self.front.balancer.table.routes)
        answers = await self.front.balancer.control.flush_cache(ids)
        refused = {rid: why for rid, why in answers.items() if why}
        flushed = [rid for rid in answers if rid not in refused]
        if refused:
            first = next(iter(refused))
            raise ApiError(400, f"Cache not flushed on {len(refused)} replica(s) ({first}: {refused[first]}); "
                                f"flushed on {len(flushed)}", code="cache_in_use")
        return web.json_response({"message": "Cache flushed.", "flushed": flushed})


async def json_body(request: web.Request) -> Any:
    """The request's JSON body (400 ``invalid_json`` when it is not JSON)."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None


async def json_object(request: web.Request) -> dict[str, Any]:
    """The request's JSON body, which must be an object."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _matched_string(full: str, kept: str, stops: list[str]) -> str | None:
    """The stop string that ended a generation whose text was cut to ``kept`` (None: a token stopped it)."""
    if not stops or len(kept) >= len(full):
        return None
    rest = full[len(kept):]
    found = [s for s in stops if rest.startswith(s)]
    return max(found, key=len) if found else None


def _api_error(err: BaseException) -> ApiError:
    if isinstance(err, ApiError):
        return err
    if isinstance(err, RollmeshError):
        return api_error(err)
    return ApiError(500, f"internal error: {str(err)[:200]}")


def _sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
