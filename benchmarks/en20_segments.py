"""Per segment of a resumed run, each stack's median ms per token: does a figure move with
the host? (en20's segments predate `timed_by`, so a segment is the job folder that first
journaled an utterance.)

    python benchmarks/en20_segments.py benchmarks/h200/issue14-en20-state.tgz

The job folders are read in the order their journals grew (each resume carries the last
one's lines first), and an utterance belongs to the first folder that journaled it.
"""

from __future__ import annotations

import json
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path


def main(state: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(state) as tar:
            tar.extractall(tmp, filter="data")
        found = Path(tmp).glob("*/runs/*/utterances.jsonl")
        journals = sorted(found, key=lambda p: len(p.read_text().splitlines()))
        seen: set[tuple[str, str, int]] = set()
        for i, path in enumerate(journals, 1):
            per_stack: dict[str, list[float]] = {}
            for line in path.read_text().splitlines():
                row = json.loads(line)
                u = row["utterance"]
                key = (row["stack"], u["prompt_id"], u["seed"])
                if key in seen:
                    continue
                seen.add(key)
                per_stack.setdefault(row["stack"], []).append(1e3 * u["lm_s"] / u["new_tokens"])
            cells = ", ".join(
                f"{name} {statistics.median(v):.2f} ms/token (n={len(v)})"
                for name, v in per_stack.items()
            )
            print(f"segment {i} ({path.parent.name}): {cells}")


if __name__ == "__main__":
    main(sys.argv[1])
