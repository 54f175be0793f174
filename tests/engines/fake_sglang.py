"""A stand-in SGLang server for the SGLang backend's tests, written to SGLang 0.5.x's HTTP shapes.

Run as ``python -m tests.engines.fake_sglang --model-path DIR --host H --port P [launch_server flags]``:
it accepts the flags the backend passes to ``sglang.launch_server`` and
behaves as the real server does where the backend depends on it:

* ``/generate`` streams ``data: {...}`` events and ``data: [DONE]``;
  ``output_ids`` is cumulative unless ``--incremental-streaming-output``;
  ``meta_info`` has ``completion_tokens``, ``finish_reason`` (``null`` or
  ``{"type": ...}``) and cumulative ``output_token_logprobs``; bad sampling
  parameters, token ids outside the vocabulary and a duplicate ``rid`` answer
  400 with ``{"error": {"message"}}``;
* ``/pause_generation`` modes ``abort`` / ``retract`` / ``in_place``: requests
  (also new ones) wait until ``/continue_generation``; ``retract`` drops their
  KV; a cache flush is refused while a request holds KV;
* ``/release_memory_occupation`` without ``--enable-weights-cpu-backup``
  loses the weights' contents (zeros until the next update);
* ``/init_weights_update_group`` joins a torch process group the way
  SGLang's ``init_custom_process_group`` does (TCPStore rendezvous at rank
  ``rank_offset``, ``PrefixStore(group_name)``) and
  ``/update_weights_from_distributed`` receives each tensor by broadcast;
* ``/metrics`` exports the gauges and histograms SGLang's collector names.

The "model" is a deterministic function of the context, the position and one
weight's sum, so a test can tell which weights produced a token. ``GET
/_fake/state`` shows what the server went through.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import _new_process_group_helper

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, float("inf"))


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(BUCKETS)
        self.total, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        for bound, count in zip(BUCKETS, self.counts):
            le = "+Inf" if math.isinf(bound) else repr(bound)
            out.append(f'{name}_bucket{{model_name="fake",le="{le}"}} {count}')
        out += [f'{name}_sum{{model_name="fake"}} {self.total}', f'{name}_count{{model_name="fake"}} {self.count}']
        return out


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        self.vocab = int(config.get("vocab_size", 16))
        self.context_length = int(config.get("max_position_embeddings", 256))
        self.eos = config.get("eos_token_id")
        self.weights = {}
        for file in sorted(Path(args.model_path).glob("*.safetensors")):
            self.weights.update(load_file(file))
        self.lock = threading.Condition()
        self.running: dict[str, dict] = {}
        self.paused: str | None = None
        self.released: set[str] = set()
        self.group = None
        self.state = {"calls": [], "flush_refused": 0, "updates": 0, "max_running": 0, "pause_modes": [],
                      "generated": 0}
        self.queue_time, self.ttft = Histogram(), Histogram()
        self.healthy_at = time.monotonic() + args.fake_startup_delay

    # ------------------------------------------------------------------ model
    def weight_sum(self) -> float:
        name = sorted(self.weights)[0]
        return float(self.weights[name].float().sum())

    def next_token(self, context: list[int], position: int, seed: int | None, temperature: float) -> int:
        base = (sum(context[-4:]) + 7 * position + int(round(self.weight_sum() * 1000))) % self.vocab
        if temperature > 0 and seed is not None:
            base = (base + random.Random(seed * 1000003 + position).randrange(self.vocab)) % self.vocab
        return base

    # ------------------------------------------------------------- endpoints
    def check_generate(self, body: dict) -> str | None:
        ids, sp = body.get("input_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids or any(not isinstance(t, int) or not 0 <= t < self.vocab
                                                       for t in ids):
            return f"input_ids must be token ids below the vocabulary size {self.vocab}"
        if sp.get("temperature", 1.0) < 0:
            return f"temperature must be non-negative, got {sp['temperature']}."
        if not 0.0 < sp.get("top_p", 1.0) <= 1.0:
            return f"top_p must be in (0, 1], got {sp['top_p']}."
        top_k = sp.get("top_k", -1)
        if top_k < 1 and top_k != -1:
            return f"top_k must be -1 (disable), or at least 1, got {top_k}."
        if len(ids) + sp.get("max_new_tokens", 128) > self.context_length:
            return "The input and max_new_tokens exceed the context length"
        if body.get("rid") in self.running:
            return f"Duplicate request ID {body.get('rid')}"
        if self.released:
            return "memory is released"
        return None

    def generate(self, handler: "Handler", body: dict) -> None:
        rid, sp, submitted = body["rid"], body.get("sampling_params") or {}, time.monotonic()
        request = {"aborted": False, "retracted": False, "holds_kv": False}
        self.running[rid] = request
        self.state["generated"] += 1
        self.state["max_running"] = max(self.state["max_running"], len(self.running))
        context, output, logprobs = list(body["input_ids"]), [], []
        stop = set(sp.get("stop_token_ids") or [])
        if not sp.get("ignore_eos") and self.eos is not None:
            stop |= set(self.eos if isinstance(self.eos, list) else [self.eos])
        handler.start_stream()
        finish = None
        try:
            while finish is None:
                time.sleep(self.args.fake_token_delay)
                with self.lock:   # one decode step, never while paused
                    while self.paused in ("in_place", "retract") and not request["aborted"]:
                        self.lock.wait(0.05)
                    if request["aborted"]:
                        finish = {"type": "abort", "message": "Abort request"}
                        break
                    if not output:
                        self.queue_time.observe(time.monotonic() - submitted)
                    request["holds_kv"], request["retracted"] = True, False
                    token = self.next_token(context + output, len(output), sp.get("sampling_seed"),
                                            sp.get("temperature", 1.0))
                output.append(token)
                logprobs.append([-0.5 - 0.01 * len(output), token, None])
                if len(output) == 1:
                    self.ttft.observe(time.monotonic() - submitted)
                if token in stop:
                    finish = {"type": "stop", "matched": token}
                elif len(output) >= sp.get("max_new_tokens", 128):
                    finish = {"type": "length", "length": len(output)}
                if finish is None and len(output) % 2:
                    continue   # the server streams every other token, as stream_interval does
                if finish is not None:
                    self.running.pop(rid, None)   # a finished request frees its KV before its last event
                self.emit(handler, body, rid, output, logprobs, finish)
            if finish["type"] == "abort":
                self.running.pop(rid, None)
                self.emit(handler, body, rid, output, logprobs, finish)
            handler.send_event("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.running.pop(rid, None)

    def emit(self, handler, body, rid, output, logprobs, finish) -> None:
        sent = handler.sent
        incremental = self.args.incremental_streaming_output
        ids = output[sent:] if incremental else list(output)
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(output), "cached_tokens": 0}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = logprobs[sent:] if incremental else list(logprobs)
        handler.sent = len(output)
        handler.send_event(json.dumps({"output_ids": ids, "meta_info": meta}))

    def flush_refused(self) -> bool:
        holding = [r for r in self.running.values() if r["holds_kv"] and not r["retracted"]]
        if holding:
            self.state["flush_refused"] += 1
        return bool(holding)

    def control(self, path: str, body: dict) -> tuple[int, dict]:
        self.state["calls"].append(path)
        if path == "/abort_request":
            for rid, request in list(self.running.items()):
                if body.get("abort_all") or rid == body.get("rid"):
                    request["aborted"] = True
            return 200, {}
        if path == "/pause_generation":
            mode = body.get("mode", "abort")
            self.state["pause_modes"].append(mode)
            if mode == "abort":
                for request in self.running.values():
                    request["aborted"] = True
            with self.lock:
                if mode == "retract":
                    for request in self.running.values():
                        request["retracted"], request["holds_kv"] = True, False
                self.paused = mode
            return 200, {}
        if path == "/continue_generation":
            with self.lock:
                self.paused = None
                self.lock.notify_all()
            return 200, {}
        if path == "/flush_cache":
            if self.flush_refused():
                return 400, {"error": {"message": "Cache not flushed because there are pending requests."}}
            return 200, {}
        if path == "/release_memory_occupation":
            tags = set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
            if "weights" in tags and not self.args.enable_weights_cpu_backup:
                self.weights = {n: torch.zeros_like(t) for n, t in self.weights.items()}
            self.released |= tags
            return 200, {}
        if path == "/resume_memory_occupation":
            self.released -= set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
            return 200, {}
        if path == "/init_weights_update_group":
            timeout = datetime.timedelta(seconds=30)
            store = dist.TCPStore(body["master_address"], body["master_port"], body["world_size"],
                                  is_master=False, timeout=timeout)
            self.group, _ = _new_process_group_helper(
                body["world_size"], body["rank_offset"], [], body["backend"],
                dist.PrefixStore(body["group_name"], store), group_name=body["group_name"], timeout=timeout)
            self.state["group"] = body
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        if path == "/update_weights_from_distributed":
            if self.group is None or body.get("group_name") != self.state.get("group", {}).get("group_name"):
                return 400, {"error": {"message": f"unknown group {body.get('group_name')!r}"}}
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(tensor, group=self.group, group_src=0)
                if name not in self.weights:
                    return 200, {"success": False, "message": f"unknown weight {name}"}
                self.weights[name] = tensor
            self.state["updates"] += 1
            if body.get("flush_cache") and self.flush_refused():
                return 200, {"success": False, "message": "Cache not flushed because there are pending requests."}
            return 200, {"success": True, "message": "Succeeded to update parameter online."}
        return 404, {"error": {"message": f"no route {path}"}}

    def metrics(self) -> str:
        used = sum(1 for r in self.running.values() if r["holds_kv"])
        lines = ["# TYPE sglang:num_running_reqs gauge",
                 f'sglang:num_running_reqs{{model_name="fake"}} {sum(1 for _ in self.running)}',
                 "# TYPE sglang:num_queue_reqs gauge", 'sglang:num_queue_reqs{model_name="fake"} 0',
                 "# TYPE sglang:token_usage gauge", f'sglang:token_usage{{model_name="fake"}} {used / 64}']
        lines += self.queue_time.lines("sglang:queue_time_seconds")
        lines += self.ttft.lines("sglang:time_to_first_token_seconds")
        return "\n".join(lines) + "\n"


class Handler(BaseHTTPRequestHandler):
    server_version = "fake-sglang/0.5"
    sent = 0

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, status: int, body: dict | str) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def send_event(self, data: str) -> None:
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def do_GET(self) -> None:
        fake: Server = self.server.fake
        if self.path == "/health":
            self._json(200 if time.monotonic() >= fake.healthy_at else 503, {})
        elif self.path == "/get_server_info":
            self._json(200, {"tp_size": 1, "dtype": fake.args.dtype, "context_length": fake.context_length,
                             "max_total_num_tokens": 64, "version": "0.5.0-fake"})
        elif self.path == "/metrics":
            self._json(200, fake.metrics())
        elif self.path == "/_fake/state":
            self._json(200, {**fake.state, "weight_sum": fake.weight_sum(), "released": sorted(fake.released),
                             "paused": fake.paused, "running": sorted(fake.running)})
        else:
            self._json(404, {"error": {"message": "no route"}})

    def do_POST(self) -> None:
        fake: Server = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/generate":
            problem = fake.check_generate(body)
            if problem:
                self._json(400, {"error": {"message": problem}})
                return
            fake.generate(self, body)
            return
        status, answer = fake.control(self.path, body)
        self._json(status, answer)


class FakeSglangProcess:
    """The fake started as a process on a free loopback port (``url``); ``state()`` reads ``/_fake/state``."""

    def __init__(self, model_dir: Path | str, *flags: str) -> None:
        import subprocess
        import sys

        from mesh_runtime.net import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root = Path(__file__).resolve().parents[2]
        self.process = subprocess.Popen([sys.executable, "-m", "tests.engines.fake_sglang", "--model-path",
                                         str(model_dir), "--port", str(self.port), *flags], cwd=root)

    def state(self) -> dict:
        import httpx2

        return httpx2.get(f"{self.url}/_fake/state", timeout=5).json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def write_model(directory: Path, shapes: dict[str, tuple[int, ...]], *, vocab: int = 32, eos: int = 31) -> Path:
    """A checkpoint directory the fake (and the backend's weight catalog) reads: config.json + safetensors."""
    from safetensors.torch import save_file

    config = {"vocab_size": vocab, "max_position_embeddings": 128, "eos_token_id": eos, "torch_dtype": "float32"}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=generator) for n, s in shapes.items()}, directory / "model.safetensors")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--fake-token-delay", type=float, default=0.005)
    parser.add_argument("--fake-startup-delay", type=float, default=0.0)
    args, _ = parser.parse_known_args()   # every other launch_server flag is accepted and ignored
    httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    httpd.daemon_threads = True
    httpd.fake = Server(args)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
