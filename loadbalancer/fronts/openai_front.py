"""The balancer's OpenAI-compatible HTTP API (``http_listen``): models, completions, chat, sessions.

Requests run through the same :class:`~loadbalancer.balancer.Balancer` as gRPC ``Generate``: the same
routing (a session from the ``x-session-id`` header, the body's ``session_id`` or ``user``), retries and
resumes with the tokens so far, one result per request id (the ``x-request-id`` header; choice ``i`` of
several is ``<id>/<i>``), ``min_weight_version`` and deadlines (``x-request-timeout`` or the openai
client's ``x-stainless-timeout``, in seconds). The prompt is tokenized, and a chat rendered with the
model's chat template, here (:mod:`mesh_runtime.chat`), so every response carries the exact ids.

Token ids follow vLLM's ``return_token_ids`` convention, always on: ``prompt_token_ids`` (on each
completion choice; at the top of a chat response or of its first streamed chunk) and ``token_ids`` on
each choice or streamed delta. rollmesh adds ``segments`` to a finished choice (runs of tokens by weight
version and replica: ``{weight_version, num_tokens, replica_id}``) and ``weight_version`` to each streamed
chunk. Errors use OpenAI's shape with the HTTP status of the mesh's error (400 naming the field, 404
unknown model, 409 request id in flight, 429 with Retry-After, 503 no replica, 504 deadline).

Security as on gRPC: with ``tls`` the listener is HTTPS and requires a client certificate of the mesh's
CA naming a client, trainer-agent or operator (unless ``http_plaintext``); ``http_api_token`` requires
``Authorization: Bearer``; plaintext without a token only on loopback (the config refuses it elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import propagate

from mesh_runtime.chat import ChatTokenizer
from mesh_runtime.errors import RollmeshError
from mesh_runtime.net import format_host_port, parse_host_port
from mesh_runtime.validate import quote
from rollmesh.loadbalancer.v1.loadbalancer_pb2 import GenerateRequest, GenerateResponse

from ..balancer import Balancer
from ..config import LoadBalancerConfig
from .openai_choices import ChoiceResult, ChoiceRun, Delta
from .openai_requests import (EXPECTED_PAUSE_HEADER, VERSION_POLICY_HEADER, ApiError, Plan, api_error,
                              apply_expected_pause, apply_version_policy, check_request_id, parse_chat,
                              parse_completion)
from .sglang_front import SglangApi
from .sglang_workers import WorkerApi
from .smg_rl import RlApi

log = logging.getLogger(__name__)

CALLER_ROLES = frozenset({"client", "trainer-agent", "operator"})
CONTROL_ROLES = frozenset({"trainer-agent", "operator"})
"""Roles that may change the fleet over HTTP (add or remove workers, pause): on a mutual-TLS listener."""
MAX_BODY_BYTES = 32 * 1024 * 1024
_RELOAD_CHECK_S = 30.0


class OpenAIFront:
    """Serves the HTTP API on ``config.http_listen`` for ``balancer``."""

    def __init__(self, config: LoadBalancerConfig, balancer: Balancer, tokenizer: ChatTokenizer, *,
                 controller: grpc.aio.Channel | None = None) -> None:
        """``controller``: a channel to the controller, through which SGLang's worker API changes the fleet."""
        self.config = config
        self.controller = controller
        self.balancer = balancer
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or tokenizer.name or config.model
        self.served = {self.model_name, config.model}
        self.created = int(time.time())
        self.in_flight = 0
        self.address = ""
        self._runner: web.AppRunner | None = None
        self._ssl: ssl.SSLContext | None = None
        self._tls_stamp: tuple[float, ...] = ()
        self._tls_checked = 0.0

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_delete("/v1/sessions/{session_id}", self.close_session)
        app.router.add_get("/health", self.health)
        sglang = SglangApi(self)
        sglang.add_routes(app)
        WorkerApi(self, sglang, self.controller).add_routes(app)
        RlApi(self, self.controller).add_routes(app)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        host, port = parse_host_port(self.config.http_listen)
        if self.config.tls is not None and not self.config.http_plaintext:
            self._ssl = self._ssl_context()
        site = web.TCPSite(self._runner, host, port, ssl_context=self._ssl, reuse_port=False)
        await site.start()
        bound = site._server.sockets[0].getsockname()   # type: ignore[union-attr]
        self.address = format_host_port(host, bound[1])
        log.info("OpenAI-compatible API on %s://%s/v1 (model %s)", "https" if self._ssl else "http", self.address,
                 self.model_name)
        return self.address

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _ssl_context(self) -> ssl.SSLContext:
        tls = self.config.tls
        assert tls is not None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_cert_chain(tls.cert, tls.key)
        context.load_verify_locations(tls.ca)
        self._tls_stamp = self._stamp()
        return context

    def _stamp(self) -> tuple[float, ...]:
        tls = self.config.tls
        assert tls is not None
        return tuple(os.stat(p).st_mtime for p in (tls.cert, tls.key, tls.ca))

    def _reload_tls(self) -> None:
        """Rotated certificate files take effect for new connections (checked at most every 30 s)."""
        now = time.monotonic()
        if self._ssl is None or now - self._tls_checked < _RELOAD_CHECK_S:
            return
        self._tls_checked = now
        with contextlib.suppress(OSError, ssl.SSLError):
            stamp = self._stamp()
            if stamp != self._tls_stamp:
                tls = self.config.tls
                assert tls is not None
                self._ssl.load_cert_chain(tls.cert, tls.key)
                self._ssl.load_verify_locations(tls.ca)
                self._tls_stamp = stamp
                log.info("HTTP API: reloaded the rotated TLS files")

    # ------------------------------------------------------------ middleware
    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        smg = request.path.startswith("/v1/rl/")   # SMG's error shape there: {"error": CODE, "message"}
        try:
            if request.path != "/health":
                self._authorize(request)
            return await handler(request)
        except ApiError as err:
            return _error_response(err, smg)
        except RollmeshError as err:
            return _error_response(api_error(err), smg)
        except web.HTTPRequestEntityTooLarge:
            return _error_response(ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes"))
        except web.HTTPNotFound:
            return _error_response(ApiError(404, f"no such endpoint: {request.method} {quote(request.path)}; "
                                                 "this server has /v1/models, /v1/completions, "
                                                 "/v1/chat/completions, DELETE /v1/sessions/ID and SGLang's "
                                                 "/generate, /abort_request, /health, /health_generate, "
                                                 "/get_model_info, /get_server_info, /v1/loads, "
                                                 "/workers and /v1/rl/*",
                                            code="unknown_url"), smg)
        except web.HTTPMethodNotAllowed as err:
            return _error_response(ApiError(405, f"{request.method} is not allowed on {request.path}; use "
                                                 f"{', '.join(sorted(err.allowed_methods))}",
                                            code="method_not_allowed"))

    def _authorize(self, request: web.Request) -> None:
        if self._ssl is not None:
            self._reload_tls()
            self._check_certificate(request)
        token = self.config.http_api_token
        if token:
            given = request.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
                raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _check_certificate(self, request: web.Request) -> None:
        from mesh_runtime.identity import identity_from_pem  # noqa: PLC0415

        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        identity = identity_from_pem(ssl.DER_cert_to_PEM_cert(der).encode()) if der else None
        request["rollmesh.identity"] = identity
        if identity is None or identity.role not in CALLER_ROLES:
            role = identity.role if identity is not None else "none"
            raise ApiError(403, f"this API takes callers whose certificate names a role of "
                                f"{', '.join(sorted(CALLER_ROLES))}; yours names {quote(role)}",
                           code="permission_denied")

    def require_control(self, request: web.Request) -> None:
        """On a mutual-TLS listener, only a trainer agent's or an operator's certificate may change the fleet
        (add or remove workers, pause and resume them); a client's may generate and read."""
        identity = request.get("rollmesh.identity")
        if self._ssl is not None and (identity is None or identity.role not in CONTROL_ROLES):
            role = identity.role if identity is not None else "none"
            raise ApiError(403, f"changing the fleet takes a certificate naming a role of "
                                f"{', '.join(sorted(CONTROL_ROLES))}; yours names {quote(role)}",
                           code="permission_denied")

    # ------------------------------------------------------------ endpoints
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rollmesh",
             "max_model_len": self.tokenizer.max_model_len}]})

    async def close_session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        replica_id, released = await self.balancer.control.close_session(session_id)
        return web.json_response({"session_id": session_id, "closed": True, "replica_id": replica_id or None,
                                  "released": released})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        plan = parse_completion(body, self.tokenizer, self.served, **self.call_options(request))
        return await self._serve(request, plan)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        plan = parse_chat(body, self.tokenizer, self.served, **self.call_options(request))
        return await self._serve(request, plan)

    def call_options(self, request: web.Request) -> dict[str, Any]:
        """The request id, session and deadline a call's headers give."""
        headers = request.headers
        timeouts = []
        for name in ("x-request-timeout", "x-stainless-timeout"):
            if name in headers:
                try:
                    value = float(headers[name])
                except ValueError:
                    raise ApiError(400, f"{name} must be seconds, got {quote(headers[name])}", param=name,
                                   code="invalid_argument") from None
                if not value > 0:
                    raise ApiError(400, f"{name} must be > 0, got {quote(headers[name])}", param=name,
                                   code="invalid_argument")
                timeouts.append(value)
        session = headers.get("x-session-id", "")
        if len(session) > 256:
            raise ApiError(400, f"x-session-id must be at most 256 characters, got {quote(session)}",
                           param="x-session-id", code="invalid_session_id")
        return {"request_id": check_request_id(headers.get("x-request-id", "")), "session_id": session,
                "timeout_s": min(timeouts) if timeouts else None}

    # ------------------------------------------------------------ generation
    async def _serve(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        apply_version_policy(plan.requests, request.headers.get(VERSION_POLICY_HEADER),
                             self.balancer.table.newest_version)
        apply_expected_pause(plan.requests, request.headers.get(EXPECTED_PAUSE_HEADER))
        with self.admitted(len(plan.requests)):
            return await self._serve_admitted(request, plan)

    @contextlib.contextmanager
    def admitted(self, count: int) -> Iterator[None]:
        """``count`` generations admitted for as long as the block runs (429 beyond ``http_max_in_flight``)."""
        if self.in_flight + count > self.config.http_max_in_flight:
            raise ApiError(429, f"the HTTP API runs {self.in_flight} generations and admits at most "
                                f"{self.config.http_max_in_flight}; retry later", code="front_overloaded",
                           headers={"Retry-After": "1"})
        self.in_flight += count
        try:
            yield
        finally:
            self.in_flight -= count

    async def _serve_admitted(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        token = otel_context.attach(propagate.extract(dict(request.headers)))
        try:
            runs = [ChoiceRun(r, self.tokenizer, stop=plan.stop, parse_tools=plan.tools is not None,
                              generate=self._generator(plan), call_prefix=f"call-{uuid.uuid4().hex[:12]}-{i}")
                    for i, r in enumerate(plan.requests)]
            if plan.stream:
                return await self._stream(request, plan, runs)
            results = await asyncio.gather(*(_drain(run) for run in runs))
            return web.json_response(self._response(plan, results))
        finally:
            otel_context.detach(token)

    def _generator(self, plan: Plan) -> Callable[[GenerateRequest], AsyncIterator[GenerateResponse]]:
        def generate(request: GenerateRequest) -> AsyncIterator[GenerateResponse]:
            return self.balancer.generate(request, plan.timeout_s)
        return generate

    def _response(self, plan: Plan, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            choice: dict[str, Any] = {"index": index, "finish_reason": result.finish_reason,
                                      "token_ids": result.token_ids, "segments": result.segments}
            if plan.kind == "chat":
                content = result.text[:result.text.find("<tool_call>")].strip() if result.tool_calls \
                    else result.text
                choice["message"] = {"role": "assistant", "content": content or None if result.tool_calls
                                     else content}
                if result.tool_calls:
                    choice["message"]["tool_calls"] = [c.to_openai() for c in result.tool_calls]
                choice["logprobs"] = self._chat_logprobs(plan, result.token_ids, result.logprobs)
            else:
                choice["text"] = result.text
                choice["prompt_token_ids"] = plan.prompt_of(index)
                choice["logprobs"] = self._completion_logprobs(plan, result.token_ids, result.logprobs)
            choices.append(choice)
        response: dict[str, Any] = {
            "id": plan.response_id, "object": "chat.completion" if plan.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": plan.model, "choices": choices,
            "usage": _usage(plan, sum(len(r.token_ids) for r in results), sum(r.cached_tokens for r in results))}
        if plan.kind == "chat":
            response["prompt_token_ids"] = plan.prompts[0]
        return response

    async def _stream(self, request: web.Request, plan: Plan, runs: list[ChoiceRun]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, run: ChoiceRun) -> None:
            try:
                async for delta in run.deltas():
                    await queue.put((index, delta))
            except BaseException as err:  # noqa: BLE001 - handed to the writer, which reports it
                await queue.put((index, err))

        tasks = [asyncio.get_running_loop().create_task(pump(i, run)) for i, run in enumerate(runs)]
        try:
            index, item = await queue.get()    # an error before any output is an HTTP error, not a stream
            if isinstance(item, BaseException):
                raise item
            await response.prepare(request)
            written = [0] * len(runs)
            open_choices = len(runs)
            while True:
                await self._write(response, plan, index, item, written)
                written[index] += 1
                if item.finish_reason is not None:
                    open_choices -= 1
                    if open_choices == 0:
                        break
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    error = api_error(item) if isinstance(item, RollmeshError) else \
                        item if isinstance(item, ApiError) else ApiError(500, f"internal error: {item}")
                    await response.write(_sse(error.body()))
                    break
            if plan.include_usage:
                tokens = sum(len(r.result.token_ids) for r in runs)
                cached = sum(r.result.cached_tokens for r in runs)
                await response.write(_sse(self._chunk(plan, [], usage=_usage(plan, tokens, cached))))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _write(self, response: web.StreamResponse, plan: Plan, index: int, delta: Delta,
                     written: list[int]) -> None:
        run_tokens = delta.token_ids
        choice: dict[str, Any] = {"index": index, "finish_reason": delta.finish_reason, "token_ids": run_tokens,
                                  "weight_version": delta.weight_version}
        if plan.kind == "chat":
            message: dict[str, Any] = {"content": delta.text}
            if written[index] == 0:
                message["role"] = "assistant"
            if delta.tool_calls:
                message["tool_calls"] = [{"index": i, **call.to_openai()} for i, call in enumerate(delta.tool_calls)]
            choice["delta"] = message
            choice["logprobs"] = self._chat_logprobs(plan, run_tokens, delta.logprobs)
        else:
            choice["text"] = delta.text
            choice["logprobs"] = self._completion_logprobs(plan, run_tokens, delta.logprobs)
            if written[index] == 0:
                choice["prompt_token_ids"] = plan.prompt_of(index)
        chunk = self._chunk(plan, [choice])
        if plan.kind == "chat" and sum(written) == 0:
            chunk["prompt_token_ids"] = plan.prompts[0]
        await response.write(_sse(chunk))

    def _chunk(self, plan: Plan, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict:
        chunk: dict[str, Any] = {"id": plan.response_id, "object": "chat.completion.chunk" if plan.kind == "chat" else
                 "text_completion", "created": int(time.time()), "model": plan.model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def _chat_logprobs(self, plan: Plan, ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not plan.logprobs:
            return None
        content = []
        for token_id, logprob in zip(ids, logprobs):
            text = self.tokenizer.token_text(token_id)
            entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            entry["top_logprobs"] = [dict(entry)] if plan.top_logprobs else []
            content.append(entry)
        return {"content": content}

    def _completion_logprobs(self, plan: Plan, ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not plan.logprobs:
            return None
        tokens = [self.tokenizer.token_text(t) for t in ids]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)] if plan.top_logprobs else None,
                "text_offset": offsets}


async def _drain(run: ChoiceRun) -> ChoiceResult:
    async for _ in run.deltas():
        pass
    return run.result


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None


def _usage(plan: Plan, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` as OpenAI (and vLLM) report it: prompt
    tokens the replicas found in their prefix caches."""
    prompt_tokens = sum(len(p) for p in plan.prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error_response(err: ApiError, smg: bool = False) -> web.Response:
    body = {"error": err.code or "error", "message": err.message} if smg else err.body()
    return web.json_response(body, status=err.status, headers=err.headers)

