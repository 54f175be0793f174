"""``TorchEngine``: a Hugging Face causal LM served with torch + transformers.

The model comes from a local Hugging Face directory (config.json +
safetensors; nothing is ever downloaded) or from a built-in preset
(:mod:`presets`). Requests are continuously batched by
:class:`~.core.SteppedEngine`; each step runs on a dedicated single-thread
executor (:class:`~.torch_batch.BatchRunner`), so the event loop stays
responsive while torch computes. Weight swaps and (off)loading run on the
same thread, between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from .chunking import DEFAULT_FLUSH_INTERVAL_S
from .core import SteppedEngine
from .errors import EngineError, EngineUnavailable, InvalidRequest
from modeling.presets import PRESETS, build_preset_model
from modeling.versions import check_supported
from .request_state import StepBatch
from .torch_batch import BatchRunner
from .torch_prefix import PrefixCache
from .torch_weights import ModelWeights
from .types import WeightSpec

log = logging.getLogger(__name__)
_Part = TypeVar("_Part")
R = TypeVar("R")

CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536


@dataclasses.dataclass
class TorchEngineConfig:
    """Options of :class:`TorchEngine` (the keys ``create_engine("torch", ...)`` accepts)."""

    model_path: str | None = None
    """Local Hugging Face model directory (config.json + *.safetensors). Exclusive with ``preset``."""
    preset: str | None = None
    """Name of a built-in random model (see ``presets.PRESETS``). Exclusive with ``model_path``."""
    seed: int = 0
    """Initialisation seed of a preset: same preset + seed gives identical weights everywhere."""
    device: str = "auto"
    """``"cpu"``, ``"cuda"``, ``"cuda:N"``, or ``"auto"`` (CUDA when available)."""
    dtype: str = "auto"
    """Parameter dtype name; ``"auto"`` is float32 on CPU and bfloat16 on CUDA."""
    replica_id: str = ""
    """Recorded in every token segment this engine produces."""
    node_id: str = ""
    """Recorded in every token segment this engine produces."""
    stream_interval: int = 16
    """Most new tokens per streamed chunk (see :mod:`.chunking`)."""
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    """Longest a generated token waits before it is streamed; 0: by ``stream_interval`` only."""
    max_batch_size: int = 64
    """Most requests decoded together; later ones wait."""
    max_total_tokens: int | None = None
    """KV capacity in tokens (prompt + max_tokens is reserved per running request).
    Default: sized from ``memory_fraction`` on CUDA, 65536 on CPU."""
    memory_fraction: float = 0.9
    """Share of accelerator memory the engine may use (weights + KV). Recorded only on CPU."""
    num_threads: int | None = None
    """torch intra-op threads; default: the CPUs this process may run on."""
    attn_implementation: str = "sdpa"
    """transformers attention backend (``"sdpa"`` or ``"eager"``)."""
    weight_version: int = 0
    """Version reported for the initial weights."""
    prefix_cache_tokens: int = 32768
    """Tokens of KV the prefix cache keeps for reuse (prompts after their prefill, finished sequences, a
    session's turns; see :mod:`.torch_prefix`); 0 turns it off."""
    prefix_block_size: int = 16
    """Granularity of the prefix cache in tokens."""
    session_idle_timeout_s: float = 600.0
    """A cached sequence unused this long is dropped (a session that never sent CloseSession)."""
    delta_in_place: bool = True
    """Apply a weight delta where the weights lie (checked, undone if it fails); False: rebuild the target in a
    packed copy of the weights and load it, as engines that cannot lend their weights do (one more model of
    memory and two more passes over it per sync)."""

    def validate(self) -> None:
        if (self.model_path is None) == (self.preset is None):
            raise InvalidRequest("torch engine: set exactly one of model_path and preset")
        if self.preset is not None and self.preset not in PRESETS:
            raise InvalidRequest(f"torch engine: unknown preset {self.preset!r}; known: {sorted(PRESETS)}")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise InvalidRequest(f"torch engine: {self.model_path!r} is not a directory with a config.json")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise InvalidRequest(f"torch engine: memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.prefix_cache_tokens and self.prefix_cache_tokens < self.prefix_block_size:
            raise InvalidRequest(f"torch engine: prefix_cache_tokens must be 0 (off) or >= prefix_block_size "
                                 f"({self.prefix_block_size}), got {self.prefix_cache_tokens}")
        if self.prefix_block_size < 1 or not self.session_idle_timeout_s > 0:
            raise InvalidRequest("torch engine: prefix_block_size must be >= 1 and session_idle_timeout_s > 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidRequest(f"torch engine: num_threads must be >= 1, got {self.num_threads}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise InvalidRequest(f"torch engine: max_total_tokens must be >= 1, got {self.max_total_tokens}")


class TorchEngine(SteppedEngine):
    """Continuous-batching engine over a transformers causal LM."""

    def __init__(self, config: TorchEngineConfig) -> None:
        config.validate()
        super().__init__(
            replica_id=config.replica_id,
            node_id=config.node_id,
            stream_interval=config.stream_interval,
            flush_interval_s=config.flush_interval_s,
            max_batch_size=config.max_batch_size,
            max_total_tokens=config.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS,
        )
        self.config = config
        self.memory_fraction = config.memory_fraction
        self._weight_version = config.weight_version
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, self.device)
        self.model: torch.nn.Module | None = None
        self._weights: ModelWeights | None = None
        self._spec: list[WeightSpec] = []
        self._runner: BatchRunner | None = None
        self._eos: frozenset[int] = frozenset()
        self._vocab_size: int | None = None
        self._max_model_len: int | None = None

    async def _in_worker(self, fn: Callable[..., R], *args: Any) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------ model load
    async def _load_model(self) -> None:
        await self._in_worker(self._load_sync)

    def _load_sync(self) -> None:
        check_supported()   # an unsupported torch or transformers is refused before any model is built
        threads = self.config.num_threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        if self.config.preset is not None:
            model = build_preset_model(
                self.config.preset, self.config.seed, self.dtype, self.config.attn_implementation
            )
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                str(self.config.model_path),   # set: validate() requires model_path or preset
                local_files_only=True,
                dtype=self.dtype,
                attn_implementation=self.config.attn_implementation,
            )
        model = model.to(self.device).eval().requires_grad_(False)
        config = model.config.get_text_config(decoder=True)
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False):
            raise EngineError(
                f"torch engine supports full-attention models only, got layer types {sorted(layer_types)}"
            )
        self.model = model
        self._weights = ModelWeights(model, self.device)
        self._spec = list(self._weights.spec)
        prefix = None
        if self.config.prefix_cache_tokens:
            prefix = PrefixCache(self.config.prefix_cache_tokens, block=self.config.prefix_block_size,
                                 idle_s=self.config.session_idle_timeout_s)
        self._runner = BatchRunner(model, self.device, prefix)
        self._eos = _eos_ids(model)
        self._vocab_size = config.vocab_size
        self._max_model_len = getattr(config, "max_position_embeddings", None)
        if self.device.type == "cuda" and self.config.max_total_tokens is None:
            self.max_total_tokens = _cuda_token_capacity(config, self.dtype, self.device, self.memory_fraction)
        log.info(
            "torch engine %r: %s on %s (%s), %d threads, %d KV tokens",
            self.replica_id, self.config.preset or self.config.model_path, self.device,
            self.dtype, threads, self.max_total_tokens,
        )

    async def _unload_model(self) -> None:
        self.model = self._runner = self._weights = None
        self._executor.shutdown(wait=True)

    # ---------------------------------------------------------- step hooks
    def _request_limits(self) -> dict[str, int | None]:
        return {"vocab_size": self._vocab_size, "max_model_len": self._max_model_len}

    @staticmethod
    def _loaded(part: _Part | None) -> _Part:
        """The model's weights or batch runner, once loaded (EngineUnavailable before ``start`` or after close)."""
        if part is None:
            raise EngineUnavailable("the model is not loaded (loading, or closed)")
        return part

    def _eos_token_ids(self) -> frozenset[int]:
        return self._eos

    async def _execute_step(self, batch: StepBatch) -> list[tuple[int, float]]:
        runner = self._loaded(self._runner)
        out = await self._in_worker(runner.step, batch)
        for request_id, cached in runner.cached.items():
            active = self._requests.get(request_id)
            if active is not None:
                active.cached_tokens = cached
        return out

    async def _reset_batch(self) -> None:
        if self._runner is not None:
            await self._in_worker(self._runner.reset)

    async def _retire_batch(self, holds: dict[str, float]) -> None:
        if self._runner is not None:
            await self._in_worker(self._runner.reset, True, holds)

    # ------------------------------------------------------------- weights
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Detached views of the live parameters (no copy). Read them between
        ``load_weights`` calls; a concurrent load may be observed half-way."""
        if self._weights is None or not (self._weights_resident and self._weights_loaded):
            raise EngineUnavailable("weights are not resident or not loaded (loading, asleep or closed)")
        return self._weights.named_tensors()

    def weight_spec(self) -> list[WeightSpec]:
        if not self._spec:
            raise EngineUnavailable("engine is still loading")
        return list(self._spec)

    def _check_weights(self, named_tensors: Mapping[str, Any], require_complete: bool) -> None:
        self._loaded(self._weights).check(named_tensors, require_complete)

    @property
    def patches_weights_in_place(self) -> bool:   # type: ignore[override]
        return self.config.delta_in_place

    async def patch_weights(self, patch: Callable[[list[tuple[str, Any]]], object], version: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidRequest(f"weight version must be an integer, got {version!r}")
        self._check_alive()
        if not self.config.delta_in_place:
            raise EngineUnavailable("this torch engine changes no weights in place (delta_in_place: false)")
        async with self._step_lock:
            if not (self._weights_resident and self._weights_loaded):
                raise EngineUnavailable("weights are not resident or not loaded (asleep or still loading)")
            await self._in_worker(self._patch_sync, patch)
            self._weight_version = version
        self._work.set()

    def _patch_sync(self, patch: Callable[[list[tuple[str, Any]]], object]) -> None:
        patch(list(self._loaded(self._weights).named_tensors()))
        self._clear_prefixes()   # only once the patch took: a refused one left the weights the cache was built on

    async def _swap_weights(self, named_tensors: Mapping[str, Any]) -> None:
        await self._in_worker(self._swap_sync, named_tensors)

    def _swap_sync(self, named_tensors: Mapping[str, Any]) -> None:
        self._loaded(self._weights).swap(named_tensors)
        self._clear_prefixes()   # keys and values of the old weights are wrong for the new ones

    async def _release_weights(self, level: int) -> int:
        await self._in_worker(self._clear_prefixes)
        return await self._in_worker(self._loaded(self._weights).release, level, self._weights_resident)

    async def _flush_cache(self) -> None:
        await self._in_worker(self._clear_prefixes)   # running requests own their rows' KV, not the cache's

    def _clear_prefixes(self) -> None:
        if self._runner is not None and self._runner.prefix is not None:
            self._runner.prefix.clear()

    async def close_session(self, session_id: str) -> bool:
        runner = self._runner
        if runner is None or runner.prefix is None:
            return False
        return await self._in_worker(runner.prefix.close_session, session_id)

    def prefix_stats(self) -> Any:
        """The prefix cache's counters (None when it is off)."""
        return self._runner.prefix.stats if self._runner is not None and self._runner.prefix is not None else None

    async def _restore_weights(self) -> bool:
        return await self._in_worker(self._loaded(self._weights).restore)

    def resident_weight_bytes(self) -> int:
        """Bytes of parameter storage the model references right now (0 while asleep)."""
        return 0 if self._weights is None else self._weights.resident_bytes()


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"torch engine: device {name!r} requested but CUDA is not available")
    return device


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidRequest(f"torch engine: {name!r} is not a floating-point dtype name")
    return dtype


def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _cuda_token_capacity(config: Any, dtype: torch.dtype, device: torch.device, fraction: float) -> int:
    """KV tokens that fit in ``fraction`` of the device after what is already used."""
    free, total = torch.cuda.mem_get_info(device)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8
    budget = total * fraction - (total - free)
    # The padded dynamic cache re-concatenates tensors each step: keep half as headroom.
    return max(1, int(budget // per_token) // 2)
