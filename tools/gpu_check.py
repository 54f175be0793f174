"""One prepared check of rollmesh's GPU paths: run by ``scripts/gpu-check`` on a CUDA machine.

Sections (each prints OK, SKIP with the reason, or FAIL with the error, and its timings):

1. ``environment``: torch, CUDA devices, which optional engines are importable.
2. ``torch-engine``: the torch engine on the GPU: batched generation (tokens/s), sleep level 1 and wake
   (seconds, bytes freed, weights back bit for bit), abort latency.
3. ``trainer``: the torch training backend on the GPU: one GRPO step, offload and onload.
4. ``nccl-broadcast``: with two GPUs or more, rollmesh's weight sync over NCCL against a raw NCCL broadcast
   of the same bytes (two processes).
5. ``megatron``: with megatron-core importable, its GPT built from the preset's config, its export compared
   with the checkpoint, its logits with transformers', one GRPO step, offload and onload.
6. ``vllm``: with vllm importable, tests/engines/test_vllm_gpu.py.

``--allow-cpu`` runs the sections that can on CPU (so the suite checks this script); the exit status is 1
when any section FAILs. Everything is bounded: the wrapper gives the whole check a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from mesh_runtime.net import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS: list[dict] = []


class Skip(Exception):
    """A section that cannot run here (the message says why)."""


def section(name: str, run: Callable[[argparse.Namespace], dict], args: argparse.Namespace) -> None:
    started = time.perf_counter()
    try:
        figures = run(args)
        outcome = {"section": name, "result": "OK", **figures}
    except Skip as why:
        outcome = {"section": name, "result": "SKIP", "why": str(why)}
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the other sections still run
        outcome = {"section": name, "result": "FAIL", "error": repr(exc)[:500],
                   "trace": traceback.format_exc()[-1500:]}
    outcome["seconds"] = round(time.perf_counter() - started, 3)
    RESULTS.append(outcome)
    print(json.dumps(outcome), flush=True)


def device(args: argparse.Namespace) -> str:
    if torch.cuda.is_available():
        return "cuda"
    if args.allow_cpu:
        return "cpu"
    raise Skip("no CUDA device")


# ---------------------------------------------------------------------------------------------- sections
def environment(args: argparse.Namespace) -> dict:
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": names,
            "vllm": importlib.util.find_spec("vllm") is not None,
            "megatron_core": importlib.util.find_spec("megatron") is not None,
            "sglang": importlib.util.find_spec("sglang") is not None}


def torch_engine(args: argparse.Namespace) -> dict:
    from replica_agent.engines import FinishReason, EngineRequest, SamplingParams, create_engine

    where = device(args)

    async def run() -> dict:
        engine = create_engine("torch", preset=args.preset, device=where, stream_interval=16,
                               max_total_tokens=None if where == "cuda" else 65536)
        await engine.start()
        try:
            async def one(i: int, tokens: int):
                request = EngineRequest(f"g{i}", [1 + i % 7, 2, 3], SamplingParams(max_tokens=tokens,
                                                                                   ignore_eos=True, seed=i))
                return [c async for c in engine.generate(request)]

            await asyncio.gather(*(one(i, 8) for i in range(4)))   # warm-up
            started = time.perf_counter()
            outs = await asyncio.gather(*(one(i, args.tokens) for i in range(args.batch)))
            elapsed = time.perf_counter() - started
            produced = sum(len(c.token_ids) for out in outs for c in out)
            before = {n: t.detach().clone() for n, t in engine.named_weights()}
            started = time.perf_counter()
            freed = await engine.sleep(1)
            slept = time.perf_counter() - started
            started = time.perf_counter()
            await engine.wake_up()
            woke = time.perf_counter() - started
            same = all(torch.equal(before[n], t) for n, t in engine.named_weights())
            from modeling.presets import preset_config

            longest = preset_config(args.preset).max_position_embeddings - 8
            stream = engine.generate(EngineRequest("long", [1, 2, 3], SamplingParams(max_tokens=longest,
                                                                                       ignore_eos=True)))
            await stream.__anext__()
            started = time.perf_counter()
            await engine.abort(["long"])
            rest = [c async for c in stream]
            aborted = time.perf_counter() - started
            if rest[-1].finish_reason is not FinishReason.ABORTED or not same:
                raise AssertionError(f"abort ended {rest[-1].finish_reason}, weights back bit for bit: {same}")
            return {"device": where, "tokens_per_s": round(produced / elapsed, 1), "batch": args.batch,
                    "sleep_s": round(slept, 4), "wake_s": round(woke, 4), "bytes_freed": freed,
                    "abort_s": round(aborted, 4)}
        finally:
            await engine.close()

    return asyncio.run(run())


def _samples(vocab: int, groups: int = 4, per: int = 4, length: int = 24):
    from trainer_agent.training.grpo import Sample

    generator = torch.Generator().manual_seed(0)
    out = []
    for g in range(groups):
        prompt = torch.randint(0, vocab, (6,), generator=generator).tolist()
        out.append([Sample(prompt, torch.randint(0, vocab, (length,), generator=generator).tolist(),
                           [-1.0] * length, reward=float((g + i) % 2)) for i in range(per)])
    return out


def _train_step(source, vocab: int) -> dict:
    from trainer_agent.training.grpo import GrpoConfig, GrpoTrainer

    trainer = GrpoTrainer.from_weight_source(source, GrpoConfig(lr=1e-4))
    step = _timed(lambda: trainer.step(_samples(vocab)))
    offload = _timed(trainer.offload)
    held = trainer.offloaded_bytes()
    onload = _timed(trainer.onload)
    return {"grpo_step_s": step, "offload_s": offload, "onload_s": onload, "offloaded_bytes": held,
            "weight_version": source.weight_version}


def _timed(call: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return round(time.perf_counter() - started, 4)


def trainer(args: argparse.Namespace) -> dict:
    from modeling.presets import preset_config
    from trainer_agent.weight_source import TorchWeightSource

    where = device(args)
    source = TorchWeightSource(args.preset, device=where, dtype="bfloat16" if where == "cuda" else "float32")
    source.load()
    return {"device": where, **_train_step(source, preset_config(args.preset).vocab_size)}


def _nccl_worker(rank: int, port: int, total_bytes: int, iters: int, out) -> None:
    from weight_transfer import (GroupCache, WeightTransferConfig, broadcast_manifest, build_manifest,
                                 receive_weights, send_weights)

    torch.cuda.set_device(rank)
    config = WeightTransferConfig(bucket_size_bytes=64 << 20, setup_timeout_s=120, op_timeout_s=120)
    members = ["sender", "receiver"]
    with GroupCache(members[rank], config) as cache:
        if rank == 0:
            cache.host_rendezvous("127.0.0.1", port)
        group = cache.get("gpu-check", members, ("127.0.0.1", port), backend="nccl")
        count = 64
        tensors = [(f"w{i}", torch.randn(total_bytes // 4 // count, device="cuda")) for i in range(count)]
        manifest = broadcast_manifest(group, build_manifest(tensors, config.bucket_size_bytes) if rank == 0
                                      else None)
        raw = torch.empty(manifest.total_bytes, dtype=torch.uint8, device="cuda")
        pg = group.backend_group
        timings: dict[str, list[float]] = {"raw_nccl_broadcast": [], "rollmesh_weight_sync": []}
        for i in range(iters + 1):
            for mode in timings:
                pg.barrier().wait()
                torch.cuda.synchronize()
                started = time.perf_counter()
                if mode == "raw_nccl_broadcast":
                    pg.broadcast(raw, 0).wait()
                elif rank == 0:
                    send_weights(group, manifest, tensors)
                else:
                    receive_weights(group, manifest)
                torch.cuda.synchronize()
                pg.barrier().wait()
                if i:
                    timings[mode].append(time.perf_counter() - started)
        out.put((rank, {m: statistics.median(t) for m, t in timings.items()}, manifest.total_bytes))


def nccl_broadcast(args: argparse.Namespace) -> dict:
    if torch.cuda.device_count() < 2:
        raise Skip(f"needs two GPUs, this machine has {torch.cuda.device_count()} (NCCL does not run two "
                   "ranks on one device)")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_nccl_worker, args=(r, port, args.sync_mib << 20, 5, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict((r, (t, b)) for r, t, b in (out.get(timeout=240) for _ in procs))
    for proc in procs:
        proc.join(timeout=60)
    timings, total = results[1]
    raw, ours = timings["raw_nccl_broadcast"], timings["rollmesh_weight_sync"]
    return {"bytes": total, "raw_s": round(raw, 4), "weight_sync_s": round(ours, 4),
            "weight_sync_vs_raw": round(raw / ours, 3), "raw_gb_per_s": round(total / raw / 1e9, 2)}


def megatron(args: argparse.Namespace) -> dict:
    if importlib.util.find_spec("megatron") is None:
        raise Skip("megatron-core is not installed (pip install 'rollmesh[megatron]')")
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise Skip("megatron-core's forward pass needs CUDA")
    where = "cuda" if torch.cuda.is_available() else "cpu"
    warnings.filterwarnings("ignore", module="megatron")
    from modeling.presets import build_preset_model, preset_config
    from trainer_agent.megatron.source import MegatronWeightSource

    source = MegatronWeightSource(args.preset, device=where, dtype="float32")
    load = _timed(source.load)
    reference = build_preset_model(args.preset, 0).to(where).eval()
    exported = dict(source.named_weights())
    expected = {n: p.detach() for n, p in reference.state_dict().items() if n in exported}
    if not all(torch.equal(exported[n], t) for n, t in expected.items()):
        raise AssertionError("the exported weights differ from the checkpoint")
    if where == "cpu":
        return {"device": where, "load_s": load, "exported_tensors": len(exported),
                "forward": "not run: megatron-core's forward pass needs CUDA"}
    ids = torch.randint(0, preset_config(args.preset).vocab_size, (2, 32), device="cuda")
    with torch.no_grad():
        ours = source.module(input_ids=ids).logits.float()
        theirs = reference(input_ids=ids).logits.float()
    difference = (ours - theirs).abs().max().item()
    if difference > 1e-3:
        raise AssertionError(f"megatron logits differ from transformers' by {difference:g}")
    return {"load_s": load, "max_logit_difference": difference,
            **_train_step(source, preset_config(args.preset).vocab_size)}


def vllm(args: argparse.Namespace) -> dict:
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed")
    if not torch.cuda.is_available():
        raise Skip("vllm needs CUDA")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/engines/test_vllm_gpu.py",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=480)
    if done.returncode != 0:
        raise AssertionError(done.stdout[-1500:])
    return {"pytest": done.stdout.strip().splitlines()[-1]}


SECTIONS = {"environment": environment, "torch-engine": torch_engine, "trainer": trainer,
            "nccl-broadcast": nccl_broadcast, "megatron": megatron, "vllm": vllm}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run what can on CPU (checks this script)")
    parser.add_argument("--only", default="", help="comma-separated sections (default: all)")
    parser.add_argument("--preset", default="small-llama", help="model preset for the engine and trainer")
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests of the generation timing")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request of the generation timing")
    parser.add_argument("--sync-mib", type=int, default=1024, help="bytes of the NCCL weight-sync timing")
    args = parser.parse_args(argv)
    chosen = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    for name in chosen:
        section(name, SECTIONS[name], args)
    failed = [r["section"] for r in RESULTS if r["result"] == "FAIL"]
    print(json.dumps({"summary": {r["section"]: r["result"] for r in RESULTS}, "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
