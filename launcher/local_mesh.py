"""Local mesh helpers behind ``rollmesh up`` and ``rollmesh status``.

``up`` starts the four servers as separate processes on loopback (free ports)
with mutual TLS from a CA it makes in the run directory (``pki/``), prints each
one's status and either stops them or keeps them running until Ctrl-C.
``status`` finds a server's rollmesh service by reflection and prints a
summary of its ``GetStatus`` answer (or all of it as JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from mesh_runtime.channels import open_channel, read_methods
from mesh_runtime.config import TlsConfig
from mesh_runtime.durations import to_seconds
from mesh_runtime.json_values import integral
from google.protobuf import json_format
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from .pki import LocalPki
from .processes import LaunchError, ServerProcess, start_server

# Full service name -> module holding its generated stub and messages.
STATUS_SERVICES = {
    "rollmesh.controller.v1.ControllerService": "rollmesh.controller.v1.controller",
    "rollmesh.loadbalancer.v1.LoadBalancerService": "rollmesh.loadbalancer.v1.loadbalancer",
    "rollmesh.replica.v1.ReplicaAgentService": "rollmesh.replica.v1.replica_agent",
    "rollmesh.trainer.v1.TrainerAgentService": "rollmesh.trainer.v1.trainer_agent",
}


async def list_services(channel: grpc.aio.Channel, timeout_s: float) -> list[str]:
    """Service names a server announces through reflection."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                     timeout=timeout_s)
    async for response in call:
        return [s.name for s in response.list_services_response.service]
    return []


async def fetch_status(address: str, timeout_s: float = 5.0,
                       tls: TlsConfig | None = None) -> tuple[str, Any]:
    """``(service name, GetStatusResponse)`` of the rollmesh server at ``address``."""
    async with open_channel(address, tls=tls, idempotent=read_methods()) as channel:
        names = await list_services(channel, timeout_s)
        service = next((n for n in names if n in STATUS_SERVICES), None)
        if service is None:
            raise LookupError(f"{address} serves no rollmesh service (it announces: {', '.join(names)})")
        prefix = STATUS_SERVICES[service]
        messages = importlib.import_module(prefix + "_pb2")
        stubs = importlib.import_module(prefix + "_pb2_grpc")
        stub = getattr(stubs, service.rsplit(".", 1)[1] + "Stub")(channel)
        return service, await stub.GetStatus(messages.GetStatusRequest(), timeout=timeout_s)


async def print_status(address: str, timeout_s: float, tls: TlsConfig | None = None, *,
                       as_json: bool = False) -> int:
    try:
        service, response = await fetch_status(address, timeout_s, tls)
    except (grpc.RpcError, LookupError) as err:
        print(f"rollmesh status: error: {address}: {_failure(err)}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(integral(json_format.MessageToDict(response)), indent=2))
    else:
        print("\n".join(status_summary(service, response)))
    return 0


async def print_leader_status(addresses: list[str], timeout_s: float, tls: TlsConfig | None = None, *,
                              as_json: bool = False) -> int:
    """The status of the controller leading among ``addresses``, then one line per other address."""
    from rollmesh.controller.v1 import controller_pb2  # noqa: PLC0415

    answers = await asyncio.gather(*(fetch_status(a, timeout_s, tls) for a in addresses), return_exceptions=True)
    leading = next(((a, answer) for a, answer in zip(addresses, answers) if not isinstance(answer, BaseException)
                    and getattr(answer[1], "role", None) == controller_pb2.CONTROLLER_ROLE_LEADER), None)
    leader = leading[0] if leading else None
    if as_json:
        print(json.dumps({"leader": leader or "", "controllers": {
            a: {"error": _failure(answer)} if isinstance(answer, BaseException)
            else integral(json_format.MessageToDict(answer[1])) for a, answer in zip(addresses, answers)}},
            indent=2))
    else:
        if leading is not None:
            print("\n".join(status_summary(*leading[1])))
        for address, answer in zip(addresses, answers):
            if address != leader:
                print(f"  {address}: {_member_line(answer)}")
    if leader is None:
        print(f"rollmesh status: error: none of {', '.join(addresses)} answered as the leading controller",
              file=sys.stderr)
        return 1
    return 0


def _failure(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or error.code().name
    return str(error)


def _member_line(answer: tuple[str, Any] | BaseException) -> str:
    """One controller that is not the leader: a standby and whom it names, else why it did not answer."""
    from rollmesh.controller.v1 import controller_pb2  # noqa: PLC0415

    if isinstance(answer, BaseException):
        return f"did not answer: {_failure(answer)}"
    service, response = answer
    if getattr(response, "role", None) is None:
        return f"not a controller ({service})"
    role = controller_pb2.ControllerRole.Name(response.role).removeprefix("CONTROLLER_ROLE_").lower()
    return f"{role}, leader: {response.leader_address or 'unknown'}"



def status_summary(service: str, response: Any) -> list[str]:
    """A few readable lines: who answered, how it is reached, what it holds."""
    from rollmesh.common.v1 import status_pb2  # noqa: PLC0415

    st = response.status
    security = status_pb2.TransportSecurity.Name(st.transport_security).removeprefix("TRANSPORT_SECURITY_")
    uptime = to_seconds(st.uptime)
    lines = [f"{st.server_name} {st.version} on node {st.node_id or '?'}, listening on {st.listen_address}",
             f"  ready: {'yes' if st.ready else 'no'}   transport: {security.lower()}"
             f"{'   identity: ' + st.identity if st.identity else ''}   up {uptime:.0f} s",
             f"  capabilities: {', '.join(st.capabilities) or '-'}"]
    fields = {f.name: (f.enum_type.values_by_number[getattr(response, f.name)].name if f.enum_type
                       else getattr(response, f.name))
              for f in response.DESCRIPTOR.fields
              if f.name != "status" and f.type != f.TYPE_MESSAGE and not f.is_repeated}
    if fields:
        lines.append("  " + "   ".join(f"{k.replace('_', ' ')}: {_readable(v)}" for k, v in fields.items()))
    lines.append(f"  ({service}; --json for everything, the effective config included)")
    return lines


def _readable(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value) if value != "" else "-"


ORDER = ("lb", "trainer-agent", "controller", "replica-agent")   # the controller is told the trainer's address


_PREFIX = {"lb": "ROLLMESH_LB", "controller": "ROLLMESH_CONTROLLER", "replica-agent": "ROLLMESH_REPLICA_AGENT",
           "trainer-agent": "ROLLMESH_TRAINER_AGENT"}
_IDENTITY = {"lb": "lb", "controller": "controller", "replica-agent": "local", "trainer-agent": "local"}


def local_client_tls(run_dir: Path) -> TlsConfig:
    """The identity tools use towards a local mesh: a read-only operator of its CA (``run_dir/pki``)."""
    return LocalPki(run_dir / "pki").tls("operator-readonly", "local")


async def start_local_mesh(run_dir: Path, env: dict[str, str], *, tls: bool = True,
                           configs: dict[str, dict[str, Any]] | None = None) -> dict[str, ServerProcess]:
    """Start the four servers on free loopback ports, logs under ``run_dir``; with mutual TLS from a CA made
    in ``run_dir/pki`` unless ``tls`` is false. With ``configs`` (server name -> config), only those servers,
    each from its config (written to ``run_dir/NAME.yaml``), and the replica agent registers with the
    controller."""
    import yaml  # noqa: PLC0415

    run_dir = run_dir.resolve()   # the configs written here name their files absolutely
    run_dir.mkdir(parents=True, exist_ok=True)
    pki = LocalPki(run_dir / "pki")
    started: dict[str, ServerProcess] = {}
    try:
        for name in ORDER:
            if configs is not None and name not in configs:
                continue
            child_env = dict(env)
            args = ["--listen", "127.0.0.1:0"]
            if configs is not None:
                (run_dir / f"{name}.yaml").write_text(yaml.safe_dump(configs[name], sort_keys=False))
                args += ["--config", str(run_dir / f"{name}.yaml")]
            if tls:
                child_env.update(pki.env(_PREFIX[name], name, _IDENTITY[name]))
            if name == "controller":
                child_env["ROLLMESH_CONTROLLER__LOAD_BALANCER_ADDRESS"] = started["lb"].address
                if "trainer-agent" in started and configs is not None:
                    child_env["ROLLMESH_CONTROLLER__TRAINER_ADDRESS"] = started["trainer-agent"].address
            if name == "replica-agent" and "controller" in started and configs is not None:
                child_env["ROLLMESH_REPLICA_AGENT__CONTROLLER_ADDRESS"] = started["controller"].address
            started[name] = await start_server(name, args, env=child_env, log_path=run_dir / f"{name}.log")
    except BaseException:
        await stop_all(started)
        raise
    return started


async def stop_all(servers: dict[str, ServerProcess]) -> dict[str, int]:
    codes = await asyncio.gather(*(s.terminate() for s in servers.values()))
    return dict(zip(servers, codes))


async def up(run_dir: str, *, exit_after_status: bool, env: dict[str, str], config: str | None = None) -> int:
    from mesh_runtime.config import ConfigError  # noqa: PLC0415
    from mesh_runtime.net import format_host_port, free_port, parse_host_port  # noqa: PLC0415

    from .serve_config import load_serve_config, serve_server_configs  # noqa: PLC0415

    configs = http_listen = None
    serve = None
    try:
        if config is not None:
            serve = load_serve_config(config)
            host, port = parse_host_port(serve.http_listen)
            http_listen = format_host_port(host, port or free_port(host))
            configs = serve_server_configs(serve, http_listen)
        servers = await start_local_mesh(Path(run_dir), env, configs=configs)
        tls = local_client_tls(Path(run_dir))
    except ConfigError as err:
        print(f"rollmesh up: error: {config}: {err}", file=sys.stderr)
        return 2
    except LaunchError as err:
        print(f"rollmesh up: error: {err}", file=sys.stderr)
        return 1
    codes: dict[str, int] = {}
    try:
        print(f"{'server':<14} {'address':<22} {'ready':<6} {'version':<8} capabilities")
        for name, proc in servers.items():
            _, response = await fetch_status(proc.address, tls=tls)
            status = response.status
            print(f"{name:<14} {proc.address:<22} {str(status.ready).lower():<6} {status.version:<8} "
                  f"{', '.join(status.capabilities)}")
        if serve is not None and http_listen is not None:
            routed = await _wait_routed(servers["lb"].address, tls, serve.replicas)
            print(f"replicas routed: {routed} of {serve.replicas}")
            print(f"openai: http://{http_listen}/v1", flush=True)
            if serve.verl or serve.weights_dir:
                print("verl: " + " ".join(verl_overrides(Path(run_dir), servers["controller"].address,
                                                         serve.weights_dir)), flush=True)
        if not exit_after_status:
            print("mesh running; press Ctrl-C to stop", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            codes = await stop_all(servers)
            print("stopped: " + ", ".join(f"{n} (exit {c})" for n, c in codes.items()))
    return 0 if codes and all(c == 0 for c in codes.values()) else 1


VERL_BLOCK = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollmesh"


def verl_overrides(run_dir: Path, controller: str, weights_dir: str = "") -> list[str]:
    """The overrides that point verl's rollmesh plugin at this mesh (docs/coming-from-verl.md): the
    controller, the directory its trainer agent reads (with ``weights_dir``; else verl's rank 0 serves its
    weights), and a trainer-agent identity of the mesh's CA (made in ``run_dir/pki`` the first time: verl's
    trainer commits weight versions with it, and its rank 0 serves them with it)."""
    tls = LocalPki(run_dir.resolve() / "pki").section("trainer-agent", "verl")
    return [f"+{VERL_BLOCK}.controller={controller}",
            *([f"+{VERL_BLOCK}.weights_dir={Path(weights_dir).resolve()}"] if weights_dir else []),
            *(f"+{VERL_BLOCK}.tls.{key}={value}" for key, value in tls.items())]


async def _wait_routed(lb: str, tls: TlsConfig, want: int, timeout_s: float = 180.0) -> int:
    """Wait until the balancer routes ``want`` replicas (they load, register, are routed); the count."""
    deadline = time.monotonic() + timeout_s
    routed = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            _, response = await fetch_status(lb, tls=tls)
            routed = response.routable_replica_count
            if routed >= want:
                break
        await asyncio.sleep(0.5)
    return routed
