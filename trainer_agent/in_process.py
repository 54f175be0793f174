"""A trainer process that serves its own weights: the controller broadcasts from where the tensors are.

A trainer agent holds the weights in its own process; a trainer that is not rollmesh's (verl's rank 0 with the
rollmesh checkpoint engine, a ``MeshClient`` trainer) would have to copy each version to it, through a file or a
socket, before the broadcast could start. :class:`InProcessWeightServer` serves ``WeightSourceService`` from the
trainer's own process instead: the trainer hands each version over (:meth:`~InProcessWeightServer.hand_over`,
no copy), then asks the controller to broadcast it with ``SyncWeights(source_address=server.address)``; the
controller prepares and sends it here exactly as it does from a trainer agent (buckets, delta from the version
the fleet holds, manifest checksum, signatures on a secure mesh, the same rendezvous).

The server runs on an event loop of its own, in a daemon thread, so it keeps serving whatever the trainer's
thread does between versions (training, a blocking collective); :meth:`hand_over` and :meth:`close` are safe
from any thread. It listens on ``listen`` (mutual TLS with ``tls``: the controller alone may call it); the
rendezvous store of its broadcasts listens on the advertised host, on a free port.

What it costs the trainer's process: the handed-over version and, with deltas on, the one before it (the base of
the next delta), both in host memory, as a trainer agent would hold them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from mesh_runtime.config import TlsConfig
from mesh_runtime.net import format_host_port, is_loopback, is_wildcard, parse_host_port
from mesh_runtime.server import MeshServer
from mesh_runtime.status import node_name
from weight_transfer import WeightTransferConfig

from .broadcast import WeightBroadcaster
from .published_weights import HandedWeightSource
from .weight_service import trainer_member_id, weight_source_binding

log = logging.getLogger(__name__)

_WAIT_S = 60.0
"""Bound of starting and of stopping the server."""


class InProcessWeightServer:
    """``WeightSourceService`` over the versions this process hands over (see the module docstring).

    ``listen``: ``HOST:PORT`` to serve on (port 0: a free one); ``advertise_host``: the host the controller and
    the replicas reach this process at, required when ``HOST`` is a wildcard. ``transfer``: the weight-transfer
    settings, which must agree with the replicas' (topology, checksum); ``served_dtype``: the dtype floating-point
    weights are broadcast in when the replicas serve another than the trainer hands over. ``threads``: torch's
    intra-op threads for the server's CPU work (the checksums, the delta from the version the fleet holds, the
    casts), in the server's own worker threads only; 0 = as many as the CPUs this process may run on. A trainer
    process often runs torch on one thread (Ray sets ``OMP_NUM_THREADS=1`` in its workers) while it waits for
    the sync with its CPUs idle.
    """

    def __init__(self, *, listen: str = "127.0.0.1:0", advertise_host: str = "", tls: TlsConfig | None = None,
                 node_id: str = "", transfer: WeightTransferConfig | None = None, served_dtype: str = "",
                 timeout_s: float = 300.0, threads: int = 0) -> None:
        host, _ = parse_host_port(listen)
        if is_wildcard(host) and not advertise_host:
            raise ValueError(f"listen {listen!r} is a wildcard: name the host the controller and the replicas "
                             "reach this process at (advertise_host)")
        self.listen = listen
        self.host = advertise_host or host
        self.tls = tls
        self.source = HandedWeightSource()
        # its own member id (this process's): a trainer agent on the node is another source, with groups of its own
        self.member_id = trainer_member_id(f"{node_name(node_id)}-{os.getpid()}")
        self.broadcaster = WeightBroadcaster(self.source, member_id=self.member_id, rendezvous=(self.host, 0),
                                             config=transfer or WeightTransferConfig(), served_dtype=served_dtype)
        self._timeout_s = timeout_s
        self.threads = threads or len(os.sched_getaffinity(0))
        self._server: MeshServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.address = ""
        """``HOST:PORT`` the controller reaches this server at (``SyncWeights.source_address``), once started."""

    def start(self) -> str:
        """Start serving (idempotent); returns :attr:`address`."""
        if self._loop is not None:
            return self.address
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="rollmesh-weight-source", initializer=torch.set_num_threads,
            initargs=(self.threads,)))   # torch's thread count is per thread: the trainer's own stays as it is
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollmesh-weight-source", daemon=True)
        self._thread.start()
        try:
            port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(_WAIT_S)
        except BaseException:
            self.close()
            raise
        self.address = format_host_port(self.host, port)
        log.info("serving the trainer's weights at %s (%s)", self.address,
                 "mutual TLS" if self.tls is not None else "plaintext")
        return self.address

    async def _start(self) -> int:
        await self.broadcaster.start()
        self._server = MeshServer(server_name="trainer-weights", listen=self.listen, tls=self.tls,
                                  insecure=self.tls is None and not is_loopback(parse_host_port(self.listen)[0]),
                                  services=[weight_source_binding(self.broadcaster, self.member_id,
                                                                  self._timeout_s)])
        return await self._server.start()

    def hand_over(self, named_tensors: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Serve ``named_tensors`` as ``weight_version`` from now on; the caller never writes into them again
        (see :meth:`HandedWeightSource.hand_over`)."""
        self.source.hand_over(named_tensors, weight_version)

    @property
    def weight_version(self) -> int | None:
        """The version handed over last; None before the first."""
        return self.source.weight_version if self.source.loaded else None

    def close(self) -> None:
        """Stop serving and free the store (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), loop).result(_WAIT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(_WAIT_S)
            loop.close()

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(1.0)
        await self.broadcaster.close()

