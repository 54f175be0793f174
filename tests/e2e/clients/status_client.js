// Calls GetStatus on rollmesh servers from Node, loading the contracts from proto/
// with @grpc/proto-loader (no generated code): proves other languages can call the mesh.
// Usage: node status_client.js SERVICE=HOST:PORT [SERVICE=HOST:PORT ...]
// SERVICE is a full service name such as rollmesh.loadbalancer.v1.LoadBalancerService.
// Prints one JSON line per server: {"service", "address", "status"} or {"service", "error"}.
// With ROLLMESH_TLS_CA, ROLLMESH_TLS_CERT and ROLLMESH_TLS_KEY (PEM paths) it speaks mutual TLS.
"use strict";
const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const root = path.resolve(__dirname, "..", "..", "..", "proto");
// google/api/field_behavior.proto (and google/rpc's error details) come with the buf workspace's second module
const googleapis = path.resolve(__dirname, "..", "..", "..", "third_party", "googleapis");
const files = [
  "rollmesh/controller/v1/controller.proto",
  "rollmesh/loadbalancer/v1/loadbalancer.proto",
  "rollmesh/replica/v1/replica_agent.proto",
  "rollmesh/trainer/v1/trainer_agent.proto",
  "rollmesh/weights/v1/weight_source.proto",
];
const definition = protoLoader.loadSync(files, {
  includeDirs: [root, googleapis], keepCase: false, longs: String, enums: String, defaults: true, oneofs: true,
});
const api = grpc.loadPackageDefinition(definition);

function lookup(fullName) {
  return fullName.split(".").reduce((node, part) => node && node[part], api);
}

function credentials() {
  const { ROLLMESH_TLS_CA: ca, ROLLMESH_TLS_CERT: cert, ROLLMESH_TLS_KEY: key } = process.env;
  if (!ca && !cert && !key) return grpc.credentials.createInsecure();
  return grpc.credentials.createSsl(fs.readFileSync(ca), fs.readFileSync(key), fs.readFileSync(cert));
}

function callStatus(service, address) {
  return new Promise((resolve) => {
    const Client = lookup(service);
    if (!Client) return resolve({ service, address, error: `unknown service ${service}` });
    const client = new Client(address, credentials());
    const deadline = new Date(Date.now() + 10000);
    client.GetStatus({}, { deadline }, (err, response) => {
      client.close();
      if (err) resolve({ service, address, error: `${err.code} ${err.details}` });
      else resolve({ service, address, status: response.status });
    });
  });
}

(async () => {
  const targets = process.argv.slice(2).map((arg) => arg.split("="));
  const results = await Promise.all(targets.map(([service, address]) => callStatus(service, address)));
  for (const result of results) console.log(JSON.stringify(result));
  process.exit(results.every((r) => !r.error) ? 0 : 1);
})();
