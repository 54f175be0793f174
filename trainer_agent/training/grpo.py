"""GRPO on a Hugging Face causal LM: the torch training backend's update step.

One :meth:`GrpoTrainer.step` takes groups of rollout samples (one group = the
completions of one prompt) and does, each phase timed under the ``timing_raw``
key the controller's metrics read (:data:`controller.core.metrics.TRAIN_COMPUTE_KEYS`):

- ``reward``: score the samples (with ``reward_fn`` when given, otherwise the
  rewards the samples carry);
- ``old_log_prob``: gather the rollout logprobs into the behaviour policy's
  token tensor. The replicas recorded them when they sampled, possibly with
  older weights (fully-async RL), so no extra forward pass is needed and the
  importance ratio corrects for the staleness;
- ``adv``: group-normalised advantages, ``(r - mean) / (std + eps)`` per group;
- ``update_actor``: one forward/backward of the PPO-clipped policy loss
  (token mean over all completion tokens), gradient clipping, one AdamW step.

There is no reference model, value model or critic: ``ref``, ``values`` and
``update_critic`` are reported as 0.

After the optimizer step the new weights are published to the
:class:`~trainer_agent.weight_source.WeightSource` (if one is attached) with the
next weight version: in place inside ``source.updating(version)`` when the
source holds this very model, through ``source.set_weights`` otherwise.

:meth:`GrpoTrainer.offload` / :meth:`GrpoTrainer.onload` move parameters and
optimizer state out of the model to a host-side storage dict and back (the
trainer's half of a hybrid deployment's sleep/wake, like the replica engine's
sleep). On CPU the tensors are *moved* (no copy): afterwards every parameter
of the model is an empty tensor and the storage dict is the only owner of the
memory; on an accelerator they are copied to host memory and the device
memory is released.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from mesh_runtime.errors import FailedPrecondition, InvalidArgument
from mesh_runtime.reasons import Reason

from ..weight_source import WeightSource
from .limits import DEFAULT_LOGPROB_MISMATCH_BOUND

RewardFn = Callable[[Sequence[int], Sequence[int]], float]
log = logging.getLogger(__name__)


class LogprobMismatch(FailedPrecondition):
    """On-policy samples' rollout logprobs differ from the trainer's beyond the configured bound."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One rollout: a prompt, the sampled completion and what the sampler saw."""

    prompt_ids: Sequence[int]
    """Token ids of the prompt."""
    completion_ids: Sequence[int]
    """Token ids the sampler produced (at least one)."""
    rollout_logprobs: Sequence[float]
    """Log-probability of each completion token under the sampling (behaviour) policy."""
    reward: float = 0.0
    """Scalar reward; replaced when :meth:`GrpoTrainer.step` gets a ``reward_fn``."""
    loss_mask: Sequence[int] = ()
    """Per completion token, 1 to train on it, 0 not (tool and user turns of a trajectory); empty = all."""
    weight_version: int | None = None
    """The one weight version every generated token was sampled under; None when they span several or it is
    unknown. A sample at the trainer's own current version is on-policy: its rollout logprobs must equal the
    trainer's recomputation (see :attr:`GrpoConfig.logprob_mismatch_bound`)."""


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """Hyper-parameters of :class:`GrpoTrainer`."""

    lr: float = 1e-3
    """AdamW learning rate."""
    clip_ratio: float = 0.2
    """PPO clip: the importance ratio is clipped to ``[1 - clip_ratio, 1 + clip_ratio]``."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global L2 norm (``<= 0`` disables clipping)."""
    advantage_eps: float = 1e-6
    """Added to the group's reward std before dividing."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    temperature: float = 1.0
    """The rollout's sampling temperature: the trainer's logits are divided by it before the log-softmax, so its
    log-probabilities are those of the distribution the engine sampled from (as verl's actor does)."""
    logprob_mismatch_bound: float = DEFAULT_LOGPROB_MISMATCH_BOUND
    """Largest mean absolute difference (nats per token) between the rollout logprobs of on-policy samples (all
    tokens at the trainer's current weight version) and the trainer's recomputation; beyond it the step is
    refused (``logprob_mismatch_action``). ``<= 0`` turns the check off."""
    logprob_mismatch_action: str = "error"
    """``error``: a step over the bound raises :class:`LogprobMismatch` before any update; ``warn``: it logs a
    warning and trains."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise InvalidArgument(f"lr must be positive, got {self.lr}", reason=Reason.INVALID_TRAINING_CONFIG)
        if not self.temperature > 0:
            raise InvalidArgument(f"temperature must be positive, got {self.temperature}",
                                  reason=Reason.INVALID_TRAINING_CONFIG)
        if self.logprob_mismatch_action not in ("error", "warn"):
            raise InvalidArgument(f"logprob_mismatch_action must be 'error' or 'warn', got "
                                  f"{self.logprob_mismatch_action[:32]!r}", reason=Reason.INVALID_TRAINING_CONFIG)
        if not 0 < self.clip_ratio < 1:
            raise InvalidArgument(f"clip_ratio must lie in (0, 1), got {self.clip_ratio}",
                                  reason=Reason.INVALID_TRAINING_CONFIG)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one :meth:`GrpoTrainer.step` reports."""

    metrics: dict[str, float]
    """Loss, reward, advantage, clipping and gradient statistics."""
    timing_raw: dict[str, float]
    """Seconds per phase under the controller's keys (``reward``, ``old_log_prob``, ``adv``, ``update_actor``...)."""
    weight_version: int
    """Version of the weights after the step (published to the weight source if one is attached)."""


# -- the pure core ------------------------------------------------------------------------------


def group_advantages(group_rewards: Sequence[Sequence[float]], eps: float = 1e-6) -> list[list[float]]:
    """``(r - mean) / (std + eps)`` within each group; ``std`` is the sample (n - 1) std.

    A group of one sample, or one whose rewards are all equal, gets advantage 0
    for every sample (no signal).
    """
    advantages = []
    for rewards in group_rewards:
        n = len(rewards)
        if n < 2:
            advantages.append([0.0] * n)
            continue
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        if std == 0.0:
            advantages.append([0.0] * n)
            continue
        advantages.append([(r - mean) / (std + eps) for r in rewards])
    return advantages


def clipped_policy_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_ratio: float) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped policy loss, averaged over the tokens where ``mask`` is set.

    Per token: ``ratio = exp(logprob - rollout_logprob)``,
    ``loss = -min(ratio * A, clip(ratio, 1 - c, 1 + c) * A)``. All tensors are
    ``[batch, tokens]`` (``advantages`` broadcast from ``[batch, 1]`` is fine).
    Returns the loss and ``clip_fraction`` (share of tokens where the clipped
    term was the one taken) and ``ratio_mean``.
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - rollout_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    tokens = mask.sum().clamp_min(1.0)
    loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        clip_fraction = float(((clipped < unclipped).to(mask.dtype) * mask).sum() / tokens)
        ratio_mean = float((ratio * mask).sum() / tokens)
    return loss, {"clip_fraction": clip_fraction, "ratio_mean": ratio_mean}


def completion_logprobs(model: torch.nn.Module, samples: Sequence[Sample], device: torch.device,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of each sample's completion tokens under ``model`` sampled at ``temperature``:
    ``(logprobs, mask)``, ``[B, T]``.

    Sequences are right-padded (so positions start at 0 for every sample);
    ``T`` is the longest completion. ``mask`` is each sample's ``loss_mask`` (all of it when empty).
    """
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    width = max(lengths)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    attention = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        tokens = [*sample.prompt_ids, *sample.completion_ids]
        input_ids[row, :len(tokens)] = torch.tensor(tokens)
        attention[row, :len(tokens)] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    token_logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    rows = []
    for row, sample in enumerate(samples):
        start = len(sample.prompt_ids) - 1  # the logits at position p predict token p + 1
        rows.append(token_logprobs[row, start:start + len(sample.completion_ids)])
    logprobs = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    masks = [torch.tensor([bool(m) for m in s.loss_mask], dtype=torch.bool, device=r.device) if s.loss_mask
             else torch.ones_like(r, dtype=torch.bool) for s, r in zip(samples, rows)]
    mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
    return logprobs, mask


# -- the trainer --------------------------------------------------------------------------------


class GrpoTrainer:
    """GRPO updates of one causal LM, publishing each new version to a weight source.

    Not thread-safe by itself: one training loop drives it. Publishing takes
    the weight source's lock, so a concurrent broadcaster sees either the old
    or the new version. Do not offload while a broadcast reads the weights.
    """

    def __init__(self, model: torch.nn.Module, config: GrpoConfig = GrpoConfig(), *,
                 weight_source: WeightSource | None = None, weight_version: int | None = None) -> None:
        self.model = model
        self.config = config
        self.weight_source = weight_source
        self.weight_version = weight_source.weight_version if weight_source is not None else (weight_version or 0)
        self.device = next(model.parameters()).device
        self._params = _unique_named_parameters(model)
        self.optimizer = torch.optim.AdamW([p for p in self._params.values() if p.requires_grad], lr=config.lr,
                                           betas=config.betas, weight_decay=config.weight_decay)
        self._host: dict[str, torch.Tensor] | None = None
        self._host_optimizer: dict[str, dict[str, torch.Tensor]] | None = None

    @classmethod
    def from_weight_source(cls, source: WeightSource, config: GrpoConfig = GrpoConfig()) -> GrpoTrainer:
        """Train the model a loaded weight source holds (its ``module``: a transformers model, or the megatron
        backend's :class:`~trainer_agent.megatron.source.MegatronCausalLM`), publishing in place."""
        if source.module is None:
            raise FailedPrecondition("the weight source has not loaded its model", reason=Reason.NO_MODEL_LOADED)
        return cls(source.module, config, weight_source=source)

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's weights under Hugging Face names, tied ones once (first name), detached, no copy."""
        self._check_onloaded()
        for name, param in self._params.items():
            yield name, param.detach()

    # -- one step -------------------------------------------------------------------------------

    def step(self, groups: Sequence[Sequence[Sample]], *, reward_fn: RewardFn | None = None) -> StepResult:
        """One GRPO update from ``groups`` (each the samples of one prompt); see the module docstring."""
        self._check_onloaded()
        _validate(groups)
        timing = {"ref": 0.0, "values": 0.0, "update_critic": 0.0}

        started = time.perf_counter()
        if reward_fn is not None:
            groups = [[dataclasses.replace(s, reward=float(reward_fn(s.prompt_ids, s.completion_ids))) for s in g]
                      for g in groups]
        rewards = [[float(s.reward) for s in g] for g in groups]
        timing["reward"] = time.perf_counter() - started

        samples = [s for g in groups for s in g]
        started = time.perf_counter()
        width = max(len(s.completion_ids) for s in samples)
        rollout = torch.zeros(len(samples), width)
        for row, sample in enumerate(samples):
            rollout[row, :len(sample.rollout_logprobs)] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        rollout = rollout.to(self.device)
        timing["old_log_prob"] = time.perf_counter() - started

        started = time.perf_counter()
        advantages = group_advantages(rewards, self.config.advantage_eps)
        adv = torch.tensor([a for g in advantages for a in g], dtype=torch.float32, device=self.device)[:, None]
        timing["adv"] = time.perf_counter() - started

        started = time.perf_counter()
        self.model.train()
        logprobs, mask = completion_logprobs(self.model, samples, self.device, self.config.temperature)
        on_policy = self._check_on_policy(samples, rollout, logprobs.detach(), mask)
        loss, stats = clipped_policy_loss(logprobs, rollout, adv, mask, self.config.clip_ratio)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = _clip_grad_norm(list(self._params.values()), self.config.max_grad_norm)
        self._apply_and_publish()
        timing["update_actor"] = time.perf_counter() - started

        with torch.no_grad():
            tokens = mask.sum().clamp_min(1)
            mismatch = float(((rollout - logprobs.detach()).abs() * mask).sum() / tokens)
        flat = [r for g in rewards for r in g]
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/pg_clipfrac": stats["clip_fraction"],
            "actor/ratio_mean": stats["ratio_mean"],
            "actor/grad_norm": grad_norm,
            "actor/lr": self.config.lr,
            "actor/rollout_logprob_abs_diff": mismatch,
            **on_policy,
            "critic/rewards/mean": sum(flat) / len(flat),
            "critic/rewards/max": max(flat),
            "critic/rewards/min": min(flat),
            "critic/advantages/mean": float(adv.mean()),
            "response_length/mean": float(mask.sum(dim=1).float().mean()),
            "num_samples": float(len(samples)),
            "num_groups": float(len(groups)),
        }
        return StepResult(metrics, timing, self.weight_version)

    def _check_on_policy(self, samples: Sequence[Sample], rollout: torch.Tensor, logprobs: torch.Tensor,
                         mask: torch.Tensor) -> dict[str, float]:
        """Compare the rollout logprobs of the samples generated under this trainer's current weights with its
        own; over the bound, refuse the step (before any update) or warn, as configured. Returns the metrics
        ``actor/on_policy_logprob_abs_diff`` and ``actor/on_policy_tokens`` (none without on-policy samples)."""
        rows = [i for i, s in enumerate(samples) if s.weight_version == self.weight_version]
        if not rows:
            return {}
        index = torch.tensor(rows, dtype=torch.long, device=rollout.device)
        on_mask = mask.index_select(0, index)
        tokens = int(on_mask.sum())
        if tokens == 0:
            return {}
        diff = float(((rollout.index_select(0, index) - logprobs.index_select(0, index)).abs() * on_mask).sum()
                     / tokens)
        bound = self.config.logprob_mismatch_bound
        if bound > 0 and not diff <= bound:   # a NaN is over any bound
            from modeling.versions import describe  # noqa: PLC0415

            message = (f"the rollout engine's log-probabilities of {len(rows)} sample(s) generated under the "
                       f"trainer's current weights (version {self.weight_version}) differ from the trainer's "
                       f"by {diff:.4g} nats per token on average (bound {bound:g}, "
                       f"actor.logprob_mismatch_bound) with {describe()}: the engine and the trainer do not "
                       f"compute the same model, and training on these samples would learn nothing. Check that "
                       f"both run a supported torch and transformers and the same model and tokenizer; set "
                       f"actor.logprob_mismatch_action: warn to train anyway")
            if self.config.logprob_mismatch_action == "error":
                raise LogprobMismatch(message, reason=Reason.LOGPROB_MISMATCH,
                                      metadata={"difference": f"{diff:.6g}", "bound": f"{bound:g}"})
            log.warning("%s", message)
        return {"actor/on_policy_logprob_abs_diff": diff, "actor/on_policy_tokens": float(tokens)}

    def _apply_and_publish(self) -> None:
        version = self.weight_version + 1
        source = self.weight_source
        if source is not None and getattr(source, "module", None) is self.model:
            with source.updating(version):
                self.optimizer.step()
        else:
            self.optimizer.step()
            if source is not None:
                source.set_weights(dict(self.named_weights()), version)
        self.weight_version = version

    # -- offload / onload -----------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes the optimizer state tensors hold (0 when offloaded or before the first step)."""
        return sum(v.numel() * v.element_size() for state in self.optimizer.state.values()
                   for v in state.values() if torch.is_tensor(v))

    def offloaded_bytes(self) -> int:
        """Bytes held in host storage by :meth:`offload` (0 when onloaded)."""
        tensors = [*(self._host or {}).values(),
                   *(v for state in (self._host_optimizer or {}).values() for v in state.values())]
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    def offload(self, include_optimizer: bool = True) -> None:
        """Move parameters (and the optimizer state unless ``include_optimizer`` is false) to host storage;
        the model keeps empty tensors. Idempotent."""
        if self._host is not None:
            return
        host: dict[str, torch.Tensor] = {}
        host_optimizer: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for name, param in self._params.items():
                host[name] = _to_host(param.data)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                param.grad = None
                state = self.optimizer.state.get(param)
                if state and include_optimizer:
                    host_optimizer[name] = {k: _to_host(v) if torch.is_tensor(v) else v for k, v in state.items()}
                    self.optimizer.state[param] = {}
        self._host, self._host_optimizer = host, host_optimizer
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Put the offloaded parameters and optimizer state back, bit for bit. Idempotent."""
        if self._host is None:
            return
        with torch.no_grad():
            host_optimizer = self._host_optimizer or {}
            for name, param in self._params.items():
                param.data = self._host[name].to(self.device)
                if name in host_optimizer:
                    self.optimizer.state[param] = {k: v.to(self.device) if torch.is_tensor(v) and v.dim() > 0 else v
                                                  for k, v in host_optimizer[name].items()}
        self._host = self._host_optimizer = None

    # -- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Parameters and AdamW state by Hugging Face name, and the weight version (copies; works offloaded)."""
        params, optimizer = {}, {}
        with torch.no_grad():
            for name, param in self._params.items():
                params[name] = (self._host[name] if self._host is not None else param.data).detach().to("cpu").clone()
                state = (self._host_optimizer or {}).get(name) or self.optimizer.state.get(param)
                if state:
                    optimizer[name] = {k: v.detach().to("cpu").clone() if torch.is_tensor(v) else v
                                       for k, v in state.items()}
        return {"weight_version": self.weight_version, "params": params, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` bit for bit (onloaded only) and publish its version to the weight source."""
        self._check_onloaded()
        params, version = state["params"], int(state["weight_version"])
        unknown = sorted(set(params) ^ set(self._params))
        if unknown:
            raise InvalidArgument(f"checkpoint does not fit the model: {unknown[:5]}", reason=Reason.CHECKPOINT_MISMATCH)

        def write() -> None:
            with torch.no_grad():
                for name, param in self._params.items():
                    param.data.copy_(params[name].to(param.device, param.dtype))
                    saved = state["optimizer"].get(name)
                    self.optimizer.state[param] = {} if not saved else {
                        k: v.to(self.device) if torch.is_tensor(v) and v.dim() > 0 else
                        (v.clone() if torch.is_tensor(v) else v) for k, v in saved.items()}

        source = self.weight_source
        if source is not None and getattr(source, "module", None) is self.model and version > source.weight_version:
            with source.updating(version):
                write()
        elif source is not None and version > source.weight_version:
            write()
            source.set_weights(dict(self.named_weights()), version)
        else:
            write()
        self.weight_version = version

    def host_storage(self) -> dict[str, torch.Tensor]:
        """The offloaded parameters by Hugging Face name (empty when onloaded)."""
        return dict(self._host or {})

    def _check_onloaded(self) -> None:
        if self._host is not None:
            raise FailedPrecondition("the trainer's weights are offloaded; onload() first", reason=Reason.TRAINER_OFFLOADED)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters hold (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in _unique_named_parameters(model).values())


def _unique_named_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    seen: set[int] = set()
    params = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in seen:
            seen.add(id(param))
            params[name] = param
    return params


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu":
        return tensor  # a move: the storage dict becomes the only owner
    return tensor.to("cpu", non_blocking=False)


def _clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))


def _validate(groups: Sequence[Sequence[Sample]]) -> None:
    if not groups or any(not g for g in groups):
        raise InvalidArgument("a step needs at least one non-empty group of samples", reason=Reason.EMPTY_BATCH)
    for g in groups:
        for s in g:
            if not s.prompt_ids or not s.completion_ids:
                raise InvalidArgument("every sample needs prompt and completion tokens", reason=Reason.EMPTY_SAMPLE)
            if len(s.rollout_logprobs) != len(s.completion_ids):
                raise InvalidArgument(f"{len(s.rollout_logprobs)} rollout logprobs for {len(s.completion_ids)} "
                                      "completion tokens", reason=Reason.LOGPROB_LENGTH_MISMATCH)
            if s.loss_mask and len(s.loss_mask) != len(s.completion_ids):
                raise InvalidArgument(f"a loss mask of {len(s.loss_mask)} for {len(s.completion_ids)} completion "
                                      "tokens", reason=Reason.LOGPROB_LENGTH_MISMATCH)
