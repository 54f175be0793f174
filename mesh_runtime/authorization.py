"""Who may call what: the one authorization table of every rollmesh RPC, and the check enforcing it.

On a server with mutual TLS every call carries the caller's verified identity
(:mod:`mesh_runtime.identity`). :data:`RULES` names, for every RPC of every
rollmesh service, the roles allowed to call it; :func:`authorize`, run by every
server's :class:`~mesh_runtime.pipeline.ServerPipeline`, looks the method up before the handler runs: a wrong role is
``PERMISSION_DENIED`` naming the roles required, a certificate without a
rollmesh identity is ``UNAUTHENTICATED``, and an RPC missing from the table is
refused (a new RPC without a rule cannot be called, and the suite's table test
fails). Nothing runs, so nothing changes. Rules that depend on the request
(an agent registers only the node its certificate names) are checked by the
servicer with :func:`~mesh_runtime.identity.current_identity`; the table says
so in ``scope``. The proto comments quote :func:`describe` for each RPC.

Operator mutations also accept the controller's bearer token
(``scale_api_token``, metadata ``authorization: Bearer TOKEN``) from any
authenticated identity, for humans with a plain client certificate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc

from .errors import PermissionDenied, Unauthenticated
from .identity import ROLES, Identity, peer_identity
from .reasons import Reason

ANY = frozenset(ROLES)
"""Every authenticated identity (reads, health, reflection)."""


@dataclass(frozen=True)
class Rule:
    roles: frozenset[str]
    scope: str = ""
    """What the servicer checks on top of the role (empty: nothing)."""
    token_alternative: bool = False
    """A valid operator bearer token also allows the call."""

    def describe(self) -> str:
        who = "any authenticated identity" if self.roles == ANY else ", ".join(r for r in ROLES if r in self.roles)
        extra = " (or the operator bearer token)" if self.token_alternative else ""
        return f"{who}{extra}" + (f"; {self.scope}" if self.scope else "")


def _r(*roles: str, scope: str = "", token: bool = False) -> Rule:
    unknown = set(roles) - set(ROLES)
    assert not unknown, unknown
    return Rule(frozenset(roles), scope, token)


READ = Rule(ANY)
OPERATOR = _r("operator", token=True)
FROM_CONTROLLER = _r("controller")
TRAINER = _r("trainer-agent")

CONTROLLER_SERVICE = "rollmesh.controller.v1.ControllerService"
LB_SERVICE = "rollmesh.loadbalancer.v1.LoadBalancerService"
REPLICA_SERVICE = "rollmesh.replica.v1.ReplicaAgentService"
TRAINER_SERVICE = "rollmesh.trainer.v1.TrainerAgentService"
WEIGHTS_SERVICE = "rollmesh.weights.v1.WeightSourceService"
OPERATIONS_SERVICE = "google.longrunning.Operations"

RULES: dict[str, dict[str, Rule]] = {
    CONTROLLER_SERVICE: {
        "GetStatus": READ, "ListNodes": READ, "GetNode": READ, "ListReplicas": READ, "GetReplica": READ,
        "GetSchedulerState": READ, "WatchEvents": READ, "GetMetrics": READ,
        "GetAutoscalerStatus": READ, "GetAutoscalerConditions": READ,
        "ListScaleHistory": READ,
        "RegisterNode": _r("replica-agent", scope="only the node named in the caller's certificate"),
        "StreamLoadReports": _r("replica-agent", scope="only the node named in the caller's certificate"),
        "DeregisterNode": _r("replica-agent", "operator",
                             scope="a replica agent only the node named in its certificate"),
        "RegisterBalancer": _r("lb", scope="only the balancer named in the caller's certificate"),
        "DeregisterBalancer": _r("lb", "operator", scope="a balancer only the one named in its certificate"),
        "ListBalancers": READ,
        "BeginTrainingStep": TRAINER, "ReleaseHybridReplicas": TRAINER, "CompleteTrainingStep": TRAINER,
        "SyncWeights": TRAINER, "LoadWeights": _r("trainer-agent", "operator", token=True),
        "UpdateWeightsFromGroup": _r("trainer-agent", "operator", token=True),
        "ScaleOut": OPERATOR, "ScaleIn": OPERATOR, "CancelOperations": OPERATOR,
        "SetAutoscalerEnabled": OPERATOR,
    },
    OPERATIONS_SERVICE: {   # the controller's scale operations
        "GetOperation": READ, "ListOperations": READ, "WaitOperation": READ,
        "CancelOperation": OPERATOR, "DeleteOperation": OPERATOR,
    },
    LB_SERVICE: {
        "GetStatus": READ, "ListReplicas": READ, "GetStats": READ,
        "Generate": _r("client", "trainer-agent", "operator"),
        "GenerateMany": _r("client", "trainer-agent", "operator"),
        "AddReplicas": FROM_CONTROLLER, "RemoveReplicas": FROM_CONTROLLER, "UpdateReplicas": FROM_CONTROLLER,
        "ClearStickySessions": FROM_CONTROLLER, "Rebalance": FROM_CONTROLLER,
        "CloseSession": _r("client", "trainer-agent", "operator"),
    },
    REPLICA_SERVICE: {
        "GetStatus": READ, "ListReplicas": READ, "GetReplica": READ, "GetLoadReports": READ,
        "WatchPrefixCache": READ, "Generate": _r("lb"), "GenerateMany": _r("lb"),
        "AbortRequests": _r("controller", "lb"), "CloseSession": _r("lb"),
        "LaunchReplica": FROM_CONTROLLER, "StopReplica": FROM_CONTROLLER, "PauseGeneration": FROM_CONTROLLER,
        "ResumeGeneration": FROM_CONTROLLER, "Sleep": FROM_CONTROLLER, "WakeUp": FROM_CONTROLLER,
        "ReceiveWeights": FROM_CONTROLLER, "LoadCheckpoint": FROM_CONTROLLER, "FlushCache": _r("controller", "lb"),
        "JoinWeightGroup": FROM_CONTROLLER, "ReceiveGroupWeights": FROM_CONTROLLER,
        "LeaveWeightGroup": FROM_CONTROLLER,
    },
    TRAINER_SERVICE: {
        "GetStatus": READ, "GetTrainingProgress": READ, "StopTraining": _r("operator"),
        "OffloadTrainingState": FROM_CONTROLLER, "OnloadTrainingState": FROM_CONTROLLER,
    },
    WEIGHTS_SERVICE: {"PrepareWeightSync": FROM_CONTROLLER, "SendWeights": FROM_CONTROLLER},
    # served by every server
    "grpc.health.v1.Health": {"Check": READ, "Watch": READ, "List": READ},
    "grpc.reflection.v1alpha.ServerReflection": {"ServerReflectionInfo": READ},
    "grpc.reflection.v1.ServerReflection": {"ServerReflectionInfo": READ},
}


def rule_for(full_method: str) -> Rule | None:
    """The rule of ``/package.Service/Method`` (None: no rule, the call is refused)."""
    service, _, method = full_method.lstrip("/").partition("/")
    return RULES.get(service, {}).get(method)


def describe(service: str, method: str) -> str:
    """The rule's text as the proto comments quote it (``Authorization: ...``)."""
    return RULES[service][method].describe()


TokenCheck = Callable[[grpc.aio.ServicerContext], bool]
"""Whether a call carries a valid operator bearer token."""


def authorize(full_method: str, auth_context: Mapping[str, Iterable[bytes]], token_ok: Callable[[], bool] | None = None,
              own: Identity | None = None) -> Identity:
    """The caller's identity if it may call ``full_method``; raises otherwise. ``own``: the server's own
    identity, which may call every method that has a rule (a replica process takes its agent's calls)."""
    method = full_method.rsplit("/", 1)[-1]
    identity = peer_identity(auth_context)
    if identity is None:
        raise Unauthenticated(f"{method}: the client certificate names no rollmesh identity (a URI SAN "
                              "spiffe://rollmesh/<role>/<name>; see rollmesh certs create)",
                              reason=Reason.NO_IDENTITY)
    rule = rule_for(full_method)
    if rule is None:
        raise PermissionDenied(f"{full_method[:120]} has no authorization rule; nobody may call it",
                               reason=Reason.NO_RULE)
    if identity.role in rule.roles or (own is not None and identity == own):
        return identity
    if rule.token_alternative and token_ok is not None and token_ok():
        return identity
    raise PermissionDenied(f"{method} needs the role {rule.describe()}; the caller is {identity}",
                           reason=Reason.ROLE_NOT_ALLOWED, metadata={"caller": identity.uri})
