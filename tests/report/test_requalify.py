"""Re-qualification and the confound gate on records written by hand (pure): what counts as a
change, where the window splits, what the gate names and when a baseline isolates speculation."""

from __future__ import annotations

from typing import Any

from evidence.engine_config import resolve_engine
from records.reader import read
from report.confounds import confound
from report.requalify import changes, split

BASE = {"engine": "vllm", "version": "0.32.0", "dtype": "bfloat16", "quantization": None}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def engine(declared: dict[str, Any] | None = None, /, **values: Any) -> dict[str, Any]:
    got = resolve_engine({"s": ("vllm_server_info", values)}, declared)
    assert got is not None
    return got.to_json()


def record(t: int, *legs: tuple[str, str, dict[str, Any] | None]) -> Any:
    return read(
        {
            "started_unix_ns": t,
            "legs": [{"role": role, "backend": backend, "engine": e} for role, backend, e in legs],
        }
    )


def test_a_change_splits_the_window_and_a_field_that_becomes_known_does_not() -> None:
    prim = engine(**BASE, speculative=None)
    cand = engine(**BASE, speculative=NGRAM)
    partial = engine(engine="vllm", speculative=NGRAM)  # the probe had only /version … not yet
    upgraded = engine(**{**BASE, "version": "0.33.0"}, speculative=NGRAM)
    recs = [
        record(1, ("primary", "p", prim), ("candidate", "c", None)),  # nothing known yet
        record(2, ("primary", "p", prim), ("candidate", "c", partial)),
        record(3, ("primary", "p", prim), ("candidate", "c", cand)),  # more known: no change
        record(4, ("primary", "p", prim), ("candidate", "c", cand)),
        record(5, ("primary", "p", prim), ("candidate", "c", upgraded)),
        record(6, ("primary", "p", prim), ("candidate", "c", upgraded)),
    ]
    (ch,) = changes(recs)
    assert (ch.backend, ch.at_unix_ns, ch.fields) == ("c", 5, ("version",))
    assert (ch.before["version"], ch.after["version"]) == ("0.32.0", "0.33.0")
    judged, found, since = split(recs)
    assert since == 5 and [r.started_unix_ns for r in judged] == [5, 6] and found == [ch]
    # Without a change nothing is cut.
    judged, found, since = split(recs[:4])
    assert since is None and found == [] and len(judged) == 4
    # A new depth is a new candidate too (the speculative block counts for re-qualification).
    deeper = engine(**BASE, speculative={**NGRAM, "num_speculative_tokens": 6})
    more = [*recs[:4], record(7, ("primary", "p", prim), ("candidate", "c", deeper))]
    assert [c.fields for c in changes(more)] == [("speculative",)]


def test_the_gate_names_what_differs_and_says_what_was_only_declared() -> None:
    prim = engine(**BASE, kv_cache_dtype="auto", speculative=None)  # auto: the model's dtype
    cand = engine({"kv_cache_dtype": "fp8"}, **{**BASE, "quantization": "fp8"}, speculative=NGRAM)
    gate = confound([record(1, ("primary", "p", prim), ("candidate", "c", cand))], "c")
    assert gate is not None and gate.confounded
    assert gate.fields == ("quantization", "kv_cache_dtype")
    assert gate.declared == ("kv_cache_dtype",)  # the candidate's engine did not say it
    assert gate.production["kv_cache_dtype"] == "bfloat16"
    # A field one side does not know is unknown, not different.
    silent = engine(**BASE, speculative=None)
    unknown = confound([record(1, ("primary", "p", silent), ("candidate", "c", cand))], "c")
    assert unknown is not None and unknown.fields == ("quantization",)
    text = gate.differences()
    assert "quantization (production unset, candidate fp8)" in text
    assert "kv_cache_dtype" in text and "declared, not reported" in text
    assert gate.fragment is not None and "cand" not in gate.fragment.split("backends:")[0]


def test_a_baseline_that_matches_but_for_speculation_isolates_it() -> None:
    prim = engine(**BASE, speculative=None)
    fp8 = {**BASE, "quantization": "fp8"}
    cand = engine(**fp8, speculative=NGRAM)
    good = engine(**fp8, speculative=None)
    other = engine(**{**fp8, "version": "0.33.0"}, speculative=None)
    legs = (("primary", "p", prim), ("candidate", "c", cand))
    isolated = confound([record(1, *legs, ("baseline", "b", good))], "c")
    assert isolated is not None and isolated.isolated and not isolated.confounded
    assert isolated.reason().startswith("judged against baseline b")
    not_isolated = confound([record(1, *legs, ("baseline", "b", other))], "c")
    assert not_isolated is not None and not_isolated.confounded
    assert not_isolated.baseline_fields == ("version",)
    # Unknown configurations: no gate at all.
    assert confound([record(1, ("primary", "p", None), ("candidate", "c", cand))], "c") is None
