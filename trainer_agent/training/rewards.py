"""Custom reward functions the verl way: ``custom_reward_function.path`` + ``.name``, verl's signature.

The function is called as verl's reward manager calls it::

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)

``solution_str`` is the completion decoded with the model's tokenizer
(special tokens skipped). It returns a number, or a dict with a ``score`` key
and other numeric entries that are averaged into the step's metrics as
``reward_extra/<key>``. A function that raises, or returns anything else,
fails the run with the row and the traceback: a broken reward never becomes
a silent 0. With ``num_workers > 0`` the calls run in a pool of that many
processes (spawned, each importing the file once), for rewards that are slow
or hold the GIL; with 0 they run in the training thread.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import math
import multiprocessing
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .data import DataRow

_LOADED: dict[tuple[str, str], Callable[..., Any]] = {}


class RewardFunctionError(RuntimeError):
    """The reward function could not be loaded, or failed on a row (the message says which and why)."""


def load_function(path: str, name: str) -> Callable[..., Any]:
    """``name`` from the Python file at ``path`` (imported once per process)."""
    key = (str(Path(path).resolve()), name)
    if key in _LOADED:
        return _LOADED[key]
    file = Path(path)
    if not file.is_file():
        raise RewardFunctionError(f"custom_reward_function.path {path[:120]!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"rollmesh_reward_{abs(hash(key))}", file)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"custom_reward_function.path {path[:120]!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise RewardFunctionError(f"importing {path[:120]!r} failed: {exc!r}\n{traceback.format_exc()}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardFunctionError(f"{path[:120]!r} has no function {name!r} (custom_reward_function.name)")
    _LOADED[key] = function
    return function


def _call(path: str, name: str, row: int, data_source: str, solution: str, ground_truth: Any,
          extra_info: Any) -> tuple[float, dict[str, float]] | str:
    """One call, in whichever process; a failure comes back as its message (exceptions may not pickle)."""
    try:
        result = load_function(path, name)(data_source=data_source, solution_str=solution,
                                           ground_truth=ground_truth, extra_info=extra_info)
    except Exception:  # noqa: BLE001 - reported with its traceback
        return traceback.format_exc()
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            return f"returned a dict without a 'score' key: {str(result)[:200]}"
        extras = {k: float(v) for k, v in result.items()
                  if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        result = result["score"]
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
        return f"returned {str(result)[:80]!r}, not a finite number"
    return float(result), extras


class RewardScorer:
    """Scores completions of dataset rows with the user's reward function."""

    def __init__(self, path: str, name: str, tokenizer: Any, *, num_workers: int = 0) -> None:
        load_function(path, name)   # fail at start, not at the first step
        self.path, self.name, self.tokenizer = path, name, tokenizer
        self._pool = (concurrent.futures.ProcessPoolExecutor(num_workers,
                                                             mp_context=multiprocessing.get_context("spawn"))
                      if num_workers > 0 else None)

    def score(self, items: Sequence[tuple[DataRow, Sequence[int]]]) -> tuple[list[float], dict[str, float]]:
        """Scores of ``(row, completion_ids)`` pairs, in order, and the mean of each extra metric."""
        calls = [(self.path, self.name, row.row, row.data_source,
                  self.tokenizer.decode(list(ids), skip_special_tokens=True), row.ground_truth, row.extra_info)
                 for row, ids in items]
        if self._pool is not None:
            results = list(self._pool.map(_call, *zip(*calls))) if calls else []
        else:
            results = [_call(*c) for c in calls]
        scores: list[float] = []
        sums: dict[str, list[float]] = {}
        for (row, _), call, result in zip(items, calls, results):
            if isinstance(result, str):
                raise RewardFunctionError(
                    f"custom_reward_function {self.name!r} ({self.path}) failed on row {row.row} (data_source "
                    f"{row.data_source!r}, solution {call[4][:60]!r}): {result}")
            score, extras = result
            scores.append(score)
            for key, value in extras.items():
                sums.setdefault(key, []).append(value)
        return scores, {f"reward_extra/{k}": sum(v) / len(v) for k, v in sums.items()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
