"""The agent's steps of a checkpoint load (``LoadCheckpoint``) on a real torch engine: CHECK changes nothing and
names what does not fit, INSTALL serves the checkpoint as the new version (the engine's logprobs are the
checkpoint model's), REVERT puts the replaced weights and version back, RELEASE drops them."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from mesh_runtime.errors import InvalidArgument, NotFound
from modeling.presets import build_preset_model, save_preset
from replica_agent.checkpoint_load import CheckpointLoads
from replica_agent.engines import EngineRequest, SamplingParams
from replica_agent.replicas import Replica
from trainer_agent.training.grpo import Sample, completion_logprobs

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 72, 101, 108, 108, 111]


class _Manager:
    def __init__(self, replicas: dict[str, Replica]) -> None:
        self.replicas = replicas

    def get(self, replica_id: str) -> Replica:
        if replica_id not in self.replicas:
            raise NotFound(f"no replica {replica_id!r}")
        return self.replicas[replica_id]


def _distance(engine, model) -> float:
    """Largest difference between the engine's weights and ``model``'s."""
    mine = dict(engine.named_weights())
    theirs = dict(model.named_parameters())
    return max(float((mine[n] - theirs[n].detach()).abs().max()) for n in mine)


async def _logprob_gap(engine, collect, model) -> float:
    request = EngineRequest("g", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=True))
    out = await collect(engine, request)
    with torch.no_grad():
        logprobs, mask = completion_logprobs(model.eval(), [Sample(PROMPT, out.tokens, out.logprobs)],
                                             torch.device("cpu"), 1.0)
    return float((torch.tensor(out.logprobs) - logprobs[0][mask[0]]).abs().max())


async def test_install_serves_the_checkpoint_and_revert_puts_the_old_weights_back(torch_engine_factory, collect,
                                                                                  tmp_path):
    engine = await torch_engine_factory(seed=0)
    replica = Replica("r0", "STANDALONE", [0], 1.0, True, engine, phase=None)
    loads = CheckpointLoads(_Manager({"r0": replica}))
    before, after = build_preset_model("tiny-llama", 0), build_preset_model("tiny-llama", 7)
    path = str(save_preset("tiny-llama", 7, tmp_path / "v7"))

    [checked] = await loads.run(["r0"], "CHECK", path=path, version=3, update_id="u1", keep_previous=True)
    assert checked.checksum_ok and checked.weight_version == 0 and _distance(engine, before) == 0

    [installed] = await loads.run(["r0"], "INSTALL", path=path, version=3, update_id="u1", keep_previous=True)
    assert installed.checksum_ok and installed.weight_version == 3 and engine.weight_version == 3
    assert installed.bytes_received == sum(p.numel() * 4 for p in after.parameters())
    assert _distance(engine, after) == 0 and replica.state == "ACTIVE"
    assert await _logprob_gap(engine, collect, after) < 1e-4       # it computes the checkpoint's model now

    [reverted] = await loads.run(["r0"], "REVERT", path="", version=0, update_id="u1", keep_previous=False)
    assert reverted.checksum_ok and reverted.weight_version == 0 and engine.weight_version == 0
    assert _distance(engine, before) == 0 and "r0" not in loads.kept
    assert await _logprob_gap(engine, collect, before) < 1e-4
    [again] = await loads.run(["r0"], "REVERT", path="", version=0, update_id="u1", keep_previous=False)
    assert not again.checksum_ok and "no weights kept" in again.error           # one revert per install

    await loads.run(["r0"], "INSTALL", path=path, version=4, update_id="u2", keep_previous=True)
    [released] = await loads.run(["r0"], "RELEASE", path="", version=0, update_id="u2", keep_previous=False)
    assert released.checksum_ok and "r0" not in loads.kept and engine.weight_version == 4


async def test_a_checkpoint_that_does_not_fit_changes_nothing_and_says_why(torch_engine_factory, tmp_path):
    engine = await torch_engine_factory(seed=0)
    replica = Replica("r0", "STANDALONE", [0], 1.0, True, engine, phase=None)
    loads = CheckpointLoads(_Manager({"r0": replica}))
    before = build_preset_model("tiny-llama", 0)
    tensors = {n: p.detach().clone() for n, p in build_preset_model("tiny-llama", 7).named_parameters()}
    name = "model.layers.0.mlp.up_proj.weight"
    (tmp_path / "short").mkdir()
    safetensors.torch.save_file({n: t for n, t in tensors.items() if n != name}, tmp_path / "short" / "m.safetensors")
    (tmp_path / "wide").mkdir()
    safetensors.torch.save_file({**tensors, name: torch.zeros(3, 3)}, tmp_path / "wide" / "m.safetensors")
    (tmp_path / "ints").mkdir()
    safetensors.torch.save_file({**tensors, name: tensors[name].to(torch.int32)}, tmp_path / "ints" / "m.safetensors")
    cases = {"short": f"{name} is missing", "wide": f"{name} has shape [3, 3]", "ints": f"{name} is int32",
             "nowhere": "is not a directory"}
    for directory, why in cases.items():
        for step in ("CHECK", "INSTALL"):
            [result] = await loads.run(["r0"], step, path=str(tmp_path / directory), version=5, update_id="u",
                                       keep_previous=False)
            assert not result.checksum_ok and why in result.error, (directory, result.error)
            assert result.weight_version == 0 and engine.weight_version == 0 and _distance(engine, before) == 0
    (tmp_path / "empty").mkdir()
    [result] = await loads.run(["r0"], "CHECK", path=str(tmp_path / "empty"), version=5, update_id="",
                               keep_previous=False)
    assert not result.checksum_ok and "no *.safetensors" in result.error

    bad = [(["r0"], "CHECK", "", 1, ""), ([], "CHECK", "/x", 1, ""), (["r0"], "CHECK", "/x", -1, ""),
           (["r0"], "NAP", "/x", 1, ""), (["r0"], "REVERT", "", 0, "")]
    for ids, step, path, version, update_id in bad:
        with pytest.raises(InvalidArgument):
            await loads.run(ids, step, path=path, version=version, update_id=update_id, keep_previous=False)
    with pytest.raises(NotFound):
        await loads.run(["zz"], "CHECK", path="/x", version=1, update_id="", keep_previous=False)
