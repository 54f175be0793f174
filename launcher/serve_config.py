"""The config of ``rollmesh up --config FILE``: a local mesh that serves a model to agents.

One YAML (see ``examples/serve.yaml``) names the model, how many replicas run it and where the balancer's
OpenAI-compatible API listens; :func:`serve_server_configs` turns it into the balancer's, the controller's
and the replica agent's configs. The replicas register with the controller, which routes them on the
balancer, so scaling and the events work as in training. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from mesh_runtime.config import ConfigError, check_addresses, load_config, setting


@dataclasses.dataclass
class ServeConfig:
    """Everything ``rollmesh up --config`` needs."""

    model: str = setting("tiny-llama", path="existing", help="the model: a preset (tiny-llama, tiny-qwen2) or a "
                                                             "Hugging Face directory (relative to this file)")
    seed: int = setting(0, help="initialisation seed of a preset")
    served_model_name: str = setting("", help="the model's name in the API; empty = the preset or directory name")
    backend: Literal["torch", "synthetic"] = setting("torch", help="the engine the replicas run")
    replicas: int = setting(1, help="replicas of the model (one replica agent hosts them all)")
    http_listen: str = setting("127.0.0.1:0", help="HOST:PORT of the OpenAI-compatible API; port 0 picks one")
    http_api_token: str = setting("", secret=True, help="bearer token the API requires; empty = none (loopback "
                                                        "only)")
    engine_options: dict[str, Any] = setting(default_factory=dict, help="the engine's options (max_batch_size, "
                                                                        "...)")
    lease_ttl_s: float = setting(10.0, help="the replica agent's lease with the controller")
    verl: bool = setting(False, help="a verl trainer uses this fleet (examples/verl): `rollmesh up` prints verl's "
                                     "overrides, with a trainer-agent identity of the mesh's CA made for verl; "
                                     "verl's rank 0 serves each weight version from its own process")
    weights_dir: str = setting("", path=True, help="a directory a trainer outside rollmesh publishes weight "
                                                   "versions into (verl's rollmesh checkpoint engine with its "
                                                   "weights_dir): set, a trainer agent serves them to the "
                                                   "replicas (implies verl); empty = no trainer agent")

    def validate(self) -> None:
        if not 1 <= self.replicas <= 64:
            raise ConfigError("replicas", f"must be in 1..64, got {self.replicas}")
        check_addresses(self, listen_keys=("http_listen",))
        if self.lease_ttl_s <= 0:
            raise ConfigError("lease_ttl_s", f"must be > 0, got {self.lease_ttl_s}")


def load_serve_config(path: str | Path) -> ServeConfig:
    """Read and check ``path``; raises :class:`ConfigError` naming the key."""
    return load_config(ServeConfig, path)


def serve_server_configs(serve: ServeConfig, http_listen: str) -> dict[str, dict[str, Any]]:
    """The configs of ``lb``, ``controller`` and ``replica-agent``, and with ``weights_dir`` the
    ``trainer-agent``'s (addresses between them come from the launcher as environment overrides, once each
    server is up)."""
    model = str(Path(serve.model).resolve()) if Path(serve.model).exists() else serve.model
    configs: dict[str, dict[str, Any]] = {
        "lb": {"http_listen": http_listen, "model": model, "served_model_name": serve.served_model_name,
               "http_api_token": serve.http_api_token, "http_plaintext": True},
        "controller": {"lease_ttl_s": serve.lease_ttl_s, "load_report_interval_s": 1.0},
        "replica-agent": {"node_id": "local", "backend": serve.backend, "model": model, "model_seed": serve.seed,
                          "slots": serve.replicas, "engine_options": serve.engine_options,
                          "replicas": [{"replica_id": f"s{i}", "kind": "STANDALONE"} for i in range(serve.replicas)]},
    }
    if serve.weights_dir:
        configs["trainer-agent"] = {
            "model": model, "model_seed": serve.seed,
            "weight_source": "trainer_agent.published_weights:DirectoryWeightSource",
            "weight_source_options": {"directory": str(Path(serve.weights_dir).resolve())}}
    return configs
