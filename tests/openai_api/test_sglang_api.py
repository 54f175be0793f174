"""SGLang's native API on the balancer's HTTP front against a real mesh (two replica agents running the torch
engine on the tiny-llama preset), called as slime calls SGLang's router: ``/generate`` with token ids and
SGLang's sampling names, answers with the engine's exact ids and logprobs, streams, stop strings and tokens,
stickiness by ``X-SMG-Routing-Key``, ``/abort_request`` handing back partial outputs that slime's partial
rollout sends again, the server queries, and bad input refused by name."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp
import grpc
import pytest

from mesh_runtime.chat import ChatTokenizer
from rollmesh.common.v1 import generation_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from tests.processes import free_port, running_server

pytestmark = pytest.mark.timeout(300)

AGENT = """node_id: {node}
backend: torch
model: tiny-llama
stream_interval: 4
flush_interval_s: 0.05
engine_options: {{max_batch_size: 16, num_threads: 1}}
replicas:
  - {{replica_id: {node}-s0, kind: STANDALONE}}
"""
PROMPT = [5, 72, 101, 108, 108, 111]


class Mesh:
    def __init__(self, base: str, agents: dict[str, str], bare: str, procs: dict) -> None:
        self.base, self.agents, self.bare, self.procs = base, agents, bare, procs
        self.tokenizer = ChatTokenizer.from_model("tiny-llama")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("sglang")
    for node in ("a", "b"):
        (tmp / f"{node}.yaml").write_text(AGENT.format(node=node))
    with running_server("replica-agent", ["--config", str(tmp / "a.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp / "a.log") as a, \
            running_server("replica-agent", ["--config", str(tmp / "b.yaml"), "--listen", "127.0.0.1:0"],
                           log_path=tmp / "b.log") as b:
        http, bare_http = free_port(), free_port()
        (tmp / "lb.yaml").write_text(
            f"http_listen: 127.0.0.1:{http}\nmodel: tiny-llama\nhttp_max_in_flight: 16\nreplicas:\n"
            f"  - {{replica_id: a-s0, address: {a[0]}}}\n  - {{replica_id: b-s0, address: {b[0]}}}\n")
        (tmp / "bare.yaml").write_text(f"http_listen: 127.0.0.1:{bare_http}\nmodel: tiny-llama\n"
                                       "no_replica_wait_s: 0.3\n")
        with running_server("lb", ["--config", str(tmp / "lb.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp / "lb.log"), \
                running_server("lb", ["--config", str(tmp / "bare.yaml"), "--listen", "127.0.0.1:0"],
                               log_path=tmp / "bare.log"):
            yield Mesh(f"http://127.0.0.1:{http}", {"a-s0": a[0], "b-s0": b[0]}, f"http://127.0.0.1:{bare_http}",
                       {"a-s0": a[1], "b-s0": b[1]})


def _engine(agent: str, replica: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy ids and logprobs straight from a replica agent (no balancer, no HTTP)."""
    with grpc.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        ids: list[int] = []
        logprobs: list[float] = []
        for msg in stub.Generate(agent_pb.GenerateRequest(
                replica_id=replica, request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt,
                sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                              logprobs=True)), timeout=60):
            ids.extend(msg.token_ids)
            logprobs.extend(msg.logprobs)
        return ids, logprobs


async def _post(base: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base}{path}", json=body, headers=headers or {}) as response:
        return response.status, await response.json()


def _greedy(max_new: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, **extra}


async def test_generate_returns_the_engines_ids_and_logprobs_as_sglang_does(mesh):
    status, out = await _post(mesh.base, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                                       "return_text_in_logprobs": True,
                                                       "sampling_params": _greedy(12)})
    assert status == 200, out
    ids, logprobs = _engine(mesh.agents["a-s0"], "a-s0", PROMPT, 12)
    assert out["output_ids"] == ids and out["text"] == mesh.tokenizer.decode(ids)
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids       # slime reads ids and logprobs here
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(logprobs, abs=1e-5)
    assert [text for _, _, text in meta["output_token_logprobs"]] == [mesh.tokenizer.token_text(t) for t in ids]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (6, 12, "0")
    assert len(meta["id"]) == 32 and meta["e2e_latency"] > 0
    assert sum(s["num_tokens"] for s in meta["segments"]) == 12
    # text in, SGLang's default sampling: the prompt is tokenized here
    status, out = await _post(mesh.base, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and out["meta_info"]["prompt_tokens"] == len(mesh.tokenizer.encode("hello"))
    assert "output_token_logprobs" not in out["meta_info"]


async def test_a_batch_with_n_answers_a_list_in_prompt_order(mesh):
    status, out = await _post(mesh.base, "/generate", {
        "input_ids": [PROMPT, PROMPT[:3]], "rid": "batch-1", "return_logprob": True,
        "sampling_params": [{"n": 2, "max_new_tokens": 5, "sampling_seed": 3}, {"max_new_tokens": 3}]})
    assert status == 200, out
    assert [o["meta_info"]["id"] for o in out] == ["batch-1/0", "batch-1/1", "batch-1/2"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [6, 6, 3]
    assert [len(o["output_ids"]) for o in out if o["meta_info"]["finish_reason"]["type"] == "length"]
    status, none = await _post(mesh.base, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert status == 200 and none["output_ids"] == [] and none["meta_info"]["finish_reason"] == {"type": "length",
                                                                                                  "length": 0}


async def test_stop_strings_and_stop_tokens_end_as_sglang_reports_them(mesh):
    _, whole = await _post(mesh.base, "/generate", {"input_ids": PROMPT, "sampling_params": _greedy(24)})
    ids, text = whole["output_ids"], whole["text"]
    stop = text[4:6]
    assert stop and stop not in text[:5]
    _, cut = await _post(mesh.base, "/generate", {"input_ids": PROMPT, "sampling_params": _greedy(24, stop=[stop])})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[:text.find(stop)] and cut["output_ids"] == ids[:len(cut["output_ids"])]
    _, kept = await _post(mesh.base, "/generate", {"input_ids": PROMPT,
                                                   "sampling_params": _greedy(24, stop=stop, no_stop_trim=True)})
    assert kept["output_ids"] == cut["output_ids"]     # the text keeps the stop string: all the tokens' text
    assert kept["text"] == mesh.tokenizer.decode(kept["output_ids"]) and stop in kept["text"]
    token = ids[7]
    first = ids.index(token)
    _, by_token = await _post(mesh.base, "/generate", {"input_ids": PROMPT,
                                                       "sampling_params": _greedy(24, stop_token_ids=[token])})
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert by_token["output_ids"] == ids[:first + 1]


async def test_a_stream_holds_the_whole_output_so_far_and_ends_as_the_answer(mesh):
    body = {"input_ids": PROMPT, "return_logprob": True, "stream": True, "sampling_params": _greedy(40)}
    _, whole = await _post(mesh.base, "/generate", {**body, "stream": False})
    events = []
    async with aiohttp.ClientSession() as session, session.post(f"{mesh.base}/generate", json=body) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for line in response.content:
            if line.strip():
                events.append(line.decode().strip())
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len(chunks) > 2
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert [lp for lp, _, _ in last["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


async def test_a_routing_key_keeps_a_trajectory_on_one_replica(mesh):
    for key in ("traj-1", "traj-2"):
        replicas = set()
        for turn in range(3):
            _, out = await _post(mesh.base, "/generate", {"input_ids": PROMPT + [turn + 7],
                                                          "sampling_params": {"max_new_tokens": 3}},
                                 headers={"X-SMG-Routing-Key": key})
            replicas |= {s["replica_id"] for s in out["meta_info"]["segments"]}
        assert len(replicas) == 1, (key, replicas)


async def test_an_abort_returns_the_partial_output_and_slimes_resume_completes_it(mesh):
    """slime's partial rollout: /abort_request ends the generation with what it made (finish_reason abort);
    slime sends prompt + partial output again for the rest, and the whole equals an uninterrupted run."""
    _, whole = await _post(mesh.base, "/generate", {"input_ids": PROMPT, "sampling_params": _greedy(300)})
    body = {"input_ids": PROMPT, "rid": "to-abort", "return_logprob": True, "stream": True,
            "sampling_params": _greedy(300)}
    chunks = []
    async with aiohttp.ClientSession() as session, session.post(f"{mesh.base}/generate", json=body) as response:
        async for line in response.content:
            line = line.strip()
            if not line or line == b"data: [DONE]":
                continue
            chunks.append(json.loads(line[len(b"data: "):]))
            if len(chunks) == 2:
                status, aborted = await _post(mesh.base, "/abort_request", {"rid": "to-abort"})
                assert status == 200 and aborted == {"aborted": ["to-abort"]}
    partial = chunks[-1]
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    done = partial["output_ids"]
    assert 0 < len(done) < 300 and done == whole["output_ids"][:len(done)]
    assert len(partial["meta_info"]["output_token_logprobs"]) == len(done)
    _, rest = await _post(mesh.base, "/generate", {"input_ids": PROMPT + done,
                                                   "sampling_params": _greedy(300 - len(done))})
    assert done + rest["output_ids"] == whole["output_ids"]


async def test_abort_all_ends_every_generation_through_the_front(mesh):
    async def long(i: int) -> dict:
        return (await _post(mesh.base, "/generate", {"input_ids": PROMPT, "rid": f"all-{i}",
                                                     "sampling_params": _greedy(400)}))[1]

    tasks = [asyncio.create_task(long(i)) for i in range(3)]
    deadline = time.monotonic() + 60
    while True:
        _, info = await _post_get(mesh.base, "/get_server_info")
        if info["in_flight"] == 3:
            break
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.05)
    status, aborted = await _post(mesh.base, "/abort_request", {"abort_all": True})
    assert status == 200 and aborted["aborted"] == ["all-0", "all-1", "all-2"]
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" and len(o["output_ids"]) < 400 for o in outs)


async def _stream(base: str, body: dict, chunks: list[dict]) -> None:
    """Streams /generate, appending each chunk to ``chunks`` as it arrives."""
    async with aiohttp.ClientSession() as session, session.post(f"{base}/generate", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            line = line.strip()
            if line and line != b"data: [DONE]":
                chunks.append(json.loads(line[len(b"data: "):]))


async def _post_get(base: str, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.get(f"{base}{path}") as response:
        return response.status, await response.json()


async def test_server_queries(mesh):
    status, info = await _post_get(mesh.base, "/get_model_info")
    assert status == 200 and info["model_path"] == "tiny-llama" and info["is_generation"] is True
    assert info["weight_version"] == "0"
    status, server = await _post_get(mesh.base, "/get_server_info")
    assert status == 200 and server["routable_replicas"] == 2 and server["context_length"] == 512
    assert (await _post_get(mesh.base, "/health_generate"))[0] == 200
    status, body = await _post_get(mesh.bare, "/health_generate")   # a balancer without replicas
    assert status == 503 and "cannot generate" in body["error"]["message"]


async def test_bad_input_is_refused_by_name_and_starts_nothing(mesh):
    cases = [({"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 0.3}}, "sampling_params.frequency_penalty"),
             ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000}}, "sampling_params.max_new_tokens"),
             ({"input_ids": [10**7]}, "input_ids"),
             ({"input_ids": PROMPT, "rid": "x" * 300}, "rid")]
    for body, field in cases:
        status, out = await _post(mesh.base, "/generate", body)
        assert status == 400 and out["error"]["param"] == field, out
        assert len(out["error"]["message"]) < 400
    status, out = await _post(mesh.base, "/generate", {"input_ids": PROMPT},
                              headers={"X-SMG-Routing-Key": "k" * 300})
    assert status == 400 and out["error"]["param"] == "X-SMG-Routing-Key"
    status, out = await _post(mesh.base, "/abort_request", {})
    assert status == 400 and out["error"]["param"] == "rid"
    async with aiohttp.ClientSession() as session, \
            session.post(f"{mesh.base}/generate", data=b"{not json") as response:
        assert response.status == 400 and (await response.json())["error"]["code"] == "invalid_json"
    _, server = await _post_get(mesh.base, "/get_server_info")
    assert server["in_flight"] == 0


async def test_a_rid_in_flight_is_refused(mesh):
    first = asyncio.create_task(_post(mesh.base, "/generate", {"input_ids": PROMPT, "rid": "busy",
                                                               "sampling_params": _greedy(200)}))
    deadline = time.monotonic() + 60
    while (await _post_get(mesh.base, "/get_server_info"))[1]["in_flight"] == 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    status, out = await _post(mesh.base, "/generate", {"input_ids": PROMPT, "rid": "busy"})
    assert status == 409 and out["error"]["code"] == "request_in_flight"
    status, done = await first
    assert status == 200 and len(done["output_ids"]) == 200


async def test_a_repeated_rid_answers_the_recorded_result(mesh):
    body = {"input_ids": PROMPT, "rid": f"again-{time.monotonic_ns()}", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 1.0}}
    _, first = await _post(mesh.base, "/generate", body)
    _, second = await _post(mesh.base, "/generate", body)
    assert second["output_ids"] == first["output_ids"] and len(first["output_ids"]) == 24
    assert second["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]


async def test_the_worker_list_names_urls_that_take_slimes_abort(mesh):
    """Without a controller the balancer lists the replicas its config names; each worker's URL is the
    balancer's own, taking slime's abort and load polls for that replica's generations."""
    status, listed = await _post_get(mesh.base, "/workers")
    assert status == 200 and [w["id"] for w in listed["workers"]] == ["a-s0", "b-s0"]
    assert all(w["url"] == f"{mesh.base}/workers/{w['id']}" and w["engine_url"] is None and w["is_healthy"]
               for w in listed["workers"])
    assert (await _post_get(mesh.base, "/workers/a-s0"))[1]["id"] == "a-s0"
    assert (await _post_get(mesh.base, "/workers/a-s0/health_generate"))[0] == 200
    assert (await _post_get(mesh.base, "/workers/zz"))[0] == 404
    pinned = {"X-SMG-Routing-Key": "pinned-trajectory"}
    _, first = await _post(mesh.base, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
                           headers=pinned)
    replica = first["meta_info"]["segments"][0]["replica_id"]
    other = "b-s0" if replica == "a-s0" else "a-s0"
    task = asyncio.create_task(_post(mesh.base, "/generate", {"input_ids": PROMPT, "sampling_params": _greedy(400)},
                                     headers=pinned))
    deadline = time.monotonic() + 60
    while (await _post_get(mesh.base, f"/workers/{replica}/v1/loads"))[1]["loads"][0]["num_running_reqs"] != 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert (await _post_get(mesh.base, "/v1/loads"))[1]["loads"][0]["num_total_reqs"] == 1
    await asyncio.sleep(0.2)
    assert (await _post(mesh.base, f"/workers/{other}/abort_request", {"abort_all": True}))[1] == {"aborted": []}
    status, aborted = await _post(mesh.base, f"/workers/{replica}/abort_request", {"abort_all": True})
    assert status == 200 and len(aborted["aborted"]) == 1
    _, out = await task
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await _post_get(mesh.base, f"/workers/{replica}/v1/loads"))[1]["loads"][0]["num_running_reqs"] == 0
    status, refused = await _post(mesh.base, "/workers", {"url": "http://127.0.0.1:9"})
    assert status == 503 and refused["error"]["code"] == "no_controller"


async def test_a_version_policy_per_request_and_the_versions_stamped_on_the_answer(mesh):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
    for policy in ("any", "latest-only", "max-staleness:0", "min-version:0"):
        status, out = await _post(mesh.base, "/generate", body, headers={"x-weight-version-policy": policy})
        assert status == 200, out
        assert out["meta_info"]["weight_versions"] == [0] and out["meta_info"]["spans_versions"] is False
    # no replica holds version 1: the request waits for one until its deadline
    status, out = await _post(mesh.base, "/generate", body, headers={"x-weight-version-policy": "min-version:1",
                                                                     "x-request-timeout": "0.5"})
    assert status == 504, out
    status, out = await _post(mesh.base, "/generate", body, headers={"x-weight-version-policy": "newest"})
    assert status == 400 and out["error"]["param"] == "x-weight-version-policy"


async def test_smgs_own_rl_client_lists_workers_and_pauses_the_fleet(mesh):
    """SMG 1.13's RL client (smg.rl, unchanged) against the balancer: workers in SMG's shape; a paused section
    (pause_generation abort ... continue_generation) holds new requests and aborts the running one, which
    resumes with its tokens so far and completes; single calls; weight updates by tensor refused, by disk
    refused without a controller, as is a selector that matches nothing."""
    from smg.rl import RL, RlError, paused

    rl = RL(mesh.base, timeout=30)
    workers = await asyncio.to_thread(rl.workers)
    assert [w.id for w in workers] == ["a-s0", "b-s0"]
    assert all(w.engine == "rollmesh" and w.health == "healthy" and w.weight_version == "0"
               and w.control_url == f"{mesh.base}/v1/rl/workers/{w.id}/engine" for w in workers)
    assert (await asyncio.to_thread(rl.worker, "b-s0")).labels["node"] == ""
    with pytest.raises(RlError) as err:
        await asyncio.to_thread(rl.worker, "zz")
    assert err.value.status == 404 and err.value.code == "worker_not_found"
    call = await asyncio.to_thread(rl.call, "a-s0", "get_weight_version", {})
    assert call.status == 200 and call.body == {"weight_version": "0"}

    _, direct = await _post(mesh.base, "/generate", {"input_ids": PROMPT, "sampling_params": _greedy(400)})
    # The pause must land while the request runs; on a fast machine 400 tokens can finish first, so the
    # stream shows which happened and a request that finished before the pause is tried again.
    for _ in range(5):
        chunks: list[dict] = []
        whole = asyncio.create_task(_stream(mesh.base, {"input_ids": PROMPT, "stream": True,
                                                        "sampling_params": _greedy(400)}, chunks))
        deadline = time.monotonic() + 60
        while not chunks:
            assert time.monotonic() < deadline and not whole.done()
            await asyncio.sleep(0.005)
        with paused(rl, "engine=rollmesh") as result:
            assert result.total == result.succeeded == 2 and not result.failed
            assert {w.health for w in rl.workers()} == {"paused"}
            await asyncio.sleep(0.5)
            if whole.done():   # it finished before the pause reached its replica
                continue
            held = asyncio.create_task(_post(mesh.base, "/generate", {"input_ids": PROMPT,
                                                                      "sampling_params": {"max_new_tokens": 3}}))
            served = len(chunks[-1]["output_ids"])
            await asyncio.sleep(0.8)
            # nothing is served while the fleet is paused: the running request was aborted and waits
            assert not held.done() and not whole.done() and len(chunks[-1]["output_ids"]) == served < 400
        break
    else:
        pytest.fail("a 400-token request finished before the pause every time")
    status, out = await asyncio.wait_for(held, 30)
    assert status == 200 and len(out["output_ids"]) == 3
    await asyncio.wait_for(whole, 60)
    out = chunks[-1]
    assert len(out["output_ids"]) == 400 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == direct["output_ids"]   # resumed with its tokens so far: the same greedy ids
    assert len(out["meta_info"]["segments"]) >= 2 and sum(s["num_tokens"] for s in out["meta_info"]["segments"]) == 400

    with pytest.raises(RlError) as err:
        await asyncio.to_thread(rl.fanout, "update_weights_from_disk", {"model_path": "/x", "weight_version": "1"},
                                selector="engine=rollmesh")
    assert err.value.status == 503 and err.value.code == "no_controller"   # this balancer has no controller
    with pytest.raises(RlError) as err:
        await asyncio.to_thread(rl.fanout, "update_weights_from_tensor", {"serialized_named_tensors": ["x"]},
                                selector="engine=rollmesh")
    assert err.value.status == 501 and err.value.code == "not_supported"
    with pytest.raises(RlError) as err:
        await asyncio.to_thread(rl.fanout, "pause_generation", {}, selector="engine=sglang")
    assert err.value.status == 404 and err.value.code == "no_workers_matched"
    with pytest.raises(RlError) as err:
        await asyncio.to_thread(rl.fanout, "pause_generation", {}, selector="engine")
    assert err.value.status == 400 and err.value.code == "invalid_selector"
    with pytest.raises(RlError) as err:
        await asyncio.to_thread(rl.fanout, "pause_generation", {"mode": "nap"}, selector="all")
    assert err.value.status == 400
    assert {w.health for w in await asyncio.to_thread(rl.workers)} == {"healthy"}   # nothing changed

async def test_flush_cache_drops_the_replicas_cached_prefixes(mesh):
    """/flush_cache (the fleet), /workers/{id}/flush_cache (one worker) and SMG's engine path: the next request
    with a prompt the cache held computes it again."""
    from smg.rl import RL

    prompt = [(i * 7 + 3) % 200 for i in range(48)]
    headers = {"X-SMG-Routing-Key": "flush"}   # one replica for every request of this test

    async def cached() -> int:
        status, out = await _post(mesh.base, "/generate", {"input_ids": prompt, "sampling_params": _greedy(2)},
                                  headers)
        assert status == 200
        return out["meta_info"]["cached_tokens"]
    await cached()
    assert await cached() > 0
    status, out = await _post(mesh.base, "/flush_cache", {})
    assert status == 200 and out == {"message": "Cache flushed.", "flushed": ["a-s0", "b-s0"]}
    assert await cached() == 0
    assert await cached() > 0
    status, out = await _post(mesh.base, "/workers/a-s0/flush_cache", {})
    assert status == 200 and out["flushed"] == ["a-s0"]
    status, out = await _post(mesh.base, "/workers/b-s0/flush_cache", {})
    assert status == 200 and out["flushed"] == ["b-s0"]
    assert await cached() == 0
    result = await asyncio.to_thread(RL(mesh.base, timeout=30).fanout, "flush_cache", {}, selector="all")
    assert result.succeeded == result.total == 2
    assert await cached() == 0
    status, out = await _post(mesh.base, "/workers/zz/flush_cache", {})
    assert status == 404


async def test_a_replica_sigkilled_mid_rollout_costs_slime_no_request(mesh):
    """Requests shaped as slime's generate sends them (token ids, its sampling parameters, logprobs, one routing
    key per sample); one replica agent is SIGKILLed while they run: every request completes (last test here:
    it leaves one replica)."""
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 60, "stop": None,
                "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                "spaces_between_special_tokens": False, "ignore_eos": True}

    async def sample(i: int) -> tuple[int, dict]:
        return await _post(mesh.base, "/generate", {"input_ids": PROMPT + [i + 7], "return_logprob": True,
                                                     "sampling_params": sampling},
                           headers={"X-SMG-Routing-Key": f"sample-{i}"})

    tasks = [asyncio.create_task(sample(i)) for i in range(16)]
    deadline = time.monotonic() + 60
    while (await _post_get(mesh.base, "/workers/a-s0/v1/loads"))[1]["loads"][0]["num_running_reqs"] < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    mesh.procs["a-s0"].send_signal(signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert [status for status, _ in results] == [200] * 16, results
    assert all(len(out["output_ids"]) == 60 and len(out["meta_info"]["output_token_logprobs"]) == 60
               and out["meta_info"]["finish_reason"] == {"type": "length", "length": 60} for _, out in results)
