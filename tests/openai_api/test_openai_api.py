"""The balancer's OpenAI-compatible API with the real ``openai`` client against a real mesh: two replica
agents running the torch engine on a tiny model fitted to call a tool (:mod:`.tool_model`), a balancer
routing to both with ``http_listen`` on, and a second balancer with no replica and a bearer token."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc
import httpx2 as httpx
import openai
import pytest

from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc
from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from tests.processes import free_port, running_server

from .tool_model import ANSWER, CALL, MESSAGES, TOOLS, fit_tool_model

pytestmark = pytest.mark.timeout(300)

AGENT = """node_id: {node}
backend: torch
model: {model}
stream_interval: 4
flush_interval_s: 0.05
engine_options: {{max_batch_size: 16, num_threads: 1}}
replicas:
  - {{replica_id: {node}-s0, kind: STANDALONE}}
"""
MODEL = "tool-model"


class Mesh:
    def __init__(self, base: str, lb: str, agents: dict[str, tuple[str, subprocess.Popen]], bare: str) -> None:
        self.base, self.lb, self.agents, self.bare = base, lb, agents, bare
        self.client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    model_dir = fit_tool_model(tmp / MODEL)
    with running_server("replica-agent", _agent(tmp, "a", model_dir), log_path=tmp / "a.log") as a, \
            running_server("replica-agent", _agent(tmp, "b", model_dir), log_path=tmp / "b.log") as b:
        http, bare_http = free_port(), free_port()
        (tmp / "lb.yaml").write_text(
            f"http_listen: 127.0.0.1:{http}\nmodel: {model_dir}\nserved_model_name: {MODEL}\n"
            "http_max_in_flight: 4\nreplicas:\n"
            f"  - {{replica_id: a-s0, address: {a[0]}}}\n  - {{replica_id: b-s0, address: {b[0]}}}\n")
        (tmp / "bare.yaml").write_text(f"http_listen: 127.0.0.1:{bare_http}\nmodel: {model_dir}\n"
                                       "http_api_token: s3cret\nno_replica_wait_s: 0.3\n")
        with running_server("lb", ["--config", str(tmp / "lb.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp / "lb.log") as lb, \
                running_server("lb", ["--config", str(tmp / "bare.yaml"), "--listen", "127.0.0.1:0"],
                               log_path=tmp / "bare.log"):
            yield Mesh(f"http://127.0.0.1:{http}/v1", lb[0], {"a-s0": a, "b-s0": b},
                       f"http://127.0.0.1:{bare_http}/v1")


def _agent(tmp: Path, node: str, model_dir: Path) -> list[str]:
    (tmp / f"{node}.yaml").write_text(AGENT.format(node=node, model=model_dir))
    return ["--config", str(tmp / f"{node}.yaml"), "--listen", "127.0.0.1:0"]


def _engine_ids(agent: str, replica: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids straight from a replica agent (no balancer, no HTTP)."""
    with grpc.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        ids: list[int] = []
        for msg in stub.Generate(agent_pb.GenerateRequest(
                replica_id=replica, request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt,
                sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                              ignore_eos=True)), timeout=60):
            ids.extend(msg.token_ids)
        return ids


def test_models_lists_the_served_model(mesh):
    models = mesh.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_completion_returns_the_engines_exact_token_ids_and_logprobs(mesh):
    completion = mesh.client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                                logprobs=1, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == [ord(c) for c in "hello there"]
    assert extra["token_ids"] == _engine_ids(mesh.agents["a-s0"][0], "a-s0", extra["prompt_token_ids"], 12)
    assert completion.usage.completion_tokens == 12 and completion.usage.prompt_tokens == 11
    assert len(choice.logprobs.token_logprobs) == 12 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert sum(s["num_tokens"] for s in extra["segments"]) == 12
    assert {s["weight_version"] for s in extra["segments"]} == {0}
    # token ids in as the prompt: the same ids come back
    again = mesh.client.completions.create(model=MODEL, prompt=extra["prompt_token_ids"], max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].model_extra["token_ids"] == extra["token_ids"]
    assert again.choices[0].text == choice.text


def test_streamed_completion_adds_up_to_the_whole(mesh):
    whole = mesh.client.completions.create(model=MODEL, prompt="stream me", max_tokens=40, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(mesh.client.completions.create(model=MODEL, prompt="stream me", max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    parts = [c for c in chunks if c.choices]
    assert len(parts) > 1                               # streamed in several chunks
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text
    assert [t for c in parts for t in c.choices[0].model_extra["token_ids"]] == \
        whole.choices[0].model_extra["token_ids"]
    assert parts[0].choices[0].model_extra["prompt_token_ids"] == [ord(c) for c in "stream me"]
    assert parts[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 40


def test_chat_with_tools_returns_the_models_tool_call(mesh):
    response = mesh.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
                                                   logprobs=True)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == CALL["name"]
    assert json.loads(call.function.arguments) == CALL["arguments"]
    assert choice.message.content is None
    extra = response.model_extra
    from mesh_runtime.chat import ChatTokenizer

    tokenizer = ChatTokenizer.from_model("tiny-llama")
    assert extra["prompt_token_ids"] == tokenizer.encode_chat(MESSAGES, tools=TOOLS)
    assert tokenizer.decode(choice.model_extra["token_ids"]) == ANSWER
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
    # the harness's next turn: the call and its result go back in; the template renders them
    follow = mesh.client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, tools=TOOLS, messages=[
        *MESSAGES, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id,
                                                                  "content": "42"}])
    assert "<tool_response>42</tool_response>" in tokenizer.decode(follow.model_extra["prompt_token_ids"],
                                                                   skip_special_tokens=False)


def test_streamed_chat_delivers_the_tool_call_in_a_delta(mesh):
    chunks = list(mesh.client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
                                                      stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "lookup"
    assert json.loads(calls[0].function.arguments) == {"key": "x"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""    # the call is not shown as text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].model_extra["prompt_token_ids"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stop_strings_end_the_text_before_them(mesh):
    whole = mesh.client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0]
    stop = whole.text[10:12]
    cut = mesh.client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole.text[:whole.text.find(stop)]
    ids = cut.model_extra["token_ids"]
    assert ids == whole.model_extra["token_ids"][:len(ids)] and len(ids) < 30


def test_a_repeated_request_id_gets_the_same_result(mesh):
    headers = {"x-request-id": f"idem-{time.monotonic_ns()}"}
    first = mesh.client.completions.create(model=MODEL, prompt="sample", max_tokens=16, temperature=1.0,
                                           extra_headers=headers)
    second = mesh.client.completions.create(model=MODEL, prompt="sample", max_tokens=16, temperature=1.0,
                                            extra_headers=headers)
    assert second.choices[0].model_extra["token_ids"] == first.choices[0].model_extra["token_ids"]
    assert second.choices[0].text == first.choices[0].text


def test_error_shapes(mesh):
    with pytest.raises(openai.NotFoundError) as err:
        mesh.client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "gpt-4" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        mesh.client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert err.value.body["param"] == "max_tokens" and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        mesh.client.completions.create(model=MODEL, prompt="x", max_tokens=600)
    assert "context of 512 tokens" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        mesh.client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.RateLimitError) as err:     # 5 generations, 4 admitted at once
        mesh.client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=5)
    assert err.value.response.headers["retry-after"] == "1"
    bare = openai.OpenAI(base_url=mesh.bare, api_key="s3cret", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:   # no replica: 503 once no_replica_wait_s passed
        bare.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert err.value.status_code == 503
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=mesh.bare, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in bare.models.list().data] == [MODEL]
    response = httpx.post(f"{mesh.base}/completions", content=b"{not json", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    for pause in ("-1", "soon", "1e9"):
        with pytest.raises(openai.BadRequestError) as err:
            mesh.client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           extra_headers={"x-session-id": "t", "x-expected-pause": pause})
        assert err.value.body["param"] == "x-expected-pause" and pause in err.value.body["message"]


def test_a_request_id_in_flight_is_refused_and_deadlines_are_kept(mesh):
    headers = {"x-request-id": f"busy-{time.monotonic_ns()}"}
    stream = mesh.client.completions.create(model=MODEL, prompt="long one", max_tokens=300, temperature=0,
                                            stream=True, extra_headers=headers, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)                                         # running now
    with pytest.raises(openai.ConflictError) as err:
        mesh.client.completions.create(model=MODEL, prompt="long one", max_tokens=300, extra_headers=headers)
    assert err.value.body["code"] == "request_in_flight"
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks if c.choices) > 0
    bare = openai.OpenAI(base_url=mesh.bare, api_key="s3cret", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:    # no replica, and the deadline comes first
        bare.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_headers={"x-request-timeout": "0.1"})
    assert err.value.status_code == 504
    with pytest.raises(openai.BadRequestError):
        bare.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_headers={"x-request-timeout": "soon"})


def test_close_session_over_grpc_checks_its_argument(mesh):
    with grpc.insecure_channel(mesh.lb) as channel:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
        assert stub.CloseSession(lb_pb.CloseSessionRequest(session_id="never-seen")).replica_id == ""
        with pytest.raises(grpc.RpcError) as err:
            stub.CloseSession(lb_pb.CloseSessionRequest(session_id="x" * 300))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in err.value.details()


def test_sessions_stick_and_close_over_http(mesh):
    headers = {"x-session-id": "trajectory-7"}
    replicas = set()
    for turn in range(3):
        response = mesh.client.completions.create(model=MODEL, prompt=f"turn {turn}", max_tokens=4,
                                                  extra_headers=headers)
        replicas |= {s["replica_id"] for s in response.choices[0].model_extra["segments"]}
    assert len(replicas) == 1
    closed = httpx.delete(f"{mesh.base}/sessions/trajectory-7", timeout=10).json()
    assert closed == {"session_id": "trajectory-7", "closed": True, "replica_id": replicas.pop(), "released": False}
    again = httpx.delete(f"{mesh.base}/sessions/trajectory-7", timeout=10).json()
    assert again["replica_id"] is None


def test_curl_sees_sse_framing(mesh):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": MODEL, "prompt": "frame", "max_tokens": 20, "stream": True, "temperature": 0,
                       "ignore_eos": True})
    out = subprocess.run([curl, "-sN", f"{mesh.base}/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=60).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert sum(len(p["choices"][0]["token_ids"]) for p in payloads) == 20


def test_concurrent_clients_each_get_their_own_result(mesh):
    async def run():
        client = openai.AsyncOpenAI(base_url=mesh.base, api_key="unused", max_retries=0)
        prompts = [f"prompt {i}" for i in range(4)]
        results = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                                                   temperature=0, extra_body={"ignore_eos": True})
                                          for p in prompts))
        await client.close()
        return results

    results = asyncio.run(run())
    for i, result in enumerate(results):
        assert result.choices[0].model_extra["prompt_token_ids"] == [ord(c) for c in f"prompt {i}"]
        assert len(result.choices[0].model_extra["token_ids"]) == 8


def test_a_stream_survives_the_kill_of_its_replica(mesh, tmp_path):
    prompt = "resume after a crash"
    expected = _engine_ids(mesh.agents["b-s0"][0], "b-s0", [ord(c) for c in prompt], 400)
    stream = mesh.client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    ids: list[int] = []
    killed = None
    for chunk in stream:
        if chunk.choices:
            ids.extend(chunk.choices[0].model_extra["token_ids"])
        if killed is None and ids:
            killed = _kill_busy_agent(mesh)
    assert killed is not None and len(ids) == 400
    assert ids == expected


def _kill_busy_agent(mesh) -> str:
    with grpc.insecure_channel(mesh.lb) as channel:
        reply = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel).ListReplicas(lb_pb.ListReplicasRequest())
    busy = next(r.endpoint.replica_id for r in reply.replicas if r.in_flight)
    mesh.agents[busy][1].send_signal(signal.SIGKILL)
    return busy


def test_a_repeated_long_prompt_is_routed_to_its_cache_and_reports_cached_tokens(mesh):
    prompt = "the same long system prompt, sent twice. " * 4                 # 164 characters: 164 tokens
    first = mesh.client.completions.create(model=MODEL, prompt=prompt + "a", max_tokens=2, temperature=0)
    second = mesh.client.completions.create(model=MODEL, prompt=prompt + "b", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the balancer sends it where the prompt's blocks went; that replica's torch engine finds 10 blocks of 16
    assert second.usage.prompt_tokens_details.cached_tokens == 160
