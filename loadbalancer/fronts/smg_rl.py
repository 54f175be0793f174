"""SMG's RL control plane (``/v1/rl/*``) on the balancer's HTTP front, as SMG 1.13's own client (``smg.rl``)
calls it, mapped onto rollmesh's operations.

- ``GET /v1/rl/workers``, ``GET /v1/rl/workers/{id}``: the routed replicas in SMG's worker shape (``id``,
  ``url``, ``base_url``, ``engine``, ``model_id``, ``worker_type``, ``connection_mode``, ``health``,
  ``weight_version``, ``control_url``, ``labels``, ``capabilities``, ...). ``engine`` is the replica agent's
  backend (``torch``, ``vllm``, ``sglang``, ``synthetic``) where the controller knows it, else ``rollmesh``;
  labels ``engine``, ``node``, ``kind`` and ``model``.
- ``POST /v1/rl/workers/{id}/engine/{path}``: one call on one worker, answered as SMG's ``CallResult``
  (``worker_id``, ``url``, ``status``, ``latency_ms``, ``body``).
- ``POST /v1/rl/engine/{path}?selector=k=v,k2=v2``: the same call on every worker whose labels (or ``id``)
  match, answered ``{"results", "failed", "total", "succeeded"}``: 200 when all succeeded, 207 only when some
  really failed. ``selector=all`` (or ``*``) matches every worker; one that matches none is a 404.

Engine paths, as rollmesh's own operations: ``pause_generation`` (``{"mode": "abort" | "in_place" |
"retract"}``, SGLang's default ``abort``): the balancer takes the workers out of routing until
``continue_generation``; requests wait for a routable replica meanwhile (the no-replica limit does not run
during a pause, their deadlines do); with ``abort`` the requests in flight on them are aborted and resume,
with the tokens so far, once routing allows, so none is lost; ``in_place`` and ``retract`` let them finish.
``get_weight_version``: the version the worker serves. ``flush_cache``: SGLang's, per worker (a 400 result for
one whose engine keeps its cache while requests hold blocks of it). ``update_weights_from_disk`` (``model_path``,
``weight_version``, SGLang's body) is the controller's ``LoadWeights`` on the selected workers, one fleet-wide
flip: the balancer holds new requests off them while it runs (those in flight are aborted by the load and
resume on the new weights), every node checks the checkpoint before any replica changes, and the versions
flip together. A worker that cannot load it leaves routing and the version commits on the rest (a 207 that
lists it), or with ``"on_failure": "rollback"`` (rollmesh's extension) every worker goes back to what it
served (a 207 listing all, ``rolled_back`` true); a checkpoint no worker can load changes nothing (400).
``init_weights_update_group``, ``update_weights_from_distributed`` and ``destroy_weights_update_group`` are the
controller's ``UpdateWeightsFromGroup``: the workers join the trainer's own process group as SGLang engines do
(worker i of a call takes rank ``rank_offset + i``), receive what its rank 0 broadcasts (new requests wait
meanwhile; a worker that fails leaves routing; with ``weight_version`` the rest serve it), and leave.
``update_weights_from_tensor`` (pickled tensors in the body: code the engines would run, and CUDA IPC handles
that mean something only on the sender's host) is refused (501). Errors are SMG's shape,
``{"error": CODE, "message": ...}``. Engine calls take, on a mutual-TLS listener, a trainer agent's or an
operator's certificate (a client's may list workers); the caller's ``Authorization`` header goes on to the
controller (its operator token).
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
from aiohttp import web

from mesh_runtime.validate import quote
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import registry_pb2

from .openai_requests import ApiError
from .sglang_front import Front

PAUSE_MODES = ("abort", "in_place", "retract")
REFUSED_WEIGHT_PATHS = ("update_weights_from_tensor",)
WEIGHT_ACTIONS = ("update_weights_from_disk", "init_weights_update_group", "update_weights_from_distributed",
                  "destroy_weights_update_group")
DISK_FIELDS = {"model_path", "load_format", "weight_version", "abort_all_requests", "flush_cache", "is_async",
               "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "on_failure"}
"""The keys of SGLang's UpdateWeightFromDiskReqInput rollmesh takes (the engine-side tuning ones change no
output and are accepted as no-ops), plus ``on_failure``."""
LOAD_TIMEOUT_S = 600.0
LABELS = ("engine", "node", "kind", "model", "id")
LIST_TIMEOUT_S = 5.0


class RlApi:
    """See the module docstring. ``controller``: a channel to the controller (the replicas' backends), or None."""

    def __init__(self, front: Front, controller: grpc.aio.Channel | None) -> None:
        self.front = front
        self.controller = controller

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/rl/workers", self.workers)
        app.router.add_get("/v1/rl/workers/{id}", self.worker)
        app.router.add_route("*", "/v1/rl/workers/{id}/engine/{path:.+}", self.call)
        app.router.add_route("*", "/v1/rl/engine/{path:.+}", self.fanout)

    # ------------------------------------------------------------ workers
    async def _engines(self) -> dict[str, str]:
        """node id -> its agent's backend name, from the controller (empty without one or on failure)."""
        if self.controller is None:
            return {}
        from rollmesh.controller.v1 import controller_pb2_grpc  # noqa: PLC0415

        try:
            reply = await controller_pb2_grpc.ControllerServiceStub(self.controller).ListNodes(
                registry_pb2.ListNodesRequest(), timeout=LIST_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return {}
        return {n.node_id: types_pb2.EngineBackend.Name(n.backend).removeprefix("ENGINE_BACKEND_").lower()
                for n in reply.nodes if n.backend}

    async def _all(self, request: web.Request) -> list[dict[str, Any]]:
        table = self.front.balancer.table
        floor = table.version_floor(None)
        engines = await self._engines()
        base = f"{request.scheme}://{request.host}"
        out = []
        for route in sorted(table.routes.values(), key=lambda r: r.replica_id):
            engine = engines.get(route.node_id, "rollmesh")
            reason = table.unroutable_reason(route, floor)
            out.append({
                "id": route.replica_id, "url": f"{base}/workers/{route.replica_id}",
                "base_url": f"{base}/workers/{route.replica_id}", "engine": engine, "engine_version": None,
                "model_id": self.front.model_name, "worker_type": "regular", "connection_mode": "http",
                "tp_size": None, "dp_size": None, "pp_size": None, "dp_ranks": 1, "role": None,
                "health": "paused" if route.paused else "healthy" if not reason else "unhealthy",
                "weight_version": str(route.weight_version),
                "control_url": f"{base}/v1/rl/workers/{route.replica_id}/engine",
                "labels": {"engine": engine, "node": route.node_id, "kind": route.kind.lower(),
                           "model": self.front.model_name},
                "capabilities": {"pause_generation": True, "continue_generation": True,
                                 "get_weight_version": True, "flush_cache": True,
                                 "weight_updates": self.controller is not None}})
        return out

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": await self._all(request)})

    async def worker(self, request: web.Request) -> web.Response:
        worker_id = request.match_info["id"]
        for entry in await self._all(request):
            if entry["id"] == worker_id:
                return web.json_response(entry)
        raise _rl_error(404, "worker_not_found", f"no worker {quote(worker_id)}")

    # ------------------------------------------------------------ engine calls
    async def call(self, request: web.Request) -> web.Response:
        self.front.require_control(request)
        worker_id, path = request.match_info["id"], request.match_info["path"]
        workers = {w["id"]: w for w in await self._all(request)}
        if worker_id not in workers:
            raise _rl_error(404, "worker_not_found", f"no worker {quote(worker_id)}")
        action = _action(path)
        body = await _body(request)
        if action in WEIGHT_ACTIONS:
            results, _ = await self._weights(request, action, body, [workers[worker_id]])
        else:
            results = await self._run(action, body, [workers[worker_id]])
        return web.json_response({"worker_id": worker_id, **results[worker_id]})

    async def fanout(self, request: web.Request) -> web.Response:
        self.front.require_control(request)
        path = request.match_info["path"]
        selector = request.query.get("selector")
        if selector is None:
            raise _rl_error(400, "invalid_selector", "the selector query parameter is required "
                                                     "(k=v[,k=v...] over labels engine, node, kind, model, id; or all)")
        action = _action(path)
        body = await _body(request)
        matched = [w for w in await self._all(request) if _matches(w, selector)]
        if not matched:
            raise _rl_error(404, "no_workers_matched", f"selector {quote(selector)} matches no worker")
        extra: dict[str, Any] = {}
        if action in WEIGHT_ACTIONS:
            results, extra = await self._weights(request, action, body, matched)
        else:
            results = await self._run(action, body, matched)
        ok = {wid: r for wid, r in results.items() if r["status"] < 400}
        failed = [{"worker_id": wid, "url": r["url"], "status": r["status"], "error": "engine_error",
                   "message": r["body"].get("message", json.dumps(r["body"]))[:300]}
                  for wid, r in results.items() if r["status"] >= 400]
        return web.json_response({"results": ok, "failed": failed, "total": len(results), "succeeded": len(ok),
                                  **extra}, status=207 if failed else 200)

    async def _weights(self, request: web.Request, action: str, body: dict[str, Any],
                       workers: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, Any]]:
        """A weight update on ``workers`` through the controller (``update_weights_from_disk``: LoadWeights; the
        group steps: UpdateWeightsFromGroup); per worker ``{url, status, latency_ms, body}``, and what the
        update did. New requests wait while weights change (``update_weights_from_disk``,
        ``update_weights_from_distributed``)."""
        from rollmesh.controller.v1 import controller_pb2_grpc  # noqa: PLC0415

        ids = [w["id"] for w in workers]
        if action == "update_weights_from_disk":
            call = _load_request(body)
            call.replica_ids.extend(ids)
        else:
            call = _group_request(action, body, ids)
        if self.controller is None:
            raise _rl_error(503, "no_controller", "weight updates go through rollmesh's controller, and this "
                                                  "balancer has none (controller_address)")
        stub = controller_pb2_grpc.ControllerServiceStub(self.controller)
        method = stub.LoadWeights if action == "update_weights_from_disk" else stub.UpdateWeightsFromGroup
        auth = request.headers.get("Authorization")
        metadata = (("authorization", auth),) if auth else ()
        balancer = self.front.balancer
        routes = balancer.table.routes
        changing = action in ("update_weights_from_disk", "update_weights_from_distributed")
        held = [i for i in ids if changing and i in routes and not routes[i].paused]
        started = time.perf_counter()
        await balancer.control.pause(held, abort=False)   # nothing new starts on a worker while it changes
        try:
            reply = await method(call, metadata=metadata, timeout=LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            code = err.code().name
            status = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404,
                      "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403}.get(code, 502)
            raise _rl_error(status, code.lower(), f"{action}: {(err.details() or '')[:400]}") from None
        finally:
            balancer.control.resume(held)
        result = reply.result
        latency = int((time.perf_counter() - started) * 1000)
        outcome: dict[str, Any] = {}
        if action == "update_weights_from_disk":
            outcome = {"weight_version": str(result.weight_version), "committed": reply.committed,
                       "rolled_back": getattr(reply, "rolled_back", False)}
            done = f"serving weight version {result.weight_version} from {call.checkpoint_path}"
        elif action == "update_weights_from_distributed":
            if call.receive.HasField("weight_version"):
                outcome = {"weight_version": str(result.weight_version), "committed": reply.committed}
            done = f"received {len(call.receive.tensors)} tensor(s) from group {call.group_name}"
        else:
            done = f"{'joined' if action == 'init_weights_update_group' else 'left'} group {call.group_name}"
        by_id = {r.replica_id: r for r in result.replica_results}
        out = {}
        for w in workers:
            r = by_id.get(w["id"])
            ok = r is not None and r.ok
            answer = {"success": ok, "message": done if ok else (r.error_message if r is not None
                                                                 else "not part of the update"), **outcome}
            out[w["id"]] = {"url": w["url"], "status": 200 if ok else 500, "latency_ms": latency, "body": answer}
        return out, outcome

    async def _run(self, action: str, body: dict[str, Any], workers: list[dict[str, Any]]) -> dict[str, dict]:
        """Do ``action`` on ``workers``; per worker ``{url, status, latency_ms, body}``."""
        started = time.perf_counter()
        balancer = self.front.balancer
        ids = [w["id"] for w in workers]
        statuses: dict[str, int] = {}
        if action == "pause_generation":
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise _rl_error(400, "invalid_argument", f"mode must be one of {', '.join(PAUSE_MODES)}; "
                                                         f"got {quote(mode)}")
            await balancer.control.pause(ids, abort=mode == "abort")
            answer: dict[str, Any] = {"success": True, "message": f"paused ({mode})"}
            bodies = {i: answer for i in ids}
        elif action == "continue_generation":
            balancer.control.resume(ids)
            bodies = {i: {"success": True, "message": "continued"} for i in ids}
        elif action == "flush_cache":
            refused = await balancer.control.flush_cache(ids)
            statuses = {i: 400 if refused.get(i) else 200 for i in ids}
            bodies = {i: {"success": False, "message": refused[i]} if refused.get(i)
                      else {"success": True, "message": "Cache flushed."} for i in ids}
        else:   # get_weight_version
            bodies = {w["id"]: {"weight_version": w["weight_version"]} for w in workers}
        latency = int((time.perf_counter() - started) * 1000)
        return {w["id"]: {"url": w["url"], "status": statuses.get(w["id"], 200), "latency_ms": latency,
                          "body": bodies[w["id"]]} for w in workers}


ACTIONS = ("pause_generation", "continue_generation", "get_weight_version", "flush_cache", *WEIGHT_ACTIONS)


def _action(path: str) -> str:
    path = path.strip("/")
    if path in ACTIONS:
        return path
    if path in REFUSED_WEIGHT_PATHS:
        raise _rl_error(501, "not_supported",
                        f"{path}: pickled tensors (code the engines would run, handles that mean something on "
                        "the sender's host only); send weights from disk (update_weights_from_disk) or over "
                        "your process group (update_weights_from_distributed); see "
                        "docs/coming-from-sglang-router.md")
    raise _rl_error(404, "unknown_engine_path", f"{quote(path)} is not an engine path rollmesh serves "
                                                f"({', '.join(ACTIONS)})")


GROUP_FIELDS = {
    "init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                  "backend"},
    "update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                        "abort_all_requests", "weight_version", "load_format"},
    "destroy_weights_update_group": {"group_name"},
}
DEFAULT_GROUP = "weight_update_group"   # SGLang's default group_name


def _group_request(action: str, body: dict[str, Any], ids: list[str]) -> Any:
    """SGLang's body of a group step as an UpdateWeightsFromGroupRequest (400 for what rollmesh cannot take)."""
    from rollmesh.common.v1 import weights_pb2  # noqa: PLC0415
    from rollmesh.controller.v1 import weight_sync_pb2  # noqa: PLC0415

    unknown = sorted(set(body) - GROUP_FIELDS[action])
    if unknown:
        raise _rl_error(400, "invalid_argument", f"{action} does not take {quote(unknown[0])} "
                                                 f"(it takes {', '.join(sorted(GROUP_FIELDS[action]))})")
    group = body.get("group_name", DEFAULT_GROUP)
    if not isinstance(group, str) or not group or len(group) > 200:
        raise _rl_error(400, "invalid_argument", f"group_name must be 1 to 200 characters, got {quote(group)}")
    call = weight_sync_pb2.UpdateWeightsFromGroupRequest(replica_ids=ids, group_name=group)
    if action == "destroy_weights_update_group":
        call.leave.SetInParent()
        return call
    if action == "init_weights_update_group":
        address = body.get("master_address")
        numbers = [body.get(k) for k in ("master_port", "rank_offset", "world_size")]
        if not isinstance(address, str) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                   for n in numbers):
            raise _rl_error(400, "invalid_argument", "init_weights_update_group needs master_address (a string) "
                                                     "and master_port, rank_offset, world_size (integers)")
        backend = body.get("backend", "nccl")
        if backend not in ("nccl", "gloo"):
            raise _rl_error(400, "invalid_argument", f"backend must be nccl or gloo, got {quote(backend)}")
        call.join.master_address = address
        call.join.master_port, call.join.rank_offset, call.join.world_size = (int(n or 0) for n in numbers)
        call.join.backend = (weights_pb2.PROCESS_GROUP_BACKEND_NCCL if backend == "nccl"
                             else weights_pb2.PROCESS_GROUP_BACKEND_GLOO)
        return call
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes) and names):
        raise _rl_error(400, "invalid_argument", "names, dtypes and shapes must be lists of one length, not empty")
    if body.get("load_format") not in (None, "auto"):
        raise _rl_error(400, "invalid_argument", f"load_format {quote(body['load_format'])} is not supported")
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not (isinstance(name, str) and isinstance(dtype, str) and isinstance(shape, list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise _rl_error(400, "invalid_argument", f"tensor {quote(name)}: a name, a dtype string and a shape "
                                                     "of integers")
        call.receive.tensors.add(name=name, dtype=dtype.removeprefix("torch."), shape=shape)
    version = body.get("weight_version")
    if version is not None:
        call.receive.weight_version = _version(version)
    return call


def _version(version: Any) -> int:
    text = str(version).strip()
    if isinstance(version, bool) or not text.isdigit() or len(text) > 18:
        raise _rl_error(400, "invalid_argument", f"weight_version {quote(version)}: rollmesh's versions are "
                                                 "integers >= 0")
    return int(text)


def _load_request(body: dict[str, Any]) -> Any:
    """SGLang's update_weights_from_disk body as a LoadWeightsRequest (400 for what rollmesh cannot honour)."""
    from rollmesh.controller.v1 import weight_sync_pb2  # noqa: PLC0415

    unknown = sorted(set(body) - DISK_FIELDS)
    if unknown:
        raise _rl_error(400, "invalid_argument", f"update_weights_from_disk does not take {quote(unknown[0])} "
                                                 f"(it takes {', '.join(sorted(DISK_FIELDS))})")
    path = body.get("model_path")
    if not isinstance(path, str) or not path.strip():
        raise _rl_error(400, "invalid_argument", "model_path must name the checkpoint's directory, readable at "
                                                 "that path on every worker's node")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        raise _rl_error(400, "invalid_argument", f"load_format {quote(body['load_format'])}: rollmesh loads "
                                                 "safetensors checkpoints only")
    load = weight_sync_pb2.LoadWeightsRequest(checkpoint_path=path)
    version = body.get("weight_version")
    if version is not None:
        load.weight_version = _version(version)
    on_failure = body.get("on_failure", "exclude")
    if on_failure not in ("exclude", "rollback"):
        raise _rl_error(400, "invalid_argument", f"on_failure must be exclude or rollback, got {quote(on_failure)}")
    load.on_failure = (weight_sync_pb2.WEIGHT_UPDATE_ON_FAILURE_ROLLBACK if on_failure == "rollback"
                       else weight_sync_pb2.WEIGHT_UPDATE_ON_FAILURE_EXCLUDE)
    return load


def _matches(worker: dict[str, Any], selector: str) -> bool:
    if selector.strip() in ("all", "*"):
        return True
    for term in selector.split(","):
        key, sep, value = term.strip().partition("=")
        if not sep or key not in LABELS:
            raise _rl_error(400, "invalid_selector", f"selector term {quote(term)}: use k=v with k one of "
                                                     f"{', '.join(LABELS)}")
        have = worker["id"] if key == "id" else worker["labels"].get(key)
        if have != value:
            return False
    return True


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _rl_error(400, "invalid_json", f"the request body is not valid JSON: {err}") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise _rl_error(400, "invalid_json", "the request body must be a JSON object")
    return body


def _rl_error(status: int, code: str, message: str) -> ApiError:
    """An error in SMG's shape (the front's error handler renders ``code`` and ``message`` as SMG does for
    ``/v1/rl``)."""
    return ApiError(status, message, code=code)
