"""The controller's SQLite store: an older snapshot never overwrites a newer one."""

from __future__ import annotations

from controller.store import StateStore


def test_a_late_background_write_cannot_overwrite_a_newer_flush(tmp_path):
    store = StateStore(str(tmp_path))
    state = {"value": 1}
    store.track("doc", lambda: dict(state))
    store.mark("doc")
    older = store._collect()  # a background write that is slow to reach the disk
    state["value"] = 2
    store.mark("doc")
    store.flush()  # a synchronous flush of the newer state lands first
    store._write(*older)
    assert store.load("doc") == {"value": 2}
    state["value"] = 3
    store.mark("doc")
    store.flush()
    assert StateStore(str(tmp_path)).load("doc") == {"value": 3}
