"""Sampled text with a known per-prompt token distribution (pure): the model, its exact
probabilities, sequential and speculative sampling, and the lossy modes (``SimConfig.sampling``).

**The model.** A Markov chain per prompt over :data:`VOCAB` — the simulator's words, ``"."``,
``","`` and an end-of-sequence :data:`EOS`. A :class:`TokenModel` is a weighted sum of *bases*:
for one ``(prompt digest, salt, previous token)`` a base is ``SCALE`` × i.i.d. standard normals,
one per non-EOS token, from a ``random.Random`` seeded by a blake2b hash of those three; the
logits are ``Σ coefficient × base`` plus a fixed bias for ``"."`` and ``","``. Punctuation is
masked (probability 0) at the start and right after punctuation. So the logits are a pure
function of ``(digest, model, prev)``: every server with the same model has the same
distributions. The target of a server is ``TokenModel.of(config.model_salt)``; another salt is
another model.

**End of sequence.** At ``position`` (tokens emitted so far) the EOS logit is ``-inf`` before
``min_tokens``, forced (probability 1) at ``max_tokens``, and in between ``lse + log(h / (1 −
h))`` with ``h = 1 / (max_tokens − position + 1)`` and ``lse`` the log-sum-exp of the other
logits: at temperature 1 without nucleus truncation EOS has hazard exactly ``h``, so natural
lengths are uniform on ``[min_tokens, max_tokens]`` (as the deterministic answers' lengths are).
EOS ends the answer and is not an output token: the text and the token ids never carry it.

**Sampling a step** (vLLM's order): logits / temperature, softmax, then nucleus truncation —
the most probable tokens (ties: lower id first) are kept while the mass *before* a token is
below ``top_p``, the kept ones renormalised. ``temperature <= GREEDY_EPS`` (vLLM's ``1e-5``) is
greedy: the argmax of the raw logits (ties: lower id), ``top_p`` ignored.
:func:`next_token_distribution` / :func:`distribution` are this ground truth; :func:`generate`
draws from exactly the same numbers (cached per ``(digest, model, prev)`` and temperature).

**Speculative sampling** (Leviathan et al. 2023, Chen et al. 2023), :func:`generate` with a
:class:`Speculation`: the prefill step emits one token drawn from the target ``p``; each decode
step drafts (with probability ``coverage``) ``min(k, remaining − 1)`` tokens from the drafter
``q`` — the target plus a fixed seeded perturbation of std ``sigma`` per logit, tempered and
truncated like the target — stopping after a drafted EOS; verifies them in order, accepting
``x`` with probability ``min(1, p(x) / q(x))``; at the first rejection emits a token from
``normalize(max(0, p − q))`` and stops; if all are accepted, emits a bonus token from ``p``. The
output's distribution is exactly the target's. Greedy is the limit: the drafter's argmax chain,
accepted while it equals the target's argmax. Steps follow the contract of
:mod:`simulator.acceptance` (each emits accepted + 1 tokens; drafts never reach past
``max_tokens``); a step whose tokens reach EOS is cut at it: its ``v`` visible tokens are all
accepted drafts and it becomes ``Step(v − 1, v − 1)``, as if the proposer had not drafted past
the end (the rule :func:`~simulator.acceptance.plan_steps` follows), and a step with no visible
token is not a step.

**Lossy modes** (``SimConfig.sampling_defect``, built by :func:`model_for` / :func:`generate`):
``greedy_collapse`` commits the argmax whatever the temperature; ``draft_temperature_ignored``
draws the drafts from ``q`` at temperature 1 while the acceptance ratio and the residual use
``q`` at the request's temperature (biased unless the temperature is 1); ``different_model``
serves ``√(1 − w²) × target + w × another model`` (``w = defect_strength``); ``logit_noise``
adds fresh ``N(0, σ²)`` to every finite logit of the target at every emitted position before
sampling (greedy included).

Log-likelihood of an answer: :func:`parse_text` reads a text back into token ids,
:func:`sequence_logprobs` gives each token's log-probability under a model at a temperature and
``top_p`` (plus the EOS term when the answer stopped).

Size: one token model and everything that must draw from exactly its numbers — the ground-truth
distributions, sequential and speculative sampling, the lossy modes and the likelihood read-back
share the cached rows and the nucleus rule; a ninth of the file is this docstring.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Protocol

from simulator.acceptance import Step
from simulator.config import SimConfig
from simulator.textgen import WORDS, split_pieces

SCALE = 2.0  # std of one base's logits: top token ≈ 0.3 at temperature 1, ≈ 0.4 at 0.8
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy

VOCAB: tuple[str, ...] = (*WORDS, ".", ",", "<eos>")
PERIOD = len(WORDS)
COMMA = PERIOD + 1
EOS = PERIOD + 2
_ORDINARY = EOS  # ids 0 … EOS − 1 are output tokens
_PUNCT = frozenset((PERIOD, COMMA))
_BIAS = {PERIOD: 1.5, COMMA: 1.0}  # a period about every 15 tokens at temperature 1
_CACHE_ROWS = 4096  # per cache: about 65 rows per prompt and temperature


@dataclass(frozen=True, slots=True)
class TokenModel:
    """A model: logits ``Σ coefficient × base(salt)`` (see the module doc), EOS between
    ``min_tokens`` and ``max_tokens``."""

    terms: tuple[tuple[str, float], ...] = (("target", 1.0),)
    min_tokens: int = 16
    max_tokens: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("TokenModel: expected 1 <= min_tokens <= max_tokens")
        if not self.terms:
            raise ValueError("TokenModel: expected at least one term")

    @classmethod
    def of(cls, salt: str = "target", *, min_tokens: int = 16, max_tokens: int = 256) -> TokenModel:
        return cls(((salt, 1.0),), min_tokens, max_tokens)

    def mixed(self, salt: str, weight: float) -> TokenModel:
        """``√(1 − w²) × self + w × base(salt)``: logits of the same scale, correlation
        ``√(1 − w²)`` with ``self`` (``w = 1``: an independent model)."""
        keep = math.sqrt(max(0.0, 1.0 - weight * weight))
        terms = tuple((s, c * keep) for s, c in self.terms if c * keep != 0.0)
        return TokenModel((*terms, (salt, weight)), self.min_tokens, self.max_tokens)

    def perturbed(self, salt: str, sigma: float) -> TokenModel:
        """``self`` plus a fixed perturbation of std ``sigma`` per logit (a drafter)."""
        if sigma == 0.0:
            return self
        return TokenModel((*self.terms, (salt, sigma / SCALE)), self.min_tokens, self.max_tokens)


def model_for(config: SimConfig) -> TokenModel:
    """The model a server samples from: its ``model_salt``, its output-length bounds, and
    ``sampling_defect="different_model"`` mixed in."""
    model = TokenModel.of(
        config.model_salt,
        min_tokens=config.min_output_tokens,
        max_tokens=config.max_output_tokens,
    )
    if config.sampling_defect == "different_model":
        model = model.mixed(config.model_salt + "/different", config.defect_strength)
    return model


def drafter_for(config: SimConfig) -> TokenModel:
    """The drafter of a speculative sampling server: its model perturbed by
    ``draft_logit_sigma``."""
    return model_for(config).perturbed(config.model_salt + "/drafter", config.draft_logit_sigma)


# ------------------------------------------------------------------ logits, cached


def _seed(*parts: bytes) -> int:
    material = b"|".join(b"%d:%s" % (len(p), p) for p in parts)
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "big")


_TABLE_BITS = 16


@lru_cache(maxsize=1)
def _normals() -> tuple[float, ...]:
    """``SCALE`` × a fixed table of 2¹⁶ standard normals (Box–Muller over ``random.Random(0)``),
    built on first use; a row's normals are looked up in it at hashed indices (``random.gauss``
    per row would cost ten times as much)."""
    rnd = random.Random(0).random
    out: list[float] = []
    for _ in range(1 << (_TABLE_BITS - 1)):
        radius = SCALE * math.sqrt(-2.0 * math.log(1.0 - rnd()))
        angle = math.tau * rnd()
        out += (radius * math.cos(angle), radius * math.sin(angle))
    return tuple(out)


_INDICES = struct.Struct(f"<{_ORDINARY}H")  # one 16-bit table index per ordinary token


@lru_cache(maxsize=_CACHE_ROWS)
def _base(prompt_digest: bytes, salt: str, prev: int | None) -> tuple[float, ...]:
    """``SCALE`` × i.i.d. standard normals for one ``(digest, salt, prev)``: table entries at
    indices read from a blake2b hash of the three (sampling with replacement from 2¹⁶ normals:
    i.i.d. normal for every purpose here)."""
    key = b"%d:%s|%s|%s" % (len(salt.encode()), salt.encode(), prompt_digest, str(prev).encode())
    raw = b"".join(
        hashlib.blake2b(key, digest_size=64, person=b"simlogits%d" % i).digest()
        for i in range(-(-_INDICES.size // 64))
    )
    table = _normals()
    return tuple([table[i] for i in _INDICES.unpack_from(raw)])


@dataclass(frozen=True, slots=True)
class _Tempered:
    """A row at one temperature, by token id: ``weights[t] = exp((values[t] − top) / T)``."""

    weights: tuple[float, ...]
    cumulative: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class _Row:
    """The non-EOS logits for one ``(digest, model, prev)``, by token id."""

    values: tuple[float, ...]  # ``-inf`` where masked
    top: float
    argmax: int  # lowest id among ties
    lse: float  # log-sum-exp of ``values``
    unit: _Tempered  # at temperature 1


@lru_cache(maxsize=_CACHE_ROWS)
def _row(terms: tuple[tuple[str, float], ...], prompt_digest: bytes, prev: int | None) -> _Row:
    (salt, c), *rest = terms
    base = _base(prompt_digest, salt, prev)
    value = list(base) if c == 1.0 else [c * b for b in base]
    for salt, c in rest:
        value = [v + c * b for v, b in zip(value, _base(prompt_digest, salt, prev), strict=True)]
    if prev is None or prev in _PUNCT:
        value[PERIOD] = value[COMMA] = -math.inf
    else:
        value[PERIOD] += _BIAS[PERIOD]
        value[COMMA] += _BIAS[COMMA]
    top = max(value)
    weights = tuple([math.exp(v - top) for v in value])
    cumulative = tuple(accumulate(weights))
    unit = _Tempered(weights, cumulative)
    return _Row(tuple(value), top, value.index(top), top + math.log(cumulative[-1]), unit)


@lru_cache(maxsize=_CACHE_ROWS)
def _tempered(
    terms: tuple[tuple[str, float], ...], prompt_digest: bytes, prev: int | None, temperature: float
) -> _Tempered:
    row = _row(terms, prompt_digest, prev)
    if temperature == 1.0:
        return row.unit
    top = row.top
    weights = tuple([math.exp((v - top) / temperature) for v in row.values])
    return _Tempered(weights, tuple(accumulate(weights)))


@dataclass(frozen=True, slots=True)
class _Ranked:
    """A tempered row most probable first (ties: lower id; masked tokens last, weight 0), for
    nucleus truncation only."""

    order: tuple[int, ...]
    weights: tuple[float, ...]  # same order
    prefix: tuple[float, ...]  # prefix[i] = weights[0] + … + weights[i]
    neg_values: tuple[float, ...]  # −logits, same order (ascending, for bisect)
    rank: tuple[int, ...]  # rank[token]: index in ``order``


@lru_cache(maxsize=_CACHE_ROWS)
def _ranked(
    terms: tuple[tuple[str, float], ...], prompt_digest: bytes, prev: int | None, temperature: float
) -> _Ranked:
    tm = _tempered(terms, prompt_digest, prev, temperature)
    values = _row(terms, prompt_digest, prev).values
    order = sorted(range(_ORDINARY), key=values.__getitem__, reverse=True)  # stable: ties by id
    weights = tuple([tm.weights[t] for t in order])
    return _Ranked(
        tuple(order),
        weights,
        tuple(accumulate(weights)),
        tuple([-values[t] for t in order]),
        tuple(sorted(range(_ORDINARY), key=order.__getitem__)),
    )


def _eos_logit(model: TokenModel, lse: float, position: int) -> float:
    if position < model.min_tokens:
        return -math.inf
    if position >= model.max_tokens:
        return math.inf
    h = 1.0 / (model.max_tokens - position + 1)
    return lse + math.log(h / (1.0 - h))


def logits(model: TokenModel, prompt_digest: bytes, prev: int | None, position: int) -> list[float]:
    """The raw logits over :data:`VOCAB` (``-inf``: masked; EOS ``+inf``: forced)."""
    row = _row(model.terms, prompt_digest, prev)
    return [*row.values, _eos_logit(model, row.lse, position)]


# ------------------------------------------------------------------ one step's distribution


class Dist(Protocol):
    """One position's sampling distribution over :data:`VOCAB`."""

    def prob(self, token: int) -> float: ...
    def sample(self, rng: random.Random) -> int: ...
    def vector(self) -> list[float]: ...


# Not frozen, these: one is built at every step, and a frozen dataclass's __init__ is slow.


@dataclass(slots=True)
class _OneHot:
    token: int

    def prob(self, token: int) -> float:
        return 1.0 if token == self.token else 0.0

    def sample(self, rng: random.Random) -> int:
        return self.token

    def vector(self) -> list[float]:
        out = [0.0] * len(VOCAB)
        out[self.token] = 1.0
        return out


def _last_positive(weights: Sequence[float]) -> int:
    return max(t for t, w in enumerate(weights) if w > 0.0)


@dataclass(slots=True)
class _Vector:
    probs: tuple[float, ...]
    cumulative: tuple[float, ...]

    @classmethod
    def of(cls, probs: Sequence[float]) -> _Vector:
        return cls(tuple(probs), tuple(accumulate(probs)))

    def prob(self, token: int) -> float:
        return self.probs[token]

    def sample(self, rng: random.Random) -> int:
        # A zero-probability token repeats its predecessor's cumulative sum, so bisect_right
        # never lands on it; past the end is a float edge (u rounded up to the total).
        i = bisect_right(self.cumulative, rng.random() * self.cumulative[-1])
        return i if i < len(self.probs) else _last_positive(self.probs)

    def vector(self) -> list[float]:
        return list(self.probs)


@dataclass(slots=True)
class _Full:
    """No truncation: ordinary weights × ``scale`` and EOS weight ``eos``, over ``total``."""

    tempered: _Tempered
    scale: float
    eos: float
    total: float

    def prob(self, token: int) -> float:
        if token == EOS:
            return self.eos / self.total
        return self.tempered.weights[token] * self.scale / self.total

    def sample(self, rng: random.Random) -> int:
        u = rng.random() * self.total
        if u < self.eos:
            return EOS
        cumulative = self.tempered.cumulative
        i = bisect_right(cumulative, (u - self.eos) / self.scale)
        return i if i < _ORDINARY else _last_positive(self.tempered.weights)

    def vector(self) -> list[float]:
        k = self.scale / self.total
        return [*(w * k for w in self.tempered.weights), self.eos / self.total]


@dataclass(slots=True)
class _Nucleus:
    """Truncated: the first ``kept`` ranked tokens (and EOS when ``eos_kept``), ordinary
    weights × ``scale``, EOS weight ``eos``, over ``total``."""

    ranked: _Ranked
    scale: float
    eos: float
    kept: int
    eos_kept: bool
    total: float

    def prob(self, token: int) -> float:
        if token == EOS:
            return self.eos / self.total if self.eos_kept else 0.0
        r = self.ranked.rank[token]
        if r >= self.kept:
            return 0.0
        return self.ranked.weights[r] * self.scale / self.total

    def sample(self, rng: random.Random) -> int:
        u = rng.random() * self.total
        if self.eos_kept:
            if u < self.eos or self.kept == 0:
                return EOS
            u -= self.eos
        i = bisect_right(self.ranked.prefix, u / self.scale, 0, self.kept)
        return self.ranked.order[min(i, self.kept - 1)]

    def vector(self) -> list[float]:
        out = [0.0] * len(VOCAB)
        weights, order, k = self.ranked.weights, self.ranked.order, self.scale / self.total
        for r in range(self.kept):
            out[order[r]] = weights[r] * k
        if self.eos_kept:
            out[EOS] = self.eos / self.total
        return out


def _nucleus(ranked: _Ranked, scale: float, eos: float, e: float, top_p: float) -> _Nucleus:
    """Keep the most probable tokens while the mass before each is below ``top_p``; EOS sits
    after the ordinary tokens whose logit is at least its own."""
    prefix = ranked.prefix
    n = len(prefix)
    target = top_p * (prefix[-1] * scale + eos)
    i = bisect_left(prefix, target / scale)  # the first ordinary token whose prefix reaches it
    if eos == 0.0:
        kept, eos_kept = min(i + 1, n), False
    else:
        j = bisect_right(ranked.neg_values, -e)  # ordinary tokens ranked above EOS
        if i < j:
            kept, eos_kept = i + 1, False
        else:
            eos_kept = True
            rest = target - eos
            if rest <= (prefix[j - 1] * scale if j else 0.0):
                kept = j
            else:
                kept = min(bisect_left(prefix, rest / scale, j) + 1, n)
    total = (prefix[kept - 1] * scale if kept else 0.0) + (eos if eos_kept else 0.0)
    return _Nucleus(ranked, scale, eos, kept, eos_kept, total)


def step_distribution(
    model: TokenModel,
    prompt_digest: bytes,
    prev: int | None,
    position: int,
    *,
    temperature: float,
    top_p: float = 1.0,
) -> Dist:
    """The sampling distribution of the token at ``position`` after ``prev`` (cached)."""
    terms = model.terms
    row = _row(terms, prompt_digest, prev)
    e = _eos_logit(model, row.lse, position)
    if e == math.inf:
        return _OneHot(EOS)
    if temperature <= GREEDY_EPS:
        return _OneHot(EOS if e > row.top else row.argmax)
    if e == -math.inf:
        scale, eos = 1.0, 0.0
    else:  # weights relative to the larger of the top logit and EOS's, so nothing overflows
        a = (e - row.top) / temperature
        scale, eos = (math.exp(-a), 1.0) if a > 0 else (1.0, math.exp(a))
        if scale == 0.0:
            return _OneHot(EOS)
    if top_p < 1.0:
        ranked = _ranked(terms, prompt_digest, prev, temperature)
        return _nucleus(ranked, scale, eos, e, top_p)
    tm = row.unit if temperature == 1.0 else _tempered(terms, prompt_digest, prev, temperature)
    return _Full(tm, scale, eos, tm.cumulative[-1] * scale + eos)


def distribution_from_logits(
    values: Sequence[float], *, temperature: float, top_p: float = 1.0
) -> list[float]:
    """The sampling rule of the module doc applied to any logits over :data:`VOCAB`
    (``-inf`` masked, a ``+inf`` forced)."""
    forced = [t for t, v in enumerate(values) if v == math.inf]
    if forced or temperature <= GREEDY_EPS:
        best = forced[0] if forced else max(range(len(values)), key=lambda t: (values[t], -t))
        return [1.0 if t == best else 0.0 for t in range(len(values))]
    top = max(values)
    weights = [math.exp((v - top) / temperature) if v > -math.inf else 0.0 for v in values]
    if top_p >= 1.0:
        total = sum(weights)
        return [w / total for w in weights]
    order = sorted((t for t, w in enumerate(weights) if w > 0.0), key=lambda t: (-values[t], t))
    total = sum(weights)
    kept: list[int] = []
    before = 0.0
    for t in order:
        if before >= top_p * total:
            break
        kept.append(t)
        before += weights[t]
    mass = sum(weights[t] for t in kept)
    out = [0.0] * len(values)
    for t in kept:
        out[t] = weights[t] / mass
    return out


def distribution(
    model: TokenModel,
    prompt_digest: bytes,
    prev: int | None,
    position: int,
    *,
    temperature: float,
    top_p: float = 1.0,
) -> list[float]:
    """P(token at ``position`` = t | previous token ``prev``) for every t in :data:`VOCAB`."""
    return step_distribution(
        model, prompt_digest, prev, position, temperature=temperature, top_p=top_p
    ).vector()


def next_token_distribution(
    prompt_digest: bytes,
    prev: int | None,
    position: int,
    *,
    temperature: float,
    top_p: float = 1.0,
    model_salt: str = "target",
    min_tokens: int = 16,
    max_tokens: int = 256,
) -> list[float]:
    """:func:`distribution` of the model ``model_salt`` (a server's target with
    ``min_output_tokens=min_tokens``, ``max_output_tokens=max_tokens``)."""
    model = TokenModel.of(model_salt, min_tokens=min_tokens, max_tokens=max_tokens)
    return distribution(model, prompt_digest, prev, position, temperature=temperature, top_p=top_p)


def raw_logprob(
    model: TokenModel, prompt_digest: bytes, prev: int | None, position: int, token: int
) -> float:
    """``log softmax(logits)[token]`` at temperature 1 without truncation (vLLM's default
    ``raw_logprobs``: what a server reports as a token's logprob)."""
    row = _row(model.terms, prompt_digest, prev)
    e = _eos_logit(model, row.lse, position)
    if e == math.inf:
        return 0.0 if token == EOS else -math.inf
    norm = row.lse if e == -math.inf else max(row.lse, e) + math.log1p(math.exp(-abs(row.lse - e)))
    return (e if token == EOS else row.values[token]) - norm


# ------------------------------------------------------------------ text ↔ ids


def pieces(ids: Sequence[int]) -> list[str]:
    """The output tokens (text pieces) of ``ids``: a word has its leading space except first,
    and a capital first and after ``"."``; they split back into themselves
    (:func:`simulator.textgen.split_pieces`)."""
    out: list[str] = []
    prev: int | None = None
    for t in ids:
        if t in _PUNCT:
            out.append(VOCAB[t])
        elif t == EOS:
            raise ValueError("EOS is not an output token")
        else:
            word = WORDS[t]
            if prev is None or prev == PERIOD:
                word = word.capitalize()
            out.append(word if prev is None else " " + word)
        prev = t
    return out


_WORD_ID = {w: i for i, w in enumerate(WORDS)}


def parse_text(text: str) -> list[int] | None:
    """The ids whose :func:`pieces` are ``text``; ``None`` when the model cannot write it."""
    ids: list[int] = []
    for piece in split_pieces(text):
        if piece == ".":
            ids.append(PERIOD)
        elif piece == ",":
            ids.append(COMMA)
        else:
            t = _WORD_ID.get(piece.lstrip(" ").lower())
            if t is None:
                return None
            ids.append(t)
    return ids if "".join(pieces(ids)) == text else None


def sequence_logprobs(
    model: TokenModel,
    prompt_digest: bytes,
    ids: Sequence[int],
    *,
    temperature: float,
    top_p: float = 1.0,
    stopped: bool = False,
) -> list[float]:
    """``log P(ids[i] | ids[i − 1], i)`` for each token (``-inf`` where impossible), then
    ``log P(EOS)`` after the last when ``stopped`` (finish_reason ``"stop"``). Their sum is the
    answer's log-likelihood; without the EOS term, that of its prefix."""
    out: list[float] = []
    prev: int | None = None
    for position, t in enumerate([*ids, EOS] if stopped else ids):
        p = step_distribution(
            model, prompt_digest, prev, position, temperature=temperature, top_p=top_p
        ).prob(t)
        out.append(math.log(p) if p > 0.0 else -math.inf)
        prev = t
    return out


# ------------------------------------------------------------------ drawing an answer


@dataclass(frozen=True, slots=True)
class Speculation:
    """Speculative sampling: ``k`` drafts per drafting step from ``drafter``; each decode step
    drafts with probability ``coverage`` (drawn from ``steps_rng`` in :func:`generate`);
    ``draft_temperature`` (the defect) draws the drafts at that temperature instead."""

    k: int
    drafter: TokenModel
    coverage: float = 1.0
    draft_temperature: float | None = None


@dataclass(frozen=True, slots=True)
class Sampled:
    """One drawn answer: its ids (EOS excluded), whether it drew EOS, its engine steps."""

    ids: tuple[int, ...]
    stopped: bool
    steps: tuple[Step, ...]


def request_rng(prompt_digest: bytes, seed: int | None) -> random.Random:
    """The draws of one request: reproducible from the request's ``seed``, else fresh entropy
    (``os.urandom``), so two servers answering the same prompt draw independently."""
    if seed is None:
        return random.Random(int.from_bytes(os.urandom(16), "big"))
    return random.Random(_seed(b"sample", prompt_digest, str(seed).encode()))


class _Target:
    """The target's distribution at each position, with the logit-noise defect."""

    def __init__(
        self,
        model: TokenModel,
        prompt_digest: bytes,
        temperature: float,
        top_p: float,
        noise: float,
        rng: random.Random,
    ) -> None:
        self.model, self.digest, self.noise, self.rng = model, prompt_digest, noise, rng
        self.temperature, self.top_p = temperature, top_p

    def at(self, prev: int | None, position: int) -> Dist:
        if self.noise <= 0.0:
            return step_distribution(
                self.model,
                self.digest,
                prev,
                position,
                temperature=self.temperature,
                top_p=self.top_p,
            )
        values = logits(self.model, self.digest, prev, position)
        if values[EOS] == math.inf:
            return _OneHot(EOS)
        gauss, sigma = self.rng.gauss, self.noise
        noisy = [v + gauss(0.0, sigma) if v > -math.inf else v for v in values]
        probs = distribution_from_logits(noisy, temperature=self.temperature, top_p=self.top_p)
        if self.temperature <= GREEDY_EPS:
            return _OneHot(probs.index(1.0))
        return _Vector.of(probs)


def _residual(p: Dist, q: Dist) -> Dist:
    pv, qv = p.vector(), q.vector()
    r = [max(0.0, a - b) for a, b in zip(pv, qv, strict=True)]
    return _Vector.of(r) if sum(r) > 0.0 else _Vector.of(pv)


def generate(
    model: TokenModel,
    prompt_digest: bytes,
    *,
    temperature: float,
    top_p: float = 1.0,
    max_tokens: int,
    rng: random.Random,
    speculation: Speculation | None = None,
    steps_rng: random.Random | None = None,
    noise_sigma: float = 0.0,
) -> Sampled:
    """Draw one answer of at most ``max_tokens`` tokens (see the module doc): one token per
    step, or speculative sampling with ``speculation`` (coverage drawn from ``steps_rng``,
    default ``rng``). ``noise_sigma``: the logit-noise defect on the target."""
    target = _Target(model, prompt_digest, temperature, top_p, noise_sigma, rng)
    ids: list[int] = []
    steps: list[Step] = []
    prev: int | None = None
    cover = steps_rng or rng
    while len(ids) < max_tokens:
        position = len(ids)
        drafted = 0
        if speculation is not None and position > 0 and cover.random() < speculation.coverage:
            drafted = min(speculation.k, max_tokens - position - 1)
        if drafted == 0:
            x = target.at(prev, position).sample(rng)
            if x == EOS:
                return Sampled(tuple(ids), True, tuple(steps))
            ids.append(x)
            steps.append(Step(0, 0))
            prev = x
            continue
        assert speculation is not None
        proposed, tokens = _speculative_step(
            target, speculation, prompt_digest, prev, position, drafted, temperature, top_p, rng
        )
        if EOS in tokens:  # the visible tokens before EOS are accepted drafts
            visible = tokens[: tokens.index(EOS)]
            if visible:  # as if the proposer had not drafted past the end (plan_steps' rule)
                ids += visible
                steps.append(Step(len(visible) - 1, len(visible) - 1))
            return Sampled(tuple(ids), True, tuple(steps))
        ids += tokens
        steps.append(Step(proposed, len(tokens) - 1))
        prev = tokens[-1]
    return Sampled(tuple(ids), False, tuple(steps))


def _speculative_step(
    target: _Target,
    spec: Speculation,
    prompt_digest: bytes,
    prev: int | None,
    position: int,
    k: int,
    temperature: float,
    top_p: float,
    rng: random.Random,
) -> tuple[int, list[int]]:
    """(drafts proposed, the step's tokens: accepted drafts then the target's own token)."""
    draft_t = temperature if spec.draft_temperature is None else spec.draft_temperature
    drafts: list[int] = []
    qs: list[Dist] = []
    dp = prev
    for i in range(k):
        drawn = step_distribution(
            spec.drafter, prompt_digest, dp, position + i, temperature=draft_t, top_p=top_p
        )
        x = drawn.sample(rng)
        q = (
            drawn
            if draft_t == temperature
            else step_distribution(
                spec.drafter, prompt_digest, dp, position + i, temperature=temperature, top_p=top_p
            )
        )
        drafts.append(x)
        qs.append(q)
        if x == EOS:
            break
        dp = x
    tokens: list[int] = []
    dp = prev
    for i, (x, q) in enumerate(zip(drafts, qs, strict=True)):
        p = target.at(dp, position + i)
        px, qx = p.prob(x), q.prob(x)
        if px > 0.0 and (qx <= px or rng.random() * qx < px):  # accept w.p. min(1, p/q)
            tokens.append(x)
            if x == EOS:
                return len(drafts), tokens
            dp = x
            continue
        tokens.append(_residual(p, q).sample(rng))
        return len(drafts), tokens
    tokens.append(target.at(dp, position + len(drafts)).sample(rng))  # the bonus token
    return len(drafts), tokens
