// Calls every rollmesh server through the generated TypeScript package (generated/ts, @rollmesh/client):
// GetStatus of each, the controller's WatchEvents server stream, a dry-run ScaleOut whose
// google.longrunning.Operation metadata is unpacked, the load balancer's Generate stream, and an error (from
// google.longrunning.Operations on the controller) whose google.rpc.ErrorInfo detail is decoded. Prints one
// JSON line per call.
// Usage: node client.js [--status-only] CONTROLLER LB REPLICA_AGENT TRAINER_AGENT (HOST:PORT each); mutual
// TLS from the PEM paths in ROLLMESH_TLS_CA / ROLLMESH_TLS_CERT / ROLLMESH_TLS_KEY, plaintext without them.
import { readFileSync } from "node:fs";
import { Code, ConnectError, createClient, type Transport } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { anyUnpack } from "@bufbuild/protobuf/wkt";
import { Operations } from "../../../../generated/ts/src/google/longrunning/operations_pb.js";
import { ErrorInfoSchema } from "../../../../generated/ts/src/google/rpc/error_details_pb.js";
import { ControllerService } from "../../../../generated/ts/src/rollmesh/controller/v1/controller_pb.js";
import { LoadBalancerService } from "../../../../generated/ts/src/rollmesh/loadbalancer/v1/loadbalancer_pb.js";
import { ReplicaAgentService } from "../../../../generated/ts/src/rollmesh/replica/v1/replica_agent_pb.js";
import { TrainerAgentService } from "../../../../generated/ts/src/rollmesh/trainer/v1/trainer_agent_pb.js";
import { EventType } from "../../../../generated/ts/src/rollmesh/controller/v1/events_pb.js";
import { OperationState, ScaleOperationSchema } from "../../../../generated/ts/src/rollmesh/controller/v1/scaling_pb.js";
import { TransportSecurity } from "../../../../generated/ts/src/rollmesh/common/v1/status_pb.js";

function transport(address: string): Transport {
  const { ROLLMESH_TLS_CA: ca, ROLLMESH_TLS_CERT: cert, ROLLMESH_TLS_KEY: key } = process.env;
  if (!ca || !cert || !key) {
    return createGrpcTransport({ baseUrl: `http://${address}` });
  }
  return createGrpcTransport({
    baseUrl: `https://${address}`,
    nodeOptions: { ca: readFileSync(ca), cert: readFileSync(cert), key: readFileSync(key) },
  });
}

function print(line: Record<string, unknown>): void {
  process.stdout.write(JSON.stringify(line) + "\n");
}

function failure(err: unknown): Record<string, unknown> {
  const error = ConnectError.from(err);
  const info = error.findDetails(ErrorInfoSchema)[0];
  return { code: Code[error.code], message: error.rawMessage, reason: info?.reason ?? null,
           domain: info?.domain ?? null, metadata: info?.metadata ?? null };
}

async function main(): Promise<void> {
  const args = process.argv.slice(2);
  const statusOnly = args[0] === "--status-only";
  const [controllerAt, lbAt, replicaAt, trainerAt] = statusOnly ? args.slice(1) : args;
  if (!controllerAt || !lbAt || !replicaAt || !trainerAt) {
    throw new Error("usage: client.js CONTROLLER LB REPLICA_AGENT TRAINER_AGENT");
  }
  const controller = createClient(ControllerService, transport(controllerAt));
  const operations = createClient(Operations, transport(controllerAt));
  const lb = createClient(LoadBalancerService, transport(lbAt));
  const replica = createClient(ReplicaAgentService, transport(replicaAt));
  const trainer = createClient(TrainerAgentService, transport(trainerAt));
  const options = { timeoutMs: 10000 };

  const statuses = await Promise.all([controller.getStatus({}, options), lb.getStatus({}, options),
                                      replica.getStatus({}, options), trainer.getStatus({}, options)]);
  for (const reply of statuses) {
    print({ call: "GetStatus", server: reply.status?.serverName ?? null, ready: reply.status?.ready ?? false,
            security: TransportSecurity[reply.status?.transportSecurity ?? TransportSecurity.UNSPECIFIED] });
  }
  if (statusOnly) return;

  const newest = (await controller.getStatus({}, options)).lastEventSequence;
  const types: string[] = [];
  for await (const message of controller.watchEvents({ includeHistory: true }, { timeoutMs: 15000 })) {
    const event = message.event;
    if (event === undefined) continue;
    types.push(EventType[event.type] ?? String(event.type));
    if (event.sequence >= newest) break;
  }
  print({ call: "WatchEvents", events: types.length, types: [...new Set(types)].sort() });

  const preview = await controller.scaleOut({ target: { case: "numReplicas", value: 1 }, dryRun: true }, options);
  const metadata = preview.metadata === undefined ? undefined : anyUnpack(preview.metadata, ScaleOperationSchema);
  print({ call: "ScaleOut", done: preview.done, name: preview.name, dryRun: metadata?.dryRun ?? null,
          state: metadata === undefined ? null : OperationState[metadata.state] });

  try {
    await operations.getOperation({ name: "operations/no-such-operation" }, options);
    print({ call: "GetOperation", error: null });
  } catch (err) {
    print({ call: "GetOperation", error: failure(err) });
  }

  const tokens: number[] = [];
  try {
    for await (const chunk of lb.generate({ requestId: "ts-client-1", promptTokenIds: [1, 2, 3],
                                            samplingParams: { maxTokens: 4, ignoreEos: true } },
                                          { timeoutMs: 30000 })) {
      tokens.push(...chunk.tokenIds);
    }
    print({ call: "Generate", tokens: tokens.length, error: null });
  } catch (err) {
    print({ call: "Generate", tokens: tokens.length, error: failure(err) });
  }

  const replicas = await replica.listReplicas({}, options);
  print({ call: "ListReplicas", replicas: replicas.replicas.map((r) => r.replicaId) });
}

main().catch((err: unknown) => {
  process.stderr.write(`${err instanceof Error ? err.stack ?? err.message : String(err)}\n`);
  process.exit(1);
});
