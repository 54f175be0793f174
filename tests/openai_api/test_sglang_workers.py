"""SGLang's router's worker API on the balancer, as slime uses it, against real processes: a controller, a
balancer registered with it (HTTP front on), a replica agent of the sglang backend, and SGLang servers (the fake
of tests/engines/fake_sglang.py, as processes). slime registers each engine with ``POST /workers``, generates
through ``/generate``, aborts with ``/abort_request`` on every URL ``GET /workers`` lists and polls their
``/v1/loads`` until idle, and removes an engine with ``DELETE /workers/{id}``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from tests.controller.scaling.helpers import Procs, until
from tests.engines.fake_sglang import FakeSglangProcess, write_model
from tests.processes import free_port

pytestmark = pytest.mark.timeout(240)
CONTROLLER = "lease_ttl_s: 3\nload_report_interval_s: 0.2\nstate_dir: {state}\n"
SGLANG_AGENT = """node_id: s
slots: 1
backend: sglang
model: {model}
controller_address: {controller}
stream_interval: 2
flush_interval_s: 0.05
engine_options: {{weight_backend: gloo, metrics_interval_s: 0.2}}
"""


def _model(directory: Path) -> Path:
    """The fake's checkpoint plus a word-level tokenizer of its 32 tokens (the balancer's HTTP front needs one)."""
    from tokenizers import Tokenizer, models

    model = write_model(directory, {"lm_head.weight": (32, 8)})
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0")).save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t31"}))
    return model


async def _call(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.request(method, url, json=body) as response:
        return response.status, await response.json()


async def test_slime_registers_generates_aborts_and_removes_engines_through_the_worker_api(tmp_path):
    model = _model(tmp_path / "model")
    servers = [FakeSglangProcess(model, "--fake-token-delay", "0.03") for _ in range(2)]
    procs = Procs(tmp_path)
    try:
        controller = procs.start("controller", "controller", CONTROLLER.format(state=tmp_path / "state"))
        http = free_port()
        procs.start("lb", "lb", f"controller_address: {controller}\nhttp_listen: 127.0.0.1:{http}\n"
                                f"model: {model}\nno_replica_wait_s: 10\n")
        procs.start("s", "replica-agent", SGLANG_AGENT.format(model=model, controller=controller))
        router = f"http://127.0.0.1:{http}"

        async def agent_registered() -> bool:
            status, body = await _call("POST", f"{router}/workers", {"url": servers[0].url,
                                                                     "worker_type": "regular"})
            return status == 200 and body   # 502 until the sglang agent has registered
        added = await until(agent_registered, 60, every_s=0.5, what="the first engine to be attached")
        assert added["status"] == "ok" and added["url"] == servers[0].url
        status, second = await _call("POST", f"{router}/workers", {"url": servers[1].url})
        assert status == 200, second
        status, again = await _call("POST", f"{router}/workers", {"url": servers[0].url})   # already there
        assert status == 200 and again["worker_id"] == added["worker_id"]

        status, listed = await _call("GET", f"{router}/workers")
        workers = {w["engine_url"]: w for w in listed["workers"]}
        assert status == 200 and listed["total"] == 2 and sorted(workers) == sorted(s.url for s in servers)
        first = workers[servers[0].url]
        assert first["id"] == added["worker_id"] and first["url"] == f"{router}/workers/{first['id']}"
        assert first["is_healthy"] and first["worker_type"] == "regular" and first["weight_version"] == 0

        status, out = await _call("POST", f"{router}/generate", {"input_ids": [1, 2, 3], "return_logprob": True,
                                                                 "sampling_params": {"max_new_tokens": 6,
                                                                                     "ignore_eos": True}})
        assert status == 200 and len(out["output_ids"]) == 6, out
        assert out["meta_info"]["segments"][0]["replica_id"] in {w["id"] for w in listed["workers"]}

        # slime's abort: /abort_request {"abort_all": true} on every listed URL, then /v1/loads until idle
        streamed = [0] * 4

        async def long(i: int) -> dict:
            body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 120,
                                                                                 "ignore_eos": True}}
            last = {}
            async with aiohttp.ClientSession() as session, \
                    session.post(f"{router}/generate", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        last = json.loads(line[6:])
                        streamed[i] = len(last["output_ids"])
            return last

        tasks = [asyncio.create_task(long(i)) for i in range(4)]
        await until(lambda: all(streamed), 60, what="four generations streaming tokens")
        status, refused = await _call("POST", f"{router}/flush_cache")   # SGLang keeps a cache requests hold
        assert status == 400 and refused["error"]["code"] == "cache_in_use", refused
        for worker in listed["workers"]:
            status, _ = await _call("POST", f"{worker['url']}/abort_request", {"abort_all": True})
            assert status == 200

        async def idle() -> bool:
            loads = [(await _call("GET", f"{w['url']}/v1/loads"))[1] for w in listed["workers"]]
            return all(entry["loads"][0]["num_running_reqs"] == 0 for entry in loads)
        await until(idle, 30, what="the workers to report idle")
        partial = await asyncio.wait_for(asyncio.gather(*tasks), 30)

        async def flushed() -> dict | None:   # once the servers have let go of the aborted requests' KV
            status, answer = await _call("POST", f"{router}/flush_cache")
            return answer if status == 200 else None
        answer = await until(flushed, 20, every_s=0.2, what="a flush of every engine's cache")
        assert sorted(answer["flushed"]) == sorted(w["id"] for w in listed["workers"])
        assert all(p["meta_info"]["finish_reason"]["type"] == "abort" for p in partial), partial
        assert all(0 < len(p["output_ids"]) < 120 for p in partial), [len(p["output_ids"]) for p in partial]
        await until(lambda: all(s.state()["running"] == [] for s in servers), 10,
                    what="nothing left running on the engines")

        # slime's shutdown: DELETE the engine's worker; the replica drains, the server keeps running
        status, removed = await _call("DELETE", f"{router}/workers/{first['id']}")
        assert status == 200 and removed["worker_id"] == first["id"], removed
        status, listed = await _call("GET", f"{router}/workers")
        assert [w["engine_url"] for w in listed["workers"]] == [servers[1].url]
        assert servers[0].process.poll() is None

        # bad input changes nothing
        for body, field in (({"url": servers[0].url, "worker_type": "prefill"}, "worker_type"),
                            ({"url": "ftp://x"}, "url"), ({"url": servers[0].url, "api_key": "k"}, "api_key"),
                            ({"url": servers[0].url, "model_id": "other"}, "model_id")):
            status, error = await _call("POST", f"{router}/workers", body)
            assert status == 400 and error["error"]["param"] == field, error
        status, error = await _call("DELETE", f"{router}/workers/nobody")
        assert status == 404 and "nobody" in error["error"]["message"]
        assert [w["engine_url"] for w in (await _call("GET", f"{router}/workers"))[1]["workers"]] == [servers[1].url]
    finally:
        procs.close()
        for server in servers:
            server.stop()
