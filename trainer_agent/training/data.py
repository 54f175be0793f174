"""verl-format datasets: parquet (or JSONL) rows rendered into token prompts with the model's tokenizer.

A row is what verl's data preprocessing scripts write: ``data_source``, the
prompt under ``data.prompt_key`` (a chat message list ``[{"role", "content"},
...]`` or a plain string), ``reward_model.ground_truth`` and ``extra_info``.
Chat prompts are rendered with the tokenizer's chat template and the
generation prompt; strings are tokenized as they are. A prompt longer than
``max_prompt_length`` tokens is dropped with ``filter_overlong_prompts``, else
handled by ``truncation`` (``error``: fail naming the row; ``left`` / ``right``:
keep the last / first tokens). Prompts are taken in order, or shuffled with
``seed`` (a new order each pass, as verl's sampler does).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SUFFIXES = (".parquet", ".jsonl", ".json")


class DatasetError(ValueError):
    """A dataset that cannot be used as configured (the message names the file, row or key)."""


@dataclasses.dataclass(frozen=True)
class DataRow:
    """One prompt of the dataset, rendered, with what its reward function is given."""

    prompt_id: str
    token_ids: tuple[int, ...]
    row: int
    data_source: str
    ground_truth: Any
    extra_info: Any
    messages: tuple[dict[str, Any], ...] = ()
    """The prompt's chat messages (empty for a string prompt): where a multi-turn trajectory starts."""


def files_of(train_files: str | Sequence[str]) -> list[Path]:
    return [Path(f).expanduser() for f in ([train_files] if isinstance(train_files, str) else train_files)]


def columns(path: Path) -> list[str]:
    """The column names of a parquet file (its schema only) or of a JSONL file's first row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with path.open() as f:
        first = next((line for line in f if line.strip()), "")
    return list(json.loads(first)) if first else []


def check_files(train_files: str | Sequence[str], prompt_key: str) -> None:
    """Raise :class:`DatasetError` unless every file exists, has a known format and a ``prompt_key`` column."""
    paths = files_of(train_files)
    if not paths:
        raise DatasetError("no file given")
    for path in paths:
        if path.suffix not in SUFFIXES:
            raise DatasetError(f"{str(path)[:120]!r}: expected a .parquet or .jsonl file")
        if not path.is_file():
            raise DatasetError(f"{str(path)[:120]!r} does not exist")
        try:
            names = columns(path)
        except Exception as exc:  # noqa: BLE001 - a corrupt file is a bad dataset, said as such
            raise DatasetError(f"{str(path)[:120]!r} cannot be read: {exc}") from None
        if prompt_key not in names:
            raise DatasetError(f"{str(path)[:120]!r} has no column {prompt_key!r} (data.prompt_key); its columns: "
                               f"{names[:12]}")


def read_rows(train_files: str | Sequence[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in files_of(train_files):
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(path).to_pylist())
        else:
            with path.open() as f:
                rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def _render(tokenizer: Any, prompt: Any, index: int, tools: list[dict[str, Any]] | None = None) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in prompt):
        rendered = tokenizer.apply_chat_template(list(prompt), tools=tools, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return [int(t) for t in rendered]
    raise DatasetError(f"row {index}: the prompt must be a string or a list of {{role, content}} messages, got "
                       f"{str(prompt)[:80]!r}")


def load_dataset(train_files: str | Sequence[str], tokenizer: Any, *, prompt_key: str = "prompt",
                 max_prompt_length: int = 512, truncation: str = "error",
                 filter_overlong_prompts: bool = False, tools: list[dict[str, Any]] | None = None) -> list[DataRow]:
    """Every usable row, rendered (see the module docstring; chat prompts with ``tools``' schemas, for
    multi-turn trajectories). Raises :class:`DatasetError`."""
    check_files(train_files, prompt_key)
    out: list[DataRow] = []
    for index, row in enumerate(read_rows(train_files)):
        if prompt_key not in row:
            raise DatasetError(f"row {index} has no {prompt_key!r}")
        ids = _render(tokenizer, row[prompt_key], index, tools)
        if len(ids) > max_prompt_length:
            if filter_overlong_prompts:
                continue
            if truncation == "left":
                ids = ids[-max_prompt_length:]
            elif truncation == "right":
                ids = ids[:max_prompt_length]
            else:
                raise DatasetError(f"row {index}: the prompt is {len(ids)} tokens, more than data.max_prompt_length "
                                   f"{max_prompt_length} (data.truncation error; set left/right or "
                                   "data.filter_overlong_prompts)")
        if not ids:
            raise DatasetError(f"row {index}: the prompt renders to no tokens")
        reward_model = row.get("reward_model") or {}
        prompt = row[prompt_key]
        out.append(DataRow(f"r{index}", tuple(ids), index, str(row.get("data_source") or ""),
                           reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
                           row.get("extra_info"),
                           tuple(dict(m) for m in prompt) if not isinstance(prompt, str) else ()))
    if not out:
        raise DatasetError("no prompt is left (every one is longer than data.max_prompt_length)")
    return out


def prompt_order(rows: Sequence[DataRow], *, shuffle: bool, seed: int) -> Iterator[DataRow]:
    """Rows forever, pass after pass; with ``shuffle`` each pass in a new order drawn from ``seed``."""
    for epoch in itertools.count():
        order = list(rows)
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        yield from order
