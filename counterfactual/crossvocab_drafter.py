"""A drafter with its own tokenizer, asked offline for what :mod:`.crossvocab` replays.

``specshadow counterfactual --cross-vocab NAME=URL,target_tokenizer=DIR,drafter_tokenizer=DIR``
scores a drafter served alone by vLLM at ``URL`` (its own tokenizer) on the records' token ids
(``tokens.prompt`` / ``tokens.output``): nothing on the gateway's request path changes.

**Vocabularies** come from the two folders' ``tokenizer.json`` (and ``tokenizer_config.json`` /
``config.json`` beside it), read as JSON: no tokenizer library is needed, because TLI needs only
``get_vocab()`` (model vocabulary plus added tokens), the space marker vLLM probes by encoding
``" a"`` (``Ġ`` for a ``ByteLevel`` pre-tokenizer, ``▁`` for ``Metaspace``; both otherwise, as
vLLM falls back), the ``unk`` id (else ``eos``) and the model's vocabulary size (``config.json``
``vocab_size``: ids at or past it are left out, as vLLM's mask does).

**TLI** (one call per record): the record's prompt + output through ``target → draft``, sent as
the ``prompt`` of ``/v1/completions`` with ``max_tokens: 1`` and ``prompt_logprobs: top``. At each
output position the highest-ranked of the ``top`` candidates inside the intersection is vLLM's
masked argmax — exactly, whenever one of them is inside. Where none is (``no_candidate``), the
position is treated as no draft at all (a drafting step starting there drafts nothing; one
reaching it stops accepting): conservative, and counted so a reader sees how often it happened.

**SLEM** (one call per output position and depth, so capped by ``max_records``): the context's
text (the target's pieces of prompt + output so far) is sent as a text ``prompt`` — the drafter's
server re-encodes it with its own tokenizer, as transformers' Universal Assisted Generation does —
with ``max_tokens`` = the depth (``num_assistant_tokens``) and ``temperature: 0``; the text it
returns is the draft :func:`.crossvocab.slem_offers` matches against the output tokens' texts.

Calls are bounded: ``timeout_s`` each, ``concurrency`` at once (threads; the CLI is offline). A
drafter that cannot be reached on the first call is an :class:`OSError` naming it; a later failed
call leaves that record (or position) out and is counted.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import jsonx
from counterfactual.crossvocab import FALLBACK_SPACE_PREFIXES, Intersection
from counterfactual.grid import CrossVocabRule

__all__ = [
    "CrossVocabScores",
    "CrossVocabSpec",
    "Vocabulary",
    "load_vocabulary",
    "masked_argmax",
    "parse_cross_vocab",
    "score_drafter",
]

DEFAULT_TOP = 20
DEFAULT_SLEM_RECORDS = 20


@dataclass(frozen=True, slots=True)
class CrossVocabSpec:
    """One ``--cross-vocab`` value."""

    name: str
    url: str
    target_tokenizer: Path
    drafter_tokenizer: Path
    top: int = DEFAULT_TOP  # prompt_logprobs asked per position (vLLM caps it at max_logprobs)
    rules: tuple[CrossVocabRule, ...] = ("tli",)
    model: str | None = None  # the served model name (default: the server's first /v1/models)
    timeout_s: float = 60.0
    concurrency: int = 2


_RULES: tuple[CrossVocabRule, ...] = ("tli", "slem")


def parse_cross_vocab(text: str) -> CrossVocabSpec:
    """``NAME=URL,target_tokenizer=DIR,drafter_tokenizer=DIR[,top=20][,rules=tli+slem]
    [,model=NAME][,timeout_s=60][,concurrency=2]``.

    Raises:
        ValueError: naming the piece that is wrong.
    """
    head, _, rest = text.partition(",")
    name, eq, url = head.partition("=")
    if not eq or not name.strip() or not url.strip().startswith(("http://", "https://")):
        raise ValueError(f"--cross-vocab {text!r}: expected NAME=http://HOST:PORT,... first")
    knobs: dict[str, str] = {}
    for piece in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = piece.partition("=")
        if not eq:
            raise ValueError(f"--cross-vocab {name}: {piece!r} is not KEY=VALUE")
        knobs[key.strip()] = value.strip()
    known = {"target_tokenizer", "drafter_tokenizer", "top", "rules", "model", "timeout_s",
             "concurrency"}  # fmt: skip
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise ValueError(
            f"--cross-vocab {name}: unknown key {unknown[0]!r} (known: {sorted(known)})"
        )
    dirs: dict[str, Path] = {}
    for key in ("target_tokenizer", "drafter_tokenizer"):
        if key not in knobs:
            raise ValueError(f"--cross-vocab {name}: {key}=DIR is required")
        folder = Path(knobs[key])
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"--cross-vocab {name}: {key}: {folder}/tokenizer.json not found")
        dirs[key] = folder
    names = [r for r in knobs.get("rules", "tli").split("+") if r]
    rules: tuple[CrossVocabRule, ...] = tuple(r for r in _RULES if r in names)
    if not names or any(r not in _RULES for r in names):
        raise ValueError(
            f"--cross-vocab {name}: rules={knobs['rules']!r}: expected tli, slem or tli+slem"
        )
    try:
        top = int(knobs.get("top", DEFAULT_TOP))
        timeout_s = float(knobs.get("timeout_s", 60.0))
        concurrency = int(knobs.get("concurrency", 2))
    except ValueError as exc:
        raise ValueError(f"--cross-vocab {name}: {exc}") from None
    if not 1 <= top <= 1000 or timeout_s <= 0 or not 1 <= concurrency <= 64:
        raise ValueError(
            f"--cross-vocab {name}: expected 1 <= top <= 1000, timeout_s > 0, 1 <= concurrency <= 64"
        )
    return CrossVocabSpec(
        name=name.strip(),
        url=url.strip().rstrip("/"),
        target_tokenizer=dirs["target_tokenizer"],
        drafter_tokenizer=dirs["drafter_tokenizer"],
        top=top,
        rules=rules,
        model=knobs.get("model"),
        timeout_s=timeout_s,
        concurrency=concurrency,
    )


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What TLI and SLEM read from one tokenizer folder."""

    vocab: dict[str, int]  # get_vocab(): token string → id, in id order
    prefixes: tuple[str, ...]  # the space marker(s) vLLM's probe would find
    unk: int  # unk_token_id, else eos_token_id
    size: int | None  # the model's vocabulary size (config.json), None when absent
    special: frozenset[int]  # added special tokens (skipped when text is decoded)


def _token_id(vocab: Mapping[str, int], token: object) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return vocab.get(token) if isinstance(token, str) else None


def load_vocabulary(folder: str | Path) -> Vocabulary:
    """A Hugging Face tokenizer folder's vocabulary (``tokenizer.json`` read as JSON).

    Raises:
        ValueError: a file that is not a tokenizer, or no unk/eos token.
    """
    folder = Path(folder)
    raw = jsonx.loads((folder / "tokenizer.json").read_bytes())
    model = raw.get("model") if isinstance(raw, dict) else None
    vocab_raw = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab_raw, dict):
        pairs = [(str(t), int(i)) for t, i in vocab_raw.items()]
    elif isinstance(vocab_raw, list):
        pairs = [(str(entry[0]), i) for i, entry in enumerate(vocab_raw)]
    else:
        raise ValueError(f"{folder}/tokenizer.json: no model.vocab")
    special: set[int] = set()
    for added in raw.get("added_tokens") or ():
        pairs.append((str(added["content"]), int(added["id"])))
        if added.get("special"):
            special.add(int(added["id"]))
    vocab = dict(sorted(pairs, key=lambda p: p[1]))
    shape = jsonx.dumps([raw.get("pre_tokenizer"), raw.get("decoder")]).decode()
    prefixes: tuple[str, ...] = (
        ("\u0120",) if "ByteLevel" in shape
        else ("\u2581",) if "Metaspace" in shape
        else FALLBACK_SPACE_PREFIXES
    )  # fmt: skip
    config: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            loaded = jsonx.loads(path.read_bytes())
            if isinstance(loaded, dict):
                config = {**loaded, **config} if name == "config.json" else loaded
    unk = _token_id(vocab, model.get("unk_token") if isinstance(model, dict) else None)
    unk = unk if unk is not None else _token_id(vocab, config.get("unk_token"))
    unk = unk if unk is not None else _token_id(vocab, config.get("eos_token"))
    if unk is None and isinstance(config.get("eos_token_id"), int):
        unk = int(config["eos_token_id"])
    if unk is None:
        raise ValueError(f"{folder}: no unk or eos token in tokenizer_config.json/config.json")
    size = config.get("vocab_size")
    return Vocabulary(vocab, prefixes, unk, size if isinstance(size, int) else None,
                      frozenset(special))  # fmt: skip


def build_intersection(target: Vocabulary, draft: Vocabulary) -> Intersection:
    return Intersection.build(
        target.vocab,
        draft.vocab,
        target_unk=target.unk,
        draft_unk=draft.unk,
        target_prefixes=target.prefixes,
        draft_prefixes=draft.prefixes,
        target_vocab_size=target.size,
        draft_vocab_size=draft.size,
    )


def masked_argmax(
    prompt_logprobs: object, start: int, count: int, allowed: Mapping[int, int], top: int
) -> tuple[list[int | None], int]:
    """At positions ``start … start + count − 1`` of vLLM's ``prompt_logprobs``: the best-ranked
    of the ``top`` candidates inside ``allowed`` (draft ids), ``None`` where none of them is; and how many
    positions had none. Position ``start`` (the first output token) is always ``None``: the
    prefill drafts nothing.

    Raises:
        ValueError: an answer not shaped as vLLM's.
    """
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) < start + count:
        raise ValueError("prompt_logprobs missing or too short")
    out: list[int | None] = [None] if count else []
    misses = 0
    for entry in prompt_logprobs[start + 1 : start + count]:
        if not isinstance(entry, dict):
            raise ValueError("prompt_logprobs entry is not an object")
        ranked: list[tuple[int, int]] = []
        for token, info in entry.items():
            rank = info.get("rank") if isinstance(info, dict) else None
            if not isinstance(rank, int):
                raise ValueError("prompt_logprobs entry without a rank")
            # Only the top ones: the actual token, added beside them with its own rank, is the
            # masked argmax only if no unseen token between them is inside the intersection.
            if rank <= top:
                ranked.append((rank, int(token)))
        best = next((tid for _, tid in sorted(ranked) if tid in allowed), None)
        if best is None:
            misses += 1
        out.append(best)
    return out, misses


@dataclass(slots=True)
class CrossVocabScores:
    """What one cross-vocabulary drafter said about the records, keyed by exchange id."""

    spec: CrossVocabSpec
    intersection: Intersection
    target_pieces: dict[int, str]  # target id → its text, for SLEM's output texts
    target_special: frozenset[int] = frozenset()
    tli: dict[str, list[int | None]] = field(default_factory=dict)  # masked argmax, draft ids
    slem: dict[tuple[str, int], list[str | None]] = field(default_factory=dict)  # (id, k) → texts
    positions: int = 0  # output positions asked (TLI)
    no_candidate: int = 0  # of them: none of the top candidates inside the intersection
    calls: int = 0
    failed: int = 0
    slem_records: int = 0

    def output_texts(self, output: Sequence[int]) -> list[str]:
        return [self.target_pieces.get(t, "") for t in output]

    def as_json(self) -> dict[str, Any]:
        return {
            "drafter": self.spec.name,
            "url": self.spec.url,
            "rules": list(self.spec.rules),
            "intersection_size": self.intersection.size,
            "top_logprobs": self.spec.top,
            "tli_records": len(self.tli),
            "tli_positions": self.positions,
            "no_candidate_in_top": self.no_candidate,
            "slem_records": self.slem_records,
            "calls": self.calls,
            "failed_calls": self.failed,
        }


def _post(url: str, body: Mapping[str, Any], timeout_s: float) -> Any:
    request = urllib.request.Request(
        url, data=jsonx.dumps(body), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return jsonx.loads(resp.read())


def _served_model(spec: CrossVocabSpec) -> str:
    if spec.model is not None:
        return spec.model
    try:
        with urllib.request.urlopen(spec.url + "/v1/models", timeout=spec.timeout_s) as resp:
            answer = jsonx.loads(resp.read())
        return str(answer["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise OSError(f"cross-vocabulary drafter {spec.name}: {spec.url}/v1/models: {exc}") from exc


_CALL_ERRORS = (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError)


def _decode(pieces: Mapping[int, str], special: frozenset[int], ids: Iterable[int]) -> str:
    return "".join(pieces.get(t, "") for t in ids if t not in special)


def score_drafter(
    spec: CrossVocabSpec,
    records: Iterable[tuple[str, Sequence[int], Sequence[int]]],
    *,
    depths: Sequence[int],
    max_slem_records: int = DEFAULT_SLEM_RECORDS,
    pieces: Callable[[Path], dict[int, str]] | None = None,
) -> CrossVocabScores:
    """Ask the drafter about every ``(exchange id, prompt ids, output ids)``.

    Raises:
        ValueError: a tokenizer folder that cannot be read.
        OSError: the drafter's server cannot be reached (its first call failed).
    """
    from counterfactual.rejections import load_pieces

    target, draft = load_vocabulary(spec.target_tokenizer), load_vocabulary(spec.drafter_tokenizer)
    x = build_intersection(target, draft)
    texts = (pieces or load_pieces)(spec.target_tokenizer / "tokenizer.json")
    scores = CrossVocabScores(spec, x, texts, target.special)
    model = _served_model(spec)
    url = spec.url + "/v1/completions"
    work = list(records)

    def tli(item: tuple[str, Sequence[int], Sequence[int]]) -> tuple[str, Any]:
        rid, prompt, output = item
        body = {"model": model, "prompt": x.to_draft([*prompt, *output]), "max_tokens": 1,
                "temperature": 0, "prompt_logprobs": spec.top}  # fmt: skip
        try:
            answer = _post(url, body, spec.timeout_s)
            return rid, masked_argmax(
                answer["choices"][0]["prompt_logprobs"], len(prompt), len(output),
                x.draft_to_target, spec.top,
            )  # fmt: skip
        except _CALL_ERRORS as exc:
            return rid, exc

    def slem(item: tuple[str, int, int, str]) -> tuple[str, int, int, Any]:
        rid, k, j, context = item
        body = {"model": model, "prompt": context, "max_tokens": k, "temperature": 0}
        try:
            answer = _post(url, body, spec.timeout_s)
            return rid, k, j, str(answer["choices"][0]["text"])
        except _CALL_ERRORS as exc:
            return rid, k, j, exc

    def failed(i: int, got: object) -> bool:
        """Count a call; a failed first call is the drafter unreachable (one line, exit 2),
        a later one is counted and its record or position left out."""
        scores.calls += 1
        if not isinstance(got, Exception):
            return False
        if i == 0:
            raise OSError(f"cross-vocabulary drafter {spec.name}: {url}: {got}")
        scores.failed += 1
        return True

    with ThreadPoolExecutor(max_workers=spec.concurrency) as pool:
        if "tli" in spec.rules:
            for i, (rid, got) in enumerate(pool.map(tli, work)):
                if failed(i, got):
                    continue
                argmax, misses = got
                scores.tli[rid] = argmax
                scores.positions += max(len(argmax) - 1, 0)
                scores.no_candidate += misses
        if "slem" in spec.rules:
            chosen = work[:max_slem_records]
            scores.slem_records = len(chosen)
            jobs = [
                (rid, k, j, _decode(texts, target.special, [*prompt, *output[:j]]))
                for rid, prompt, output in chosen
                for k in depths
                for j in range(1, len(output))
            ]
            for rid, _, output in chosen:
                for k in depths:
                    scores.slem[(rid, k)] = [None] * len(output)
            for i, (rid, k, j, got) in enumerate(pool.map(slem, jobs)):
                if failed(i, got):
                    continue
                scores.slem[(rid, k)][j] = got
    return scores
