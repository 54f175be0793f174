"""One choice of an OpenAI request: the balancer's token stream turned into text deltas.

:class:`ChoiceRun` consumes one generation's ``GenerateResponse`` messages and yields :class:`Delta`
values: the new token ids (with logprobs and the weight version that made them) and the text they add,
decoded incrementally (:mod:`.detokenize`: each step decodes its new tokens with a little context, never the
whole completion again; a token that ends inside a multi-byte character waits for the next one). Stop
strings end the choice at the token that completes one (its text left out, as OpenAI does, its token ids
kept) and cancel the generation upstream. With tools, text from the first ``<tool_call>`` on is held
back and parsed for calls at the end; text that could still become ``<tool_call>`` waits too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from mesh_runtime.chat import TOOL_CALL_OPEN, ChatTokenizer, ToolCall, parse_tool_calls
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb

from .detokenize import IncrementalDecoder

FINISH = {generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length",
          generation_pb2.FINISH_REASON_ABORTED: "abort"}


@dataclasses.dataclass
class Delta:
    """What a choice adds in one step; the last one has ``finish_reason``."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    weight_version: int = 0
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ChoiceResult:
    """A finished choice, for the non-streaming response and the final streamed chunk."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str = "stop"
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    segments: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    resumed_tokens: int = 0
    cached_tokens: int = 0
    attempts: int = 0


class ChoiceRun:
    """See the module docstring. ``generate(request)`` is the balancer's stream of one request."""

    def __init__(self, request: pb.GenerateRequest, tokenizer: ChatTokenizer, *, stop: list[str],
                 parse_tools: bool, generate: Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]],
                 call_prefix: str, text_deltas: bool = True) -> None:
        """``text_deltas``: False leaves each delta's ``text`` empty (a caller that renders the text itself saves
        decoding the output on every step; the final ``result.text`` is still set)."""
        self.request = request
        self.text_deltas = text_deltas
        self.tokenizer = tokenizer
        self.stop = stop
        self.parse_tools = parse_tools
        self._generate = generate
        self._call_prefix = call_prefix
        self.result = ChoiceResult()
        self._versions: list[tuple[int, str]] = []   # (weight version, replica) per token
        self._sent = 0                                 # characters of visible text already yielded
        self._held = len(max(stop, key=len)) - 1 if stop else 0
        self._scanned = 0                              # characters of the text searched for stop strings
        self.decoder = IncrementalDecoder(tokenizer)
        """The completion's text so far (only decoded when deltas carry text or stop strings are checked)."""

    async def deltas(self) -> AsyncIterator[Delta]:
        result = self.result
        stream = self._generate(self.request)
        try:
            async for message in stream:
                start = len(result.token_ids)
                result.token_ids.extend(message.token_ids)
                result.logprobs.extend(message.logprobs)
                self._versions.extend([(message.weight_version, message.replica_id)] * len(message.token_ids))
                if self.text_deltas or self.stop:
                    self.decoder.extend(message.token_ids)
                stopped = self._stop_at(start)
                final = stopped or message.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
                if final and not stopped:
                    self._finish(message)
                finish, calls = self._close() if final else (None, [])
                visible = self._visible(final) if self.text_deltas else ""
                delta = Delta(text=visible[self._sent:], token_ids=result.token_ids[start:],
                              logprobs=result.logprobs[start:] if message.logprobs else [],
                              weight_version=message.weight_version, finish_reason=finish, tool_calls=calls)
                self._sent = max(self._sent, len(visible))
                yield delta
                if final:
                    return
        finally:
            await _aclose(stream)

    def _stop_at(self, start: int) -> bool:
        """Cut the choice at the first token that completes a stop string (True when one did)."""
        if not self.stop:
            return False
        text = self.decoder.text
        window = max(0, self._scanned - self._held)   # a stop string found now ends in the new text
        if not any(s in text[window:] for s in self.stop):
            self._scanned = len(text)
            return False
        for end in range(start + 1, len(self.result.token_ids) + 1):
            prefix = self.tokenizer.decode(self.result.token_ids[:end])
            hits = [prefix.find(s, window) for s in self.stop]
            found = [h for h in hits if h >= 0]
            if found:
                del self.result.token_ids[end:]
                del self.result.logprobs[end:]
                del self._versions[end:]
                self.result.text = prefix[:min(found)]
                self.result.finish_reason = "stop"
                self._segments_from_versions()
                return True
        return False

    def _finish(self, message: pb.GenerateResponse) -> None:
        result = self.result
        whole = [t for s in message.segments for t in s.token_ids]
        if whole and whole != result.token_ids:   # the record of a repeated id, or a restart: segments rule
            result.token_ids = whole
            result.logprobs = [lp for s in message.segments for lp in s.logprobs]
            self._versions = [(s.weight_version, s.replica_id) for s in message.segments for _ in s.token_ids]
        result.text = self.tokenizer.decode(result.token_ids)
        result.finish_reason = FINISH.get(message.finish_reason, "stop")
        result.segments = [{"weight_version": s.weight_version, "num_tokens": len(s.token_ids),
                            "replica_id": s.replica_id} for s in message.segments]
        result.resumed_tokens = message.usage.resumed_tokens
        result.cached_tokens = message.usage.cached_tokens
        result.attempts = len(message.attempts)

    def _segments_from_versions(self) -> None:
        segments: list[dict[str, Any]] = []
        for version, replica in self._versions:
            if segments and segments[-1]["weight_version"] == version and segments[-1]["replica_id"] == replica:
                segments[-1]["num_tokens"] += 1
            else:
                segments.append({"weight_version": version, "num_tokens": 1, "replica_id": replica})
        self.result.segments = segments

    def _visible(self, final: bool) -> str:
        """The text that may be shown so far. At the end: all of it, up to the first tool call when calls
        were parsed. Before: without an unfinished character, the tail a stop string could still begin
        in, and (with tools) anything from a ``<tool_call>`` or what could begin one."""
        if final:
            text = self.result.text
            return text[:text.find(TOOL_CALL_OPEN)] if self.result.tool_calls else text
        text = self.decoder.text
        text = text[:len(text) - self._held]
        if self.parse_tools:
            cut = text.find(TOOL_CALL_OPEN)
            text = text[:cut] if cut >= 0 else text[:len(text) - _partial_tag(text)]
        return text

    def _close(self) -> tuple[str, list[ToolCall]]:
        """The finish reason, and the tool calls parsed from the whole text (with tools)."""
        result = self.result
        if self.parse_tools and TOOL_CALL_OPEN in result.text:
            parsed = parse_tool_calls(result.text, id_prefix=self._call_prefix)
            if parsed.tool_calls:
                result.tool_calls = parsed.tool_calls
                result.finish_reason = "tool_calls"
        return result.finish_reason, result.tool_calls


def _partial_tag(text: str) -> int:
    """Length of the longest end of ``text`` that begins ``<tool_call>``."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


async def _aclose(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
