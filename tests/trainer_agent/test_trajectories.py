"""Multi-turn trajectories on a scripted generator: exact ids, loss masks, per-turn weight versions, tools
written for verl, error turns, limits, environments, CloseSession, and what the step reports."""

from __future__ import annotations

import asyncio
import sys

import pytest
import yaml

from mesh_runtime.chat import ChatTokenizer
from mesh_runtime.config import ConfigError, load_config
from trainer_agent.driver.queue import Sample
from trainer_agent.driver.rollout_types import RolloutRequest, GenerationResult, Segment
from trainer_agent.driver.sample_metrics import step_sample_metrics
from trainer_agent.driver.settings import MultiTurnSettings, RolloutSamplingSettings
from trainer_agent.driver.tools import ToolBox, ToolConfigError, import_tool_module, load_tools
from trainer_agent.driver.trajectory import Environment, TrajectoryRunner

verl_tools = import_tool_module("tests.trainer_agent.verl_tools")   # written for verl, which is not installed
TOK = ChatTokenizer.from_model("tiny-llama")
EOS = TOK.eos_token_id
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'


def ids(text: str, eos: bool = True) -> list[int]:
    return TOK.encode(text, add_special_tokens=False) + ([EOS] if eos else [])


def tool_config(tmp_path, **config) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{
        "class_name": "tests.trainer_agent.verl_tools.LookupTool",
        "config": {"type": "native", "table": {"x": "42"}, **config},
        "tool_schema": {"type": "function", "function": {
            "name": "lookup", "description": "value of a key",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}}]}))
    return str(path)


class Script:
    """A generator that answers turn k with ``turns[k]``: a list of (text, eos, weight_version, replica)
    segments (several: a turn resumed after an abort or across a weight sync)."""

    def __init__(self, turns, finish="stop"):
        self.turns = turns
        self.finish = finish
        self.requests: list[RolloutRequest] = []

    async def __call__(self, request: RolloutRequest) -> GenerationResult:
        self.requests.append(request)
        parts = self.turns[len(self.requests) - 1]
        segments = [Segment(token_ids=ids(text, eos), logprobs=[-0.5] * len(ids(text, eos)), weight_version=v,
                            replica_id=r) for text, eos, v, r in parts]
        budget = request.max_tokens
        out, finish = [], self.finish
        for s in segments:
            take = s.token_ids[:budget]
            budget -= len(take)
            out.append(Segment(take, s.logprobs[:len(take)], s.weight_version, s.replica_id))
            if len(take) < len(s.token_ids):
                finish = "length"
                break
        return GenerationResult(segments=out, finish_reason=finish)


def runner(tmp_path, settings=None, *, max_tokens=400, environment=None, closed=None, **tool_config_kw):
    settings = settings or MultiTurnSettings(enable=True, tool_config_path=tool_config(tmp_path, **tool_config_kw),
                                             tool_timeout_s=0.5)
    toolbox = ToolBox(load_tools(settings.tool_config_path), timeout_s=settings.tool_timeout_s,
                      max_response_length=settings.max_tool_response_length,
                      truncate_side=settings.tool_response_truncate_side) if settings.tool_config_path else None

    async def close(session):
        if closed is not None:
            closed.append(session)

    return TrajectoryRunner(TOK, settings, max_response_tokens=max_tokens, toolbox=toolbox, environment=environment,
                            close_session=close, context_of=lambda pid: {
                                "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"expected_key": "x"}}}}})


def first_request(prompt: list[int]) -> RolloutRequest:
    return RolloutRequest(request_id="g#0/1", prompt_token_ids=prompt, session_id="g#0", partial_rollout=True,
                             param_version=3, max_tokens=400)


def run(trajectory, request, script) -> Sample:
    return asyncio.run(trajectory.run("g#0", 1, request, script))


def test_a_tool_trajectory_keeps_exact_ids_masks_and_the_version_of_each_turn(tmp_path):
    verl_tools.CALLS.clear()
    closed: list[str] = []
    trajectory = runner(tmp_path, closed=closed)
    prompt = TOK.encode_chat([{"role": "user", "content": "what is x?"}], tools=trajectory.tool_schemas)
    # turn 1 at weight version 3; the weights sync to 4; turn 2 is aborted on replica a and resumed on b
    script = Script([[(CALL, True, 3, "a")], [("it is ", False, 4, "a"), ("42", True, 4, "b")]])
    sample = run(trajectory, first_request(prompt), script)

    tool_turn = ids("<|user|><tool_response>42</tool_response></s><|assistant|>", eos=False)
    turn1, turn2 = ids(CALL), ids("it is ", False) + ids("42")
    assert sample.completion_ids == turn1 + tool_turn + turn2
    assert sample.loss_mask == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(turn2)
    assert sample.weight_versions == [3, -1, 4, 4]
    assert sample.segment_lengths == [len(turn1), len(tool_turn), 6, 3]
    assert sample.logprobs == [-0.5] * len(turn1) + [0.0] * len(tool_turn) + [-0.5] * len(turn2)
    # every turn's prompt is the prompt plus the earlier turns' ids as they were, never re-tokenized
    assert script.requests[1].prompt_token_ids == prompt + turn1 + tool_turn
    assert {r.session_id for r in script.requests} == {"g#0/1"} and closed == ["g#0/1"]
    assert [r.request_id for r in script.requests] == ["g#0/1/t0", "g#0/1/t1"]
    # a turn's budget: what is left of the response length and of the model's context (512 tokens)
    assert script.requests[1].max_tokens == min(400, 512 - len(prompt)) - len(turn1) - len(tool_turn)
    assert (sample.assistant_turns, sample.user_turns, sample.tool_calls, sample.tool_errors) == (2, 1, 1, 0)
    assert sample.tool_reward == 1.0 and sample.finish_reason == "stop"
    assert [c[0] for c in verl_tools.CALLS] == ["create", "execute", "calc_reward", "release"]
    assert verl_tools.CALLS[0] == ("create", "x")
    # the tool's module imported verl's names; the stand-ins were only there while it loaded
    assert "verl" not in sys.modules and "verl.tools.base_tool" not in sys.modules
    assert ChatTokenizer.from_model("tiny-llama").decode(sample.completion_ids, skip_special_tokens=False).count(
        "<tool_response>42</tool_response>") == 1
    metrics = step_sample_metrics([sample], trainer_version=5)
    assert metrics["staleness/max"] == 2.0                   # counted from the trajectory's oldest version, 3
    assert metrics["staleness/samples_spanning_versions"] == 1.0
    assert metrics["tokens_by_weight_version"] == {"3": len(turn1), "4": len(turn2)}
    assert metrics["multi_turn/tool_calls/mean"] == 1.0


@pytest.mark.parametrize("turn,expect", [
    ('<tool_call>{"name": "lookup", "arguments": {oops}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "there is no tool 'search'"),
    ('<tool_call>{"name": "lookup", "arguments": {"key": "slow"}}</tool_call>', "did not answer within 0.5 s"),
])
def test_bad_calls_become_error_messages_to_the_model(tmp_path, turn, expect):
    trajectory = runner(tmp_path)
    script = Script([[(turn, True, 0, "a")], [("sorry", True, 0, "a")]])
    sample = run(trajectory, first_request(ids("q", False)), script)
    tool_text = TOK.decode(script.requests[1].prompt_token_ids, skip_special_tokens=False)
    assert expect in tool_text and sample.tool_errors == 1 and sample.finish_reason == "stop"
    assert sample.assistant_turns == 2


def test_a_tool_that_raises_ends_its_trajectory_and_is_counted(tmp_path, caplog):
    trajectory = runner(tmp_path)
    boom = '<tool_call>{"name": "lookup", "arguments": {"key": "boom"}}</tool_call>'
    script = Script([[(boom, True, 0, "a")], [("never", True, 0, "a")]])
    sample = run(trajectory, first_request(ids("q", False)), script)
    assert sample.finish_reason == "tool_error" and len(script.requests) == 1
    assert "the lookup service exploded" in caplog.text     # its traceback is in the log
    assert step_sample_metrics([sample], 0)["multi_turn/tool_crashes"] == 1.0


def test_parallel_calls_beyond_the_limit_are_answered_with_an_error(tmp_path):
    trajectory = runner(tmp_path)
    two = CALL + CALL.replace('"x"', '"y"')
    script = Script([[(two, True, 0, "a")], [("done", True, 0, "a")]])
    sample = run(trajectory, first_request(ids("q", False)), script)
    text = TOK.decode(script.requests[1].prompt_token_ids, skip_special_tokens=False)
    assert "<tool_response>42</tool_response>" in text and "at most 1 tool call(s) per turn" in text
    assert sample.tool_calls == 2 and sample.tool_errors == 1


def test_limits_end_trajectories(tmp_path):
    settings = MultiTurnSettings(enable=True, tool_config_path=tool_config(tmp_path), max_assistant_turns=2)
    script = Script([[(CALL, True, 0, "a")]] * 5)
    sample = run(runner(tmp_path, settings), first_request(ids("q", False)), script)
    assert sample.assistant_turns == 2 and len(script.requests) == 2
    settings = MultiTurnSettings(enable=True, tool_config_path=tool_config(tmp_path), max_user_turns=1)
    script = Script([[(CALL, True, 0, "a")]] * 5)
    sample = run(runner(tmp_path, settings), first_request(ids("q", False)), script)
    assert sample.user_turns == 1 and sample.assistant_turns == 2
    # the response budget: a tool turn that does not fit is left out; the model's turn is cut at the budget
    script = Script([[(CALL, True, 0, "a")]] * 5)
    sample = run(runner(tmp_path, max_tokens=len(ids(CALL)) + 10), first_request(ids("q", False)), script)
    assert sample.finish_reason == "length" and sample.completion_ids == ids(CALL) and sum(sample.loss_mask) == \
        len(ids(CALL))
    script = Script([[(CALL, True, 0, "a")]])
    sample = run(runner(tmp_path, max_tokens=20), first_request(ids("q", False)), script)
    assert sample.finish_reason == "length" and len(sample.completion_ids) == 20


class Quiz(Environment):
    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    async def user_turn(self, messages, context):
        asked = sum(1 for m in messages if m["role"] == "user")
        return None if asked > self.rounds else f"and round {asked + 1}?"


def test_an_environment_writes_user_turns(tmp_path):
    settings = MultiTurnSettings(enable=True, environment="tests.trainer_agent.test_trajectories:Quiz",
                                 environment_options={"rounds": 2})
    trajectory = TrajectoryRunner(TOK, settings, max_response_tokens=400, environment=Quiz(2))
    script = Script([[("one", True, 0, "a")], [("two", True, 0, "a")], [("three", True, 0, "a")]])
    prompt_messages = [{"role": "user", "content": "round 1"}]
    trajectory._context_of = lambda pid: {"messages": prompt_messages}
    sample = run(trajectory, first_request(TOK.encode_chat(prompt_messages)), script)
    assert (sample.assistant_turns, sample.user_turns) == (3, 2)
    text = TOK.decode(sample.completion_ids, skip_special_tokens=False)
    assert text == ("one</s><|user|>and round 2?</s><|assistant|>two</s><|user|>and round 3?</s><|assistant|>"
                    "three</s>")


def test_verls_multi_turn_keys_and_tool_config_are_checked(tmp_path):
    path = tmp_path / "rollout.yaml"
    path.write_text(yaml.safe_dump({"multi_turn": {
        "enable": True, "max_assistant_turns": 3, "max_user_turns": 3, "max_parallel_calls": 2,
        "max_tool_response_length": 64, "tool_response_truncate_side": "left", "format": "hermes",
        "tool_config_path": tool_config(tmp_path), "tokenization_sanity_check_mode": "strict",
        "use_inference_chat_template": False}}))
    settings = load_config(RolloutSamplingSettings, path).multi_turn
    assert (settings.max_parallel_calls, settings.tool_response_truncate_side) == (2, "left")
    path.write_text(yaml.safe_dump({"multi_turn": {"enable": True, "max_tool_response_lenght": 3}}))
    with pytest.raises(ConfigError, match="did you mean 'multi_turn.max_tool_response_length'"):
        load_config(RolloutSamplingSettings, path)
    path.write_text(yaml.safe_dump({"multi_turn": {"enable": True}}))
    with pytest.raises(ConfigError, match="needs tools"):
        load_config(RolloutSamplingSettings, path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tools": [{"class_name": "tests.trainer_agent.verl_tools.Nope",
                                              "tool_schema": {"type": "function", "function": {"name": "n"}}}]}))
    with pytest.raises(ToolConfigError, match="cannot import"):
        load_tools(bad)
    bad.write_text("tools: []\n")
    with pytest.raises(ToolConfigError, match="non-empty list"):
        load_tools(bad)


def test_long_tool_responses_are_truncated_as_verl_does(tmp_path):
    box = ToolBox(load_tools(tool_config(tmp_path)), timeout_s=1, max_response_length=4, truncate_side="middle")
    assert box._truncate("abcdefgh") == "ab...(truncated)...gh"
    box.truncate_side = "left"
    assert box._truncate("abcdefgh") == "abcd...(truncated)"
    box.truncate_side = "right"
    assert box._truncate("abcdefgh") == "(truncated)...efgh"


def test_the_loss_mask_reaches_the_policy_loss():
    torch = pytest.importorskip("torch")
    from modeling.presets import build_preset_model
    from trainer_agent.training.grpo import Sample as GrpoSample
    from trainer_agent.training.grpo import completion_logprobs

    model = build_preset_model("tiny-llama", 0)
    samples = [GrpoSample([5, 6], [7, 8, 9, 10], [0.0] * 4, loss_mask=[1, 0, 0, 1]), GrpoSample([5], [7, 8], [0.0] * 2)]
    _, mask = completion_logprobs(model, samples, torch.device("cpu"))
    assert mask.tolist() == [[True, False, False, True], [True, True, False, False]]
