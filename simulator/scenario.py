"""Scenarios: the workload, the simulated hardware and the runs to compare.

A scenario is a YAML file (see ``examples/scenarios/``) or the name of one of
the built-in files there (``reference-32gpu``, ``tiny``). Every section maps
onto a frozen dataclass; :func:`load_scenario` checks every field and raises
:class:`ScenarioError` naming the field (``runs[1].rollout_gpus``) and what
is allowed. ``scheduling`` holds the reference's parameter names (section 2
of ``dynamic-resource-scheduling.md``) and is validated by the controller
core's own :class:`~controller.core.config.SchedulingConfig`.

Units: as in verl (:mod:`mesh_runtime.samples`), a sample is one prompt with
its ``n`` responses and ``ppo_mini_batch_size`` is in prompts, so
``required_samples = ppo_mini_batch_size x require_batches``; the simulated
engines and queue work per completion (``*_completions`` = samples x ``n``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mesh_runtime import samples

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "examples" / "scenarios"


class ScenarioError(ValueError):
    """A scenario field is missing, of the wrong type or inconsistent; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"scenario field {field!r}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class ResponseLengths:
    """Response lengths in tokens: log-normal, clipped to ``max_tokens``, drifting over training."""

    median: float = 2000.0
    """Median response length at the start of training."""
    sigma: float = 0.6
    """Log-normal shape; larger is a longer tail (0 = every response has the median length)."""
    max_tokens: int = 16384
    """Generation budget; longer draws are truncated here."""
    growth_per_step: float = 0.0
    """Relative growth of the median per training step's worth of samples (RL responses lengthen)."""


@dataclasses.dataclass(frozen=True)
class Workload(samples.SampleArithmetic):
    """The RL job: batch geometry (reference names) and response lengths."""

    n: int = 8
    """Samples per prompt (one GRPO group)."""
    ppo_mini_batch_size: int = 32
    """Prompts per mini-batch."""
    require_batches: int = 1
    trigger_parameter_sync_step: int = 4
    staleness_threshold: float = 0.5
    prompt_tokens: int = 512
    response_lengths: ResponseLengths = ResponseLengths()
    max_queue_size: int = 0
    """Bound of the message queue in samples (prompts); 0 means ``2 x max_required_samples``."""

    @property
    def step_samples(self) -> int:
        """Samples (prompts) per weight-sync cycle (the simulator's name for ``step_required_samples``)."""
        return self.step_required_samples

    @property
    def queue_bound(self) -> int:
        """The queue bound in completions."""
        return (self.max_queue_size or 2 * self.max_required_samples) * self.n


@dataclasses.dataclass(frozen=True)
class Engine:
    """One inference replica: processor-sharing decode with a saturating throughput curve.

    With ``c`` requests in flight a replica decodes ``peak_tokens_per_s x c /
    (c + half_saturation_concurrency)`` tokens per second in total, shared
    equally by the ``c`` requests.
    """

    gpus_per_replica: int = 4
    peak_tokens_per_s: float = 6000.0
    half_saturation_concurrency: float = 32.0
    concurrent_samples_per_replica: int = 64
    """``s`` of the reference: the rollouter keeps at most ``replicas x s`` requests in flight."""
    hybrid_throughput_factor: float = 0.8
    """Hybrid replicas run with a lower ``gpu_memory_utilization`` (smaller KV cache): peak x this."""
    prefill_tokens_per_s: float = 50000.0
    """Prompt (and resumed-context) processing speed, charged as decode-equivalent work."""
    resume_cost_tokens: float = 0.0
    """Extra decode-equivalent work when an aborted request resumes on another replica."""


@dataclasses.dataclass(frozen=True)
class Trainer:
    """Training compute per mini-batch: ``overhead_s + tokens/1e6 x gpu_s_per_mtoken / gpus**scaling_exponent``."""

    gpu_seconds_per_mtoken: float = 400.0
    scaling_exponent: float = 0.9
    overhead_s: float = 2.0


@dataclasses.dataclass(frozen=True)
class Transitions:
    """Durations of the operations the controller drives (seconds)."""

    weight_sync_s: float = 10.0
    """One weight broadcast (any number of replicas; NCCL broadcast time barely grows with receivers)."""
    model_bytes: int = 70_000_000_000
    sleep_s: float = 6.0
    wake_s: float = 5.0
    abort_s: float = 0.2
    resume_s: float = 0.05
    routing_s: float = 0.05


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One configuration to simulate: how the cluster is split and whether scheduling is dynamic."""

    name: str
    train_gpus: int
    rollout_gpus: int
    dynamic: bool = False
    policy: str | None = None
    """Policy for this run (default: ``scheduling.dynamic_schedule_policy``)."""


@dataclasses.dataclass(frozen=True)
class SweepWorkload:
    """One workload of the policy sweep: dotted-field overrides of the base scenario."""

    name: str
    overrides: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Sweep:
    policies: tuple[str, ...] = ("default", "fixed_ratio", "static_fully_async", "balanced")
    workloads: tuple[SweepWorkload, ...] = ()
    steps: int = 40
    oracle: bool = True


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    seed: int
    steps: int
    total_gpus: int
    gpus_per_node: int
    workload: Workload
    engine: Engine
    trainer: Trainer
    transitions: Transitions
    scheduling: Mapping[str, Any]
    runs: tuple[RunSpec, ...]
    sweep: Sweep | None = None
    source: str = ""

    def run(self, name: str) -> RunSpec:
        for spec in self.runs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def with_overrides(self, overrides: Mapping[str, Any]) -> Scenario:
        """A copy with dotted fields replaced (``engine.peak_tokens_per_s``, ``workload.response_lengths.sigma``)."""
        raw: dict[str, Any] = copy.deepcopy(dict(self.raw))
        for dotted, value in overrides.items():
            node: dict[str, Any] = raw
            parts = dotted.split(".")
            for part in parts[:-1]:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            node[parts[-1]] = value
        return parse_scenario(raw, source=self.source)

    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)


# --- parsing --------------------------------------------------------------------------------------

_TOP = {"name", "description", "seed", "steps", "cluster", "workload", "engine", "trainer", "transitions",
        "scheduling", "runs", "sweep"}


def _section(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {}) or {}
    if not isinstance(value, Mapping):
        raise ScenarioError(key, f"must be a mapping, got {type(value).__name__}")
    return dict(value)


def _build(cls: type, data: dict[str, Any], prefix: str, nested: Mapping[str, Any] | None = None) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise ScenarioError(f"{prefix}.{key}", f"unknown field; known: {', '.join(sorted(fields))}")
        if nested and key in nested:
            if not isinstance(value, Mapping):
                raise ScenarioError(f"{prefix}.{key}", "must be a mapping")
            values[key] = _build(nested[key], dict(value), f"{prefix}.{key}")
            continue
        default = fields[key].default
        values[key] = _coerce(value, default, f"{prefix}.{key}")
    return cls(**values)


def _coerce(value: Any, default: Any, field: str) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ScenarioError(field, f"must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
            raise ScenarioError(field, f"must be an integer, got {value!r}")
        return int(value)
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise ScenarioError(field, f"must be a finite number, got {value!r}")
        return float(value)
    if isinstance(default, str) and not isinstance(value, str):
        raise ScenarioError(field, f"must be a string, got {value!r}")
    return value


def _check(field: str, ok: bool, rule: str, value: Any) -> None:
    if not ok:
        raise ScenarioError(field, f"{rule}, got {value!r}")


def parse_scenario(raw: Mapping[str, Any], *, source: str = "") -> Scenario:
    """Build and validate a :class:`Scenario` from a plain mapping (a parsed YAML file)."""
    if not isinstance(raw, Mapping):
        raise ScenarioError("<top>", f"a scenario must be a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in _TOP:
            raise ScenarioError(str(key), f"unknown top-level field; known: {', '.join(sorted(_TOP))}")
    name = _coerce(raw.get("name", Path(source).stem or "scenario"), "", "name")
    description = _coerce(raw.get("description", ""), "", "description")
    seed = _coerce(raw.get("seed", 0), 0, "seed")
    steps = _coerce(raw.get("steps", 100), 0, "steps")
    _check("steps", steps >= 1, "must be >= 1", steps)
    cluster = _section(raw, "cluster")
    for key in cluster:
        if key not in ("total_gpus", "gpus_per_node"):
            raise ScenarioError(f"cluster.{key}", "unknown field; known: gpus_per_node, total_gpus")
    total = _coerce(cluster.get("total_gpus", 0), 0, "cluster.total_gpus")
    per_node = _coerce(cluster.get("gpus_per_node", 8), 0, "cluster.gpus_per_node")
    _check("cluster.total_gpus", total >= 1, "must be >= 1", total)
    _check("cluster.gpus_per_node", per_node >= 1, "must be >= 1", per_node)

    workload = _build(Workload, _section(raw, "workload"), "workload", {"response_lengths": ResponseLengths})
    engine = _build(Engine, _section(raw, "engine"), "engine")
    trainer = _build(Trainer, _section(raw, "trainer"), "trainer")
    transitions = _build(Transitions, _section(raw, "transitions"), "transitions")
    _validate_parts(workload, engine, trainer, transitions)

    scheduling = _section(raw, "scheduling")
    scheduling.setdefault("staleness_threshold", workload.staleness_threshold)
    scheduling.setdefault("trigger_parameter_sync_step", workload.trigger_parameter_sync_step)
    scheduling.setdefault("require_batches", workload.require_batches)
    for key in ("staleness_threshold", "trigger_parameter_sync_step", "require_batches"):
        if scheduling[key] != getattr(workload, key):
            raise ScenarioError(f"scheduling.{key}", f"disagrees with workload.{key} "
                                f"({getattr(workload, key)!r}); set it in one place")
    _validate_scheduling(scheduling)

    runs_raw = raw.get("runs")
    if not isinstance(runs_raw, list) or not runs_raw:
        raise ScenarioError("runs", "must be a non-empty list of {name, train_gpus, rollout_gpus, dynamic}")
    runs = []
    for index, item in enumerate(runs_raw):
        runs.append(_parse_run(item, f"runs[{index}]", total, per_node, engine.gpus_per_replica, scheduling))
    names = [r.name for r in runs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ScenarioError("runs", f"run names must be unique, repeated: {sorted(dup)}")
    sweep = _parse_sweep(raw.get("sweep"), scheduling) if raw.get("sweep") is not None else None
    return Scenario(name=name, description=description, seed=seed, steps=steps, total_gpus=total,
                    gpus_per_node=per_node, workload=workload, engine=engine, trainer=trainer,
                    transitions=transitions, scheduling=scheduling, runs=tuple(runs), sweep=sweep, source=source,
                    raw=copy.deepcopy(dict(raw)))


def _validate_parts(w: Workload, e: Engine, t: Trainer, tr: Transitions) -> None:
    for name in ("n", "ppo_mini_batch_size", "require_batches", "trigger_parameter_sync_step"):
        _check(f"workload.{name}", getattr(w, name) >= 1, "must be >= 1", getattr(w, name))
    _check("workload.staleness_threshold", w.staleness_threshold >= 0, "must be >= 0", w.staleness_threshold)
    _check("workload.prompt_tokens", w.prompt_tokens >= 0, "must be >= 0", w.prompt_tokens)
    _check("workload.max_queue_size", w.max_queue_size == 0 or w.max_queue_size >= w.required_samples,
           f"must be 0 (automatic) or >= required_samples ({w.required_samples})", w.max_queue_size)
    r = w.response_lengths
    _check("workload.response_lengths.median", r.median >= 1, "must be >= 1 token", r.median)
    _check("workload.response_lengths.sigma", 0 <= r.sigma <= 3, "must be in [0, 3]", r.sigma)
    _check("workload.response_lengths.max_tokens", r.max_tokens >= 1, "must be >= 1", r.max_tokens)
    _check("workload.response_lengths.growth_per_step", r.growth_per_step > -1,
           "must be > -1", r.growth_per_step)
    _check("engine.gpus_per_replica", e.gpus_per_replica >= 1, "must be >= 1", e.gpus_per_replica)
    _check("engine.peak_tokens_per_s", e.peak_tokens_per_s > 0, "must be > 0 (zero throughput never finishes)",
           e.peak_tokens_per_s)
    _check("engine.half_saturation_concurrency", e.half_saturation_concurrency >= 0, "must be >= 0",
           e.half_saturation_concurrency)
    _check("engine.concurrent_samples_per_replica", e.concurrent_samples_per_replica >= 1, "must be >= 1",
           e.concurrent_samples_per_replica)
    _check("engine.hybrid_throughput_factor", 0 < e.hybrid_throughput_factor <= 4, "must be in (0, 4]",
           e.hybrid_throughput_factor)
    _check("engine.prefill_tokens_per_s", e.prefill_tokens_per_s > 0, "must be > 0", e.prefill_tokens_per_s)
    _check("engine.resume_cost_tokens", e.resume_cost_tokens >= 0, "must be >= 0", e.resume_cost_tokens)
    _check("trainer.gpu_seconds_per_mtoken", t.gpu_seconds_per_mtoken > 0,
           "must be > 0 (a trainer with zero cost is not a trainer)", t.gpu_seconds_per_mtoken)
    _check("trainer.scaling_exponent", 0 < t.scaling_exponent <= 1, "must be in (0, 1]", t.scaling_exponent)
    _check("trainer.overhead_s", t.overhead_s >= 0, "must be >= 0", t.overhead_s)
    for f in dataclasses.fields(Transitions):
        value = getattr(tr, f.name)
        _check(f"transitions.{f.name}", value >= 0, "must be >= 0", value)


def _validate_scheduling(scheduling: dict[str, Any]) -> None:
    from controller.core.config import SchedulingConfig
    from controller.core.errors import CoreError
    from controller.core.policies import resolve_policy

    names = {f.name for f in dataclasses.fields(SchedulingConfig)}
    for key in scheduling:
        if key not in names:
            raise ScenarioError(f"scheduling.{key}", f"unknown scheduling parameter; known: {', '.join(sorted(names))}")
    try:
        SchedulingConfig(**scheduling).validate()
    except CoreError as err:
        raise ScenarioError(f"scheduling.{err.metadata.get('field', '?')}", err.message) from None
    except TypeError as err:
        raise ScenarioError("scheduling", str(err)) from None
    policy = scheduling.get("dynamic_schedule_policy", "default")
    try:
        resolve_policy(policy)
    except CoreError as err:
        raise ScenarioError("scheduling.dynamic_schedule_policy", err.message) from None


def _parse_run(item: Any, field: str, total: int, per_node: int, per_replica: int,
               scheduling: Mapping[str, Any]) -> RunSpec:
    from controller.core.errors import CoreError
    from controller.core.policies import resolve_policy

    if not isinstance(item, Mapping):
        raise ScenarioError(field, "must be a mapping {name, train_gpus, rollout_gpus, dynamic}")
    known = {f.name for f in dataclasses.fields(RunSpec)}
    for key in item:
        if key not in known:
            raise ScenarioError(f"{field}.{key}", f"unknown field; known: {', '.join(sorted(known))}")
    for key in ("name", "train_gpus", "rollout_gpus"):
        if key not in item:
            raise ScenarioError(f"{field}.{key}", "is required")
    spec = RunSpec(name=_coerce(item["name"], "", f"{field}.name"),
                   train_gpus=_coerce(item["train_gpus"], 0, f"{field}.train_gpus"),
                   rollout_gpus=_coerce(item["rollout_gpus"], 0, f"{field}.rollout_gpus"),
                   dynamic=_coerce(item.get("dynamic", False), False, f"{field}.dynamic"),
                   policy=item.get("policy"))
    _check(f"{field}.train_gpus", spec.train_gpus >= 1, "must be >= 1", spec.train_gpus)
    _check(f"{field}.rollout_gpus", spec.rollout_gpus >= 0, "must be >= 0", spec.rollout_gpus)
    used = spec.train_gpus + spec.rollout_gpus
    if used > total:
        raise ScenarioError(f"{field}.rollout_gpus", f"train_gpus + rollout_gpus = {used} is more than the "
                            f"cluster's total_gpus ({total})")
    for key in ("train_gpus", "rollout_gpus"):
        value = getattr(spec, key)
        _check(f"{field}.{key}", value % per_replica == 0,
               f"must be a multiple of engine.gpus_per_replica ({per_replica})", value)
    if spec.rollout_gpus == 0 and not spec.dynamic:
        raise ScenarioError(f"{field}.rollout_gpus", "must be > 0 for a static run (dynamic: false): without "
                            "rollout GPUs nothing generates; rollout_gpus: 0 is the only-hybrid (colocated) mode "
                            "and needs dynamic: true")
    if spec.policy is not None:
        if not isinstance(spec.policy, str):
            raise ScenarioError(f"{field}.policy", f"must be a string, got {spec.policy!r}")
        try:
            resolve_policy(spec.policy)
        except CoreError as err:
            raise ScenarioError(f"{field}.policy", err.message) from None
    return spec


def _parse_sweep(raw: Any, scheduling: Mapping[str, Any]) -> Sweep:
    from controller.core.errors import CoreError
    from controller.core.policies import resolve_policy

    if not isinstance(raw, Mapping):
        raise ScenarioError("sweep", "must be a mapping {policies, workloads, steps, oracle}")
    for key in raw:
        if key not in ("policies", "workloads", "steps", "oracle"):
            raise ScenarioError(f"sweep.{key}", "unknown field; known: oracle, policies, steps, workloads")
    policies = raw.get("policies", list(Sweep.policies))
    if not isinstance(policies, list) or not policies:
        raise ScenarioError("sweep.policies", "must be a non-empty list of policy names or import paths")
    for index, policy in enumerate(policies):
        try:
            resolve_policy(policy)
        except CoreError as err:
            raise ScenarioError(f"sweep.policies[{index}]", err.message) from None
    workloads = []
    for index, item in enumerate(raw.get("workloads", []) or []):
        if not isinstance(item, Mapping) or "name" not in item:
            raise ScenarioError(f"sweep.workloads[{index}]", "must be a mapping {name, overrides}")
        overrides = item.get("overrides", {}) or {}
        if not isinstance(overrides, Mapping):
            raise ScenarioError(f"sweep.workloads[{index}].overrides", "must be a mapping of dotted fields")
        workloads.append(SweepWorkload(str(item["name"]), dict(overrides)))
    steps = _coerce(raw.get("steps", Sweep.steps), 0, "sweep.steps")
    _check("sweep.steps", steps >= 1, "must be >= 1", steps)
    oracle = _coerce(raw.get("oracle", True), True, "sweep.oracle")
    return Sweep(tuple(policies), tuple(workloads), steps, oracle)


def builtin_scenarios() -> dict[str, Path]:
    """Built-in scenario names -> files (``examples/scenarios/*.yaml``)."""
    if not SCENARIO_DIR.is_dir():
        return {}
    return {path.stem: path for path in sorted(SCENARIO_DIR.glob("*.yaml"))}


def load_scenario(name_or_path: str) -> Scenario:
    """Load a built-in scenario by name, or a YAML file by path; raises ScenarioError."""
    import yaml

    path = Path(name_or_path)
    builtin = builtin_scenarios()
    if not path.is_file():
        if name_or_path in builtin:
            path = builtin[name_or_path]
        else:
            known = ", ".join(builtin) or "none found"
            raise ScenarioError("scenario", f"{name_or_path!r} is neither a file nor a built-in scenario "
                                f"(built-in: {known})")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ScenarioError("scenario", f"{path} is not valid YAML: {err}") from None
    return parse_scenario(raw or {}, source=str(path))
