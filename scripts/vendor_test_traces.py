#!/usr/bin/env python3
"""Derive the trace rows the tests use (tests/data/traces/) from the original traces.

Usage: ``scripts/vendor_test_traces.py SOURCE_DIR`` where SOURCE_DIR holds
``healthbench_chat.jsonl`` and ``id_sentiment_structured.jsonl`` (origin and licence of each in
tests/data/traces/ATTRIBUTION.md). Deterministic: the first :data:`ROWS` rows of each file, in file
order, whose prompt fits the tiny vLLM model (``meta.prompt_chars`` ≤ :data:`MAX_PROMPT_CHARS`);
``meta`` trimmed to what the tests read. Run it only to refresh the vendored files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("healthbench_chat.jsonl", "id_sentiment_structured.jsonl")
ROWS = 40
MAX_PROMPT_CHARS = 400
META_KEYS = ("source", "id", "lang", "prompt_chars")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    source = Path(argv[0])
    out_dir = ROOT / "tests" / "data" / "traces"
    for name in NAMES:
        rows = []
        for line in (source / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if row["meta"]["prompt_chars"] > MAX_PROMPT_CHARS:
                continue
            row["meta"] = {k: row["meta"][k] for k in META_KEYS if k in row["meta"]}
            rows.append(row)
            if len(rows) == ROWS:
                break
        out = out_dir / name
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
        print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
