"""Throughput of TorchEngine vs plain Hugging Face ``model.generate()``.

For each concurrency N, the engine serves N concurrent greedy requests of
``--new-tokens`` tokens each (EOS ignored) and the baseline generates the same
N prompts as one batch with ``model.generate()`` on an identically built
model. Both report completion tokens per second of wall time (the engine
figure includes streaming through asyncio). The median of ``--repeats``
runs is shown, after one warm-up run each.

    .venv/bin/python -m benchmarks.bench_torch_engine --preset tiny-llama
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from replica_agent.engines import EngineRequest, SamplingParams, create_engine
from modeling.presets import PRESETS, build_preset_model


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(i * 131 + j * 17 + 3) % vocab for j in range(length)] for i in range(n)]


async def engine_run(engine, batch: list[list[int]], new_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    async def one(i: int, ids: list[int]) -> list[int]:
        sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        out: list[int] = []
        async for chunk in engine.generate(EngineRequest(f"{tag}-{i}", ids, sp)):
            out.extend(chunk.token_ids)
        return out

    start = time.perf_counter()
    outputs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))
    return time.perf_counter() - start, outputs


def hf_run(model, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    input_ids = torch.tensor(batch, dtype=torch.long)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start, out[:, input_ids.shape[1]:].tolist()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-llama", choices=sorted(PRESETS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    engine = create_engine("torch", preset=args.preset, seed=0, max_batch_size=max(args.concurrency))
    await engine.start()
    baseline = build_preset_model(args.preset, seed=0).eval()
    vocab = baseline.config.vocab_size
    print(f"preset={args.preset} prompt={args.prompt_tokens} new_tokens={args.new_tokens} "
          f"torch_threads={torch.get_num_threads()} repeats={args.repeats} (median)")
    print(f"{'N':>4} {'engine tok/s':>13} {'HF generate tok/s':>18} {'engine/HF':>10} {'same tokens':>12}")
    try:
        for n in args.concurrency:
            batch = prompts(n, args.prompt_tokens, vocab)
            total = n * args.new_tokens
            await engine_run(engine, batch, args.new_tokens, "warm")
            hf_run(baseline, batch, args.new_tokens)
            engine_times, hf_times = [], []
            for r in range(args.repeats):
                seconds, engine_out = await engine_run(engine, batch, args.new_tokens, f"n{n}r{r}")
                engine_times.append(seconds)
                seconds, hf_out = hf_run(baseline, batch, args.new_tokens)
                hf_times.append(seconds)
            engine_tps = total / statistics.median(engine_times)
            hf_tps = total / statistics.median(hf_times)
            same = "yes" if engine_out == hf_out else "no"
            print(f"{n:>4} {engine_tps:>13.0f} {hf_tps:>18.0f} {engine_tps / hf_tps:>10.2f} {same:>12}")
    finally:
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
