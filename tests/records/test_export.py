"""``specshadow records export`` on records built by hand: the rows are the records' own ids with
the loss on the output only, what the capture policy did not keep is skipped and counted, the
filters and the redaction hook do what they say, speculators' data preparation would take the
file, and memory stays bounded however many records stream through.

speculators (0.9) is not installed here: it pulls torch. Its data preparation reads a JSON lines
file with ``datasets.load_dataset("json", ...)`` (pyarrow's JSON reader underneath) and passes
rows that have both ``input_ids`` and ``loss_mask`` straight through
(``speculators/data_generation/preprocessing.py``: ``_passthrough_pretokenized``, ``_append_row``):
it raises on a row whose two lists differ in length, drops a row with no supervised position, and
truncates to the sequence length. :func:`speculators_passthrough` is that code, line for line,
without torch; the file is read with pyarrow's JSON reader, as ``datasets`` reads it.
"""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow.json as pa_json  # type: ignore[import-untyped]  # no stubs
import pytest

from core import jsonx
from counterfactual.labels import label_row, parse_config
from counterfactual.replay import ngram_offers, replay
from records.export import ExportCounts, ExportFilter, RedactError, export_rows, write_rows
from records.reader import Record
from records.sqlite_store import RecordStore
from specshadow.main import main as cli_main


def record(
    i: int,
    *,
    prompt: list[int] | None,
    output: list[int] | None,
    category: str = "code",
    text: bool = False,
) -> dict[str, Any]:
    tokens = (
        None
        if prompt is None or output is None
        else {"source": "tokenize:cand", "leg": "primary", "prompt": prompt, "output": output,
              "output_source": "engine", "output_tokens_reported": len(output), "drafters": {},
              "legs": {}}
    )  # fmt: skip
    out_text = {"sha256": "x", "chars": 5, **({"text": f"answer {i}"} if text else {})}
    return {
        "schema": "specshadow.record/1",
        "exchange_id": f"ex-{i:06d}",
        "started_unix_ns": 1_700_000_000_000_000_000 + i * 1_000_000_000,
        "category": category,
        "greedy": i % 2 == 0,
        "capture": "full" if text else "hashes",
        "request": {"sha256": "y", "chars": 9, **({"text": f"prompt {i}"} if text else {})},
        "legs": [
            {"role": "primary", "backend": "prim", "outcome": "completed", "output": out_text}
        ],
        "tokens": tokens,
    }


def repetitive(rng: random.Random, n: int) -> list[int]:
    base = [rng.randrange(50, 90) for _ in range(6)]
    return [base[j % 6] if rng.random() < 0.7 else rng.randrange(100, 200) for j in range(n)]


def speculators_passthrough(
    examples: dict[str, list[Any]], max_length: int
) -> dict[str, list[Any]]:
    """speculators 0.9's ``_passthrough_pretokenized`` + ``_append_row`` (no minimum), torch-free."""
    results: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for ids, mask in zip(examples["input_ids"], examples["loss_mask"], strict=True):
        if len(ids) != len(mask):
            raise ValueError(
                f"Speculator-format row shape mismatch: input_ids={len(ids)}, loss_mask={len(mask)}"
            )
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) == 0:
            continue
        results["input_ids"].append(ids)
        results["loss_mask"].append(mask)
        results["seq_len"].append(len(ids))
    return results


def test_rows_are_the_records_own_ids_with_the_loss_on_the_output_only() -> None:
    rng = random.Random(1)
    recs = [
        record(i, prompt=repetitive(rng, 20 + i), output=repetitive(rng, 30 + i)) for i in range(8)
    ]
    recs.append(record(8, prompt=None, output=None))  # the tap's share did not take it
    recs.append(record(9, prompt=[1, 2], output=[]))  # nothing to learn from
    counts = ExportCounts()
    rows = list(export_rows(recs, "speculators", counts=counts))
    assert len(rows) == 8
    for r, row in zip(recs, rows, strict=False):
        prompt, output = r["tokens"]["prompt"], r["tokens"]["output"]
        assert row["input_ids"] == prompt + output
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(output)
        assert (row["exchange_id"], row["category"], row["output_source"]) == (
            r["exchange_id"], "code", "engine",
        )  # fmt: skip
    assert (counts.read, counts.written, counts.no_token_ids, counts.empty_output) == (10, 8, 1, 1)


def test_conversations_need_the_text_the_capture_setting_kept() -> None:
    recs = [record(i, prompt=[1], output=[2], text=i % 3 != 0) for i in range(9)]
    counts = ExportCounts()
    rows = list(export_rows(recs, "conversations", counts=counts))
    assert counts.no_text == 3 and counts.written == 6
    assert rows[0]["id"] == rows[0]["exchange_id"] == "ex-000001"
    assert rows[0]["conversations"] == [
        {"role": "user", "content": "prompt 1"},
        {"role": "assistant", "content": "answer 1"},
    ]


def test_the_acceptance_label_is_the_configurations_replay_and_the_filters_select_on_it() -> None:
    rng = random.Random(2)
    recs = [record(i, prompt=repetitive(rng, 24), output=repetitive(rng, 60),
                   category="code" if i % 2 else "chat") for i in range(40)]  # fmt: skip
    config = parse_config("ngram:4:2-4")
    labels = {r["exchange_id"]: label_row(Record(r), config) for r in recs}
    # The label, recomputed here from the replay itself.
    for r in recs:
        t = r["tokens"]
        available, match = ngram_offers(t["prompt"], t["output"], 2, 4, 4)
        rep = replay(len(t["output"]), 4, available, match)
        want = rep.accepted / rep.draft_tokens if rep.draft_tokens else None
        assert labels[r["exchange_id"]]["acceptance"] == want
    rates = sorted(v["acceptance"] for v in labels.values() if v["acceptance"] is not None)
    cut = rates[len(rates) // 2]
    counts = ExportCounts()
    low = list(
        export_rows(recs, "speculators", where=ExportFilter("code", max_acceptance=cut),
                    labeller=lambda r: label_row(r, config), counts=counts)
    )  # fmt: skip
    want_ids = {
        r["exchange_id"] for r in recs
        if r["category"] == "code" and labels[r["exchange_id"]]["acceptance"] is not None
        and labels[r["exchange_id"]]["acceptance"] <= cut
    }  # fmt: skip
    assert {row["exchange_id"] for row in low} == want_ids and want_ids
    assert counts.other_category == 20
    assert counts.written + counts.outside_acceptance + counts.no_acceptance == 20
    assert all(row["acceptance_config"] == "ngram k=4 lookup 2-4" for row in low)
    with pytest.raises(ValueError, match="labeller"):
        list(export_rows(recs, "speculators", where=ExportFilter(min_acceptance=0.5)))


def test_speculators_data_preparation_takes_the_file(tmp_path: Path) -> None:
    rng = random.Random(3)
    recs = [record(i, prompt=repetitive(rng, 10 + i % 7), output=repetitive(rng, 5 + i % 11))
            for i in range(300)]  # fmt: skip
    config = parse_config("ngram:2:1-3")
    path = tmp_path / "train.jsonl"
    with path.open("wb") as f:
        n = write_rows(export_rows(recs, "speculators", labeller=lambda r: label_row(r, config)), f)
    assert n == 300
    # As datasets reads it (pyarrow's JSON reader, small blocks: the schema must hold across
    # blocks, labels that are null in one block and numbers in another included).
    table = pa_json.read_json(path, read_options=pa_json.ReadOptions(block_size=4096))
    assert str(table.schema.field("input_ids").type) == "list<item: int64>"
    assert str(table.schema.field("loss_mask").type) == "list<item: int64>"
    columns = table.to_pydict()
    assert {"input_ids", "loss_mask"} <= set(columns)  # speculators' "pre-tokenised" test
    prepared = speculators_passthrough(columns, max_length=2048)
    assert len(prepared["input_ids"]) == 300  # every row kept, none raised
    for ids, mask, r in zip(prepared["input_ids"], prepared["loss_mask"], recs, strict=True):
        assert ids == r["tokens"]["prompt"] + r["tokens"]["output"]
        assert mask.index(1) == len(r["tokens"]["prompt"]) and set(mask) == {0, 1}


def stored(path: Path, n: int, length: int = 120) -> Path:
    rng = random.Random(4)
    store = RecordStore(path)
    for start in range(0, n, 500):
        store.append([
            record(i, prompt=repetitive(rng, length // 4), output=repetitive(rng, 3 * length // 4))
            for i in range(start, min(n, start + 500))
        ])  # fmt: skip
    store.close()
    return path


def peak_kib(store: Path, out: Path) -> float:
    argv = [
        "records",
        "export",
        "--store",
        str(store),
        "--format",
        "speculators",
        "--out",
        str(out),
    ]
    tracemalloc.start()
    try:
        assert cli_main(argv) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / 1024


def test_memory_stays_bounded_however_many_records_stream_through(tmp_path: Path) -> None:
    small = peak_kib(stored(tmp_path / "small.sqlite", 100), tmp_path / "small.jsonl")
    large = peak_kib(stored(tmp_path / "large.sqlite", 1500), tmp_path / "large.jsonl")
    print(f"peak {small:.0f} KiB for 100 records, {large:.0f} KiB for 1,500")
    assert len((tmp_path / "large.jsonl").read_bytes().splitlines()) == 1500
    # Fifteen times the records: what grows is the reader's set of exchange ids seen (it
    # deduplicates replicas' stores) and whatever cyclic garbage the collector has not reached
    # yet — 0.14 KiB a record alone, 0.31 in one clean CI run (the suite's gc state differs);
    # holding the rows would cost ~3 KiB each. Held at 1 KiB, a third of that.
    assert large < small + 1.0 * 1400, (small, large)


def test_the_command_exports_from_a_store_says_what_it_skipped_and_redacts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "r.sqlite"
    rng = random.Random(5)
    writer = RecordStore(store)
    recs = [record(i, prompt=repetitive(rng, 12), output=repetitive(rng, 20),
                   category="code" if i % 4 else "chat") for i in range(30)]  # fmt: skip
    recs += [record(30 + i, prompt=None, output=None) for i in range(5)]
    writer.append(recs)
    writer.close()
    hook = tmp_path / "scrub.py"
    hook.write_text(
        "def scrub(row):\n"
        "    if row['exchange_id'].endswith('1'):\n        return None\n"
        "    row['input_ids'] = row['input_ids']\n    row['scrubbed'] = True\n    return row\n"
    )
    out = tmp_path / "train.jsonl"
    argv = ["records", "export", "--store", str(store), "--format", "speculators", "--out",
            str(out), "--category", "code", "--redact", f"{hook}:scrub"]  # fmt: skip
    assert cli_main(argv) == 0
    rows = [jsonx.loads(line) for line in out.read_bytes().splitlines()]
    code = [r for r in recs if r["category"] == "code" and r["tokens"] is not None]
    kept = [r for r in code if not r["exchange_id"].endswith("1")]
    assert [row["exchange_id"] for row in rows] == [r["exchange_id"] for r in kept]
    assert all(row["scrubbed"] and row["acceptance_config"] for row in rows)
    err = capsys.readouterr().err
    assert f"wrote {len(kept)} speculators rows of 35 records" in err
    assert "5 no token ids" in err and f"{len(code) - len(kept)} redacted away" in err
    assert "other category" in err
    # A bad hook or rate is a clear error, and no file is left half-written.
    bad = ["records", "export", "--store", str(store), "--format", "speculators", "--out",
           str(tmp_path / "x.jsonl"), "--redact", "no_such_module_here:f"]  # fmt: skip
    assert cli_main(bad) == 2
    assert "cannot import no_such_module_here" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(SystemExit):
        cli_main([*bad[:-2], "--max-acceptance", "1.5"])


def test_rows_are_labelled_with_the_classes_of_the_tokens_their_drafts_were_rejected_at(
    tmp_path: Path,
) -> None:
    """Words repeat (the n-gram proposer drafts them); numbers break the pattern at known
    places, so every rejection is at a number, and the numbers are what a word-only drafter
    vocabulary lacks."""
    words = {1: " alpha", 2: " beta", 3: " gamma", 4: " delta"}
    numbers = {10 + n: f" {n}" for n in range(20)}
    rng = random.Random(6)
    recs = []
    for i in range(12):
        out = [10 + rng.randrange(20) if j % 9 == 8 else 1 + j % 4 for j in range(60)]
        recs.append(record(i, prompt=[1, 2, 3, 4] * 3, output=out))
    texts = tmp_path / "texts.json"
    texts.write_bytes(jsonx.dumps({str(k): v for k, v in {**words, **numbers}.items()}))
    vocab = tmp_path / "vocab.json"
    vocab.write_bytes(jsonx.dumps(sorted(words)))
    store = tmp_path / "r.sqlite"
    s = RecordStore(store)
    s.append(recs)
    s.close()
    out_path = tmp_path / "rows.jsonl"
    argv = ["records", "export", "--store", str(store), "--format", "speculators", "--out",
            str(out_path), "--token-texts", str(texts), "--drafter-vocabulary", str(vocab)]  # fmt: skip
    assert cli_main(argv) == 0
    rows = [jsonx.loads(line) for line in out_path.read_bytes().splitlines()]
    assert len(rows) == 12
    total = 0
    for row, r in zip(rows, recs, strict=True):
        t = r["tokens"]
        available, match = ngram_offers(t["prompt"], t["output"], 2, 4, 4)
        rep = replay(len(t["output"]), 4, available, match)
        rejections = row["rejections"]
        # One per drafting step that was rejected, each at a number (a number never repeats
        # where the proposer looks, so at most one rejection per number).
        assert sum(rejections.values()) == len(rep.rejected_at) > 0
        assert rejections["number"] <= sum(tok >= 10 for tok in t["output"])
        assert {c for c, v in rejections.items() if v} == {"number"}, rejections
        total += rejections["number"]
        assert row["out_of_vocabulary"] == sum(tok >= 10 for tok in t["output"])
    assert total > 0


def test_the_window_picks_the_exchanges_that_started_in_it(tmp_path: Path) -> None:
    store = tmp_path / "r.sqlite"
    s = RecordStore(store)
    s.append([record(i, prompt=[1, 2], output=[3, 4]) for i in range(10)])
    s.close()
    # record(i) started at 1_700_000_000 + i seconds: 2023-11-14T22:13:20Z + i s.
    out = tmp_path / "w.jsonl"
    argv = ["records", "export", "--store", str(store), "--format", "speculators", "--out", str(out),
            "--since", "2023-11-14T22:13:23Z", "--until", "2023-11-14T22:13:27Z"]  # fmt: skip
    assert cli_main(argv) == 0
    rows = [jsonx.loads(line) for line in out.read_bytes().splitlines()]
    assert [row["exchange_id"] for row in rows] == [f"ex-{i:06d}" for i in range(3, 7)]


def test_engine_ids_only_skips_outputs_that_were_re_tokenized() -> None:
    recs = [record(i, prompt=[1, 2], output=[3, 4]) for i in range(6)]
    recs[1]["tokens"]["output_source"] = "tokenize:http://127.0.0.1:8102"
    recs[2]["tokens"]["output_source"] = "leg:ngram"  # a shadow's generated ids: the engine's
    counts = ExportCounts()
    rows = list(export_rows(recs, "speculators", where=ExportFilter(engine_ids_only=True),
                            counts=counts))  # fmt: skip
    assert [row["exchange_id"] for row in rows] == [f"ex-{i:06d}" for i in (0, 2, 3, 4, 5)]
    assert counts.not_engine_ids == 1
    assert len(list(export_rows(recs, "speculators"))) == 6  # kept by default, labelled


def test_a_tokenizer_that_is_the_primarys_server_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = record(0, prompt=[1, 2], output=[3, 4])
    rec["legs"][0]["server_address"] = "127.0.0.1:8101"
    store = tmp_path / "r.sqlite"
    s = RecordStore(store)
    s.append([rec])
    s.close()
    out = tmp_path / "x.jsonl"
    argv = ["records", "export", "--store", str(store), "--format", "speculators", "--out",
            str(out), "--tokenizer", "http://127.0.0.1:8101"]  # fmt: skip
    assert cli_main(argv) == 1
    assert "is the primary's server" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "x.jsonl.partial").exists()


def test_a_redaction_hook_that_fails_stops_the_export_saying_where() -> None:
    recs = [record(i, prompt=[1], output=[2]) for i in range(3)]

    def boom(row: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("secret")

    with pytest.raises(RedactError, match="raised on exchange ex-000000: KeyError"):
        list(export_rows(recs, "speculators", redact=boom))
    with pytest.raises(RedactError, match="returned str for exchange ex-000000"):
        list(export_rows(recs, "speculators", redact=lambda row: "no"))  # type: ignore[arg-type,return-value]
