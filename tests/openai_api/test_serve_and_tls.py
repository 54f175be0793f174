"""``rollmesh up --config`` serving a model to the openai client (docs/openai-api.md's own example), and the HTTP
API behind mutual TLS: a client certificate of a caller role gets in, another role gets 403, none gets no
connection; changing the fleet takes a trainer agent's or an operator's certificate."""

from __future__ import annotations

import queue
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from launcher.pki import LocalPki
from tests.processes import clean_env, free_port, running_server

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


def _readme_example() -> str:
    section = (ROOT / "docs" / "openai-api.md").read_text()
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def _line(proc: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    """The rest of the first line ``proc`` prints that starts with ``prefix``."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.decode()) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise AssertionError(f"no line starting {prefix!r} within {timeout_s} s; printed:\n{''.join(seen)}")


def test_up_serves_the_model_to_the_readmes_openai_example(tmp_path):
    serve = (ROOT / "examples" / "serve.yaml").read_text().replace("127.0.0.1:8000", "127.0.0.1:0")
    (tmp_path / "serve.yaml").write_text(serve)
    # as the docs run it: from the directory it is in, with the default run directory (runs/up, relative)
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--config", "serve.yaml"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=clean_env(), cwd=tmp_path,
                            start_new_session=True)
    try:
        base = _line(proc, "openai: ", 150)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base)
        example = _readme_example().replace("http://127.0.0.1:8000/v1", base)
        done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=120,
                              env=clean_env())
        assert done.returncode == 0, done.stderr[-2000:]
        printed = done.stdout.splitlines()
        assert "'weight_version': 0" in printed[-1] and "'num_tokens': 8" in printed[-1]
        assert [m.id for m in openai.OpenAI(base_url=base, api_key="x").models.list().data] == ["tiny-llama"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    assert (tmp_path / "runs" / "up" / "lb.yaml").is_file() and (tmp_path / "runs" / "up" / "pki" / "ca.pem").is_file()


def test_up_refuses_a_bad_serve_config(tmp_path):
    (tmp_path / "serve.yaml").write_text("model: tiny-llama\nreplicas: 0\n")
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "up", "--config", str(tmp_path / "serve.yaml"),
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert done.returncode == 2 and "replicas" in done.stderr and "must be in 1..64" in done.stderr


def test_the_http_api_behind_mutual_tls(tmp_path):
    pki = LocalPki(tmp_path / "pki")
    http = free_port()
    (tmp_path / "lb.yaml").write_text(f"http_listen: 127.0.0.1:{http}\nmodel: tiny-llama\n")
    env = clean_env(**pki.env("ROLLMESH_LB", "lb", "lb"))
    with running_server("lb", ["--config", str(tmp_path / "lb.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp_path / "lb.log", env=env):
        base = f"https://127.0.0.1:{http}/v1"

        def client(role: str | None) -> openai.OpenAI:
            context = ssl.create_default_context(cafile=str(tmp_path / "pki" / "ca.pem"))
            if role is not None:
                section = pki.section(role, "tester")
                context.load_cert_chain(section["cert"], section["key"])
            return openai.OpenAI(base_url=base, api_key="x", max_retries=0,
                                 http_client=httpx.Client(verify=context, timeout=10))

        assert [m.id for m in client("client").models.list().data] == ["tiny-llama"]
        assert client("operator").models.list().data
        with pytest.raises(openai.PermissionDeniedError) as err:
            client("replica-agent").models.list()
        assert "replica-agent" in err.value.body["message"]
        with pytest.raises(openai.APIConnectionError):
            client(None).models.list()
        with pytest.raises(openai.APIConnectionError):   # plain HTTP to the TLS listener
            openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0).models.list()

        # changing the fleet (SGLang's worker API, SMG's RL engine calls) takes a trainer agent or an operator
        def raw(role: str) -> httpx.Client:
            context = ssl.create_default_context(cafile=str(tmp_path / "pki" / "ca.pem"))
            section = pki.section(role, "tester")
            context.load_cert_chain(section["cert"], section["key"])
            return httpx.Client(base_url=f"https://127.0.0.1:{http}", verify=context, timeout=10)

        with raw("client") as client_role, raw("operator") as operator:
            pause = "/v1/rl/engine/pause_generation?selector=all"
            refused = client_role.post(pause, json={})
            assert refused.status_code == 403 and refused.json()["error"] == "permission_denied"
            assert "operator" in refused.json()["message"]
            assert client_role.post("/workers", json={"url": "http://127.0.0.1:9"}).status_code == 403
            assert client_role.get("/v1/rl/workers").json() == {"workers": []}   # reading is a client's
            assert operator.post(pause, json={}).json()["error"] == "no_workers_matched"   # past the gate
            assert operator.post("/workers", json={"url": "http://127.0.0.1:9"}).status_code == 503
