#!/usr/bin/env python3
"""Derive the bundled demo trace (loadgen/data/demo_trace.jsonl) from the original traces.

Usage: ``scripts/make_demo_trace.py SOURCE_DIR`` (the folder holding the two original trace files).

Deterministic: the first rows of each category in file order, ``max_tokens`` capped so the demo
stays short. The origin and licence of each source are in loadgen/data/ATTRIBUTION.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {
    "healthbench_chat.jsonl": {"chat": 48, "multi_turn": 36},
    "id_sentiment_structured.jsonl": {"structured_output": 36},
}
MAX_TOKENS = 96


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    traces = Path(sys.argv[1])
    rows = []
    for name, wanted in SOURCES.items():
        left = dict(wanted)
        for line in (traces / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if left.get(row["category"], 0) <= 0:
                continue
            left[row["category"]] -= 1
            row["max_tokens"] = min(int(row.get("max_tokens", MAX_TOKENS)), MAX_TOKENS)
            row["meta"] = {k: row["meta"][k] for k in ("source", "id", "lang") if k in row["meta"]}
            rows.append(row)
    # interleave categories so a short replay sees all of them
    rows.sort(key=lambda r: (r["meta"]["id"][-3:], r["category"]))
    out = ROOT / "loadgen" / "data" / "demo_trace.jsonl"
    out.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
