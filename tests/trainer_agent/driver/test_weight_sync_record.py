"""The step record says what the step's weight syncs sent and which copy each replica took."""

from __future__ import annotations

from rollmesh.controller.v1 import weight_sync_pb2 as pb
from trainer_agent.driver.loop import weight_sync_summary


def test_a_delta_sync_and_a_peer_copy_are_recorded_per_replica():
    serving = pb.WeightSyncResult(
        sync_id="sync-4-a", weight_version=4, bytes_sent=1300, delta_base_version=3, delta_bytes=1200,
        full_bytes=40000, delta_density=0.02, replica_results=[
            pb.ReplicaSyncResult(replica_id="s0", ok=True, copy="delta", source="trainer-t"),
            pb.ReplicaSyncResult(replica_id="s1", ok=True, copy="peer", source="s0"),
            pb.ReplicaSyncResult(replica_id="s2", ok=False, error_message="timeout", copy="peer", source="s0")])
    hybrid = pb.WeightSyncResult(sync_id="sync-4-b", weight_version=4, bytes_sent=40000, delta_base_version=-1,
                                 full_bytes=40000, replica_results=[
                                     pb.ReplicaSyncResult(replica_id="h0", ok=True, copy="full", source="trainer-t")])
    summary = weight_sync_summary(serving, hybrid, pb.WeightSyncResult())   # the last: no sync this step
    assert summary == {
        "bytes_sent": 41300, "full_bytes": 40000, "delta_base_version": 3, "delta_bytes": 1200, "delta_density": 0.02,
        "copies": {"s0": {"copy": "delta", "source": "trainer-t"}, "s1": {"copy": "peer", "source": "s0"},
                   "h0": {"copy": "full", "source": "trainer-t"}}}


def test_no_sync_records_nothing_sent():
    assert weight_sync_summary(pb.WeightSyncResult()) == {"bytes_sent": 0, "copies": {}}
