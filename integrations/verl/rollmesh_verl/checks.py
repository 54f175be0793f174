"""Start-up checks of the rollmesh backend, run once per process before verl's first rollmesh replica starts.

Each failure is a :class:`FleetCheckFailed` that says what is wrong and how to fix it, before verl trains:

- verl outside the tested range (``SUPPORTED_VERL``);
- a controller that does not answer (wrong address, down), or refuses the credentials (``tls`` of the block);
- a fleet with no replica serving;
- a fleet serving another model than verl's ``actor_rollout_ref.model.path``: the architecture (``config.json``'s
  model-defining fields) and the tokenizer's vocabulary must be equal. A node's model is compared where this
  process can read it (a path on a shared or the same file system, or a rollmesh preset); a node whose model it
  cannot read is reported in the log, not refused.
"""

from __future__ import annotations

import logging
from typing import Any

from .identity import model_identity, node_identity
from .settings import MeshSettings

log = logging.getLogger(__name__)

SUPPORTED_VERL = ((0, 9), (0, 10))
"""verl releases the backend is tested with: >= 0.9, < 0.10 (its seams: ``RolloutReplicaRegistry``,
``CheckpointEngineRegistry``, ``FullyAsyncLLMServerClient``)."""

_checked: set[tuple[Any, ...]] = set()
"""(controller, model, credentials) already checked in this process."""


class FleetCheckFailed(RuntimeError):
    """The rollmesh fleet cannot serve this verl job; the message says why."""


def check_verl_version(version: str) -> None:
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_VERL
    if not low <= parts < high:
        raise FleetCheckFailed(f"verl {version[:20]} is outside the range the rollmesh backend is tested with "
                               f"(>= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))}): install "
                               "rollmesh[verl], which pins it")


async def check_fleet(settings: MeshSettings, model_config: Any) -> None:
    """All the checks of the module docstring (once per controller, model and credentials in this process)."""
    import verl  # noqa: PLC0415

    model_path = str(getattr(model_config, "local_path", None) or getattr(model_config, "path", "") or "")
    tls = settings.tls
    key = (settings.controller, model_path, (tls.cert, tls.key, tls.ca) if tls is not None else ())
    if key in _checked:
        return
    check_verl_version(getattr(verl, "__version__", "0"))
    nodes, replicas = await list_fleet(settings)
    if not replicas:
        raise FleetCheckFailed(f"the rollmesh controller at {settings.controller} lists no replica: start the "
                               "fleet's replica agents before verl")
    if settings.check_model and model_path:
        wanted = model_identity(model_path)
        for node in nodes:
            have = node_identity(node.model)
            if have is None:
                log.warning("rollmesh: cannot read node %s's model %r here; its model is not compared with "
                            "verl's", node.node_id, node.model[:200])
                continue
            problem = wanted.difference(have)
            if problem:
                raise FleetCheckFailed(f"node {node.node_id} of the rollmesh fleet serves {node.model[:200]!r}, "
                                       f"not verl's model {model_path[:200]!r}: {problem}. Point verl's "
                                       "actor_rollout_ref.model.path and the fleet at the same model")
    _checked.add(key)


async def list_fleet(settings: MeshSettings) -> tuple[list[Any], list[Any]]:
    import grpc  # noqa: PLC0415

    from mesh_runtime.channels import open_channel  # noqa: PLC0415
    from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2  # noqa: PLC0415

    channel = open_channel(settings.controller, tls=settings.tls)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    try:
        nodes = await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=settings.call_timeout_s)
        replicas = await stub.ListReplicas(registry_pb2.ListReplicasRequest(), timeout=settings.call_timeout_s)
    except grpc.aio.AioRpcError as err:
        code = err.code()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            why = "refused this process's credentials (tls: a certificate of the mesh's CA, role trainer-agent)"
        elif code == grpc.StatusCode.UNAVAILABLE:
            why = ("did not answer (is it running, is the address right, does the mesh expect mutual TLS "
                   "(set tls) or plaintext?)")
        else:
            why = f"failed ({code.name})"
        raise FleetCheckFailed(f"the rollmesh controller at {settings.controller} {why}: "
                               f"{(err.details() or '')[:300]}") from None
    finally:
        await channel.close()
    return list(nodes.nodes), list(replicas.replicas)
