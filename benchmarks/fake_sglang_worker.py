"""A fake SGLang worker for the peer benchmark (``bench_vs_smg``): the HTTP surface SMG's router uses, at a
synthetic engine's token timing.

It answers what SMG 1.13 reads from a worker (seen from its requests): ``/health``, ``/v1/models`` (a model
``owned_by: sglang``), ``/server_info`` and ``/get_server_info``, ``/model_info`` and ``/get_model_info``,
``/v1/loads`` and ``/loads``, ``/metrics``; and ``POST /generate`` with ``input_ids`` and
``sampling_params.max_new_tokens``, streamed as server-sent events (``stream: true``: a ``data:`` event per
``--chunk`` tokens, then ``data: [DONE]``) or as one JSON body. Each request gets ``--rate`` tokens/s, as
the synthetic engine gives each of its requests, so both systems route the same engine timing. With
``--engine-model JSON`` it runs instead the engine model the synthetic backend runs
(:mod:`replica_agent.engines.engine_model`: batched steps, prefill of uncached prompt tokens, a block prefix
cache, KV admission), reports ``cached_tokens`` in ``meta_info`` as SGLang does, and its loads. Plain asyncio
HTTP/1.1 with keep-alive, so the worker costs little beside the router.

    python -m benchmarks.fake_sglang_worker --port 0 --rate 200 --chunk 16    # prints "port N"
    python -m benchmarks.fake_sglang_worker --engine-model '{"speed": 0.25}'
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import random

from replica_agent.engines.engine_model import EngineModel, EngineModelConfig

MODEL = "bench-model"
_ids = itertools.count()


def _json(body: object, status: str = "200 OK") -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
            .encode() + data)


INFO = {
    "/health": {},
    "/v1/models": {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "sglang"}]},
    "/server_info": {"model_path": MODEL, "tokenizer_path": None, "dp_size": 1, "tp_size": 1,
                     "version": "0.5.0-fake"},
    "/model_info": {"model_path": MODEL, "is_generation": True},
    "/loads": {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0}]},
}
INFO["/get_server_info"], INFO["/get_model_info"], INFO["/v1/loads"] = (INFO["/server_info"], INFO["/model_info"],
                                                                          INFO["/loads"])


class Worker:
    def __init__(self, rate: float, chunk: int) -> None:
        self.rate, self.chunk = rate, chunk
        self.running = 0
        self.served = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                path = target.split("?", 1)[0]
                if method == "POST" and path == "/generate":
                    await self.generate(json.loads(body or b"{}"), writer)
                elif path == "/metrics":
                    text = (f"sglang:num_running_reqs {self.running}\n"
                            f"fake:requests_served_total {self.served}\n").encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
                                 + str(len(text)).encode() + b"\r\n\r\n" + text)
                elif path in ("/loads", "/v1/loads"):
                    writer.write(_json({"loads": [self.loads()]}))
                elif path in INFO:
                    writer.write(_json(INFO[path]))
                else:
                    writer.write(_json({"error": f"no route {path}"}, "404 Not Found"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def loads(self) -> dict:
        return {"num_running_reqs": self.running, "num_waiting_reqs": 0, "num_used_tokens": 0}

    async def generate(self, body: dict, writer: asyncio.StreamWriter) -> None:
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 16))
        prompt = len(body.get("input_ids") or [])
        rid = body.get("rid") or f"fake-{next(_ids)}"
        self.running += 1
        self.served += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(n / self.rate)
                writer.write(_json({"text": "x" * n, "output_ids": list(range(n)), "meta_info": {
                    "id": rid, "prompt_tokens": prompt, "completion_tokens": n,
                    "finish_reason": {"type": "length", "length": n}}}))
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            done = 0
            while done < n:
                step = min(self.chunk, n - done)
                await asyncio.sleep(step / self.rate)
                done += step
                finish = {"type": "length", "length": n} if done == n else None
                event = json.dumps({"text": "x" * step, "output_ids": list(range(done - step, done)), "meta_info": {
                    "id": rid, "prompt_tokens": prompt, "completion_tokens": done, "finish_reason": finish}})
                _chunk(writer, f"data: {event}\n\n".encode())
                await writer.drain()
            _chunk(writer, b"data: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
        finally:
            self.running -= 1


class _Job:
    def __init__(self, rid: str, context: list[int], max_new: int) -> None:
        self.rid, self.context, self.max_new = rid, context, max_new
        self.output: list[int] = []
        self.cached = 0
        self.events: asyncio.Queue[tuple[list[int], bool]] = asyncio.Queue()
        """(new token ids, whether they are the last)."""
        self.rng = random.Random(rid)


class ModelledWorker(Worker):
    """A worker whose requests run in batched steps timed by the engine model (see the module docstring)."""

    def __init__(self, model: EngineModel, chunk: int, max_running: int = 256) -> None:
        super().__init__(0.0, chunk)
        self.model, self.max_running = model, max_running
        self.waiting: collections.deque[_Job] = collections.deque()
        self.jobs: dict[str, _Job] = {}
        self.work = asyncio.Event()
        self.loop_task: asyncio.Task | None = None

    def loads(self) -> dict:
        return {"num_running_reqs": len(self.jobs), "num_waiting_reqs": len(self.waiting),
                "num_used_tokens": self.model.used_tokens, "cache_hit_rate": self.model.hit_rate}

    async def run(self) -> None:
        preempted: list[str] = []
        while True:
            while self.waiting and len(self.jobs) < self.max_running and not preempted:
                job = self.waiting[0]
                cached = self.model.admit(job.rid, job.context + job.output, job.max_new - len(job.output))
                if cached is None:
                    break
                self.waiting.popleft()
                if not job.output:      # a preempted job keeps what it found when first admitted
                    job.cached = cached
                self.jobs[job.rid] = job
            if not self.jobs:
                if preempted:           # every running one was preempted: admit again
                    preempted = []
                    continue
                self.work.clear()
                await self.work.wait()
                continue
            runs = [(rid, min(self.chunk, job.max_new - len(job.output))) for rid, job in self.jobs.items()]
            preempted = self.model.grow(runs, lambda rid: self.jobs[rid].context + self.jobs[rid].output)
            for rid in preempted:       # the most recent first: the earliest ends at the head of the queue
                self.waiting.appendleft(self.jobs.pop(rid))
            runs = [(rid, count) for rid, count in runs if rid in self.jobs]
            await asyncio.sleep(self.model.step_seconds(runs))
            for rid, count in runs:
                job = self.jobs[rid]
                ids = [job.rng.randrange(2, 32000) for _ in range(count)]
                job.output += ids
                finished = len(job.output) >= job.max_new
                job.events.put_nowait((ids, finished))
                if finished:
                    del self.jobs[rid]
                    self.model.release(rid, job.context + job.output)

    async def generate(self, body: dict, writer: asyncio.StreamWriter) -> None:
        if self.loop_task is None:
            self.loop_task = asyncio.get_running_loop().create_task(self.run())
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 16))
        context = [int(t) for t in body.get("input_ids") or ()]
        rid = f"{body.get('rid') or 'fake'}-{next(_ids)}"
        job = _Job(rid, context, n)
        self.served += 1
        self.waiting.append(job)
        self.work.set()
        stream = bool(body.get("stream"))
        if stream:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        finished = False
        while not finished:
            ids, finished = await job.events.get()
            if stream:
                _chunk(writer, f"data: {json.dumps(self._body(job, ids, finished))}\n\n".encode())
                await writer.drain()
        if stream:
            _chunk(writer, b"data: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(_json(self._body(job, job.output, True)))

    @staticmethod
    def _body(job: _Job, ids: list[int], done: bool) -> dict:
        return {"text": _text(ids), "output_ids": ids, "meta_info": {
            "id": job.rid, "prompt_tokens": len(job.context), "completion_tokens": len(job.output),
            "cached_tokens": job.cached,
            "finish_reason": {"type": "length", "length": job.max_new} if done else None}}


def _text(ids: list[int]) -> str:
    """The text a prompt's or a response's token ids stand for (one word a token), for routers that route by
    text: equal id prefixes give equal text prefixes."""
    return "".join(f"t{t} " for t in ids)


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--rate", type=float, default=200.0, help="tokens/s per request")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per streamed event")
    parser.add_argument("--engine-model", help="JSON options of the engine model (replaces --rate)")
    args = parser.parse_args()
    worker = (ModelledWorker(EngineModel(EngineModelConfig(**json.loads(args.engine_model)),
                                         iterations_per_step=args.chunk), args.chunk)
              if args.engine_model else Worker(args.rate, args.chunk))
    server = await asyncio.start_server(worker.serve, "127.0.0.1", args.port, backlog=1024)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
