"""Writes examples/data/quickstart.parquet: the quick start's task, as a verl-format dataset.

Each row asks, in lower case, for a kind of character (``digits`` or ``capitals``) in a few phrasings; the
reward (examples/quickstart_reward.py) is the share of the first three response characters of that kind. A
random tiny model starts near 0 (neither kind occurs in the prompts, and few of its characters happen to be
of the asked kind) and learns, from the prompt, which kind to write. The columns are verl's (``data_source``, ``prompt`` as a chat message list,
``ability``, ``reward_model.ground_truth``, ``extra_info``).

    python examples/make_quickstart_data.py   # rewrites the file (deterministic)
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PHRASINGS = {"digits": ["digits", "write digits", "numbers only", "reply in digits"],
             "capitals": ["capitals", "write capitals", "upper case only", "reply in capitals"]}
OUT = Path(__file__).resolve().parent / "data" / "quickstart.parquet"


def rows() -> list[dict]:
    out = []
    for kind, phrasings in PHRASINGS.items():
        for text in phrasings:
            out.append({"data_source": "rollmesh/char_kind", "ability": "format",
                        "prompt": [{"role": "user", "content": text}],
                        "reward_model": {"style": "rule", "ground_truth": kind},
                        "extra_info": {"split": "train", "index": len(out)}})
    return out


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows()), OUT)
    print(f"wrote {len(rows())} rows to {OUT}")


if __name__ == "__main__":
    main()
