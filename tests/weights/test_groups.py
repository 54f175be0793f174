"""GroupCache: reuse per member set, retirement, configuration, and timeouts on group creation."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mesh_runtime.config import ConfigError
from weight_transfer import (
    GroupCache,
    GroupClosed,
    TransferTimeout,
    WeightTransferConfig,
    WeightTransferError,
    build_manifest,
    receive_weights,
)

from .helpers import BUCKET, HOST, InProcessMesh, assert_same_tensors, config, model_tensors


@pytest.mark.timeout(60)
def test_same_member_set_reuses_the_group_and_a_new_set_builds_one():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    with InProcessMesh(["trainer", "r1", "r2"]) as mesh:
        for _ in range(2):
            results = mesh.sync(["trainer", "r1"], tensors, manifest)
            assert_same_tensors(results["r1"], tensors)
        assert mesh.caches["trainer"].constructions == 1
        assert mesh.caches["r1"].constructions == 1

        results = mesh.sync(["trainer", "r1", "r2"], tensors, manifest)
        for member in ("r1", "r2"):
            assert_same_tensors(results[member], tensors)
        assert mesh.caches["trainer"].constructions == 2
        assert mesh.caches["r1"].constructions == 2
        assert mesh.caches["r2"].constructions == 1
        assert len(mesh.caches["trainer"].cached_keys()) == 2


@pytest.mark.timeout(60)
def test_an_evicted_group_id_is_retired_and_a_new_id_works():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    members = ["trainer", "r1"]
    with InProcessMesh(members) as mesh:
        assert_same_tensors(mesh.sync(members, tensors, manifest)["r1"], tensors)
        for member in members:
            assert mesh.caches[member].evict("g", members) is True
            assert mesh.caches[member].evict("g", members) is False
        with pytest.raises(GroupClosed, match="new group id"):
            mesh.caches["trainer"].get("g", members, (HOST, mesh.port))
        assert_same_tensors(mesh.sync(members, tensors, manifest, group_id="g2")["r1"], tensors)


@pytest.mark.timeout(30)
def test_a_peer_that_never_shows_up_times_out_group_creation():
    with GroupCache("trainer", config(setup_timeout_s=1.0)) as cache:
        port = cache.host_rendezvous(HOST)
        started = time.monotonic()
        with pytest.raises(TransferTimeout, match="creating weight group"):
            cache.get("g", ["trainer", "ghost"], (HOST, port))
        assert 0.9 < time.monotonic() - started < 4.0
        assert cache.constructions == 0


@pytest.mark.timeout(30)
def test_a_sender_that_never_shows_up_times_out_the_receiver():
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        with GroupCache("r1", config(setup_timeout_s=1.0)) as cache:
            started = time.monotonic()
            with pytest.raises(TransferTimeout, match="rendezvous store"):
                cache.get("g", ["trainer", "r1"], (HOST, port))
            assert 0.9 < time.monotonic() - started < 4.0


@pytest.mark.timeout(30)
def test_a_silent_sender_times_out_the_transfer_and_the_group_is_retired():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    members = ["trainer", "r1"]
    with InProcessMesh(members, op_timeout_s=1.0) as mesh:
        results: dict = {}

        def receive() -> None:
            group = mesh.caches["r1"].get("g", members, (HOST, mesh.port))
            started = time.monotonic()
            try:
                receive_weights(group, manifest)
            except Exception as err:
                results["error"], results["seconds"] = err, time.monotonic() - started

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        mesh.caches["trainer"].get("g", members, (HOST, mesh.port))  # joins, then sends nothing
        thread.join(timeout=20)
        assert isinstance(results["error"], TransferTimeout), results
        assert 0.9 < results["seconds"] < 4.0
        with pytest.raises(GroupClosed):
            mesh.caches["r1"].get("g", members, (HOST, mesh.port))


@pytest.mark.timeout(10)
def test_get_checks_its_arguments_and_a_closed_cache_refuses_work():
    cache = GroupCache("r1", config())
    with pytest.raises(ValueError, match="include 'r1'"):
        cache.get("g", ["trainer", "r2"], (HOST, 1))
    with pytest.raises(ValueError, match="distinct"):
        cache.get("g", ["trainer", "r1", "r1"], (HOST, 1))
    with pytest.raises(ValueError, match="backend"):
        cache.get("g", ["trainer", "r1"], (HOST, 1), backend="mpi")
    cache.close()
    cache.close()
    with pytest.raises(GroupClosed):
        cache.get("g", ["trainer", "r1"], (HOST, 1))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("field, value", [
    ("bucket_size_bytes", 0), ("setup_timeout_s", 0.0), ("op_timeout_s", -1.0), ("ring_size", 1),
    ("topology", "ring"), ("checksum_algorithm", "md5"), ("gloo_threads", 0),
])
def test_config_validation_names_the_bad_key(field, value):
    with pytest.raises(ConfigError) as caught:
        WeightTransferConfig(**{field: value}).validate()
    assert caught.value.key == field


@pytest.mark.timeout(10)
def test_the_sender_needs_a_concrete_rendezvous_port():
    with GroupCache("trainer", config()) as cache:
        with pytest.raises(ValueError, match="concrete rendezvous port"):
            cache.get("g", ["trainer", "r1"], (HOST, 0))


def _free_run(length: int) -> int:
    """The first port of ``length`` consecutive loopback ports free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            low = probe.getsockname()[1]
        if low + length > 65535:
            continue
        sockets = []
        try:
            for port in range(low, low + length):
                s = socket.socket()
                s.bind((HOST, port))
                sockets.append(s)
            return low
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no run of free ports")


def test_a_rendezvous_store_binds_the_first_free_port_of_rendezvous_ports():
    low = _free_run(3)
    with socket.socket() as taken:
        taken.bind((HOST, low))
        taken.listen()
        with GroupCache("trainer", config(rendezvous_ports=f"{low}-{low + 2}")) as cache:
            assert cache.host_rendezvous(HOST) == low + 1
            assert cache.host_rendezvous(HOST) == low + 2    # one store per call; the range holds three
            with pytest.raises(WeightTransferError, match=f"no free port .* rendezvous_ports {low}-{low + 2}"):
                cache.host_rendezvous(HOST)
            assert cache.host_rendezvous(HOST, low + 1) == low + 1   # a port asked for explicitly is kept


@pytest.mark.parametrize("text", ["29500", "a-b", "29600-29500", "0-10", "1-70000"])
def test_a_bad_rendezvous_ports_range_is_a_config_error(text):
    with pytest.raises(ConfigError, match="rendezvous_ports"):
        GroupCache("trainer", config(rendezvous_ports=text))
