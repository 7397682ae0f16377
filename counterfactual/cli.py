"""``specshadow counterfactual --store STORE --out DIR``: score every proposer and depth.

Writes ``counterfactual.json`` (the rows: a JSON list, one per configuration × category × output
length), ``counterfactual_summary.json`` (picks, live checks, the step-time model),
``counterfactual.md`` (the picks and the best configurations), when something is worth deploying
``candidates.yaml`` (the policy fragment), and with ``--per-request`` ``requests.jsonl`` (every
record under every configuration). With ``--cross-vocab`` a drafter with its own tokenizer is
asked about the records first (:mod:`.crossvocab_drafter`; offline, bounded calls).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from core import jsonx
from core.faults import NothingToDo
from counterfactual.grid import DEFAULT_DEPTHS, DEFAULT_WINDOWS, parse_depths, parse_windows
from counterfactual.llamacpp_ngram import LlamaKnobs
from counterfactual.matrix import Matrix
from counterfactual.rules import DEFAULT_RULES, Rule, parse_rule
from records.cli import add_store_argument

__all__ = ["register", "token_texts", "write_outputs"]


def write_outputs(matrix: Matrix, out_dir: str | Path) -> dict[str, Path]:
    """Write the matrix's files into ``out_dir``; their paths by name."""
    from counterfactual.render import policy_fragment, render_markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        name: out / name
        for name in ("counterfactual.json", "counterfactual_summary.json", "counterfactual.md")
    }
    # One row per configuration × category × output length: the matrix itself, a JSON list.
    paths["counterfactual.json"].write_bytes(jsonx.dumps(matrix.rows, indent=True) + b"\n")
    paths["counterfactual_summary.json"].write_bytes(
        jsonx.dumps(matrix.as_json(), indent=True) + b"\n"
    )
    paths["counterfactual.md"].write_text(render_markdown(matrix), "utf-8")
    fragment = policy_fragment(matrix)
    candidates = out / "candidates.yaml"
    if fragment is None:
        candidates.unlink(missing_ok=True)
    else:
        candidates.write_text(fragment, "utf-8")
        paths["candidates.yaml"] = candidates
    return paths


def token_texts(
    open_records: Callable[[], Iterable[Any]], path: str | None, url: str | None
) -> tuple[dict[int, str] | None, str]:
    """Token id → text for classifying rejections: ``path`` (a ``tokenizer.json`` or an
    ``{id: text}`` map), else the tokenizer server's ``/detokenize`` for every output id the
    records hold (``url``, else the records' first candidate or baseline server — never the
    primary's). (None, why) when there is neither."""
    from counterfactual.rejections import detokenize_pieces, load_pieces
    from counterfactual.retokenize import find_tokenizer
    from records.reader import read

    if path is not None:
        return load_pieces(path), f"token texts from {path}"
    url = url or find_tokenizer(open_records())
    if url is None:
        return None, "no token texts: give --token-texts FILE or --tokenizer URL"
    ids = {
        t
        for r in map(read, open_records())
        if r.tokens is not None and r.tokens.output
        for t in r.tokens.output
    }
    try:
        return detokenize_pieces(url, ids), f"token texts from {url}/detokenize"
    except OSError as exc:
        return None, f"no token texts ({exc}): rejections are not classified"


def _llamacpp_knobs(texts: Iterable[str], depths: tuple[int, ...]) -> tuple[LlamaKnobs, ...]:
    """``--llamacpp`` knob sets, each at every depth (and at its own, when it names one)."""
    from counterfactual.llamacpp_replay import parse_llamacpp_knobs

    out: list[LlamaKnobs] = []
    for text in texts:
        knobs, own = parse_llamacpp_knobs(text)
        out += [knobs.with_depth(k) for k in depths if knobs.with_depth(k) not in out]
        if own and knobs not in out:
            out.append(knobs)
    return tuple(out)


def _run(args: argparse.Namespace) -> int:
    from counterfactual.matrix import build_matrix
    from counterfactual.retokenize import TokenizerError, find_tokenizer, needs_tokens, retokenized
    from records.readback import SourceError, iter_records
    from records.reader import read

    try:
        depths = parse_depths(args.depths)
        windows = parse_windows(args.windows)
        from counterfactual.suffix_replay import parse_suffix_knobs

        suffix = tuple(parse_suffix_knobs(text) for text in args.suffix or ())
        llamacpp = _llamacpp_knobs(args.llamacpp or (), depths)
        from counterfactual.crossvocab_drafter import parse_cross_vocab

        cross_specs = tuple(parse_cross_vocab(text) for text in args.cross_vocab or ())
        if len({x.name for x in cross_specs}) < len(cross_specs):
            raise ValueError("--cross-vocab: each drafter needs its own NAME")
        if args.cross_vocab_max_records < 0:
            raise ValueError("--cross-vocab-max-records: expected >= 0")
        rules: tuple[Rule, ...] = (
            tuple(parse_rule(text) for text in args.rule) if args.rule else DEFAULT_RULES
        )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        sources: list[str | Path] = list(args.store)
        if next(iter_records(sources), None) is None:  # before any word about token texts
            raise NothingToDo(
                f"0 records in {', '.join(map(str, sources))} (window: all time): nothing to "
                "replay; check that serve --store wrote there"
            )
        # A store recorded without the token tap: its captured text through /tokenize, once.
        if any(needs_tokens(r) for r in iter_records(sources)):
            url = args.tokenizer or find_tokenizer(iter_records(sources))
            if url is None:
                print(
                    "specshadow counterfactual: records carry text but no token ids, and no "
                    "tokenizer is known: give --tokenizer URL (never the primary)",
                    file=sys.stderr,
                )
                return 2
            primaries = {
                leg.server_address
                for r in map(read, iter_records(sources))
                for leg in r.legs
                if leg.role == "primary"
            }
            if url.split("://", 1)[-1].rstrip("/") in primaries:
                print(
                    f"specshadow counterfactual: {url} is the primary's server; "
                    "counterfactual calls never go to the primary",
                    file=sys.stderr,
                )
                return 2
            print(f"tokenizing captured text with {url}/tokenize (approximate: see docs)")
            tokens_file = out / "tokenized-records.jsonl"
            for _ in retokenized(iter_records(sources), url, tokens_file):
                pass
            sources = [tokens_file]
        with (out / "requests.jsonl").open("wb") if args.per_request else _null() as sink:

            def write(row: dict[str, Any]) -> None:
                if sink is not None:
                    sink.write(jsonx.dumps(row) + b"\n")

            pieces, why = (
                (None, "--no-rejections: rejections are not classified")
                if args.no_rejections
                else token_texts(lambda: iter_records(sources), args.token_texts, args.tokenizer)
            )
            print(why)
            vocabulary = None
            if args.drafter_vocab is not None:
                from counterfactual.rejections import load_drafter_vocabulary

                vocabulary = load_drafter_vocabulary(args.drafter_vocab)
            cross = _cross_vocab(cross_specs, lambda: iter_records(sources), depths,
                                 args.cross_vocab_max_records)  # fmt: skip
            matrix = build_matrix(
                lambda: iter_records(sources),
                depths=depths,
                windows=windows,
                rules=rules,
                per_request=write,
                pieces=pieces,
                drafter_vocabulary=vocabulary,
                suffix=suffix,
                llamacpp=llamacpp,
                cross_vocab=cross,
            )
    except (SourceError, NothingToDo):
        raise  # worded once, by the console script
    except (OSError, ValueError, TokenizerError) as exc:
        print(f"specshadow counterfactual: {exc}", file=sys.stderr)
        return 2
    if matrix.scored == 0:
        print(
            f"specshadow counterfactual: none of {matrix.records} records carries token ids or "
            "captured output text; turn on the policy's `counterfactual:` section "
            "(docs/counterfactual.md)",
            file=sys.stderr,
        )
        return 1
    paths = write_outputs(matrix, args.out)
    for cat, pick in sorted(matrix.picks.items()):
        if pick["config"] is None:
            print(f"{cat:<20} none: {pick['reason']}")
            continue
        s = pick["predicted_tpot_speedup"] or {}  # the matrix's own pick, not a record
        speed = (
            f"{s['estimate']:.2f}× predicted" if s.get("estimate") is not None else "no speed model"
        )
        print(f"{cat:<20} {pick['config']['label']:<28} {speed}")
    if args.per_request:
        paths["requests.jsonl"] = Path(args.out) / "requests.jsonl"
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _cross_vocab(
    specs: tuple[Any, ...],
    open_records: Callable[[], Iterable[Any]],
    depths: tuple[int, ...],
    max_slem_records: int,
) -> tuple[Any, ...]:
    """Each ``--cross-vocab`` drafter asked about every record with token ids (offline)."""
    if not specs:
        return ()
    from counterfactual.crossvocab_drafter import score_drafter
    from records.reader import read

    work = [
        (r.exchange_id, list(r.tokens.prompt), list(r.tokens.output))
        for r in map(read, open_records())
        if r.tokens is not None and r.tokens.prompt is not None and r.tokens.output
    ]
    out = []
    for spec in specs:
        scores = score_drafter(spec, work, depths=depths, max_slem_records=max_slem_records)
        print(
            f"cross-vocabulary drafter {spec.name}: intersection {scores.intersection.size} "
            f"tokens; {scores.calls} calls ({scores.failed} failed); "
            f"{scores.no_candidate}/{scores.positions} positions with no top-{spec.top} "
            "candidate in the intersection (counted as rejected)"
        )
        out.append(scores)
    return tuple(out)


@contextlib.contextmanager
def _null() -> Iterator[None]:
    yield None


def register(subparsers: Any) -> None:
    """Add ``counterfactual`` to the ``specshadow`` parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "counterfactual",
        help="score every proposer × depth on the records' own outputs (no server per configuration)",
    )
    add_store_argument(p, required=True)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--depths",
        default=f"{DEFAULT_DEPTHS[0]}-{DEFAULT_DEPTHS[-1]}",
        help="num_speculative_tokens to score, e.g. 1-8 or 2,4,6 (default %(default)s)",
    )
    p.add_argument(
        "--windows",
        default=",".join(f"{lo}-{hi}" for lo, hi in DEFAULT_WINDOWS),
        help="n-gram lookup windows MIN-MAX (default %(default)s)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="URL",
        help="for records without token ids but with captured text: a server with POST /tokenize "
        "(default: the records' first candidate or baseline server; never the primary)",
    )
    p.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="RULE",
        help="a dynamic lookahead rule to score beside fixed k, repeatable, e.g. "
        "heuristic:start=4,floor=1,cap=8, ema_tiers, elastic, batch_schedule:1=8/16=2 "
        "(default: heuristic, ema_tiers and elastic with their published constants)",
    )
    p.add_argument(
        "--token-texts",
        default=None,
        metavar="FILE",
        help="token id -> text (a Hugging Face tokenizer.json or a JSON {id: text} map), to "
        "classify where drafts are rejected (default: the tokenizer server's /detokenize)",
    )
    p.add_argument(
        "--no-rejections",
        action="store_true",
        help="do not fetch token texts: rejections are counted by position, not classified",
    )
    p.add_argument(
        "--drafter-vocab",
        default=None,
        metavar="FILE",
        help="a drafter's vocabulary: EAGLE-3's d2t as JSON {\"d2t\": [...]} or a JSON list of "
        "target token ids; output tokens outside it are counted as rejections by construction",
    )
    p.add_argument(
        "--suffix",
        action="append",
        nargs="?",
        const="",
        metavar="KNOBS",
        help="also score suffix decoding (vLLM method 'suffix') at every depth; KNOBS: "
        "depth=24,cache=10000,factor=1.0,min_prob=0.1 (any subset; the rest vLLM's defaults); "
        "repeat for more knob sets. Records are replayed in the order read (docs)",
    )
    p.add_argument(
        "--llamacpp",
        action="append",
        metavar="TYPE[:KNOBS]",
        help="also score llama.cpp's n-gram proposers, one replayed server per knob set fed the "
        "records in order: ngram-mod[:n_match=24,n_min=48,slots=1] or "
        "ngram-map-k[:size_n=12,min_hits=1,slots=1], at every --depths depth (n_max / size_m; "
        "a depth given in KNOBS is scored too); repeat for more knob sets (docs)",
    )
    p.add_argument(
        "--cross-vocab",
        action="append",
        metavar="NAME=URL,target_tokenizer=DIR,drafter_tokenizer=DIR[,KNOBS]",
        help="also score a drafter with its own tokenizer, served alone by vLLM at URL, at every "
        "--depths depth: by TLI (vLLM's use_heterogeneous_vocab; one /v1/completions with "
        "prompt_logprobs per record) and with rules=tli+slem by SLEM too (one call per output "
        "position and depth, first --cross-vocab-max-records records). DIRs: the target's and "
        "the drafter's Hugging Face tokenizer folders. KNOBS: top=20 (prompt_logprobs), "
        "rules=tli|slem|tli+slem, model=NAME, timeout_s=60, concurrency=2; repeatable (docs)",
    )
    p.add_argument(
        "--cross-vocab-max-records",
        type=int,
        default=20,
        metavar="N",
        help="SLEM is scored on the first N records with token ids only (default %(default)s)",
    )
    p.add_argument(
        "--per-request",
        action="store_true",
        help="also write requests.jsonl: every record's replay under every configuration",
    )
    p.set_defaults(func=_run)
