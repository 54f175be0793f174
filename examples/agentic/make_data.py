"""Writes examples/data/multiturn_lookup.parquet: 64 rows, each asking for its own secret letter.

Every row has the same question and its own secret (uniform over A-Z), handed to the lookup tool through
verl's ``extra_info.tools_kwargs`` and to the reward as ``reward_model.ground_truth``.

    python examples/agentic/make_data.py   # rewrites the file (deterministic)
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parents[1] / "data" / "multiturn_lookup.parquet"
QUESTION = "what is the secret?"


def rows(count: int = 64, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        secret = rng.choice(string.ascii_uppercase)
        out.append({"data_source": "rollmesh/lookup", "ability": "tool_use",
                    "prompt": [{"role": "user", "content": QUESTION}],
                    "reward_model": {"style": "rule", "ground_truth": secret},
                    "extra_info": {"index": index, "tools_kwargs": {"lookup": {"create_kwargs": {"secret": secret}}}}})
    return out


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows()), OUT)
    print(f"wrote {len(rows())} rows to {OUT}")


if __name__ == "__main__":
    main()
