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
``get_weight_version``: the version the worker serves. Weight updates (``update_weights_from_disk``,
``_from_tensor``, ``_from_distributed``, ``init_weights_update_group``) are refused (501): rollmesh moves
weights with its own broadcast, committed fleet-wide by the controller (``SyncWeights``, the trainer
agent), where a replica that cannot take a version leaves routing rather than serving a mixed fleet.
Errors are SMG's shape, ``{"error": CODE, "message": ...}``. Engine calls take, on a mutual-TLS listener, a
trainer agent's or an operator's certificate (a client's may list workers).
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
WEIGHT_PATHS = ("update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed",
                "init_weights_update_group", "destroy_weights_update_group")
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
                                 "get_weight_version": True, "weight_updates": False}})
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
        results = await self._run(action, body, matched)
        ok = {wid: r for wid, r in results.items() if r["status"] < 400}
        failed = [{"worker_id": wid, "url": r["url"], "status": r["status"], "error": "engine_error",
                   "message": json.dumps(r["body"])[:300]} for wid, r in results.items() if r["status"] >= 400]
        return web.json_response({"results": ok, "failed": failed, "total": len(results), "succeeded": len(ok)},
                                 status=207 if failed else 200)

    async def _run(self, action: str, body: dict[str, Any], workers: list[dict[str, Any]]) -> dict[str, dict]:
        """Do ``action`` on ``workers``; per worker ``{url, status, latency_ms, body}``."""
        started = time.perf_counter()
        balancer = self.front.balancer
        ids = [w["id"] for w in workers]
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
        else:   # get_weight_version
            bodies = {w["id"]: {"weight_version": w["weight_version"]} for w in workers}
        latency = int((time.perf_counter() - started) * 1000)
        return {w["id"]: {"url": w["url"], "status": 200, "latency_ms": latency, "body": bodies[w["id"]]}
                for w in workers}


def _action(path: str) -> str:
    path = path.strip("/")
    if path in ("pause_generation", "continue_generation", "get_weight_version"):
        return path
    if path in WEIGHT_PATHS:
        raise _rl_error(501, "not_supported",
                        f"{path}: rollmesh moves weights with its own broadcast, committed fleet-wide by the "
                        "controller (SyncWeights through the trainer agent); see docs/coming-from-sglang-router.md")
    raise _rl_error(404, "unknown_engine_path", f"{quote(path)} is not an engine path rollmesh serves "
                                                "(pause_generation, continue_generation, get_weight_version)")


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
