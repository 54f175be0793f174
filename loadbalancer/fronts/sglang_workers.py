"""SGLang's router's worker API on the balancer's HTTP front, as slime calls it.

- ``POST /workers`` ``{"url": "http://HOST:PORT", "worker_type": "regular"}``: an SGLang server that already
  runs becomes a rollmesh replica: the balancer asks the controller (``controller_address``) for an external
  scale-out of that URL, which a registered replica agent of the ``sglang`` backend attaches (health check,
  weight sync to the fleet's version, routed), and answers once it serves (or with the controller's reason).
- ``GET /workers``, ``GET /workers/{id}``: the routed replicas, each ``{"id", "url", "engine_url", "model_id",
  "worker_type", "is_healthy", "load", "weight_version", "node_id"}``.
- ``DELETE /workers/{id}``: a scale-in of that replica through the controller: it leaves routing and drains.

Each worker's ``url`` is a URL of this balancer, ``<base>/workers/{id}``, not the engine's: slime, before an
abort, sends ``/abort_request {"abort_all": true}`` to every listed URL and polls its ``/v1/loads`` until idle.
An abort sent to the engine itself would look to rollmesh like a replica's abort, which the balancer resumes
elsewhere so that no sample is lost; sent to these URLs it ends the generations this balancer's HTTP API runs
on that replica (and those still waiting for one), each answering with its partial output, and the loads
count them. ``engine_url`` is the SGLang server's own URL (null for replicas of other engines), and ``DELETE
/workers/{id}`` takes either id. Under a worker's URL: ``POST abort_request``, ``GET v1/loads``, ``GET health``
and ``GET health_generate`` (200 while the replica is routable, else 503 with the reason), ``GET
get_model_info``, ``GET get_server_info``.

Changing the fleet takes, on a mutual-TLS listener, a trainer agent's or an operator's certificate, and the
controller's scale credential when it has one (``scale_api_token``): the caller's ``Authorization`` header goes
to the controller with the call.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import grpc
from aiohttp import web
from google.longrunning import operations_pb2, operations_pb2_grpc

from mesh_runtime.durations import set_seconds
from mesh_runtime.validate import quote
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2, scaling_pb2

from .openai_requests import HTTP_STATUS, ApiError, bad
from .sglang_front import Front, SglangApi, json_object

CHANGE_TIMEOUT_S = 600.0
LIST_TIMEOUT_S = 5.0
_SMG_ONLY = ("api_key", "priority", "cost", "labels", "bootstrap_port", "tokenizer_path", "reasoning_parser",
             "tool_parser", "chat_template", "health_check", "dp_aware", "disable_health_check")


class WorkerApi:
    """See the module docstring. ``controller``: a channel to the controller, None without one."""

    def __init__(self, front: Front, sglang: SglangApi, controller: grpc.aio.Channel | None) -> None:
        self.front = front
        self.sglang = sglang
        self.controller = controller

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/workers", self.add)
        app.router.add_get("/workers", self.list_workers)
        app.router.add_get("/workers/{id}", self.get)
        app.router.add_delete("/workers/{id}", self.remove)
        app.router.add_post("/workers/{id}/abort_request", self.abort)
        app.router.add_get("/workers/{id}/v1/loads", self.loads)
        app.router.add_get("/workers/{id}/health", self.health)
        app.router.add_get("/workers/{id}/health_generate", self.health)
        app.router.add_get("/workers/{id}/get_model_info", self.sglang.model_info)
        app.router.add_get("/workers/{id}/get_server_info", self.sglang.server_info)
        app.router.add_route("GET", "/workers/{id}/flush_cache", self.flush_cache)
        app.router.add_route("POST", "/workers/{id}/flush_cache", self.flush_cache)
        app.router.add_get("/v1/loads", self.loads)

    # ------------------------------------------------------------ the fleet
    async def add(self, request: web.Request) -> web.Response:
        self.front.require_control(request)
        body = await json_object(request)
        url = body.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 512:
            raise bad("url", f"must be the SGLang server's http(s)://HOST:PORT, got {quote(url)}")
        url = url.rstrip("/")
        kind = body.get("worker_type") or "regular"
        if kind != "regular":
            raise bad("worker_type", f"only 'regular' workers are supported (no prefill/decode disaggregation); "
                                     f"got {quote(kind)}")
        runtime = body.get("runtime")
        if runtime not in (None, "sglang"):
            raise bad("runtime", f"workers added here are SGLang servers; got {quote(runtime)}")
        model = body.get("model_id")
        if model is not None and model not in (self.front.model_name, self.front.config.model):
            raise bad("model_id", f"this balancer serves {quote(self.front.model_name)}, not {quote(model)}")
        for key in _SMG_ONLY:
            if body.get(key) not in (None, False, {}, []):
                raise bad(key, "is not supported by rollmesh's worker API")
        stub = self._controller_stub()
        scale = scaling_pb2.ScaleOutRequest(request_id=f"workers-{uuid.uuid4().hex}")
        scale.external.addresses.append(url)
        set_seconds(scale.timeout, CHANGE_TIMEOUT_S)
        op = await self._operate(request, lambda metadata: stub.ScaleOut(scale, metadata=metadata,
                                                                         timeout=LIST_TIMEOUT_S), "attach", url)
        if op.state == scaling_pb2.OPERATION_STATE_NOOP:   # the URL is a replica already: its record
            records = await self._records()
            ids = [r.replica_id for r in records.values() if r.engine_url.rstrip("/") == url]
        else:
            ids = list(op.replica_ids)
        return web.json_response({"status": "ok", "worker_id": ids[0] if ids else None, "url": url,
                                  "message": f"{url} serves as replica {ids[0] if ids else '?'}"})

    async def remove(self, request: web.Request) -> web.Response:
        self.front.require_control(request)
        worker = request.match_info["id"]
        records = await self._records()
        replica_id = worker if worker in records or worker in self.front.balancer.table.routes else next(
            (r.replica_id for r in records.values() if r.engine_url and r.engine_url.rstrip("/") == worker), None)
        if replica_id is None:
            raise ApiError(404, f"no worker {quote(worker)}", code="worker_not_found")
        stub = self._controller_stub()
        scale = scaling_pb2.ScaleInRequest(request_id=f"workers-{uuid.uuid4().hex}")
        scale.replicas.replica_ids.append(replica_id)
        set_seconds(scale.timeout, CHANGE_TIMEOUT_S)
        await self._operate(request, lambda metadata: stub.ScaleIn(scale, metadata=metadata, timeout=LIST_TIMEOUT_S),
                            "detach", replica_id)
        return web.json_response({"status": "ok", "worker_id": replica_id,
                                  "message": f"replica {replica_id} left routing and drained"})

    async def list_workers(self, request: web.Request) -> web.Response:
        workers = await self._workers(request)
        return web.json_response({"workers": workers, "total": len(workers),
                                  "stats": {"healthy": sum(1 for w in workers if w["is_healthy"])}})

    async def get(self, request: web.Request) -> web.Response:
        worker = request.match_info["id"]
        for entry in await self._workers(request):
            if entry["id"] == worker:
                return web.json_response(entry)
        raise ApiError(404, f"no worker {quote(worker)}", code="worker_not_found")

    async def _workers(self, request: web.Request) -> list[dict[str, Any]]:
        table = self.front.balancer.table
        floor = table.version_floor(None)
        engines = {r.replica_id: r.engine_url for r in (await self._records(optional=True)).values()}
        base = f"{request.scheme}://{request.host}"
        placed = Counter(self.front.balancer.replica_of(rid) for rid in self.sglang.running())
        waiting = placed.pop(None, 0)   # not on a replica yet: part of every worker's load (see _on)
        return [{"id": route.replica_id, "url": f"{base}/workers/{route.replica_id}",
                 "engine_url": engines.get(route.replica_id) or None, "model_id": self.front.model_name,
                 "worker_type": "regular", "connection_mode": "http",
                 "is_healthy": not table.unroutable_reason(route, floor),
                 "load": placed[route.replica_id] + waiting,
                 "weight_version": route.weight_version, "node_id": route.node_id or None}
                for route in sorted(table.routes.values(), key=lambda r: r.replica_id)]

    # ------------------------------------------------------------ under a worker's URL
    def _route(self, request: web.Request) -> Any:
        worker = request.match_info["id"]
        route = self.front.balancer.table.routes.get(worker)
        if route is None:
            raise ApiError(404, f"no worker {quote(worker)}", code="worker_not_found")
        return route

    def _on(self, replica_id: str | None) -> list[str]:
        """The HTTP API's generations on ``replica_id`` (all of them for None), and those waiting for one."""
        balancer = self.front.balancer
        return [rid for rid in self.sglang.running()
                if replica_id is None or balancer.replica_of(rid) in (replica_id, None)]

    async def abort(self, request: web.Request) -> web.Response:
        route = self._route(request)
        body = await json_object(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool) or not (rid or abort_all):
            raise bad("rid", "give the rid of a generation, or abort_all: true")
        mine = set(self._on(route.replica_id))
        return web.json_response({"aborted": self.sglang.end(
            lambda r: r in mine and (abort_all or r == rid or r.startswith(f"{rid}/")))})

    async def flush_cache(self, request: web.Request) -> web.Response:
        return await self.sglang.flush_cache(request, [self._route(request).replica_id])

    async def loads(self, request: web.Request) -> web.Response:
        replica_id = self._route(request).replica_id if "id" in request.match_info else None
        count = len(self._on(replica_id))
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": count, "num_waiting_reqs": 0,
                                             "num_total_reqs": count}]})

    async def health(self, request: web.Request) -> web.Response:
        route = self._route(request)
        table = self.front.balancer.table
        reason = table.unroutable_reason(route, table.version_floor(None))
        if reason:
            raise ApiError(503, f"worker {route.replica_id} is not routable: {reason}", code="unhealthy")
        return web.json_response({})

    # ------------------------------------------------------------ the controller
    def _controller_stub(self) -> controller_pb2_grpc.ControllerServiceAsyncStub:
        if self.controller is None:
            raise ApiError(503, "this balancer has no controller (controller_address): workers are added and "
                                "removed through the controller", code="no_controller")
        return controller_pb2_grpc.ControllerServiceStub(self.controller)

    async def _records(self, optional: bool = False) -> dict[str, registry_pb2.ReplicaRecord]:
        if self.controller is None:
            return {}
        try:
            reply = await self._controller_stub().ListReplicas(registry_pb2.ListReplicasRequest(),
                                                               timeout=LIST_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if optional:
                return {}
            raise _controller_error("list the replicas", err) from None
        return {r.replica_id: r for r in reply.replicas}

    async def _operate(self, request: web.Request, call: Any, what: str, name: str) -> scaling_pb2.ScaleOperation:
        """Start a scale operation and wait for its end; an operation that does not succeed is an error."""
        auth = request.headers.get("Authorization")
        metadata = (("authorization", auth),) if auth else ()
        try:
            started = await call(metadata)
            ops = operations_pb2_grpc.OperationsStub(self.controller)
            reply = await ops.WaitOperation(operations_pb2.WaitOperationRequest(name=started.name),
                                            timeout=CHANGE_TIMEOUT_S + 30)
        except grpc.aio.AioRpcError as err:
            raise _controller_error(f"{what} {name}", err) from None
        op = scaling_pb2.ScaleOperation()
        reply.metadata.Unpack(op)
        if op.state in (scaling_pb2.OPERATION_STATE_ACTIVE, scaling_pb2.OPERATION_STATE_COMPLETED,
                        scaling_pb2.OPERATION_STATE_NOOP):
            return op
        state = scaling_pb2.OperationState.Name(op.state).removeprefix("OPERATION_STATE_")
        raise ApiError(502 if reply.done else 504,
                       f"the controller could not {what} {name}: operation {op.operation_id} {state}"
                       f"{': ' + op.error_message if op.error_message else ''}", code="scale_failed")


def _controller_error(what: str, err: grpc.aio.AioRpcError) -> ApiError:
    code = err.code().name
    status = HTTP_STATUS.get(code, 502)
    return ApiError(status, f"the controller refused to {what}: {code}: {(err.details() or '')[:300]}",
                    code=code.lower())
