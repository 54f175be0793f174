"""SGLang's ``/generate`` bodies as the balancer reads them, without processes: SGLang's defaults and names,
batches and ``n``, the stickiness key, and every refusal naming its field."""

from __future__ import annotations

import pytest

from loadbalancer.fronts.openai_requests import ApiError
from loadbalancer.fronts.sglang_front import _matched_string
from loadbalancer.fronts.sglang_requests import DEFAULT_MAX_NEW_TOKENS, parse_generate
from mesh_runtime.chat import ChatTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_model("tiny-llama")


def _parse(tokenizer, body, key=""):
    return parse_generate(body, tokenizer, routing_key=key)


def test_slimes_body_maps_to_the_balancers_request(tokenizer):
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": {
        "temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 30, "stop": ["</s>", "\n\n"],
        "stop_token_ids": [2, 2, 9], "skip_special_tokens": False, "no_stop_trim": True,
        "spaces_between_special_tokens": False, "sampling_seed": 7, "custom_params": {"x": 1}}}
    plan = _parse(tokenizer, body, key="session-1")
    assert not plan.batched and not plan.stream and plan.return_logprob
    [sample] = plan.samples
    request = sample.request
    assert list(request.prompt_token_ids) == [5, 6, 7] and request.session_id == "session-1"
    sp = request.sampling_params
    assert (sp.max_tokens, sp.top_k, sp.seed, list(sp.stop_token_ids)) == (30, 20, 7, [2, 9])
    assert sp.temperature == pytest.approx(0.8) and sp.top_p == pytest.approx(0.9) and sp.logprobs
    assert request.partial_rollout and len(request.request_id) == 32
    assert sample.stop == ["</s>", "\n\n"] and not sample.skip_special_tokens and sample.no_stop_trim


def test_sglangs_defaults_and_nulls(tokenizer):
    plan = _parse(tokenizer, {"text": "hello", "sampling_params": {"temperature": None, "top_k": None,
                                                                    "max_new_tokens": None}})
    [sample] = plan.samples
    sp = sample.request.sampling_params
    assert sp.max_tokens == DEFAULT_MAX_NEW_TOKENS == 128 and sp.temperature == 1.0 and sp.top_k == 0
    assert list(sample.request.prompt_token_ids) == tokenizer.encode("hello")
    assert sample.skip_special_tokens and not sample.no_stop_trim


def test_a_batch_with_n_is_prompt_major_and_names_each_generation(tokenizer):
    plan = _parse(tokenizer, {"input_ids": [[5, 6], [7, 8, 9]], "rid": "batch",
                              "sampling_params": [{"n": 2, "max_new_tokens": 3}, {"n": 2, "max_new_tokens": 4}]})
    assert plan.batched
    assert [s.request.request_id for s in plan.samples] == ["batch/0", "batch/1", "batch/2", "batch/3"]
    assert [list(s.request.prompt_token_ids) for s in plan.samples] == [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
    assert [s.request.sampling_params.max_tokens for s in plan.samples] == [3, 3, 4, 4]
    one_with_n = _parse(tokenizer, {"input_ids": [5], "sampling_params": {"n": 3}})
    assert one_with_n.batched and len(one_with_n.samples) == 3
    rids = _parse(tokenizer, {"text": ["a", "b"], "rid": ["r-a", "r-b"]})
    assert [s.request.request_id for s in rids.samples] == ["r-a", "r-b"]


@pytest.mark.parametrize("body,field", [
    ({}, "input_ids"),
    ({"input_ids": [1], "text": "x"}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 10**6]}, "input_ids"),
    ({"input_ids": [[1], "x"]}, "input_ids"),
    ({"text": ""}, "text"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.1}}, "sampling_params.repetition_penalty"),
    ({"input_ids": [1], "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 2}}, "sampling_params.min_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"typical_p": 0.9}}, "sampling_params.typical_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": "hot"}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num"),
    ({"input_ids": [1], "image_data": ["x.png"]}, "image_data"),
    ({"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
    ({"input_ids": [1], "return_routed_experts": True}, "return_routed_experts"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
    ({"input_ids": [1], "rid": "bad id!"}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["same", "same"]}, "rid"),
    ({"input_ids": [[1], [2]], "return_logprob": [True, False]}, "return_logprob"),
    ({"input_ids": [1], "min_weight_version": -1}, "min_weight_version"),
    ({"input_ids": [1], "prompt": "x"}, "prompt"),
])
def test_bad_input_is_refused_naming_the_field(tokenizer, body, field):
    with pytest.raises(ApiError) as err:
        _parse(tokenizer, body)
    assert err.value.status == 400 and err.value.param == field, err.value.message
    assert len(err.value.message) < 400


def test_neutral_values_and_other_servers_fields_are_accepted(tokenizer):
    plan = _parse(tokenizer, {"input_ids": [1], "logprob_start_len": -1, "top_logprobs_num": 0,
                              "return_hidden_states": False, "data_parallel_rank": 0, "bootstrap_room": 3,
                              "sampling_params": {"frequency_penalty": 0.0, "repetition_penalty": 1.0,
                                                  "min_p": 0.0, "stream_interval": 4, "logit_bias": None}})
    assert len(plan.samples) == 1


def test_the_stop_string_that_ended_a_generation():
    assert _matched_string("abc</s>", "abc", ["\n", "</s>"]) == "</s>"
    assert _matched_string("abc", "abc", ["</s>"]) is None          # a token stopped it
    assert _matched_string("abcd", "ab", []) is None


@pytest.mark.parametrize("policy,own,newest,floor", [
    (None, None, 7, None), ("any", None, 7, None), ("latest-only", None, 7, 7), ("min-version:3", None, 7, 3),
    ("max-staleness:2", None, 7, 5), ("max-staleness:9", None, 7, 0), ("latest-only", 9, 7, 9),
    (" min-version:8 ", 2, 7, 8)])
def test_a_version_policy_is_a_floor_on_top_of_the_requests_own(policy, own, newest, floor):
    from loadbalancer.fronts.openai_requests import apply_version_policy
    from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb

    request = pb.GenerateRequest(request_id="r")
    if own is not None:
        request.min_weight_version = own
    apply_version_policy([request], policy, newest)
    assert (request.min_weight_version if request.HasField("min_weight_version") else None) == floor


@pytest.mark.parametrize("policy", ["latest", "min-version:", "max-staleness:-1", "min-version:x", "all"])
def test_an_unknown_version_policy_is_refused_naming_the_header(policy):
    from loadbalancer.fronts.openai_requests import apply_version_policy
    from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb

    with pytest.raises(ApiError) as err:
        apply_version_policy([pb.GenerateRequest(request_id="r")], policy, 3)
    assert err.value.status == 400 and err.value.param == "x-weight-version-policy"
