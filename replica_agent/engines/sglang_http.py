"""The calls of SGLang's HTTP API the SGLang backend makes, with their failures translated.

Request and response shapes are those of SGLang 0.5.x (``python/sglang/srt/
entrypoints/http_server.py`` and ``managers/io_struct.py``):

* ``POST /generate`` ``{"input_ids", "sampling_params", "rid", "stream": true,
  "return_logprob"}`` streams server-sent events ``data: {...}`` ending with
  ``data: [DONE]``. Each event holds ``output_ids`` and ``meta_info``
  (``completion_tokens``, ``finish_reason`` = ``null`` or
  ``{"type": "stop"|"length"|"abort", ...}``, ``output_token_logprobs`` =
  ``[[logprob, token_id, text], ...]``). Whether ``output_ids`` is
  cumulative or holds only the new tokens depends on a server flag
  (``--incremental-streaming-output``, formerly ``--stream-output``), so
  :func:`new_tokens` reads the new ones from ``completion_tokens`` either way.
* a rejected request answers HTTP 400 with ``{"error": {"message": ...}}``.

httpx2 (already installed with huggingface_hub) is the HTTP client.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx2

from mesh_runtime.reasons import Reason
from .errors import EngineDead, EngineError, EngineUnavailable, InvalidRequest
from .types import FinishReason

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


def finish_reason(meta: dict[str, Any]) -> FinishReason | None:
    """``meta_info.finish_reason`` -> :class:`FinishReason` (``None`` while unfinished; an unknown type ends
    the stream as ABORTED, which the caller may resume)."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    mapped = _FINISH.get(str(kind))
    if mapped is None:
        log.warning("sglang reported finish reason %r; ending the stream as aborted", reason)
        return FinishReason.ABORTED
    return mapped


def new_tokens(event: dict[str, Any], seen: int) -> tuple[list[int], list[float]]:
    """The token ids (and their logprobs) an event adds to the ``seen`` already received.

    ``meta_info.completion_tokens`` counts every token so far; the new ones are the last
    ``completion_tokens - seen`` of ``output_ids``, whether the server streams cumulative or incremental
    lists. Logprobs come from ``output_token_logprobs`` the same way (NaN where missing)."""
    meta = event.get("meta_info") or {}
    ids = [int(t) for t in event.get("output_ids") or []]
    total = meta.get("completion_tokens")
    count = max(0, int(total) - seen) if isinstance(total, int) else len(ids)
    count = min(count, len(ids))
    fresh = ids[len(ids) - count:] if count else []
    entries = meta.get("output_token_logprobs") or []
    tail = entries[len(entries) - count:] if count and len(entries) >= count else []
    logprobs = []
    for i in range(count):
        entry = tail[i] if i < len(tail) else None
        value = entry[0] if isinstance(entry, (list, tuple)) and entry else None
        logprobs.append(float(value) if isinstance(value, (int, float)) else math.nan)
    return fresh, logprobs


def _message(response: httpx2.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))[:200]
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])[:200]
    return str(body)[:200]


class SglangClient:
    """One SGLang server's HTTP API."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout_s
        self._http = httpx2.AsyncClient(base_url=self.url, timeout=httpx2.Timeout(timeout_s))

    async def close(self) -> None:
        await self._http.aclose()

    def _failure(self, what: str, exc: BaseException) -> EngineError:
        if isinstance(exc, httpx2.TimeoutException):
            return EngineUnavailable(f"sglang {what} at {self.url} timed out", reason=Reason.SGLANG_TIMEOUT)
        return EngineDead(f"sglang server at {self.url} is unreachable ({what}): {exc!r}",
                          reason=Reason.SGLANG_UNREACHABLE)

    @staticmethod
    def _check(what: str, response: httpx2.Response) -> None:
        if response.status_code < 400:
            return
        message = _message(response)
        if response.status_code in (400, 422):
            raise InvalidRequest(f"sglang rejected {what}: {message}")
        if response.status_code in (429, 503):
            raise EngineUnavailable(f"sglang cannot take {what} now: {message}", reason=Reason.SGLANG_UNAVAILABLE)
        raise EngineError(f"sglang {what} failed with HTTP {response.status_code}: {message}",
                          reason=Reason.SGLANG_CALL_FAILED)

    async def post(self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> Any:
        """POST ``body`` to ``path``; the decoded JSON answer (or ``None`` for an empty one)."""
        try:
            response = await self._http.post(path, json=body or {},
                                             timeout=timeout_s if timeout_s is not None else self._timeout)
        except httpx2.HTTPError as exc:
            raise self._failure(path, exc) from exc
        self._check(path, response)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    async def get_text(self, path: str) -> str:
        try:
            response = await self._http.get(path)
        except httpx2.HTTPError as exc:
            raise self._failure(path, exc) from exc
        self._check(path, response)
        return response.text

    async def get_json(self, path: str) -> Any:
        return json.loads(await self.get_text(path))

    async def healthy(self) -> bool:
        try:
            response = await self._http.get("/health", timeout=min(5.0, self._timeout))
        except httpx2.HTTPError:
            return False
        return response.status_code == 200

    async def generate(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the events of one ``/generate`` call (no read deadline: a completion may take long)."""
        timeout = httpx2.Timeout(self._timeout, read=None)
        try:
            async with self._http.stream("POST", "/generate", json=body, timeout=timeout) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self._check(f"request {body.get('rid')}", response)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event and "meta_info" not in event:
                        error = event["error"]
                        message = error.get("message", error) if isinstance(error, dict) else error
                        raise EngineError(f"sglang failed request {body.get('rid')}: {str(message)[:200]}",
                                          reason=Reason.GENERATION_FAILED)
                    yield event
        except httpx2.HTTPError as exc:
            raise self._failure(f"/generate of {body.get('rid')}", exc) from exc
