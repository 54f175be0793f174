"""A stand-alone weight sender for the agent's weight-receive tests (run as a separate process).

Builds preset ``--preset`` with ``--seed``, prints one JSON line (rendezvous
port, manifest, the model's own greedy continuation of ``--prompt``), then
sends its weights as rank 0 of ``--members`` and prints ``sent BYTES``.
``--corrupt`` flips one byte of the first bucket after it is packed.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from weight_transfer import GroupCache, WeightTransferConfig, build_manifest, send_weights
from modeling.presets import build_preset_model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--group", required=True)
    parser.add_argument("--members", required=True, help="comma-separated member ids, sender first")
    parser.add_argument("--prompt", default="5,6,7")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--skip-tensor", default="", help="leave this tensor out of the manifest")
    args = parser.parse_args()
    model = build_preset_model(args.preset, args.seed).eval()
    named = [(n, p.detach()) for n, p in model.named_parameters() if n != args.skip_tensor]
    manifest = build_manifest(named, bucket_size_bytes=64 * 1024)
    members = args.members.split(",")
    cache = GroupCache(members[0], WeightTransferConfig(setup_timeout_s=60, op_timeout_s=60))
    port = cache.host_rendezvous("127.0.0.1", 0)
    prompt = [int(t) for t in args.prompt.split(",")]
    print(json.dumps({"port": port, "manifest": manifest.to_dict(), "greedy": greedy(model, prompt, args.tokens)}),
          flush=True)
    group = cache.get(args.group, members, ("127.0.0.1", port), "gloo")

    def corrupt(index: int, bucket: torch.Tensor) -> None:
        if args.corrupt and index == 0:
            bucket[0] ^= 0xFF

    result = send_weights(group, manifest, named, bucket_hook=corrupt)
    print(f"sent {result.bytes}", flush=True)
    cache.close()


if __name__ == "__main__":
    sys.exit(main())
