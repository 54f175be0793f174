"""The controller's state store: an older snapshot never overwrites a newer one; a batch the backend refuses is
kept, counted and written later."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from controller.store import StateStore
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2
from controller.store_backends import SqliteBackend, StoreUnavailable
from tests.waiting import wait_until


def test_a_late_background_write_cannot_overwrite_a_newer_flush(tmp_path):
    store = StateStore(str(tmp_path))
    state = {"next_cycle": 1}
    store.track("metrics", lambda: state_pb2.MetricsDocument(**state))
    store.mark("metrics")
    older = store._collect()  # a background write that is slow to reach the disk
    state["next_cycle"] = 2
    store.mark("metrics")
    store.flush()  # a synchronous flush of the newer state lands first
    store._write(*older)
    assert store.load("metrics", state_pb2.MetricsDocument).next_cycle == 2
    state["next_cycle"] = 3
    store.mark("metrics")
    store.flush()
    assert StateStore(str(tmp_path)).load("metrics", state_pb2.MetricsDocument).next_cycle == 3


class Refusing(SqliteBackend):
    """A SQLite backend that refuses writes while ``down`` (an etcd without quorum, say)."""

    down = False

    def write(self, upserts, deletes, events) -> None:
        if self.down:
            raise StoreUnavailable("etcd transaction: no member answered")
        super().write(upserts, deletes, events)


async def test_a_refused_batch_is_kept_for_the_next_one_and_counted(tmp_path):
    backend = Refusing(tmp_path / "s.sqlite")
    store = StateStore(backend)
    outcomes: list[bool] = []
    store.on_write = lambda seconds, ok: outcomes.append(ok)
    doc = {"next_cycle": 1}
    store.track("metrics", lambda: state_pb2.MetricsDocument(**doc))
    changes = [("n1", state_pb2.NodeDocument(node=state_pb2.Node(node_id="n1")))]
    store.track_collection("registry/node", lambda: [changes.pop() for _ in list(changes)])   # handed out once
    store.append_event(1, state_pb2.Event(sequence=1, type="NODE_REGISTERED"))
    backend.down = True
    with pytest.raises(StoreUnavailable):
        await store.commit()
    assert backend.load("metrics") is None and store.load_events(5) == []
    doc["next_cycle"] = 2
    backend.down = False
    await store.commit()
    assert store.load("metrics", state_pb2.MetricsDocument).next_cycle == 2   # a fresh snapshot of the document
    [member] = store.load_collection("registry/node", state_pb2.NodeDocument)   # the member the refused batch had
    assert member.node.node_id == "n1" and not member.replicas
    assert [(e.sequence, e.type) for e in store.load_events(5)] == [(1, "NODE_REGISTERED")]
    assert outcomes == [False, True]


async def test_the_background_writer_outlives_a_store_outage(tmp_path):
    backend = Refusing(tmp_path / "s.sqlite")
    store = StateStore(backend)
    store.track("metrics", lambda: state_pb2.MetricsDocument(next_cycle=1))
    refused: list[bool] = []
    store.on_write = lambda seconds, ok: refused.append(ok) if not ok else None
    backend.down = True
    writer = asyncio.create_task(store.run(interval_s=0.01, retry_max_s=0.05))
    try:
        store.mark("metrics")
        await wait_until(lambda: len(refused) >= 3, 5, what="the writer to retry a refused batch")
        assert not writer.done() and backend.load("metrics") is None
        backend.down = False
        await wait_until(lambda: backend.load("metrics") is not None, 5, what="the retried write")
        assert json.loads(backend.load("metrics")) == {"schema_version": 1, "next_cycle": 1, "seeded": None, "closed": []}
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
