"""``specshadow counterfactual --cross-vocab``: a drafter with its own tokenizer, scored end to end.

Two hand-built vocabularies (a byte-level target, a SentencePiece-style drafter whose ``▁`` marks
a space) whose intersection is written out by hand; a fake drafter server on a real socket
answering vLLM's ``/v1/completions`` — ``prompt_logprobs`` over a token-id prompt (TLI) and a
greedy text continuation of a text prompt (SLEM) — by rules the test knows. The ground truth
(masked predictions, positions with no candidate, each step's drafted and accepted tokens) is
computed here from those rules and the hand-written map, with a step loop of its own, and the
CLI's rows and summary must equal it exactly.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from core import jsonx
from counterfactual.crossvocab_drafter import (
    build_intersection,
    load_vocabulary,
    masked_argmax,
    parse_cross_vocab,
)
from counterfactual.matrix import ALL
from records.sqlite_store import RecordStore
from specshadow.main import main as cli_main

TARGET = ["<|endoftext|>", "a", "b", "c", "\u0120a", "\u0120b", "ab", "\u0120c", "d"]
DRAFT = ["</s>", "b", "\u2581a", "a", "\u2581c", "ba", "\u2581b", "zz"]
# By hand: the normalised strings both have ("a", "b", " a", " b", " c"), target id → draft id.
T2D = {1: 3, 2: 1, 4: 2, 5: 6, 7: 4}
D2T = {d: t for t, d in T2D.items()}
TEXT = {1: "a", 2: "b", 3: "c", 4: " a", 5: " b", 6: "ab", 7: " c", 8: "d"}
TOP = 3
DRAFT_UNK = 0  # no unk: the drafter's eos


def _tokenizer(folder: Path, vocab: list[str], pre: str, eos: str) -> Path:
    folder.mkdir()
    model = {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab) if i}, "merges": []}
    (folder / "tokenizer.json").write_bytes(jsonx.dumps({
        "model": model,
        "added_tokens": [{"id": 0, "content": vocab[0], "special": True}],
        "pre_tokenizer": {"type": pre},
        "decoder": {"type": pre},
    }))  # fmt: skip
    (folder / "tokenizer_config.json").write_bytes(jsonx.dumps({"eos_token": eos}))
    (folder / "config.json").write_bytes(jsonx.dumps({"vocab_size": len(vocab)}))
    return folder


def _ranked(i: int, actual: int) -> list[tuple[int, int]]:
    """The fake drafter's (draft id, rank) at absolute position ``i`` of its prompt."""
    if i % 5 == 0:  # only tokens outside the intersection in the top 3; the actual one at 9
        top = [5, 7, 0]
        return [
            *((t, r) for r, t in enumerate(top, 1)),
            *([(actual, 9)] if actual not in top else []),
        ]
    if i % 3 == 0:  # a wrong token inside the intersection ranks above the actual one
        wrong = 3 if actual != 3 else 1
        top = [5, wrong, actual] if actual != wrong else [5, wrong, 7]
        return [(t, r) for r, t in enumerate(top, 1)]
    top = [7, actual, 5] if actual not in (7, 5) else [7, 5, actual]
    return [(t, r) for r, t in enumerate(dict.fromkeys(top), 1)]


class _Drafter(BaseHTTPRequestHandler):
    # SLEM: context text → the output's token texts after it; the calls, by rule.
    tokens_after: ClassVar[dict[str, list[str]]] = {}
    calls: ClassVar[list[str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: object) -> None:
        data = jsonx.dumps(body)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"data": [{"id": "xdraft"}]})

    def do_POST(self) -> None:
        body = jsonx.loads(self.rfile.read(int(self.headers["content-length"])))
        assert body["model"] == "xdraft" and body["temperature"] == 0
        prompt = body["prompt"]
        if isinstance(prompt, list):  # TLI: teacher-forced prompt_logprobs
            self.calls.append("tli")
            assert body["prompt_logprobs"] == TOP and body["max_tokens"] == 1
            logprobs: list[Any] = [None] + [
                {str(t): {"logprob": -0.5 * r, "rank": r} for t, r in _ranked(i, prompt[i])}
                for i in range(1, len(prompt))
            ]
            self._send({"choices": [{"text": "x", "prompt_logprobs": logprobs}]})
            return
        self.calls.append("slem")
        after = self.tokens_after[prompt]
        k = body["max_tokens"]
        # Every 4th context length: one right token, then text the output does not have.
        text = after[0] + "zz" if len(prompt) % 4 == 0 else "".join(after[:k])
        self._send({"choices": [{"text": text}]})


@pytest.fixture
def drafter() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Drafter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _traffic() -> list[tuple[str, list[int], list[int], str]]:
    rng = random.Random(7)
    out = []
    for i in range(12):
        prompt = [rng.randint(1, 8) for _ in range(rng.randint(3, 7))]
        output = [rng.randint(1, 8) for _ in range(rng.randint(8, 30))]
        out.append((f"x{i}", prompt, output, "code" if i % 2 else "chat"))
    return out


def _steps(
    n: int, k: int, available: list[int], match: list[int]
) -> tuple[int, int, int, list[int]]:
    """(drafts, drafted, accepted, first rejected positions): the step contract, written out."""
    drafts = drafted = accepted = 0
    rejected: list[int] = []
    j = 1
    while j < n:
        d = min(k, available[j], n - j - 1)
        if d <= 0:
            j += 1
            continue
        a = 0
        while a < d and a < match[j] and j + a < n:
            a += 1
        drafts, drafted, accepted = drafts + 1, drafted + d, accepted + a
        if a < d:
            rejected.append(j + a)
        j += a + 1
    return drafts, drafted, accepted, rejected


def _tli_truth(prompt: list[int], output: list[int]) -> tuple[list[bool], int]:
    """(the masked prediction equals the output, per position; positions with no candidate)."""
    p, good, misses = len(prompt), [False], 0
    for j in range(1, len(output)):
        i, inside = p + j, output[j] in T2D
        if i % 5 == 0 or (i % 3 != 0 and not inside):
            misses += 1
        good.append(i % 5 != 0 and i % 3 != 0 and inside)
    return good, misses


def _runs(good: list[bool]) -> list[int]:
    out = [0] * (len(good) + 1)
    for j in range(len(good) - 1, -1, -1):
        out[j] = out[j + 1] + 1 if good[j] else 0
    return out[: len(good)]


def _store(path: Path, traffic: list[tuple[str, list[int], list[int], str]]) -> Path:
    store = RecordStore(path)
    store.append([
        {"schema": "specshadow.record/1", "exchange_id": rid,
         "started_unix_ns": 1_700_000_000_000_000_000 + i, "category": cat, "greedy": True, "legs": [],
         "tokens": {"source": "test", "leg": "primary", "prompt": prompt, "output": output,
                    "drafters": {}}}
        for i, (rid, prompt, output, cat) in enumerate(traffic)
    ])  # fmt: skip
    store.close()
    return path


def test_vocabularies_and_masked_argmax(tmp_path: Path) -> None:
    t = load_vocabulary(_tokenizer(tmp_path / "t", TARGET, "ByteLevel", "<|endoftext|>"))
    d = load_vocabulary(_tokenizer(tmp_path / "d", DRAFT, "Metaspace", "</s>"))
    assert (t.prefixes, d.prefixes, t.unk, d.unk) == (("\u0120",), ("\u2581",), 0, 0)
    x = build_intersection(t, d)
    assert dict(x.target_to_draft) == T2D and dict(x.draft_to_target) == D2T
    logprobs = [
        None,
        None,
        {"5": {"rank": 1}, "3": {"rank": 2}},
        {"7": {"rank": 1}, "1": {"rank": 9}},
    ]
    assert masked_argmax(logprobs, 1, 3, D2T, 3) == ([None, 3, None], 1)
    with pytest.raises(ValueError, match="too short"):
        masked_argmax(logprobs, 2, 3, D2T, 3)


def test_cli_tli_and_slem_rows_equal_the_hand_computed_steps(
    tmp_path: Path, drafter: str, capsys: pytest.CaptureFixture[str]
) -> None:
    traffic = _traffic()
    _Drafter.calls = []
    _Drafter.tokens_after = {}
    for _, prompt, output, _ in traffic:
        for j in range(1, len(output)):
            context = "".join(TEXT[t] for t in [*prompt, *output[:j]])
            assert context not in _Drafter.tokens_after  # the fake server's lookup is unique
            _Drafter.tokens_after[context] = [TEXT[t] for t in output[j:]]
    store = _store(tmp_path / "r.sqlite", traffic)
    tdir = _tokenizer(tmp_path / "t", TARGET, "ByteLevel", "<|endoftext|>")
    ddir = _tokenizer(tmp_path / "d", DRAFT, "Metaspace", "</s>")
    out = tmp_path / "out"
    spec = f"xd={drafter},target_tokenizer={tdir},drafter_tokenizer={ddir},top={TOP},rules=tli+slem"
    argv = ["counterfactual", "--store", str(store), "--out", str(out), "--no-rejections",
            "--depths", "2,4", "--windows", "2-2", "--cross-vocab", spec,
            "--cross-vocab-max-records", "5"]  # fmt: skip
    assert cli_main(argv) == 0
    slem_records = traffic[:5]
    slem_calls = sum(2 * (len(o) - 1) for _, _, o, _ in slem_records)
    assert sorted(_Drafter.calls) == sorted(["tli"] * len(traffic) + ["slem"] * slem_calls)

    rows = jsonx.loads((out / "counterfactual.json").read_bytes())
    summary = jsonx.loads((out / "counterfactual_summary.json").read_bytes())
    (xs,) = summary["cross_vocabulary"]
    truth_misses = sum(_tli_truth(p, o)[1] for _, p, o, _ in traffic)
    assert (xs["intersection_size"], xs["tli_records"], xs["no_candidate_in_top"]) == (
        5,
        12,
        truth_misses,
    )
    assert xs["tli_positions"] == sum(len(o) - 1 for _, _, o, _ in traffic)
    assert xs["slem_records"] == 5 and xs["failed_calls"] == 0
    for cat in ("chat", "code", ALL):
        mine = [(p, o) for _, p, o, c in traffic if cat in (c, ALL)]
        n_out = sum(len(o) for _, o in mine)
        outside = sum(t not in T2D for _, o in mine for t in o)
        assert xs["categories"][cat]["output_tokens"] == n_out
        assert xs["categories"][cat]["outside_intersection"] == outside
        for k in (2, 4):
            drafts = drafted = accepted = by_construction = rejected = 0
            for p, o in mine:
                good, _ = _tli_truth(p, o)
                d, dt, a, rej = _steps(len(o), k, [len(o)] * len(o), _runs(good))
                drafts, drafted, accepted = drafts + d, drafted + dt, accepted + a
                rejected += len(rej)
                by_construction += sum(o[r] not in T2D for r in rej)
            (row,) = [r for r in rows if r["category"] == cat and r["output_length_bucket"] == ALL
                      and r.get("cross_vocab_rule") == "tli" and r["num_speculative_tokens"] == k]  # fmt: skip
            assert row["proposer"] == "draft_model" and row["drafter"] == "xd"
            assert row["cross_vocabulary"] is True and row["replay_class"] == "exact_given_drafter"
            assert row["label"] == f"draft xd k={k} tli"
            assert row["requests"] == len(mine)
            assert row["mean_acceptance_length"]["estimate"] == pytest.approx(1 + accepted / drafts)
            assert row["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
            assert xs["categories"][cat]["tli_rejections"][str(k)] == {
                "rejections": rejected, "by_construction": by_construction}  # fmt: skip
            assert by_construction > 0
            # SLEM, on the first 5 records only.
            s_mine = [(p, o) for _, p, o, c in slem_records if cat in (c, ALL)]
            drafts = drafted = accepted = 0
            for p, o in s_mine:
                avail, match = [0] * len(o), [0] * len(o)
                for j in range(1, len(o)):
                    if len("".join(TEXT[t] for t in [*p, *o[:j]])) % 4 == 0:
                        match[j], avail[j] = 1, 2
                    else:
                        match[j] = avail[j] = min(k, len(o) - j)
                d, dt, a, _ = _steps(len(o), 10**6, avail, match)
                drafts, drafted, accepted = drafts + d, drafted + dt, accepted + a
            (srow,) = [r for r in rows if r["category"] == cat and r["output_length_bucket"] == ALL
                       and r.get("cross_vocab_rule") == "slem" and r["num_speculative_tokens"] == k]  # fmt: skip
            assert srow["replay_class"] == "approximate" and srow["requests"] == len(s_mine)
            assert srow["mean_acceptance_length"]["estimate"] == pytest.approx(
                1 + accepted / drafts
            )
            assert srow["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert "cross-vocabulary drafter xd: intersection 5 tokens" in capsys.readouterr().out
    md = (out / "counterfactual.md").read_text("utf-8")
    assert "## Cross-vocabulary drafters" in md and f"{truth_misses} of 236 positions" in md
    # The pick is TLI (SLEM is never picked: vLLM does not serve it), deployed as vLLM runs it.
    assert summary["picks"][ALL]["config"]["label"] == "draft xd k=2 tli"
    fragment = (out / "candidates.yaml").read_text("utf-8")
    assert '"use_heterogeneous_vocab":true' in fragment and "cross_vocabulary: true" in fragment


def test_bad_cross_vocab_arguments_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traffic = _traffic()[:2]
    store = _store(tmp_path / "r.sqlite", traffic)
    tdir = _tokenizer(tmp_path / "t", TARGET, "ByteLevel", "<|endoftext|>")
    ddir = _tokenizer(tmp_path / "d", DRAFT, "Metaspace", "</s>")
    base = [
        "counterfactual",
        "--store",
        str(store),
        "--out",
        str(tmp_path / "o"),
        "--no-rejections",
    ]
    cases = {
        "xd": "expected NAME=http://HOST:PORT,... first",
        f"xd=http://127.0.0.1:9,target_tokenizer={tdir}": "drafter_tokenizer=DIR is required",
        f"xd=http://127.0.0.1:9,target_tokenizer={tdir},drafter_tokenizer={tmp_path}":
            "tokenizer.json not found",
        f"xd=http://127.0.0.1:9,target_tokenizer={tdir},drafter_tokenizer={ddir},rules=eagle":
            "expected tli, slem or tli+slem",
    }  # fmt: skip
    for spec, words in cases.items():
        capsys.readouterr()
        assert cli_main([*base, "--cross-vocab", spec]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("specshadow counterfactual: ") and words in err and "\n" not in err
    # An unreachable drafter: one line naming it (port 9, discard: nothing listens here).
    good = f"xd=http://127.0.0.1:9,target_tokenizer={tdir},drafter_tokenizer={ddir},timeout_s=5"
    assert cli_main([*base, "--cross-vocab", good]) == 2
    err = capsys.readouterr().err.strip()
    assert "cross-vocabulary drafter xd: http://127.0.0.1:9/v1/models" in err and "\n" not in err


def test_spec_parses_defaults(tmp_path: Path) -> None:
    tdir = _tokenizer(tmp_path / "t", TARGET, "ByteLevel", "<|endoftext|>")
    spec = parse_cross_vocab(f"xd=http://h:1/,target_tokenizer={tdir},drafter_tokenizer={tdir}")
    assert spec.url == "http://h:1" and spec.rules == ("tli",) and spec.top == 20
    assert parse_cross_vocab(
        f"xd=http://h:1,target_tokenizer={tdir},drafter_tokenizer={tdir},rules=slem+tli"
    ).rules == ("tli", "slem")
