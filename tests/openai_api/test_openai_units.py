"""The OpenAI front's parts without processes: chat rendering against transformers, tool-call parsing,
request checking, a choice's text deltas, and the config's security rules."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadbalancer.config import LoadBalancerConfig
from loadbalancer.fronts.openai_choices import ChoiceRun
from loadbalancer.fronts.openai_requests import ApiError, check_request_id, parse_chat, parse_completion
from mesh_runtime.chat import PRESET_CONTEXT, ChatTokenizer, parse_tool_calls
from mesh_runtime.config import ConfigError
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is x?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": "{\"key\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "42"}]


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_model("tiny-llama")


@pytest.mark.parametrize("messages,tools", [(CHAT[1:2], None), (CHAT[:2], None), (CHAT, TOOLS), (CHAT[1:], TOOLS)])
def test_chat_rendering_matches_transformers(tokenizer, messages, tools):
    from modeling.tokenizer import preset_tokenizer

    hf = preset_tokenizer()
    assert tokenizer.render(messages, tools=tools) == hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                             add_generation_prompt=True)
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    assert tokenizer.encode_chat(messages, tools=tools) == list(expected["input_ids"])


def test_a_saved_model_directory_gives_the_same_tokenizer(tmp_path, tokenizer):
    from modeling.presets import PRESETS, save_preset

    save_preset("tiny-llama", 0, tmp_path)
    loaded = ChatTokenizer.from_model(str(tmp_path))
    assert loaded.render(CHAT, tools=TOOLS) == tokenizer.render(CHAT, tools=TOOLS)
    assert loaded.encode("hi!") == [104, 105, 33] and loaded.decode([104, 105, 1]) == "hi"
    assert loaded.eos_token_id == 1 and loaded.max_model_len == 512
    assert PRESET_CONTEXT == {name: kwargs["max_position_embeddings"] for name, (_, kwargs) in PRESETS.items()}


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a model preset"):
        ChatTokenizer.from_model(str(tmp_path))


def test_tool_calls_are_parsed_and_malformed_ones_reported():
    text = ('let me look <tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    parsed = parse_tool_calls(text, id_prefix="c")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == \
        [("c-0", "lookup", {"key": "x"}), ("c-1", "add", {"a": 1})]
    assert parsed.content == "let me look" and parsed.errors == []
    unclosed = parse_tool_calls('<tool_call>{"name": "lookup", "arguments": {}}')
    assert [c.name for c in unclosed.tool_calls] == ["lookup"]
    bad = parse_tool_calls('<tool_call>{"name": 3}</tool_call><tool_call>{oops</tool_call>'
                           '<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    assert bad.tool_calls == [] and len(bad.errors) == 3
    assert "needs a string 'name'" in bad.errors[0] and "not valid JSON" in bad.errors[1]
    assert "must be an object" in bad.errors[2]
    assert parse_tool_calls("plain text").content == "plain text"


def _completion(body, tokenizer, **kw):
    return parse_completion({"model": "m", **body}, tokenizer, {"m"}, request_id=kw.get("rid", "r"),
                            session_id=kw.get("session", ""), timeout_s=None)


def test_completion_bodies_become_one_request_per_choice(tokenizer):
    plan = _completion({"prompt": ["ab", [5, 6]], "n": 2, "max_tokens": 3, "temperature": 0, "top_k": 5,
                        "seed": 7, "stop": "x", "user": "u1", "min_weight_version": 2, "logprobs": 1}, tokenizer)
    assert [r.request_id for r in plan.requests] == ["r/0", "r/1", "r/2", "r/3"]
    assert [list(r.prompt_token_ids) for r in plan.requests] == [[97, 98], [97, 98], [5, 6], [5, 6]]
    first = plan.requests[0]
    assert first.session_id == "u1" and first.min_weight_version == 2 and first.partial_rollout
    params = first.sampling_params
    assert (params.max_tokens, params.temperature, params.top_k, params.seed, params.logprobs) == (3, 0, 5, 7, True)
    assert plan.stop == ["x"] and plan.prompt_of(3) == [5, 6]
    single = _completion({"prompt": "hi"}, tokenizer, rid="", session="s")
    assert single.requests[0].sampling_params.max_tokens == 16 and single.requests[0].session_id == "s"
    assert single.response_id == f"cmpl-{single.requests[0].request_id}"


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": [1, 999]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": {"a": 1}}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"1": 2}}, 400, "logit_bias"),
    ({"prompt": "x", "logprobs": 5}, 400, "logprobs"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "user": "u" * 300}, 400, "user"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
])
def test_bad_completion_bodies_name_the_field(tokenizer, body, status, param):
    with pytest.raises(ApiError) as err:
        _completion(body, tokenizer)
    assert err.value.status == status and err.value.param == param
    assert len(err.value.message) < 400


def test_chat_bodies(tokenizer):
    plan = parse_chat({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]},
                                                  {"role": "user", "content": "q"}], "tools": TOOLS,
                       "max_completion_tokens": 5}, tokenizer, {"m"}, request_id="c1", session_id="",
                      timeout_s=2.0)
    assert plan.tools == TOOLS and plan.timeout_s == 2.0 and plan.response_id == "chatcmpl-c1"
    assert plan.requests[0].sampling_params.max_tokens == 5
    rendered = tokenizer.decode(plan.prompts[0], skip_special_tokens=False)
    assert rendered.startswith("<|system|>hi\n\n# Tools") and rendered.endswith("<|user|>q</s><|assistant|>")
    no_max = parse_chat({"model": "m", "messages": [{"role": "user", "content": "q"}], "tool_choice": "none",
                         "tools": TOOLS}, tokenizer, {"m"}, request_id="", session_id="", timeout_s=None)
    assert no_max.tools is None
    assert no_max.requests[0].sampling_params.max_tokens == 512 - len(no_max.prompts[0])
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": 3}]},
                                                         "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "q"}], "tool_choice": "required"}, "tool_choice"),
                        ({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "x"}]}, "tools[0]"),
                        ({"messages": [{"role": "user", "content": "q"}], "top_logprobs": 1}, "top_logprobs"),
                        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
                            {"function": {"name": "f", "arguments": "{bad"}}]}]},
                         "messages[0].tool_calls[0].function.arguments")]:
        with pytest.raises(ApiError) as err:
            parse_chat({"model": "m", **body}, tokenizer, {"m"}, request_id="", session_id="", timeout_s=None)
        assert err.value.status == 400 and err.value.param == param, body


def test_request_ids_are_checked():
    assert check_request_id("run-1/step:3") == "run-1/step:3"
    with pytest.raises(ApiError, match="x-request-id"):
        check_request_id("bad id with spaces")


def _stream(chunks, finish=generation_pb2.FINISH_REASON_LENGTH):
    async def generate(request):
        for i, ids in enumerate(chunks):
            last = i == len(chunks) - 1
            msg = pb.GenerateResponse(request_id=request.request_id, token_ids=ids, weight_version=1, replica_id="r")
            if last:
                msg.finish_reason = finish
                msg.segments.add(token_ids=[t for c in chunks for t in c], weight_version=1, replica_id="r")
            yield msg
    return generate


def _deltas(run):
    async def collect():
        return [d async for d in run.deltas()]
    return asyncio.run(collect())


def _ids(text):
    return [ord(c) for c in text]


def test_a_stop_string_across_chunks_cuts_at_its_token(tokenizer):
    request = pb.GenerateRequest(request_id="r", prompt_token_ids=[5])
    run = ChoiceRun(request, tokenizer, stop=["END"], parse_tools=False,
                    generate=_stream([_ids("hello E"), _ids("ND more"), _ids("text")]), call_prefix="c")
    deltas = _deltas(run)
    assert "".join(d.text for d in deltas) == "hello " and deltas[-1].finish_reason == "stop"
    assert run.result.token_ids == _ids("hello END")          # the tokens up to the stop string's last one
    assert run.result.segments == [{"weight_version": 1, "num_tokens": 9, "replica_id": "r"}]


def test_tool_call_text_is_held_back_while_streaming(tokenizer):
    request = pb.GenerateRequest(request_id="r", prompt_token_ids=[5])
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'
    pieces = ["Sure <tool", call[5:20], call[20:]]
    run = ChoiceRun(request, tokenizer, stop=[], parse_tools=True,
                    generate=_stream([_ids(p) for p in pieces], generation_pb2.FINISH_REASON_STOP), call_prefix="c")
    deltas = _deltas(run)
    assert [d.text for d in deltas] == ["Sure ", "", ""]      # "<tool" never shown: it could begin a call
    assert deltas[-1].finish_reason == "tool_calls" and deltas[-1].tool_calls[0].name == "lookup"
    # a block that is no call is text after all
    broken = ChoiceRun(request, tokenizer, stop=[], parse_tools=True,
                       generate=_stream([_ids("a <tool_call>{oops"), _ids("</tool_call>")],
                                        generation_pb2.FINISH_REASON_STOP), call_prefix="c")
    deltas = _deltas(broken)
    assert "".join(d.text for d in deltas) == "a <tool_call>{oops</tool_call>" and deltas[-1].finish_reason == "stop"


def _config(**values):
    config = LoadBalancerConfig(**values)
    config.validate()
    return config


def test_the_http_api_config_rules(tmp_path):
    assert _config(http_listen="127.0.0.1:0", model="tiny-llama").http_listen
    with pytest.raises(ConfigError, match="model"):
        _config(http_listen="127.0.0.1:0")
    with pytest.raises(ConfigError, match="http_api_token"):
        _config(http_listen="0.0.0.0:8000", model="tiny-llama", listen="127.0.0.1:0")
    assert _config(http_listen="0.0.0.0:8000", model="tiny-llama", http_api_token="t").http_api_token
    with pytest.raises(ConfigError, match="http_max_in_flight"):
        _config(http_max_in_flight=0)
    with pytest.raises(ConfigError, match="http_listen"):
        _config(http_listen="nope", model="tiny-llama")
