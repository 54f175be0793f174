"""The gRPC/Protobuf contracts: lint-clean, documented, not breaking the frozen contract, generated fresh.

These tests guard the contracts under proto/ and the committed code under
generated/. The ones that run buf skip (not fail) when node_modules/.bin/buf
is missing, i.e. before `npm ci`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
BUF = ROOT / "node_modules" / ".bin" / "buf"
GENERATED = ROOT / "generated"
BASELINE = ROOT / "proto" / "baseline.binpb"

if importlib.util.find_spec("rollmesh") is None:  # not pip-installed: use the checkout
    sys.path.insert(0, str(GENERATED))

SERVER_SERVICES = {   # one per server process, each with GetStatus
    "rollmesh.controller.v1.ControllerService",
    "rollmesh.loadbalancer.v1.LoadBalancerService",
    "rollmesh.replica.v1.ReplicaAgentService",
    "rollmesh.trainer.v1.TrainerAgentService",
}
SERVICES = SERVER_SERVICES | {"rollmesh.weights.v1.WeightSourceService"}   # served by both agents besides theirs
STATUS_CODES = {
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
}
# Field names that denote a time or a duration: such fields must use
# google.protobuf.Timestamp / Duration, never a raw number.
TIME_NAME = re.compile(
    r"(^time$|^uptime$|^grace$|^waited$|_at$|_time$|_times$|timeout$|duration$|_ttl$|_p95$"
    r"|latency|_for$|_secs?$|_seconds$|_s$|_ms$|switch_cost$|_interval$)")
TIME_NAME_EXCEPTIONS = {"stream_interval"}  # a token count, not a time
WELL_KNOWN_TIME_TYPES = {".google.protobuf.Timestamp", ".google.protobuf.Duration"}
STATE_PACKAGE = "rollmesh.controller.state.v1"
"""The controller's durable documents, not an API: their times are seconds as JSON numbers, as every store written
before the schema holds them (controller/state_schema.py), so the wire's Timestamp/Duration rule does not apply."""

# FileDescriptorProto / DescriptorProto / EnumDescriptorProto /
# ServiceDescriptorProto field numbers used in SourceCodeInfo paths.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE, SERVICE_METHOD = 2, 2


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture(scope="module")
def buf() -> str:
    if not BUF.exists():
        pytest.skip(f"{BUF.relative_to(ROOT)} is missing; run `npm ci` to install buf")
    return str(BUF)


@pytest.fixture(scope="module")
def descriptor_set(buf: str) -> descriptor_pb2.FileDescriptorSet:
    """The rollmesh module's files with their comments (a buf image reads as a FileDescriptorSet)."""
    proc = subprocess.run([buf, "build", "proto", "--exclude-imports", "-o", "-#format=binpb"], cwd=ROOT,
                          capture_output=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    return descriptor_pb2.FileDescriptorSet.FromString(proc.stdout)


def generated_modules() -> list[str]:
    names = []
    for path in sorted((GENERATED / "rollmesh").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        names.append(".".join(path.relative_to(GENERATED).with_suffix("").parts))
    return names


def documented_elements(file: descriptor_pb2.FileDescriptorProto):
    """Yield (kind, full name, comment) for every element buf's COMMENTS rules cover."""
    comments = {tuple(loc.path): loc.leading_comments.strip()
                for loc in file.source_code_info.location}

    def enum(e, path, prefix):
        yield "enum", f"{prefix}.{e.name}", comments.get(path, "")
        for i, value in enumerate(e.value):
            yield "enum value", f"{prefix}.{value.name}", comments.get((*path, ENUM_VALUE, i), "")

    def message(m, path, prefix):
        name = f"{prefix}.{m.name}"
        yield "message", name, comments.get(path, "")
        for i, field in enumerate(m.field):
            yield "field", f"{name}.{field.name}", comments.get((*path, MESSAGE_FIELD, i), "")
        for i, oneof in enumerate(m.oneof_decl):
            members = [f for f in m.field if f.HasField("oneof_index") and f.oneof_index == i]
            if not all(f.proto3_optional for f in members):  # skip synthetic oneofs
                yield "oneof", f"{name}.{oneof.name}", comments.get((*path, MESSAGE_ONEOF, i), "")
        for i, nested in enumerate(m.nested_type):
            if not nested.options.map_entry:
                yield from message(nested, (*path, MESSAGE_NESTED, i), name)
        for i, nested_enum in enumerate(m.enum_type):
            yield from enum(nested_enum, (*path, MESSAGE_ENUM, i), name)

    for i, m in enumerate(file.message_type):
        yield from message(m, (FILE_MESSAGE, i), file.package)
    for i, e in enumerate(file.enum_type):
        yield from enum(e, (FILE_ENUM, i), file.package)
    for i, service in enumerate(file.service):
        name = f"{file.package}.{service.name}"
        yield "service", name, comments.get((FILE_SERVICE, i), "")
        for j, method in enumerate(service.method):
            yield "rpc", f"{name}.{method.name}", comments.get((FILE_SERVICE, i, SERVICE_METHOD, j), "")


@pytest.mark.timeout(60)
def test_buf_lint_is_clean(buf):
    proc = run(buf, "lint")
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_protos_are_buf_formatted(buf):
    proc = run(buf, "format", "proto", "--diff", "--exit-code")   # third_party/ stays Google's text
    assert proc.returncode == 0, f"run `{BUF.relative_to(ROOT)} format -w`:\n{proc.stdout}"


@pytest.mark.timeout(60)
def test_no_breaking_change_against_the_frozen_contract(buf):
    proc = run(buf, "breaking", "--against", str(BASELINE))
    assert proc.returncode == 0, (
        "the contracts break clients of the frozen contract (proto/baseline.binpb):\n" + proc.stdout + proc.stderr
        + "\nif the break is deliberate, run scripts/gen-protos --freeze and say so in the commit")


@pytest.mark.timeout(60)
def test_the_breaking_check_catches_a_changed_field(buf, tmp_path):
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    shutil.copytree(ROOT / "third_party", tmp_path / "third_party")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    changed = tmp_path / "proto" / "rollmesh" / "controller" / "v1" / "scheduling.proto"
    text = changed.read_text()
    assert "int64 expected_samples = 4;" in text
    changed.write_text(text.replace("int64 expected_samples = 4;", "string expected_samples = 4;"))
    proc = subprocess.run([buf, "breaking", "--against", str(BASELINE)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "expected_samples" in proc.stdout + proc.stderr


def test_error_details_are_part_of_the_workspace(buf):
    """Clients in other languages decode google.rpc.ErrorInfo from this workspace, offline."""
    proc = subprocess.run([buf, "build", "--path", "third_party/googleapis/google/rpc/error_details.proto", "-o",
                           "-#format=json"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    names = {m["name"] for f in json.loads(proc.stdout)["file"] for m in f.get("messageType", [])}
    assert {"ErrorInfo", "RetryInfo", "BadRequest"} <= names


@pytest.mark.timeout(180)
def test_generated_code_is_fresh(buf):
    proc = run(str(ROOT / "scripts" / "gen-protos"), "--check", timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_every_generated_module_imports():
    modules = generated_modules()
    assert modules, "generated/rollmesh is empty: run scripts/gen-protos"
    for name in modules:
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(GENERATED), (
            f"{name} was imported from {module.__file__}, not from this checkout's generated/")


@pytest.mark.timeout(60)
def test_every_service_has_stubs_and_get_status():
    found = {}
    for name in generated_modules():
        if name.endswith("_pb2"):
            for service in importlib.import_module(name).DESCRIPTOR.services_by_name.values():
                found[service.full_name] = (name, service)
    assert set(found) == SERVICES
    for full_name, (module_name, service) in found.items():
        if full_name in SERVER_SERVICES:   # the weight source's status is its agent's
            assert "GetStatus" in service.methods_by_name, f"{full_name} has no GetStatus RPC"
            get_status = service.methods_by_name["GetStatus"]
            assert get_status.output_type.fields_by_name["status"].message_type.full_name == (
                "rollmesh.common.v1.ServerStatus")
        grpc_module = importlib.import_module(f"{module_name}_grpc")
        for attr in (f"{service.name}Stub", f"{service.name}Servicer",
                     f"add_{service.name}Servicer_to_server"):
            assert hasattr(grpc_module, attr), f"{grpc_module.__name__} lacks {attr}"


@pytest.mark.timeout(60)
def test_every_element_has_a_comment(descriptor_set):
    missing = [f"{kind} {name}" for file in descriptor_set.file
               for kind, name, comment in documented_elements(file) if not comment]
    assert not missing, "undocumented elements:\n" + "\n".join(missing)


@pytest.mark.timeout(60)
def test_every_rpc_documents_its_errors_and_capability(descriptor_set):
    problems = []
    for file in descriptor_set.file:
        elements = list(documented_elements(file))
        capabilities = {}
        for kind, name, comment in elements:
            if kind == "service":
                listed = re.search(r"Capabilities \(see ServerStatus.capabilities\):([^.]*)\.",
                                   comment.replace("\n", " "))
                capabilities[name] = set(re.findall(r'"(\w+)"', listed.group(1))) if listed else set()
                if not capabilities[name]:
                    problems.append(f"{name}: the service comment lists no capabilities")
        for kind, name, comment in elements:
            if kind != "rpc":
                continue
            if "Errors:" not in comment:
                problems.append(f"{name}: no 'Errors:' section")
            for codes in re.findall(r"^- ([A-Z_, ]+):", comment, flags=re.MULTILINE):
                unknown = {c.strip() for c in codes.split(",")} - STATUS_CODES
                if unknown:
                    problems.append(f"{name}: {sorted(unknown)} are not gRPC status codes")
            if name.endswith(".GetStatus"):
                continue
            service = name.rsplit(".", 1)[0]
            capability = re.search(r"Capability:\s+(\w+)\.", comment)
            if capability is None:
                problems.append(f"{name}: no 'Capability: <name>.' line")
            elif capability.group(1) not in capabilities.get(service, set()):
                problems.append(f"{name}: capability {capability.group(1)!r} is not listed by "
                                f"{service}")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(60)
def test_times_and_durations_use_well_known_types(descriptor_set):
    raw = []

    def check(message: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        for field in message.field:
            if (TIME_NAME.search(field.name) and field.name not in TIME_NAME_EXCEPTIONS
                    and field.type_name not in WELL_KNOWN_TIME_TYPES):
                raw.append(f"{prefix}.{message.name}.{field.name}")
        for nested in message.nested_type:
            if not nested.options.map_entry:
                check(nested, f"{prefix}.{message.name}")

    for file in descriptor_set.file:
        if file.package == STATE_PACKAGE:
            continue
        for message in file.message_type:
            check(message, file.package)
    assert not raw, "use google.protobuf.Timestamp/Duration for:\n" + "\n".join(raw)
