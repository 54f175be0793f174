"""Where the rollmesh fleet is, read from verl's own config: ``checkpoint_engine.engine_kwargs.rollmesh``.

verl hands a checkpoint-engine backend its ``engine_kwargs[backend]`` as keyword arguments on the trainer's workers,
and every rollout replica holds the whole rollout config; so one block of verl's config reaches both sides::

    actor_rollout_ref.rollout.name=rollmesh
    actor_rollout_ref.rollout.checkpoint_engine.backend=rollmesh
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollmesh.controller=ctl.example:50051

Every key is checked when verl builds a replica or a checkpoint engine, before anything is started; a problem names
the key under its full verl path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mesh_runtime.config import ConfigError, TlsConfig, build_config, check_addresses, setting

SECTION = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollmesh"
"""Where the settings live in verl's config (named in every error)."""


@dataclasses.dataclass
class MeshSettings:
    """How verl's processes reach the rollmesh fleet."""

    controller: str = setting(help="HOST:PORT of the controller (HOST:PORT,HOST:PORT,... for several on one etcd "
                                   "store): the fleet's registry, and the weight sync's coordinator")
    load_balancer: str = setting("", help="HOST:PORT[,HOST:PORT...] of the load balancers verl's requests go "
                                          "through; empty = the balancers registered with the controller")
    tls: TlsConfig | None = setting(None, help="this process's mesh identity (a trainer-agent certificate: it "
                                               "generates and commits weight versions); unset = plaintext, "
                                               "loopback meshes only")
    source_listen: str = setting("127.0.0.1:0", help="HOST:PORT the trainer's rank 0 serves its weights on "
                                                     "(rollmesh's WeightSourceService, in verl's own process): "
                                                     "each version is handed over there and the controller "
                                                     "broadcasts it from there; port 0 = a free port; a "
                                                     "wildcard HOST advertises the node's address as Ray knows "
                                                     "it. Unused with weights_dir")
    source_threads: int = setting(0, help="torch threads of rank 0's weight server for its CPU work (checksums, "
                                          "the delta from the version the fleet holds), in its own threads only "
                                          "(verl's workers run torch on one); 0 = the CPUs the process may use")
    served_dtype: str = setting("", help="dtype the replicas serve (float32, bfloat16, float16) when verl's "
                                         "trainer hands over floating-point weights in another; empty = as "
                                         "handed over")
    weights_dir: str = setting("", help="instead of serving from verl's process: a directory a trainer agent's "
                                        "DirectoryWeightSource reads (weight_source_options.directory), where "
                                        "rank 0 writes each version before asking the controller to broadcast "
                                        "it (one more copy per version, through the file); empty = serve from "
                                        "rank 0 (source_listen)")
    call_timeout_s: float = setting(30.0, help="deadline of one control call (status, listing, abort)")
    generate_timeout_s: float = setting(600.0, help="deadline of one generation through the balancer")
    sync_timeout_s: float = setting(600.0, help="deadline of one weight sync (SyncWeights) to the fleet")
    stream_interval: int = setting(16, help="tokens per streamed chunk: what an abort returns is what was "
                                            "streamed, so smaller chunks lose fewer tokens to an abort")
    check_model: bool = setting(True, help="at start, refuse a fleet whose model differs from verl's "
                                           "(actor_rollout_ref.model.path): the served config and tokenizer "
                                           "must equal verl's")

    def validate(self) -> None:
        if not self.controller:
            raise ConfigError("controller", "is required: HOST:PORT of the rollmesh controller")
        check_addresses(self, listen_keys=("source_listen",), list_keys=("controller", "load_balancer"))
        if self.source_threads < 0:
            raise ConfigError("source_threads", f"must be >= 0 (0 = the CPUs the process may use), got "
                                                f"{self.source_threads}")
        if self.served_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ConfigError("served_dtype", f"must be float32, bfloat16, float16 or empty, got "
                                              f"{self.served_dtype[:40]!r}")
        for key in ("call_timeout_s", "generate_timeout_s", "sync_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}")
        if self.stream_interval < 1:
            raise ConfigError("stream_interval", f"must be >= 1, got {self.stream_interval}")


def mesh_settings(engine_kwargs: Mapping[str, Any] | None) -> MeshSettings:
    """The settings from ``engine_kwargs`` (the ``rollmesh`` block itself); a :class:`ConfigError` names the key
    under :data:`SECTION`."""
    if engine_kwargs is None or not hasattr(engine_kwargs, "items"):
        raise ConfigError(SECTION, "is missing: set at least "
                                   f"+{SECTION}.controller=HOST:PORT (the rollmesh controller)")
    return build_config(MeshSettings, {str(k): _plain(v) for k, v in engine_kwargs.items()}, SECTION)


def from_rollout_config(rollout_config: Any) -> MeshSettings:
    """The settings from verl's rollout config (a dataclass or an OmegaConf node)."""
    engine = rollout_config.checkpoint_engine
    backend = engine.backend
    if backend != "rollmesh":
        raise ConfigError("actor_rollout_ref.rollout.checkpoint_engine.backend",
                          f"must be 'rollmesh' with actor_rollout_ref.rollout.name=rollmesh, got {backend!r}: "
                          "rollmesh replicas take weights from rollmesh's own broadcast only")
    kwargs = engine.engine_kwargs
    return mesh_settings(kwargs.get("rollmesh") if kwargs is not None else None)


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain dicts and lists (config checks read plain values)."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value
