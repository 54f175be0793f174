"""deploy/kubernetes: every rendered object validates against the Kubernetes schemas, and every server's
config, as its pod sees it (ConfigMap file plus the container's environment), passes the server's own
validation."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import kubernetes_validate
import pytest

from mesh_runtime import certs
from launcher.cli import SERVERS
from mesh_runtime.config import load_config
from tests.kustomize_subset import render

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
TARGETS = {"base": KUBE / "base", "cpu-demo": KUBE / "overlays" / "cpu-demo", "gpu": KUBE / "overlays" / "gpu"}
KUBERNETES_VERSION = "1.34.0"
NODE = {"NODE_NAME": "node-a", "NODE_IP": "10.0.0.9"}   # what the downward API gives a pod on node-a


def _containers(obj):
    return obj["spec"]["template"]["spec"]["containers"] if obj["kind"] in ("Deployment", "StatefulSet",
                                                                             "DaemonSet") else []


@pytest.fixture(scope="module")
def mounted(tmp_path_factory) -> dict[str, Path]:
    """Stand-ins for what the pods mount: the TLS Secrets' files and a model directory."""
    tls = tmp_path_factory.mktemp("tls")
    certs.create_ca(tls)
    for role, name in (("controller", "controller"), ("lb", "lb"), ("replica-agent", NODE["NODE_NAME"]),
                       ("trainer-agent", NODE["NODE_NAME"])):
        certs.create_cert(tls, role, name, hosts=["10.0.0.9"])
    models = tmp_path_factory.mktemp("models")
    (models / "policy").mkdir()
    (models / "policy" / "config.json").write_text("{}")
    return {"/etc/rollmesh/tls/": tls, "/models/": models}


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_every_object_validates_against_the_kubernetes_schemas(target):
    objects = render(TARGETS[target])
    assert {o["kind"] for o in objects} >= {"Namespace", "ConfigMap", "StatefulSet", "Deployment", "DaemonSet",
                                            "Service", "PodDisruptionBudget", "ServiceAccount"}
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _pod_env(container) -> dict[str, str]:
    """The container's environment as Kubernetes sets it on node-a (downward API, then $(VAR) references)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[item["name"]] = {"spec.nodeName": NODE["NODE_NAME"], "status.hostIP": NODE["NODE_IP"]}[field] \
            if field else _expand(item["value"], env)
    return env


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_each_servers_config_passes_its_validation_as_its_pod_sees_it(target, mounted, tmp_path):
    objects = render(TARGETS[target])
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rollmesh-config")
    seen = set()
    for obj in objects:
        for container in _containers(obj):
            args = container["args"]
            server, config_path = args[0], args[args.index("--config") + 1]
            assert server in SERVERS and config_path.startswith("/etc/rollmesh/config/")
            text = config_map["data"][Path(config_path).name]
            env = _pod_env(container)
            for mount, local in mounted.items():
                text = text.replace(mount, f"{local}/")
                env = {k: v.replace(mount, f"{local}/") for k, v in env.items()}
            (tmp_path / "config.yaml").write_text(text)
            module = importlib.import_module(SERVERS[server])
            config = load_config(module.CONFIG_CLASS, str(tmp_path / "config.yaml"), env=env,
                                 env_prefix=module.ENV_PREFIX)
            assert config.tls is not None and config.tls.cert and not config.insecure
            # the probes ask the health-only listener, the ports the pod declares are the ones it serves
            health_port = int(config.health_listen.rsplit(":", 1)[1])
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"]["port"] == health_port, (obj["metadata"]["name"], probe)
            declared = {p["containerPort"] for p in container["ports"]}
            assert {int(config.listen.rsplit(":", 1)[1]), health_port,
                    int(config.metrics_listen.rsplit(":", 1)[1])} == declared
            if getattr(config, "node_id", None) is not None and server in ("replica-agent", "trainer-agent"):
                assert config.node_id == NODE["NODE_NAME"]
            seen.add(server)
    assert seen == set(SERVERS)


def test_node_agents_run_on_the_host_network_and_the_balancer_has_a_disruption_budget():
    objects = render(TARGETS["cpu-demo"])
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    for name in ("rollmesh-replica-agent", "rollmesh-trainer"):
        pod = by_name[("DaemonSet", name)]["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert by_name[("PodDisruptionBudget", "rollmesh-lb")]["spec"]["selector"]["matchLabels"] == \
        by_name[("Deployment", "rollmesh-lb")]["spec"]["selector"]["matchLabels"]
    assert all(o["metadata"].get("namespace") == "rollmesh" for o in objects if o["kind"] != "Namespace")


def test_the_gpu_overlay_gives_the_engines_gpus_and_the_cuda_image():
    objects = render(TARGETS["gpu"])
    agent = next(o for o in objects if o["metadata"]["name"] == "rollmesh-replica-agent")
    container = _containers(agent)[0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8 and container["image"] == "rollmesh:cuda"
    assert "backend: vllm" in next(o for o in objects if o["kind"] == "ConfigMap")["data"]["replica-agent.yaml"]
