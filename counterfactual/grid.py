"""The configurations a counterfactual run scores: proposer × depth × lookup window × drafter.

The default grid is vLLM's n-gram proposer at ``num_speculative_tokens`` 1…8 over the usual lookup
windows — vLLM's default ``(5, 5)`` and the ``(1, 3)``, ``(2, 4)``, ``(3, 5)`` windows its docs and
users reach for — plus every drafter the records carry predictions for, at the same depths. A
live candidate's configuration is always added, so predicted and measured meet. llama.cpp's
``ngram-mod`` and ``ngram-map-k`` (``--llamacpp``) are configurations of their own: one replayed
server per knob set and depth (:mod:`.llamacpp_replay`).

Beside fixed ``k``, every proposer family is scored under the dynamic rules of
:mod:`.rules` (Hugging Face's heuristic, SGLang-style EMA tiers, vLLM's elastic EWMA; the
confidence threshold for drafters whose records carry probabilities; batch-size schedules
given on the command line, as bounds). Such a configuration's ``num_speculative_tokens`` is
the rule's cap.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from counterfactual.crossvocab import SLEM_CLASS, TLI_CLASS
from counterfactual.llamacpp_ngram import LlamaKnobs
from counterfactual.llamacpp_replay import knobs_label, row_json, server_args
from counterfactual.rules import DEFAULT_RULES, ReplayClass, Rule, replay_class
from counterfactual.suffix_replay import SuffixKnobs

__all__ = [
    "DEFAULT_DEPTHS",
    "DEFAULT_WINDOWS",
    "Config",
    "config_json",
    "grid",
    "llamacpp_config",
    "parse_windows",
]

CrossVocabRule = Literal["tli", "slem"]
Proposer = Literal["ngram", "draft_model", "suffix", "ngram-mod", "ngram-map-k"]
DEFAULT_DEPTHS: tuple[int, ...] = tuple(range(1, 9))
DEFAULT_WINDOWS: tuple[tuple[int, int], ...] = ((1, 3), (2, 4), (3, 5), (5, 5))


@dataclass(frozen=True, slots=True, order=True)
class Config:
    """One speculative configuration, named as vLLM's ``--speculative-config`` names it."""

    proposer: Proposer
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    drafter: str | None = None  # draft-model configurations: the drafter backend
    rule: Rule | None = None  # a dynamic draft-length rule (k is then its cap)
    suffix: SuffixKnobs | None = None  # suffix decoding's other knobs (counterfactual/suffix.py)
    # llama.cpp's ngram-mod / ngram-map-k (counterfactual/llamacpp_ngram.py); its n_max is k.
    llamacpp: LlamaKnobs | None = None
    # A drafter with its own tokenizer (counterfactual/crossvocab.py): "tli" (vLLM's
    # use_heterogeneous_vocab) or "slem" (Hugging Face's Universal Assisted Generation).
    cross_vocab: CrossVocabRule | None = None

    @property
    def replay_class(self) -> ReplayClass:
        if self.cross_vocab == "slem":
            return "approximate"
        return replay_class(self.rule, self.proposer)

    @property
    def family(
        self,
    ) -> tuple[
        str,
        int | None,
        int | None,
        str | None,
        SuffixKnobs | None,
        LlamaKnobs | None,
        CrossVocabRule | None,
    ]:
        """Everything but the depth: configurations that differ only in k (a llama.cpp
        configuration is a replayed server of its own at every depth)."""
        return (
            self.proposer,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            self.drafter,
            self.suffix,
            self.llamacpp,
            self.cross_vocab,
        )

    @property
    def label(self) -> str:
        if self.llamacpp is not None:
            return knobs_label(self.llamacpp)
        if self.suffix is not None:
            return f"suffix k={self.num_speculative_tokens} {self.suffix.label}"
        if self.cross_vocab is not None:
            return f"draft {self.drafter} k={self.num_speculative_tokens} {self.cross_vocab}"
        if self.rule is not None:
            if self.proposer == "ngram":
                where = f"ngram lookup {self.prompt_lookup_min}-{self.prompt_lookup_max}"
            else:
                where = f"draft {self.drafter}"
            return f"{where} {self.rule.text}"
        if self.proposer == "ngram":
            return (
                f"ngram k={self.num_speculative_tokens} "
                f"lookup {self.prompt_lookup_min}-{self.prompt_lookup_max}"
            )
        return f"draft {self.drafter} k={self.num_speculative_tokens}"

    def speculative_config(self) -> dict[str, object]:
        """The ``--speculative-config`` JSON for vLLM (the drafter's model path is the operator's);
        for a llama.cpp configuration, its ``llama-server`` flags."""
        if self.llamacpp is not None:
            return {"spec_type": self.proposer, "server_args": server_args(self.llamacpp)}
        if self.suffix is not None:
            return {
                "method": "suffix",
                "num_speculative_tokens": self.num_speculative_tokens,
                **self.suffix.speculative_config(),
            }
        if self.proposer == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max,
            }
        if self.cross_vocab == "slem":  # not a vLLM method: transformers' generate() runs it
            return {
                "assistant_model": f"<{self.drafter} model>",
                "assistant_tokenizer": f"<{self.drafter} tokenizer>",
                "num_assistant_tokens": self.num_speculative_tokens,
                "num_assistant_tokens_schedule": "constant",
            }
        if self.cross_vocab == "tli":  # greedy drafts only (vLLM's restriction)
            return {
                "method": "draft_model",
                "model": f"<{self.drafter} model>",
                "num_speculative_tokens": self.num_speculative_tokens,
                "use_heterogeneous_vocab": True,
            }
        return {
            "model": f"<{self.drafter} model>",
            "num_speculative_tokens": self.num_speculative_tokens,
        }


def config_json(c: Config) -> dict[str, object]:
    """The configuration's fields in a row: as ``--speculative-config`` names them, the rule (its
    text, name and constants; None for fixed k) and the replay class."""
    return {
        "proposer": c.proposer,
        "num_speculative_tokens": c.num_speculative_tokens,
        "prompt_lookup_min": c.prompt_lookup_min,
        "prompt_lookup_max": c.prompt_lookup_max,
        "drafter": c.drafter,
        "label": c.label,
        "rule": None if c.rule is None else c.rule.text,
        "rule_name": None if c.rule is None else c.rule.name,
        "rule_params": None if c.rule is None else c.rule.params_json(),
        "replay_class": c.replay_class,
        **({} if c.suffix is None else c.suffix.row_json()),
        **({} if c.llamacpp is None else row_json(c.llamacpp)),
        **(
            {}
            if c.cross_vocab is None
            else {
                "cross_vocabulary": True,
                "cross_vocab_rule": c.cross_vocab,
                "replay_note": TLI_CLASS if c.cross_vocab == "tli" else SLEM_CLASS,
            }
        ),
    }


def grid(
    *,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    windows: Sequence[tuple[int, int]] = DEFAULT_WINDOWS,
    drafters: Iterable[str] = (),
    extra: Iterable[Config] = (),
    rules: Iterable[Rule] = DEFAULT_RULES,
    drafter_rules: Iterable[Rule] = (),
    suffix: Iterable[SuffixKnobs] = (),
    llamacpp: Iterable[LlamaKnobs] = (),
) -> tuple[Config, ...]:
    """Every configuration to score, sorted (fixed ``k`` first), without duplicates.

    ``rules`` apply to the n-gram and drafter families, ``drafter_rules`` (the confidence
    threshold) to drafters; each ``llamacpp`` knob set is one configuration (its ``n_max`` the
    depth)."""
    rules, drafter_rules = tuple(rules), tuple(drafter_rules)
    configs = {Config("ngram", k, lo, hi) for lo, hi in windows for k in depths}
    configs |= {Config("draft_model", k, drafter=d) for d in drafters for k in depths}
    configs |= {Config("ngram", r.cap, lo, hi, rule=r) for lo, hi in windows for r in rules}
    configs |= {
        Config("draft_model", r.cap, drafter=d, rule=r)
        for d in drafters
        for r in (*rules, *drafter_rules)
    }
    configs |= {Config("suffix", k, suffix=s) for s in suffix for k in depths}
    configs |= {llamacpp_config(kn) for kn in llamacpp}
    configs |= set(extra)
    return tuple(sorted(configs, key=sort_key))


def llamacpp_config(k: LlamaKnobs) -> Config:
    """The configuration of one llama.cpp n-gram server (its depth is ``n_max``)."""
    proposer: Proposer = "ngram-mod" if k.spec_type == "ngram-mod" else "ngram-map-k"
    return Config(proposer, k.n_max, llamacpp=k)


def sort_key(c: Config) -> tuple[object, ...]:
    """Family, then fixed k by depth, then the rules."""
    return (
        c.family[0],
        str(c.family[1:]),
        c.rule is not None,
        c.num_speculative_tokens if c.rule is None else 0,
        "" if c.rule is None else c.rule.text,
    )


def parse_windows(text: str) -> tuple[tuple[int, int], ...]:
    """``"1-3,2-4"`` → ((1, 3), (2, 4)).

    Raises:
        ValueError: naming the piece that is not ``MIN-MAX`` with ``1 <= MIN <= MAX``.
    """
    out: list[tuple[int, int]] = []
    for piece in text.split(","):
        lo, sep, hi = piece.strip().partition("-")
        try:
            window = (int(lo), int(hi if sep else lo))
        except ValueError:
            raise ValueError(f"lookup window {piece!r}: expected MIN-MAX, e.g. 2-4") from None
        if not 1 <= window[0] <= window[1]:
            raise ValueError(f"lookup window {piece!r}: expected 1 <= MIN <= MAX")
        out.append(window)
    return tuple(out)


def parse_depths(text: str) -> tuple[int, ...]:
    """``"1-8"`` or ``"1,2,4"`` → the depths.

    Raises:
        ValueError: a depth that is not an integer in 1..64.
    """
    out: set[int] = set()
    for piece in text.split(","):
        lo, sep, hi = piece.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"depth {piece!r}: expected K or K1-K2") from None
        if not 1 <= first <= last <= 64:
            raise ValueError(f"depth {piece!r}: expected 1 <= K <= 64")
        out.update(range(first, last + 1))
    return tuple(sorted(out))
