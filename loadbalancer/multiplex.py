"""The balancer's data path to the agents: one ``GenerateMany`` stream per agent carries every attempt sent there
(:mod:`mesh_runtime.multiplex`): an agent gets attempts on a stream once a ``GetStatus`` probe saw it list the
``generate_many`` capability; until then, and for an agent without it (an older one), ``Generate`` calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mesh_runtime.multiplex import StreamPool, serves_generate_many
from rollmesh.replica.v1 import replica_agent_pb2 as pb


def agent_streams(stub_for: Callable[[str], Any], *, probe_timeout_s: float = 5.0) -> StreamPool:
    """The stream pool of the agents whose stubs ``stub_for(address)`` gives."""
    return StreamPool(open_call=lambda address: stub_for(address).GenerateMany,
                      probe=lambda address: serves_generate_many(stub_for(address), pb.GetStatusRequest(),
                                                                 probe_timeout_s),
                      action=pb.GenerateManyAction, request=pb.GenerateManyRequest, what="agent")
