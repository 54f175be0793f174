"""Multi-turn trajectories: model turns alternating with tool and environment turns (verl's tool agent loop).

One trajectory is one sample of a GRPO group. It starts from the prompt's token ids (rendered with the
tools' schemas) and repeats:

1. a **model turn**: a generation request through the balancer whose prompt is everything so far (the
   prompt plus every earlier turn's ids as they were, never re-tokenized) and whose budget is what is left
   of the response length; its ids get loss mask 1, its logprobs and the weight version of each segment
   (a turn resumed across a weight sync or a replica has several);
2. the turn's text is searched for Hermes tool calls (``<tool_call>{json}</tool_call>``). Calls run (at
   most ``max_parallel_calls`` at once; more get an error message), each with ``tool_timeout_s``; an
   unknown tool, a malformed call or a timeout becomes an error message to the model, never a crash; a
   tool that raises ends the trajectory (its traceback is logged, the sample counts it) as verl's loop does;
3. no call: an :class:`Environment`, if configured, writes the next user turn from the conversation so
   far, or ends the trajectory;
4. the tool or user messages are rendered with the model's chat template (only the new messages: the
   template's text after an assistant turn, less the end-of-turn token the model already generated) and
   appended with loss mask 0, logprob 0 and weight version -1.

It ends when the model stops without a call, at ``max_assistant_turns`` / ``max_user_turns``, when the
response length or the model's context is reached (a tool turn that would not fit is left out, as in
verl), or when a turn is cut by the length. Every turn is routed with the trajectory's session id (``<group>/<index>``), so its prefix
stays on one replica unless the balancer's imbalance rule moves it; when the trajectory ends the balancer
is told (``CloseSession``) so the replica can drop what it kept. The tools' ``calc_reward`` and
``release`` run at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mesh_runtime.chat import ChatTokenizer, parse_tool_calls
from trainer_agent.driver.queue import Sample
from trainer_agent.driver.rollout_types import RolloutRequest, GenerationResult

from .settings import MultiTurnSettings
from .tools import ToolBox

log = logging.getLogger(__name__)
CallFn = Callable[[RolloutRequest], Awaitable[GenerationResult]]
TOOL_VERSION = -1
"""Weight version recorded for tokens the model did not generate (tool and user turns)."""
_PROBE = "\x00rollmesh-probe\x00"


class Environment:
    """Writes the user turns of a trajectory that are not tool results (a simulated user, a game, a judge).

    Subclass it and name it in ``multi_turn.environment`` (``MODULE:CLASS``); it is built once per run with
    ``multi_turn.environment_options`` as keyword arguments. The driver calls :meth:`user_turn` after each
    model turn that made no tool call.
    """

    async def user_turn(self, messages: list[dict[str, Any]], context: dict[str, Any]) -> str | None:
        """The next user message given the conversation so far (``messages``: the prompt's messages, then
        ``{"role": "assistant", "content"}`` and ``{"role": "tool" | "user", "content"}`` per turn), or
        None to end the trajectory. ``context`` holds the dataset row's ``extra_info`` and
        ``ground_truth`` when there is a dataset."""
        return None


def load_environment(spec: str, options: dict[str, Any]) -> Environment:
    module_name, _, class_name = spec.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**options)


@dataclasses.dataclass
class TurnStats:
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_crashed: bool = False
    tool_reward: float = 0.0


class TrajectoryRunner:
    """Runs trajectories for the rollouter (see the module docstring)."""

    def __init__(self, tokenizer: ChatTokenizer, settings: MultiTurnSettings, *, max_response_tokens: int,
                 toolbox: ToolBox | None = None, environment: Environment | None = None,
                 close_session: Callable[[str], Awaitable[Any]] | None = None,
                 context_of: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_response_tokens = max_response_tokens
        self.toolbox = toolbox
        self.environment = environment
        self._close_session = close_session
        self._context_of = context_of or (lambda prompt_id: {})
        self._eos = tokenizer.special_tokens.get("eos_token") or ""
        self._probe_base: str | None = None   # the template's text up to an assistant turn (rendered once)

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self.toolbox.schemas if self.toolbox is not None else None

    async def run(self, group_id: str, index: int, request: RolloutRequest, call: CallFn) -> Sample:
        session = f"{group_id}/{index}"
        context = self._context_of(group_id.rsplit("#", 1)[0])
        tools_kwargs = (context.get("extra_info") or {}).get("tools_kwargs") or {} \
            if isinstance(context.get("extra_info"), dict) else {}
        messages: list[dict[str, Any]] = list(context.get("messages") or [])
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        lengths: list[int] = []
        stats = TurnStats()
        instances: dict[str, str] = {}
        finish = "stop"
        try:
            while True:
                budget = self.max_response_tokens - len(ids)
                if self.tokenizer.max_model_len is not None:   # the context holds the prompt and every turn
                    budget = min(budget, self.tokenizer.max_model_len - len(request.prompt_token_ids) - len(ids))
                if budget <= 0:
                    finish = "length"
                    break
                turn_request = dataclasses.replace(request, request_id=f"{request.request_id}/t{stats.assistant_turns}",
                                                   prompt_token_ids=[*request.prompt_token_ids, *ids],
                                                   session_id=session, max_tokens=budget)
                result = await call(turn_request)
                turn = [t for s in result.segments for t in s.token_ids]
                for segment in result.segments:
                    if segment.token_ids:
                        versions.append(segment.weight_version)
                        lengths.append(len(segment.token_ids))
                        logprobs.extend(segment.logprobs or [0.0] * len(segment.token_ids))
                ids.extend(turn)
                mask.extend([1] * len(turn))
                stats.assistant_turns += 1
                finish = result.finish_reason
                text = self.tokenizer.decode(turn, skip_special_tokens=False)
                messages.append({"role": "assistant", "content": text.removesuffix(self._eos)})
                if finish == "length" or len(ids) >= self.max_response_tokens:
                    finish = "length"
                    break
                if self.settings.max_assistant_turns and stats.assistant_turns >= self.settings.max_assistant_turns:
                    break
                if self.settings.max_user_turns and stats.user_turns >= self.settings.max_user_turns:
                    break
                replies = await self._replies(text, tools_kwargs, instances, stats, messages, context)
                if stats.tool_crashed:
                    finish = "tool_error"
                    break
                if not replies:
                    break
                added = self._render(replies, ended_with_eos=bool(turn) and turn[-1] == self.tokenizer.eos_token_id)
                if len(ids) + len(added) >= self.max_response_tokens:
                    finish = "length"
                    break
                messages.extend(replies)
                ids.extend(added)
                mask.extend([0] * len(added))
                logprobs.extend([0.0] * len(added))
                versions.append(TOOL_VERSION)
                lengths.append(len(added))
                stats.user_turns += 1
        finally:
            if self.toolbox is not None and instances:
                stats.tool_reward = await self.toolbox.finish(instances, tools_kwargs)
            await self._end_session(session)
        return Sample(group_id=group_id, index=index, prompt_ids=list(request.prompt_token_ids), completion_ids=ids,
                      logprobs=logprobs, param_version=request.param_version, weight_versions=versions,
                      segment_lengths=lengths, finish_reason=finish, loss_mask=mask,
                      assistant_turns=stats.assistant_turns, user_turns=stats.user_turns,
                      tool_calls=stats.tool_calls, tool_errors=stats.tool_errors + int(stats.tool_crashed),
                      tool_reward=stats.tool_reward)

    async def _replies(self, text: str, tools_kwargs: dict[str, Any], instances: dict[str, str], stats: TurnStats,
                       messages: list[dict[str, Any]], context: dict[str, Any]) -> list[dict[str, Any]]:
        """The tool messages answering the turn's calls, else the environment's user message, else none."""
        parsed = parse_tool_calls(text) if self.toolbox is not None else None
        if self.toolbox is not None and parsed is not None and (parsed.tool_calls or parsed.errors):
            limit = self.settings.max_parallel_calls
            running = parsed.tool_calls[:limit]
            toolbox = self.toolbox
            outcomes = await asyncio.gather(*(toolbox.call(c.name, json.loads(c.arguments), tools_kwargs, instances)
                                              for c in running))
            replies = [{"role": "tool", "content": o.text} for o in outcomes]
            replies += [{"role": "tool", "content": f"error: at most {limit} tool call(s) per turn; {c.name} did "
                                                    "not run"} for c in parsed.tool_calls[limit:]]
            replies += [{"role": "tool", "content": f"error: {e}"} for e in parsed.errors]
            stats.tool_calls += len(parsed.tool_calls)
            stats.tool_errors += sum(o.failed for o in outcomes) + len(parsed.tool_calls[limit:]) + len(parsed.errors)
            stats.tool_crashed = any(o.crashed for o in outcomes)
            return replies
        if self.environment is not None:
            message = await self.environment.user_turn(list(messages), context)
            if message is not None:
                return [{"role": "user", "content": str(message)}]
        return []

    def _render(self, replies: list[dict[str, Any]], *, ended_with_eos: bool) -> list[int]:
        """Ids of ``replies`` as the chat template renders them right after an assistant turn."""
        probe = [{"role": "user", "content": _PROBE}]
        if self._probe_base is None:
            self._probe_base = self.tokenizer.render(probe, add_generation_prompt=True)
        base = self._probe_base
        full = self.tokenizer.render([*probe, {"role": "assistant", "content": _PROBE}, *replies],
                                     add_generation_prompt=True)
        if not full.startswith(base + _PROBE):
            raise ValueError("the chat template does not render an assistant turn as its generation prompt "
                             "continues; it cannot be used for multi-turn trajectories")
        tail = full[len(base) + len(_PROBE):]
        if ended_with_eos and self._eos and tail.startswith(self._eos):
            tail = tail[len(self._eos):]   # the model generated the end of its turn already
        return self.tokenizer.encode(tail, add_special_tokens=False)

    async def _end_session(self, session: str) -> None:
        if self._close_session is None:
            return
        try:
            await self._close_session(session)
        except Exception as err:  # noqa: BLE001 - a lost CloseSession leaves the replica's idle expiry to free it
            log.warning("CloseSession of trajectory %s failed: %s", session, err)
