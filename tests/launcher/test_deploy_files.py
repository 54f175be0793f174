"""The deployment files in deploy/: every example config passes its server's own validation, every
systemd unit passes ``systemd-analyze verify`` and starts its server with flags the CLI accepts."""

from __future__ import annotations

import configparser
import importlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mesh_runtime import certs
from launcher.cli import SERVERS, build_parser
from mesh_runtime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "deploy" / "configs").glob("*/*.yaml"))
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
TLS_DIR = "/etc/rollmesh/tls/"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """The certificates the example configs name, made as docs/deploying.md's walkthrough makes them."""
    root = tmp_path_factory.mktemp("tls")
    certs.create_ca(root)
    for role, name, host in (("controller", "controller", "10.0.0.1"), ("lb", "lb", "10.0.0.1"),
                             ("replica-agent", "infer-1", "10.0.0.2"), ("replica-agent", "trainer-1", "10.0.0.3"),
                             ("trainer-agent", "trainer-1", "10.0.0.3")):
        certs.create_cert(root, role, name, hosts=[host])
    return root


def test_there_is_a_config_for_every_server_and_machine():
    assert {p.stem for p in CONFIGS} == set(SERVERS)
    assert {p.parent.name for p in CONFIGS} == {"ctl-host", "infer-1", "trainer-1"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_example_config_passes_its_servers_validation(path, pki, tmp_path):
    text = path.read_text()
    assert TLS_DIR in text   # the examples are secure by default
    local = tmp_path / path.name
    local.write_text(text.replace(TLS_DIR, f"{pki}/"))
    config = load_config(importlib.import_module(SERVERS[path.stem]).CONFIG_CLASS, str(local), env={})
    assert config.tls is not None and not config.insecure


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_each_systemd_unit_verifies_and_runs_a_known_server(unit, tmp_path):
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(unit.read_text())
    service = parser["Service"]
    assert service["Type"] == "notify" and service["Restart"] == "on-failure"
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/bin/rollmesh") and argv[1] in SERVERS and unit.name == f"rollmesh-{argv[1]}.service"
    args = build_parser().parse_args(argv[1:])   # the CLI accepts every flag the unit passes
    assert args.config == f"/etc/rollmesh/{argv[1]}.yaml" and args.log_format == "json"
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    rollmesh = Path(sys.executable).with_name("rollmesh")
    local = tmp_path / unit.name
    local.write_text(unit.read_text().replace(argv[0], str(rollmesh)).replace("User=rollmesh", "User=root")
                     .replace("Group=rollmesh", "Group=root"))
    done = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines() if str(local) in line or "Unknown" in line]
    assert done.returncode == 0 and not problems, done.stdout + done.stderr


DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"


def test_the_container_image_copies_files_that_exist_and_every_package():
    lines = DOCKERFILE.read_text().splitlines()
    copied = [shlex.split(line)[1:-1] for line in lines if line.startswith("COPY ") and "--from=" not in line]
    sources = [source for group in copied for source in group]
    assert sources and all((ROOT / source).exists() for source in sources), sources
    packaged = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
                   ["include"])
    # rollmesh = generated/rollmesh; rollmesh_verl (integrations/verl) is the verl plugin, installed into verl's
    # environment, not the servers' image
    packages = {p.rstrip("*") for p in packaged} - {"rollmesh", "rollmesh_verl"}
    assert packages <= {s.rstrip("/") for s in sources} and "generated/" in sources


def test_the_container_image_installs_as_the_install_script_does():
    install = (ROOT / "scripts" / "install").read_text()
    image = DOCKERFILE.read_text()
    # the same constraints file and the same extras, less the ones only the suite uses (dev: test tools,
    # docs: the site builder)
    # the script's default environment: venv=.venv constraints=constraints/cpu.txt extras="..."
    default = re.search(r'^venv=\.venv constraints=(\S+) extras="([a-z,]+)"$', install, re.MULTILINE)
    assert default is not None and default.group(1) == "constraints/cpu.txt" and "-c constraints/cpu.txt" in image
    assert '-c "$constraints" -e ".[$extras]"' in install
    script_extras = set(default.group(2).split(","))
    image_extras = {tuple(m.split(",")) for m in re.findall(r'"\.\[([a-z,]+)\]"', image)}
    assert image_extras == {tuple(sorted(script_extras - {"dev", "docs"}))}
