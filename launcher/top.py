"""``rollmesh top ADDRESS``: a terminal monitor of a running controller.

Shows the balancers, the replicas (state, kind, weight version, load), the hybrid
scheduler, the autoscaler's conditions and the recent scale operations,
refreshing every ``--interval`` seconds; ``q`` quits and ``r`` refreshes now.
``--once`` prints one frame as plain text and exits, for scripts: 0 when the
controller answered, 1 when it could not be reached.

It only reads: every call is one of the controller's read-only RPCs, so an
``operator-readonly`` certificate is enough on a secure mesh (``--cacert``,
``--cert``, ``--key``). A controller that is down or an RPC that fails shows
as a line saying so; the monitor keeps refreshing until it answers again.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from mesh_runtime.durations import to_seconds

HELP = "watch a running controller: replicas, scheduler, autoscaler, operations (q quits, r refreshes)"

_OPERATIONS_SHOWN = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="HOST:PORT[,HOST:PORT...]",
                        help="the controller's address, or the addresses of several controllers on one etcd "
                             "store (top shows the leader's view, moving to the new leader after a failover)")
    parser.add_argument("--interval", type=_positive, default=2.0, help="seconds between refreshes (default 2)")
    parser.add_argument("--timeout", type=_positive, default=3.0, help="seconds to wait for each RPC (default 3)")
    parser.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    from mesh_runtime.tls import add_client_arguments  # noqa: PLC0415

    add_client_arguments(parser)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value > 3600:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 and <= 3600 seconds")
    return value


@dataclasses.dataclass
class Snapshot:
    """What one refresh read; each part is None when its RPC failed (the error is in ``errors``)."""

    address: str
    taken_at: float
    status: Any = None
    replicas: list[Any] | None = None
    scheduler: Any = None
    autoscaler: Any = None
    conditions: Any = None
    operations: list[Any] | None = None
    balancers: list[Any] | None = None
    errors: dict[str, str] = dataclasses.field(default_factory=dict)


def fetch(channel: Any, address: str, timeout_s: float) -> Snapshot:
    """Read everything the monitor shows over ``channel``; never raises for an RPC error."""
    import grpc  # noqa: PLC0415
    from google.longrunning import operations_pb2, operations_pb2_grpc  # noqa: PLC0415
    from rollmesh.controller.v1 import autoscaler_pb2, controller_pb2, controller_pb2_grpc  # noqa: PLC0415
    from rollmesh.controller.v1 import registry_pb2, scaling_pb2, scheduling_pb2  # noqa: PLC0415

    stub = controller_pb2_grpc.ControllerServiceStub(channel)

    snap = Snapshot(address=address, taken_at=time.time())

    def call(name: str, method: Callable[..., Any], request: Any) -> Any:
        try:
            return method(request, timeout=timeout_s)
        except grpc.RpcError as err:
            snap.errors[name] = f"{err.code().name}: {err.details()}"
            return None

    status = call("status", stub.GetStatus, controller_pb2.GetStatusRequest())
    snap.status = status
    if status is None and snap.errors.get("status", "").startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")):
        return snap  # the controller is not there; do not wait out every other call
    replicas = call("replicas", stub.ListReplicas, registry_pb2.ListReplicasRequest())
    snap.replicas = list(replicas.replicas) if replicas is not None else None
    balancers = call("balancers", stub.ListBalancers, registry_pb2.ListBalancersRequest())
    snap.balancers = list(balancers.balancers) if balancers is not None else None
    snap.scheduler = call("scheduler", stub.GetSchedulerState, scheduling_pb2.GetSchedulerStateRequest())
    auto = call("autoscaler", stub.GetAutoscalerStatus, autoscaler_pb2.GetAutoscalerStatusRequest())
    snap.autoscaler = auto.status if auto is not None else None
    if snap.autoscaler is not None and snap.autoscaler.configured:
        snap.conditions = call("conditions", stub.GetAutoscalerConditions,
                               autoscaler_pb2.GetAutoscalerConditionsRequest())
    ops = call("operations", operations_pb2_grpc.OperationsStub(channel).ListOperations,
               operations_pb2.ListOperationsRequest(name="operations", page_size=_OPERATIONS_SHOWN))
    if ops is not None:   # newest first
        snap.operations = []
        for operation in ops.operations:
            snap.operations.append(scaling_pb2.ScaleOperation())
            operation.metadata.Unpack(snap.operations[-1])
    return snap


class Following:
    """Sync channels to one or several controllers; :meth:`fetch` reads from the leader: a standby's answer
    names it, an unreachable address gives way to the next one."""

    def __init__(self, addresses: list[str], open_channel: Callable[[str], Any]) -> None:
        self.addresses = addresses
        self.current = addresses[0]
        self._open = open_channel
        self._channels: dict[str, Any] = {}

    def channel(self, address: str) -> Any:
        if address not in self._channels:
            self._channels[address] = self._open(address)
        return self._channels[address]

    def fetch(self, timeout_s: float) -> Snapshot:
        from rollmesh.controller.v1 import controller_pb2  # noqa: PLC0415

        tried: set[str] = set()
        while True:
            address = self.current
            tried.add(address)
            snap = fetch(self.channel(address), address, timeout_s)
            if snap.status is not None:
                leader = snap.status.leader_address
                if snap.status.role == controller_pb2.CONTROLLER_ROLE_STANDBY and leader and leader not in tried:
                    self.current = leader
                    continue
                return snap
            untried = [a for a in self.addresses if a not in tried]
            if not untried:
                return snap
            self.current = untried[0]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def _enum(name: str, prefix: str) -> str:
    return name.removeprefix(prefix) if name else "?"


def render(snap: Snapshot, width: int = 100) -> list[str]:
    """The frame as lines of at most ``width`` characters; pure."""
    from rollmesh.common.v1 import types_pb2  # noqa: PLC0415
    from rollmesh.controller.v1 import autoscaler_pb2, controller_pb2, scaling_pb2, scheduling_pb2  # noqa: PLC0415

    lines = [f"rollmesh top - controller {snap.address} - {time.strftime('%H:%M:%S', time.localtime(snap.taken_at))}"
             f"   (q quit, r refresh)"]
    if snap.status is None:
        lines.append(f"controller unreachable: {snap.errors.get('status', 'no answer')}")
        return [line[:width] for line in lines]
    st = snap.status
    if st.role == controller_pb2.CONTROLLER_ROLE_STANDBY:   # the leader could not be read: say whose copy this is
        lines.append(f"STANDBY copy (refreshed every second); leader {st.leader_address or 'unknown'} "
                     f"{st.leader_name}".rstrip())
    lines.append(f"nodes {st.node_count}   replicas {st.replica_count} ({st.active_replica_count} active)   "
                 f"running operation {st.running_operation_id or '-'}   events {st.last_event_sequence}")
    if snap.balancers:
        lines.append("balancers " + "   ".join(
            f"{b.balancer_id}{'' if b.routing_ready and b.lease_held else ' NOT READY'}" for b in snap.balancers))
    if snap.scheduler is not None:
        sc = snap.scheduler
        step = sc.last_global_step if sc.HasField("last_global_step") else "-"
        hybrid = _enum(scheduling_pb2.HybridState.Name(sc.hybrid_state), "HYBRID_STATE_")
        lines.append(f"scheduler {'on' if sc.enabled else 'off'}: policy {sc.policy_name or '-'}   hybrid {hybrid}   "
                     f"step {step}   ratio {sc.deactivate_ratio:.2f}   activations {sc.activations}   "
                     f"deactivations {sc.deactivations}")
    lines.append("")
    lines.append(f"{'REPLICA':<22} {'KIND':<10} {'STATE':<9} {'VER':>4} {'RUN':>4} {'WAIT':>4} {'KV%':>5} "
                 f"{'TOK/S':>7}  NODE")
    if snap.replicas is None:
        lines.append(f"  replicas unavailable: {snap.errors.get('replicas', '')}")
    elif not snap.replicas:
        lines.append("  (no replicas registered)")
    for r in sorted(snap.replicas or [], key=lambda r: (r.kind, r.replica_id)):
        kind = _enum(types_pb2.ReplicaKind.Name(r.kind), "REPLICA_KIND_").lower()
        state = _enum(types_pb2.ReplicaState.Name(r.state), "REPLICA_STATE_")
        rep = r.last_report if r.HasField("last_report") else None
        load = (f"{rep.running_requests:>4} {rep.waiting_requests:>4} {100 * rep.kv_cache_usage:>5.1f} "
                f"{rep.generation_tokens_per_second:>7.1f}" if rep is not None else f"{'-':>4} {'-':>4} {'-':>5} "
                                                                                  f"{'-':>7}")
        lines.append(f"{r.replica_id[:22]:<22} {kind:<10} {state:<9} {r.weight_version:>4} {load}  {r.node_id}")
    lines.append("")
    auto = snap.autoscaler
    if auto is None:
        lines.append(f"autoscaler: unavailable ({snap.errors.get('autoscaler', '')})")
    elif not auto.configured:
        lines.append("autoscaler: not configured (start the controller with --autoscaler-config FILE)")
    else:
        last = _enum(autoscaler_pb2.ScaleAction.Name(auto.last_decision.action), "SCALE_ACTION_") \
            if auto.HasField("last_decision") else "-"
        lines.append(f"autoscaler: {'enabled' if auto.enabled else 'disabled'}   engines {auto.current_engines} "
                     f"(min {auto.min_engines}, max {auto.max_engines})   last decision {last}")
        for c in (snap.conditions.conditions if snap.conditions is not None else []):
            kind = _enum(autoscaler_pb2.ScaleAction.Name(c.type), "SCALE_ACTION_").lower()
            mark = "*" if c.triggered else " "
            lines.append(f"  {mark} {c.name:<28} {kind:<9} value {c.value:>9.3f}  threshold {c.threshold:>8.3f}  "
                         f"held {to_seconds(c.held_for):>5.0f}/{to_seconds(c.required_for):.0f} s")
    lines.append("")
    lines.append("recent operations:")
    if snap.operations is None:
        lines.append(f"  unavailable ({snap.errors.get('operations', '')})")
    elif not snap.operations:
        lines.append("  (none)")
    for op in snap.operations or []:
        kind = _enum(scaling_pb2.OperationType.Name(op.type), "OPERATION_TYPE_").lower()
        state = _enum(scaling_pb2.OperationState.Name(op.state), "OPERATION_STATE_")
        created = time.strftime("%H:%M:%S", time.localtime(op.created_at.seconds))
        lines.append(f"  {op.operation_id[:24]:<24} {kind:<9} {state:<15} target {op.num_replicas:>3}  {created}  "
                     f"{op.error_message}")
    return [line[:width] for line in lines]


def _interactive(following: Following, interval_s: float, timeout_s: float) -> None:
    import curses  # noqa: PLC0415

    def loop(screen: Any) -> None:
        curses.curs_set(0) if hasattr(curses, "curs_set") else None
        screen.timeout(100)
        next_refresh, repaint = 0.0, False
        while True:
            now = time.monotonic()
            if now >= next_refresh:
                height, width = screen.getmaxyx()
                frame = render(following.fetch(timeout_s), width=max(20, width - 1))
                if repaint:
                    screen.clear()  # asked for: repaint the whole screen, not just what changed
                else:
                    screen.erase()
                repaint = False
                for row, line in enumerate(frame[:max(0, height - 1)]):
                    screen.addstr(row, 0, line)
                screen.refresh()
                next_refresh = time.monotonic() + interval_s
            key = screen.getch()
            if key in (ord("q"), ord("Q")):
                return
            if key in (ord("r"), ord("R")):
                next_refresh, repaint = 0.0, True

    try:
        curses.wrapper(loop)
    except curses.error as err:
        raise SystemExit(f"rollmesh top: error: this terminal cannot be driven ({err}); use --once") from None


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    import sys  # noqa: PLC0415

    from mesh_runtime.channels import open_sync_channel  # noqa: PLC0415
    from mesh_runtime.net import parse_host_port  # noqa: PLC0415

    from mesh_runtime.tls import client_tls  # noqa: PLC0415

    from mesh_runtime.channels import address_list  # noqa: PLC0415

    addresses = address_list(args.address)
    try:
        if not addresses:
            raise ValueError("no address given")
        for address in addresses:
            parse_host_port(address, allow_zero_port=False)
    except ValueError as err:
        print(f"rollmesh top: error: address: {err}", file=sys.stderr)
        return 2
    try:
        tls = client_tls(args)
    except ValueError as err:
        print(f"rollmesh top: error: {err}", file=sys.stderr)
        return 2
    # no channel retries: top polls again every interval, and shows an unreachable controller at once
    following = Following(addresses, lambda address: open_sync_channel(address, tls=tls))
    try:
        if args.once or not sys.stdout.isatty():
            snap = following.fetch(args.timeout)
            print("\n".join(render(snap, width=160)))
            return 0 if snap.status is not None else 1   # a script can tell an unreachable controller
        try:
            _interactive(following, args.interval, args.timeout)
        except KeyboardInterrupt:
            pass
    finally:
        following.close()
    return 0
