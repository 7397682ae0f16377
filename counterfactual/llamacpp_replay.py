"""llama.cpp's n-gram proposers in the counterfactual matrix: the knobs as axes, the rows' fields,
and the live check against a llama.cpp candidate's own ``timings`` counts.

Rows carry ``proposer`` ``ngram-mod`` or ``ngram-map-k`` — llama.cpp's own ``--spec-type``
spellings — with ``num_speculative_tokens`` the depth (``--spec-ngram-mod-n-max``, or
``--spec-ngram-map-k-size-m``), the other knobs under ``llamacpp`` and ``replay_class``
``exact_given_history``. Each configuration is one replayed server
(:class:`counterfactual.llamacpp_ngram.LlamaServer`) fed every record in the order read.

**The live check.** llama.cpp reports drafted and accepted tokens per request
(``legs[].acceptance`` with source ``llamacpp_timings``) but no drafting steps, so a llama.cpp
candidate is not checked on mean acceptance length as a vLLM one is: its configuration is
replayed on the ids the candidate itself generated (the token tap's ``tokens.legs``; production's
output where it kept none), record by record in order — the history its server saw — and the
per-request drafted and accepted counts are compared with its own. Exact per request when every
request the server served is in the records with its ids and they came one at a time; the entry
says how many requests agreed, and the pooled sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from counterfactual.llamacpp_ngram import SPEC_TYPES, LlamaKnobs, LlamaServer
from records.reader import Leg, Record

__all__ = [
    "DEFAULTS",
    "REPLAY_NOTE",
    "LlamaLiveCheck",
    "feed_live",
    "knobs_label",
    "live_knobs",
    "parse_llamacpp_knobs",
    "row_json",
    "server_args",
]

# llama.cpp's defaults (common.h; xllamacpp 2026.10.11549's CommonParams()): n_match, n_min, n_max.
DEFAULTS = {"ngram-mod": (24, 48, 64), "ngram-map-k": (12, 1, 48)}

REPLAY_NOTE = (
    "exact given the history: one replayed llama.cpp server per configuration, fed every record "
    "in the order read (production's order). ngram-mod's hash pool is shared by all the "
    "server's slots and ngram-map-k keeps a map per slot across requests, so a draft depends "
    "on every request the server served before it, and on which slot it landed on; requests "
    "missing from the records (untapped, warm-up, other traffic) are missing from the replay's "
    "history, and requests that overlapped in production fed the pool in another order"
)


def knobs_label(k: LlamaKnobs) -> str:
    if k.spec_type == "ngram-mod":
        text = f"ngram-mod k={k.n_max} n_match={k.n_match} n_min={k.n_min}"
    else:
        text = f"ngram-map-k k={k.n_max} size_n={k.n_match} min_hits={k.n_min}"
    return f"{text} slots={k.slots}"


def server_args(k: LlamaKnobs) -> list[str]:
    """The ``llama-server`` flags that run this configuration."""
    if k.spec_type == "ngram-mod":
        spec = ["--spec-ngram-mod-n-match", str(k.n_match), "--spec-ngram-mod-n-min",
                str(k.n_min), "--spec-ngram-mod-n-max", str(k.n_max)]  # fmt: skip
    else:
        spec = ["--spec-ngram-map-k-size-n", str(k.n_match), "--spec-ngram-map-k-size-m",
                str(k.n_max), "--spec-ngram-map-k-min-hits", str(k.n_min)]  # fmt: skip
    return ["--spec-type", k.spec_type, *spec, "--parallel", str(k.slots)]


def row_json(k: LlamaKnobs) -> dict[str, object]:
    """A row's llama.cpp fields (beside the configuration's own)."""
    names = ("n_match", "n_min", "n_max") if k.spec_type == "ngram-mod" else (
        "size_n", "min_hits", "size_m")  # fmt: skip
    return {
        "llamacpp": {
            "spec_type": k.spec_type,
            names[0]: k.n_match,
            names[1]: k.n_min,
            names[2]: k.n_max,
            "slots": k.slots,
            "n_ctx": k.n_ctx,
            "server_args": server_args(k),
        },
        "replay_note": REPLAY_NOTE,
    }


def parse_llamacpp_knobs(text: str) -> tuple[LlamaKnobs, bool]:
    """``"ngram-mod"`` or ``"ngram-mod:n_match=4,n_min=1,n_max=8,slots=2"`` (``ngram-map-k``:
    ``size_n``, ``size_m``, ``min_hits``; the rest llama.cpp's defaults, one slot) → the knobs,
    and whether the depth (``n_max`` / ``size_m``) was given.

    Raises:
        ValueError: naming the piece that is not a known type or ``NAME=INTEGER``.
    """
    spec_type, _, rest = text.strip().partition(":")
    if spec_type not in SPEC_TYPES:
        raise ValueError(f"llama.cpp proposer {text!r}: expected one of {', '.join(SPEC_TYPES)}")
    n_match, n_min, n_max = DEFAULTS[spec_type]
    names = (
        {"n_match": "n_match", "n_min": "n_min", "n_max": "n_max"}
        if spec_type == "ngram-mod"
        else {"size_n": "n_match", "min_hits": "n_min", "size_m": "n_max"}
    )
    values: dict[str, int] = {"n_match": n_match, "n_min": n_min, "n_max": n_max, "slots": 1}
    n_ctx: int | None = None
    depth = False
    for piece in filter(None, (p.strip() for p in rest.split(","))):
        name, _, value = piece.partition("=")
        field_name = names.get(name) or (name if name in ("slots", "n_ctx") else None)
        if field_name is None:
            known = ", ".join([*names, "slots", "n_ctx"])
            raise ValueError(f"{spec_type} knob {piece!r}: expected one of {known}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{spec_type} knob {piece!r}: expected an integer") from None
        if field_name == "n_ctx":
            n_ctx = number
        else:
            values[field_name] = number
        depth = depth or field_name == "n_max"
    knobs = LlamaKnobs(
        spec_type, values["n_match"], values["n_min"], values["n_max"], values["slots"], n_ctx
    )
    return knobs, depth


def live_knobs(leg: Leg, declared: Iterable[LlamaKnobs] = ()) -> LlamaKnobs | None:
    """The configuration a llama.cpp n-gram candidate runs: its method and depth as recorded
    (``legs[].speculative``), its slots and context from its engine block; the other knobs are
    not served, so a declared knob set of the same type and depth (``--llamacpp``) is taken,
    else llama.cpp's defaults. None for any other leg."""
    spec = leg.speculative
    method = (spec.method or "") if spec is not None else ""
    k = spec.num_speculative_tokens if spec is not None else None
    if method not in SPEC_TYPES or k is None or k < 1:
        return None
    settings = leg.engine.settings if leg.engine is not None else None
    slots = _int((settings or {}).get("max_num_seqs"))
    n_ctx = _int((settings or {}).get("max_model_len"))
    for d in declared:
        if d.spec_type == method and d.n_max == k and (slots is None or d.slots == slots):
            return d
    n_match, n_min, _ = DEFAULTS[method]
    return LlamaKnobs(method, n_match, n_min, k, slots or 1, n_ctx)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(slots=True)
class LlamaLiveCheck:
    """One llama.cpp candidate: its configuration replayed on what it served, against its own
    per-request counts."""

    backend: str
    knobs: LlamaKnobs
    server: LlamaServer = field(init=False)
    requests: int = 0
    equal: int = 0
    greedy: list[int] = field(default_factory=lambda: [0, 0])  # greedy requests, equal
    own_ids: int = 0  # requests replayed on the candidate's own generated ids
    predicted: list[int] = field(default_factory=lambda: [0, 0])  # drafted, accepted
    measured: list[int] = field(default_factory=lambda: [0, 0])
    unreplayed: int = 0  # requests it served that the replay could not feed (no ids)

    def __post_init__(self) -> None:
        self.server = self.knobs.server()

    def add(
        self,
        prompt: list[int] | None,
        output: list[int] | None,
        own: bool,
        greedy: bool,
        drafted: float | None,
        accepted: float | None,
    ) -> None:
        """One request the candidate served, in order; ``output``: the ids it generated
        (``own``) or production's."""
        if prompt is None or not output:
            self.unreplayed += 1
            return
        r = self.server.serve(prompt, output)
        if drafted is None or accepted is None:
            return
        same = (r.draft_tokens, r.accepted) == (int(drafted), int(accepted))
        self.requests += 1
        self.equal += same
        self.own_ids += own
        if greedy:
            self.greedy[0] += 1
            self.greedy[1] += same
        self.predicted[0] += r.draft_tokens
        self.predicted[1] += r.accepted
        self.measured[0] += int(drafted)
        self.measured[1] += int(accepted)

    def as_json(self, config: Mapping[str, Any]) -> dict[str, Any]:
        def counts(c: list[int]) -> dict[str, Any]:
            return {"draft_tokens": c[0], "accepted": c[1],
                    "draft_acceptance_rate": c[1] / c[0] if c[0] else None}  # fmt: skip

        note = (
            f"{self.equal} of {self.requests} requests drafted and accepted exactly what the "
            "replay predicts"
        )
        if self.unreplayed:
            note += (
                f"; {self.unreplayed} requests it served have no ids in the records, so the "
                "replay's history lacks them"
            )
        return {
            "backend": self.backend,
            **config,
            "source": "llamacpp_timings",
            "requests": self.requests,
            "requests_equal": self.equal,
            "greedy_requests": self.greedy[0],
            "greedy_requests_equal": self.greedy[1],
            "replayed_on_own_ids": self.own_ids,
            "unreplayed": self.unreplayed,
            "predicted": counts(self.predicted),
            "measured": counts(self.measured),
            "note": note,
        }


def feed_live(
    checks: dict[tuple[str, LlamaKnobs], LlamaLiveCheck],
    record: Record,
    backends: Mapping[str, LlamaKnobs],
) -> None:
    """Every leg of ``record`` (read in order) to a llama.cpp n-gram candidate ``backends`` names
    (backend → what it runs, learned from any of its legs: a leg recorded before the server had
    drafted carries no depth) into that candidate's live check."""
    t = record.tokens
    for leg in record.legs:
        knobs = backends.get(leg.backend) if leg.role == "candidate" else None
        if knobs is None or not leg.ok:
            continue
        check = checks.get((leg.backend, knobs))
        if check is None:
            check = checks[(leg.backend, knobs)] = LlamaLiveCheck(leg.backend, knobs)
        own = (t.legs.get(leg.backend) if t is not None else None) or None
        output = own or (t.output if t is not None else None)
        acc = leg.acceptance
        # llama.cpp leaves the timings' draft fields out when a request drafted nothing.
        drafted, accepted = acc.num_draft_tokens, acc.num_accepted_tokens
        if acc.source is None and drafted is None and accepted is None:
            drafted = accepted = 0
        check.add(
            t.prompt if t is not None else None,
            list(output) if output else None,
            own is not None,
            record.greedy,
            drafted,
            accepted,
        )
