"""Inference engines for replica agents.

Use :func:`create_engine`; it imports torch only for the torch backend, so
importing this package (and running the synthetic engine) never loads torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import Engine, PauseMode
from .errors import (CacheInUse, DuplicateRequest, EngineDead, EngineError, EngineUnavailable, InvalidRequest,
                     WeightMismatch)
from .types import (
    EngineState,
    FinishReason,
    GenerationChunk,
    EngineRequest,
    LoadSnapshot,
    SamplingParams,
    TokenSegment,
    Usage,
    WeightSpec,
    validate_request,
    validate_sampling,
)

BACKENDS = ("torch", "synthetic", "vllm", "sglang")

__all__ = [
    "BACKENDS", "CacheInUse", "DuplicateRequest", "Engine", "EngineDead", "EngineError", "EngineState", "EngineUnavailable",
    "FinishReason", "GenerationChunk", "EngineRequest", "InvalidRequest", "LoadSnapshot", "PauseMode",
    "SamplingParams", "TokenSegment", "Usage", "WeightMismatch", "WeightSpec", "create_engine",
    "validate_request", "validate_sampling",
]


def _build_config(config_class: type[Any], backend: str, options: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidRequest(f"{backend} engine: unknown option(s) {unknown}; known options: {sorted(known)}")
    return config_class(**options)


def create_engine(backend: str, **options: Any) -> Engine:
    """Build (but do not start) an engine.

    ``backend`` is ``"torch"`` (options: :class:`torch_engine.TorchEngineConfig`)
    or ``"synthetic"`` (options: :class:`synthetic.SyntheticEngineConfig`, plus
    ``clock``/``sleep`` to inject time). Raises ``InvalidRequest`` for an
    unknown backend or option.
    """
    if backend == "torch":
        from .torch_engine import TorchEngine, TorchEngineConfig

        return TorchEngine(_build_config(TorchEngineConfig, backend, options))
    if backend == "synthetic":
        from .synthetic import SyntheticEngine, SyntheticEngineConfig

        clock = options.pop("clock", None)
        sleep = options.pop("sleep", None)
        return SyntheticEngine(_build_config(SyntheticEngineConfig, backend, options), clock=clock, sleep=sleep)
    # --- vllm backend (options: vllm_config.VllmEngineConfig, plus vllm_api to inject a fake vLLM) ---
    if backend == "vllm":
        from .vllm_config import VllmEngineConfig
        from .vllm_engine import VllmEngine

        api = options.pop("vllm_api", None)
        return VllmEngine(_build_config(VllmEngineConfig, backend, options), api=api)
    # --- end of vllm backend ---
    if backend == "sglang":   # options: sglang_config.SglangEngineConfig
        from .sglang_config import SglangEngineConfig
        from .sglang_engine import SglangEngine

        return SglangEngine(_build_config(SglangEngineConfig, backend, options))
    raise InvalidRequest(f"unknown engine backend {backend!r}; choose one of {list(BACKENDS)}")
