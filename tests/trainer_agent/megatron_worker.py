"""Runs the megatron backend in a process of its own (megatron-core's parallel state is process-global).

``python -m tests.trainer_agent.megatron_worker OUT PRESET TP RANK PORT``: loads ``PRESET`` (seed 0) into
megatron-core's GPT with tensor parallelism ``TP`` as rank ``RANK`` (a gloo group rendezvousing on
127.0.0.1:PORT), exports the weights by Hugging Face names (gathered over the ranks), checks them against
the torch backend's, applies an update through ``set_weights`` and writes what it saw to ``OUT`` as JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist


def main() -> None:
    out, preset, tp, rank, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    warnings.filterwarnings("ignore")
    store = dist.TCPStore("127.0.0.1", port, tp, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp)
    from megatron.core import parallel_state

    from trainer_agent.megatron.source import MegatronWeightSource
    from trainer_agent.weight_source import TorchWeightSource

    source = MegatronWeightSource(preset, device="cpu", tensor_parallel_size=tp)
    source.load()
    reference = TorchWeightSource(preset)
    reference.load()
    expected = dict(reference.named_weights())
    exported = dict(source.named_weights())
    local = {n: list(p.shape) for n, p in source.module.gpt.named_parameters()}
    report = {
        "tp_world": parallel_state.get_tensor_model_parallel_world_size(),
        "names": list(exported), "expected_names": list(expected),
        "equal": all(torch.equal(exported[n], expected[n]) for n in expected if n in exported),
        "spec_equal": [(s.name, s.dtype, s.shape) for s in source.weight_spec()]
        == [(s.name, s.dtype, s.shape) for s in reference.weight_spec()],
        "local_shapes": local,
    }
    update = {n: torch.full_like(t, 0.25) for n, t in expected.items() if n.endswith("q_proj.weight")}
    if "lm_head.weight" not in expected:   # tied: the alias is accepted
        update["lm_head.weight"] = torch.full_like(expected["model.embed_tokens.weight"], 0.5)
    source.set_weights(update, 1)
    after = dict(source.named_weights())
    report["updated"] = all(torch.all(after[source._canonical_name(n)] == t).item() for n, t in update.items())
    report["untouched"] = torch.equal(after["model.layers.0.self_attn.k_proj.weight"],
                                      expected["model.layers.0.self_attn.k_proj.weight"])
    report["version"] = source.weight_version
    with open(out, "w") as f:
        json.dump(report, f)
    # Leave in order: every rank done with gloo, then every rank out of the group, the store's host (rank 0)
    # last, and no interpreter teardown: torch's C++ destructors at exit can abort ("terminate called without
    # an active exception") when a peer's connection closes under them, which a loaded CI machine hit once.
    dist.barrier()
    dist.destroy_process_group()
    store.add("left", 1)
    if rank == 0:
        while store.add("left", 0) < tp:
            time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
