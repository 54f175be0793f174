"""Configuration of the SGLang backend: attach to a running server, or launch one.

:class:`SglangEngineConfig` holds the options ``create_engine("sglang", ...)``
accepts. With ``url`` set the engine drives an SGLang server that is already
running (the reference's "external" engines); without it the engine launches
``python -m sglang.launch_server`` itself with the flags the backend relies on
(:meth:`SglangEngineConfig.launch_command`) and stops it on close.

Targeted release: SGLang 0.5.x (its HTTP API: ``/generate``,
``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/release_memory_occupation``, ``/resume_memory_occupation``,
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/flush_cache``, ``/metrics``, ``/health``, ``/get_server_info``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

from .chunking import DEFAULT_FLUSH_INTERVAL_S
from .errors import InvalidRequest

WEIGHT_BACKENDS = ("nccl", "gloo")
_OWN_FLAGS = frozenset({"--model-path", "--host", "--port", "--skip-tokenizer-init", "--enable-memory-saver",
                        "--tp-size", "--mem-fraction-static", "--random-seed", "--enable-metrics",
                        "--enable-weights-cpu-backup"})


def model_limits(model_path: str) -> tuple[int | None, int | None]:
    """``(vocab_size, max_position_embeddings)`` from a Hugging Face ``config.json``; ``None`` where absent."""
    config_file = Path(model_path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None, None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab, context = text.get("vocab_size"), text.get("max_position_embeddings")
    return (vocab if isinstance(vocab, int) else None), (context if isinstance(context, int) else None)


def model_dtype(model_path: str) -> str | None:
    """The checkpoint's ``torch_dtype`` (or ``dtype``) from its ``config.json``, if it names one."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("torch_dtype") or config.get("dtype")
    return str(dtype).removeprefix("torch.") if isinstance(dtype, str) else None


@dataclasses.dataclass
class SglangEngineConfig:
    """Options of :class:`SglangEngine` (the keys ``create_engine("sglang", ...)`` accepts)."""

    model_path: str = ""
    """Local Hugging Face model directory (config.json + *.safetensors): the server loads it when launched, and
    the agent reads the weight names and shapes trainers must send from its safetensors headers."""
    url: str = ""
    """``http://HOST:PORT`` of a running SGLang server to attach to; empty = launch one."""
    host: str = "127.0.0.1"
    """Address a launched server listens on (and the agent reaches it at)."""
    port: int = 0
    """Port of a launched server; 0 = a free port picked at launch."""
    server_command: list[str] = dataclasses.field(default_factory=lambda: [sys.executable, "-m",
                                                                            "sglang.launch_server"])
    """Program that starts the server; the backend appends its own flags and ``server_args``."""
    server_args: list[str] = dataclasses.field(default_factory=list)
    """Further ``launch_server`` flags (e.g. ``["--context-length", "4096"]``)."""
    startup_timeout_s: float = 600.0
    """How long a launched (or attached) server may take to answer ``/health``."""
    request_timeout_s: float = 60.0
    """Deadline of each control call (abort, pause, memory, weight updates) to the server."""
    seed: int = 0
    """``--random-seed`` of a launched server."""
    memory_fraction: float = 0.9
    """``--mem-fraction-static`` of a launched server."""
    tensor_parallel_size: int = 1
    """``--tp-size`` of a launched server; an attached one reports its own (``tp_size``)."""
    weights_cpu_backup: bool = False
    """Whether the server keeps a host copy of released weights (``--enable-weights-cpu-backup``): needed for
    a level-1 sleep, after which the weights return as they were."""
    weight_backend: str = "nccl"
    """Process-group backend of the weight update group shared with the server (``nccl`` on GPUs; ``gloo``
    where the server runs on CPU)."""
    weight_group_port: int = 0
    """Port of the rendezvous store this agent hosts for the weight update group; 0 = a free port."""
    weight_group_host: str = "127.0.0.1"
    """Address of that store as the server reaches it (the agent's address on the server's network)."""
    recompute_kv_after_weight_update: bool = True
    """``flush_cache`` of a weight update: True drops the KV and prefix cache so nothing computed with the
    old weights is reused; False keeps in-flight requests' KV (new prefixes still use the new weights)."""
    metrics_interval_s: float = 1.0
    """How often the server's ``/metrics`` are read for load reports."""
    replica_id: str = ""
    """Recorded in every token segment this engine produces."""
    node_id: str = ""
    """Recorded in every token segment this engine produces."""
    stream_interval: int = 16
    """Most new tokens per streamed chunk (see :mod:`.chunking`)."""
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    """Longest a generated token waits before it is streamed; 0: by ``stream_interval`` only."""
    weight_version: int = 0
    """Version reported for the weights the server starts with."""
    keep_host_weights: bool = True
    """Keep references to the tensors given to ``load_weights`` so ``named_weights`` can export them."""

    def validate(self) -> None:
        if not self.model_path or not (Path(self.model_path) / "config.json").is_file():
            raise InvalidRequest(f"sglang engine: model_path {self.model_path[:120]!r} is not a directory "
                                 "with a config.json")
        if self.url:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise InvalidRequest(f"sglang engine: url must look like http://HOST:PORT, got {self.url[:80]!r}")
        elif not self.server_command or not all(isinstance(a, str) and a for a in self.server_command):
            raise InvalidRequest("sglang engine: server_command must be a non-empty list of strings")
        if not 0 <= self.port <= 65535 or not 0 <= self.weight_group_port <= 65535:
            raise InvalidRequest("sglang engine: port and weight_group_port must be in 0..65535")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise InvalidRequest(f"sglang engine: memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.weight_backend not in WEIGHT_BACKENDS:
            raise InvalidRequest(f"sglang engine: weight_backend must be one of {list(WEIGHT_BACKENDS)}, "
                                 f"got {self.weight_backend[:20]!r}")
        for name in ("tensor_parallel_size", "stream_interval"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"sglang engine: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("startup_timeout_s", "request_timeout_s", "metrics_interval_s"):
            if not getattr(self, name) > 0:
                raise InvalidRequest(f"sglang engine: {name} must be > 0, got {getattr(self, name)}")
        clash = sorted({a.split("=", 1)[0] for a in self.server_args} & _OWN_FLAGS)
        if clash:
            raise InvalidRequest(f"sglang engine: server_args may not set {clash}; the backend sets them itself")

    def launch_command(self, port: int) -> list[str]:
        """The command line of a launched server: skip the tokenizer (rollmesh sends token ids), enable the
        memory saver (sleep/wake) and the metrics endpoint (load reports)."""
        command = [*self.server_command, "--model-path", self.model_path, "--host", self.host, "--port", str(port),
                   "--skip-tokenizer-init", "--enable-memory-saver", "--enable-metrics",
                   "--tp-size", str(self.tensor_parallel_size), "--mem-fraction-static", str(self.memory_fraction),
                   "--random-seed", str(self.seed)]
        if self.weights_cpu_backup:
            command.append("--enable-weights-cpu-backup")
        return command + list(self.server_args)
