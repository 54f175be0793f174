"""Benchmark the weight broadcast against a raw gloo broadcast of the same bytes.

Run by hand (it prints a table; nothing is asserted)::

    .venv/bin/python benchmarks/bench_weight_transfer.py            # 256 MiB, 1/2/4 receivers
    .venv/bin/python benchmarks/bench_weight_transfer.py --total-mib 64 --receivers 2

For each receiver count it starts a sender and the receivers as processes on
loopback, forms one gloo group, and then, in every iteration and in turn, times

- ``raw``: one ``broadcast`` of a single uint8 tensor of the stream's size,
  received into a buffer allocated once (the transport alone);
- ``ours/<topology>``: ``send_weights`` / ``receive_weights`` with checksum
  verification, receiving into a staging buffer kept between syncs (``out=``),
  as a replica that copies received weights into its model does;
- ``ours/<topology>/fresh`` (with ``--fresh``): the same into a newly
  allocated buffer, which adds the page faults of fresh memory;
- ``ours/<topology>/signed`` (with ``--signed``): an authenticated broadcast
  (a plan's sync key: the sender's manifest tag first, every bucket checked
  against its BLAKE3 digest instead of the checksum), the secure mesh's
  default; compare it with ``ours/<topology>`` (target >= 0.95x);
- with ``--diagnose``, where the time goes: ``ours/<topology>/no-verify``
  skips the receivers' checksum, ``ours/<topology>/no-pack`` sends the same
  bytes as one tensor, so every bucket goes out as a view without packing.

A time runs from a barrier before the transfer to a barrier after it, so it
ends when the slowest receiver is done. ``cpu`` is the CPU seconds all
processes spent in that step divided by its wall time (on C cores, near C
means CPU-bound; softirq time of loopback TCP is not all charged to the
processes, so it reads low). ``rank cpu`` is the CPU seconds of the busiest
process per transfer: what the time would approach with a core (or a host)
per member.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import socket
import statistics
import sys
import time

BYTES_PER_MIB = 1 << 20


def make_tensors(total_bytes: int, count: int, seed: int = 0):
    """``count`` tensors of varied sizes and dtypes adding up to about ``total_bytes``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=gen) + 0.2
    sizes = (weights / weights.sum() * total_bytes).long().tolist()
    tensors = []
    for i, nbytes in enumerate(sizes):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        numel = max(nbytes // dtype.itemsize, 1)
        raw = torch.randint(-2**31, 2**31 - 1, (numel * dtype.itemsize // 4 + 1,), dtype=torch.int32,
                            generator=gen)
        tensors.append((f"layer{i}.weight", raw.view(torch.uint8)[:numel * dtype.itemsize].view(dtype)))
    return tensors


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(rank: int, size: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    import torch

    from weight_transfer import (
        GroupCache,
        WeightTransferConfig,
        broadcast_manifest,
        build_manifest,
        receive_weights,
        send_weights,
    )

    torch.set_num_threads(1)
    members = [f"m{i}" for i in range(size)]
    config = WeightTransferConfig(bucket_size_bytes=args.bucket_mib * BYTES_PER_MIB, gloo_interface="lo",
                                  setup_timeout_s=120, op_timeout_s=120, ring_size=args.ring,
                                  gloo_threads=args.gloo_threads)
    with GroupCache(members[rank], config) as cache:
        if rank == 0:
            cache.host_rendezvous("127.0.0.1", port)
        group = cache.get("bench", members, ("127.0.0.1", port))
        pg = group.backend_group
        if rank == 0:
            tensors = make_tensors(args.total_mib * BYTES_PER_MIB, args.tensors)
            manifest = broadcast_manifest(group, build_manifest(tensors, config.bucket_size_bytes,
                                                                checksum_algorithm=args.checksum))
        else:
            manifest = broadcast_manifest(group)
        raw = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
        if rank == 0:
            raw.random_(0, 255)
        staging = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
        one_tensor = [("stream", raw)]
        one_manifest = None
        if args.diagnose:
            built = build_manifest(one_tensor, config.bucket_size_bytes, checksum_algorithm=args.checksum)
            one_manifest = broadcast_manifest(group, built if rank == 0 else None)
        modes = ["raw"] + [f"ours/{t}" for t in args.topology]
        if args.fresh:
            modes += [f"ours/{t}/fresh" for t in args.topology]
        if args.signed:
            modes += [f"ours/{t}/signed" for t in args.topology]
        key = hashlib.sha256(b"rollmesh benchmark sync key").digest()   # every member holds the plan's key
        if args.diagnose:
            modes += [f"ours/{t}/{v}" for t in args.topology for v in ("no-verify", "no-pack")]
        timings: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for _ in range(args.warmup + args.iters):
            for mode in modes:
                pg.barrier().wait()
                wall, cpu = time.perf_counter(), time.process_time()
                if mode == "raw":
                    pg.broadcast(raw, 0).wait()
                else:
                    topology = mode.split("/")[1]
                    sent, described = (one_tensor, one_manifest) if mode.endswith("/no-pack") else (
                        tensors if rank == 0 else None, manifest)
                    signed = key if mode.endswith("/signed") else b""
                    if rank == 0:
                        send_weights(group, described, sent, topology=topology, ring_size=args.ring, key=signed)
                    else:
                        received = receive_weights(group, described, topology=topology,
                                                   out=None if mode.endswith("/fresh") else staging,
                                                   verify=not mode.endswith("/no-verify"),
                                                   window=args.window, key=signed)
                        del received
                pg.barrier().wait()
                timings[mode].append((time.perf_counter() - wall, time.process_time() - cpu))
        results.put((rank, {m: t[args.warmup:] for m, t in timings.items()}, manifest.total_bytes))


def run(receivers: int, args: argparse.Namespace) -> dict[str, tuple[float, float, float, float, int]]:
    """{mode: (median s, best s, cpu utilisation, busiest rank's cpu s, bytes)} for ``receivers``."""
    size = receivers + 1
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, size, port, args, results)) for r in range(size)]
    for proc in procs:
        proc.start()
    per_rank = {}
    for _ in range(size):
        rank, timings, total = results.get(timeout=600)
        per_rank[rank] = timings
    for proc in procs:
        proc.join(timeout=60)
    out = {}
    for mode, samples in per_rank[0].items():
        walls = [w for w, _ in samples]
        cpu = sum(sum(c for _, c in per_rank[r][mode]) for r in per_rank)
        busiest = max(statistics.mean(c for _, c in per_rank[r][mode]) for r in per_rank)
        out[mode] = (statistics.median(walls), min(walls), cpu / sum(walls), busiest, total)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--ring", type=int, default=3)
    parser.add_argument("--window", type=int, default=4, help="buckets a receiver posts ahead")
    parser.add_argument("--gloo-threads", type=int, default=2)
    parser.add_argument("--receivers", default="1,2,4")
    parser.add_argument("--topology", default="broadcast,chain")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--checksum", default="wsum64", help="wsum64, crc32 or sha256")
    parser.add_argument("--fresh", action="store_true", help="also time receiving into fresh buffers")
    parser.add_argument("--diagnose", action="store_true", help="also time without checksum / packing")
    parser.add_argument("--signed", action="store_true", help="also time authenticated broadcasts (sync key)")
    args = parser.parse_args(argv)
    args.topology = args.topology.split(",")
    counts = [int(n) for n in args.receivers.split(",")]
    print(f"{args.total_mib} MiB in {args.tensors} tensors, {args.bucket_mib} MiB buckets, ring {args.ring}, "
          f"checksum {args.checksum}, "
          f"{args.iters} timed iterations (+{args.warmup} warm-up), median / best")
    print(f"{'receivers':>9} {'mode':<22} {'median s':>9} {'best s':>8} {'GiB/s':>7} {'vs raw':>7} {'cpu':>5} "
          f"{'rank cpu':>8}")
    table = {}
    for n in counts:
        table[n] = run(n, args)
        raw_median = table[n]["raw"][0]
        for mode, (median, best, cpu, busiest, total) in table[n].items():
            print(f"{n:>9} {mode:<22} {median:>9.3f} {best:>8.3f} {total / median / 2**30:>7.2f} "
                  f"{raw_median / median:>6.2f}x {cpu:>5.2f} {busiest:>8.3f}", flush=True)
    if len(counts) > 1:
        first, last = counts[0], counts[-1]
        for mode in table[first]:
            print(f"{mode}: time to {last} receivers / to {first}: "
                  f"{table[last][mode][0] / table[first][mode][0]:.2f}x; busiest rank's cpu: "
                  f"{table[last][mode][3] / table[first][mode][3]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
