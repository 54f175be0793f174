"""Configuration of the vLLM backend and the seam to the ``vllm`` package.

:class:`VllmEngineConfig` holds the options ``create_engine("vllm", ...)``
accepts and turns them into ``vllm.AsyncEngineArgs`` keyword arguments.
:class:`VllmApi` bundles the three things the engine takes from vllm (a way
to build the async engine, ``SamplingParams`` and the DELTA output kind);
:func:`load_vllm_api` imports them, and tests pass fakes instead, so nothing
here imports vllm at module import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh_runtime.reasons import Reason
from .chunking import DEFAULT_FLUSH_INTERVAL_S
from .errors import EngineDead, InvalidRequest
from .vllm_worker import EXTENSION_CLASS

NO_VLLM_MESSAGE = "the vllm backend needs a GPU machine with vllm installed (pip install vllm)"
_OWN_ENGINE_ARGS = frozenset({"model", "enable_sleep_mode", "worker_extension_cls"})


@dataclasses.dataclass
class VllmEngineConfig:
    """Options of :class:`VllmEngine` (the keys ``create_engine("vllm", ...)`` accepts)."""

    model_path: str = ""
    """Local Hugging Face model directory (config.json + *.safetensors); nothing is downloaded."""
    dtype: str = "auto"
    """vLLM ``dtype`` argument (``"auto"``, ``"bfloat16"``...); loaded weights must match the served dtype."""
    seed: int = 0
    """vLLM ``seed`` argument (engine-wide default sampling seed)."""
    memory_fraction: float = 0.9
    """Share of accelerator memory vLLM may use for weights and KV cache (``gpu_memory_utilization``)."""
    tensor_parallel_size: int = 1
    """GPUs the model is sharded over (vLLM ``tensor_parallel_size``)."""
    max_model_len: int | None = None
    """Context length limit; default: the model's."""
    max_batch_size: int = 256
    """Most requests decoded together (vLLM ``max_num_seqs``)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decode)."""
    replica_id: str = ""
    """Recorded in every token segment this engine produces."""
    node_id: str = ""
    """Recorded in every token segment this engine produces."""
    stream_interval: int = 16
    """Most new tokens per streamed chunk (see :mod:`.chunking`)."""
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    """Longest a generated token waits before it is streamed; 0: by ``stream_interval`` only."""
    weight_version: int = 0
    """Version reported for the checkpoint's weights."""
    recompute_kv_after_weight_update: bool = True
    """``clear_cache`` of the keep-mode pause around a weight update: True drops
    the KV cache so in-flight requests recompute it under the new weights;
    False lets them continue on KV computed by the old weights."""
    weight_bucket_bytes: int = 512 * 1024 * 1024
    """Most tensor bytes sent to the workers in one ``collective_rpc`` call."""
    weight_loader: str = "auto"
    """How workers take a weight update: ``load_weights`` (the model's own loader, in place), ``reload_weights``
    (the model runner's reload: restore, load, re-process; needed by quantized models) or ``auto``
    (``reload_weights`` when the served model is quantized)."""
    keep_host_weights: bool = True
    """Keep references to the tensors given to ``load_weights`` so that
    ``named_weights`` can export what is served (up to one model of host
    memory). When False, ``named_weights`` works only until the first update."""
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further ``AsyncEngineArgs`` fields (e.g. ``{"enable_prefix_caching": True}``)."""

    def validate(self) -> None:
        if not self.model_path or not (Path(self.model_path) / "config.json").is_file():
            raise InvalidRequest(f"vllm engine: model_path {self.model_path!r} is not a directory with a config.json")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise InvalidRequest(f"vllm engine: memory_fraction must be in (0, 1], got {self.memory_fraction}")
        for name in ("tensor_parallel_size", "max_batch_size", "stream_interval", "weight_bucket_bytes"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"vllm engine: {name} must be >= 1, got {getattr(self, name)}")
        if self.weight_loader not in ("auto", "load_weights", "reload_weights"):
            raise InvalidRequest(f"vllm engine: weight_loader must be auto, load_weights or reload_weights, "
                                 f"got {str(self.weight_loader)[:40]!r}")
        clash = sorted(_OWN_ENGINE_ARGS & set(self.engine_args))
        if clash:
            raise InvalidRequest(f"vllm engine: engine_args may not set {clash}; the engine sets them itself")

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``."""
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "dtype": self.dtype,
            "seed": self.seed,
            "gpu_memory_utilization": self.memory_fraction,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_num_seqs": self.max_batch_size,
            "enforce_eager": self.enforce_eager,
            "enable_sleep_mode": True,
            "worker_extension_cls": EXTENSION_CLASS,
        }
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        kwargs.update(self.engine_args)
        return kwargs


@dataclasses.dataclass(frozen=True)
class VllmApi:
    """The pieces of the ``vllm`` package the engine uses; tests inject fakes."""

    create_client: Callable[[dict[str, Any]], Any]
    """Builds the started async engine from ``AsyncEngineArgs`` keyword
    arguments; runs in a worker thread, off the event loop (may return an
    awaitable, which is then awaited on the loop)."""
    sampling_params: Callable[..., Any]
    """``vllm.SamplingParams``."""
    delta_output_kind: Any
    """``vllm.sampling_params.RequestOutputKind.DELTA``."""


def load_vllm_api() -> VllmApi:
    """Import vLLM. Raises :class:`EngineDead` where it is not installed."""
    try:
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise EngineDead(f"{NO_VLLM_MESSAGE}: {exc}", reason=Reason.VLLM_UNAVAILABLE) from exc

    def create_client(kwargs: dict[str, Any]) -> Any:
        # Called in a worker thread (engine start-up takes minutes on a GPU): with no running loop there,
        # AsyncLLM defers its output handler to the first request, which runs on the event loop
        # (vllm/v1/engine/async_llm.py).
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    return VllmApi(create_client, SamplingParams, RequestOutputKind.DELTA)
