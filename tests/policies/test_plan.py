"""``specshadow plan``: candidate replicas for load parity, and the parity of a sizing, checked
against the arithmetic of per-replica arrival rates done here independently."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policies.plan import Plan, plan_many

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("p", "rate", "share", "s"),
    [(10, 200.0, 0.1, 2), (8, 50.0, 0.3, 3), (1, 5.0, 1.0, 1), (4, 40.0, 0.5, 1)],
)
def test_parity_is_the_candidates_per_replica_rate_over_productions(
    p: int, rate: float, share: float, s: int
) -> None:
    plan = Plan(p, rate, share, s)
    candidate_per_replica = share * rate / s  # what each candidate replica receives
    production_per_replica = rate / p
    assert plan.parity == pytest.approx(candidate_per_replica / production_per_replica)
    assert plan.replicas_for_parity * production_per_replica == pytest.approx(share * rate)
    matched = Plan(p, rate, plan.matched_share or 0.0, s)
    assert matched.parity == pytest.approx(min(1.0, p / s) if s > p else 1.0)


def test_several_candidates_each_get_their_own_matched_share() -> None:
    rows = plan_many(10, 100.0, [1, 2])
    assert [(s, f) for s, f, _rps in rows] == [(1, 0.1), (2, 0.2)]
    assert [rps for _s, _f, rps in rows] == pytest.approx([10.0, 20.0])


def test_the_command_answers_the_sizing_question_and_names_bad_flags() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "specshadow", "plan", *args],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    out = run(
        "--primary-replicas", "10", "--rate", "200", "--share", "0.1", "--candidate-replicas", "2"
    )
    assert out.returncode == 0, out.stderr
    assert "load parity at this share: 1 candidate replica" in out.stdout
    assert "load parity 0.50 — mismatched: set ratio: load_matched (share 0.2)" in out.stdout
    bad = run("--primary-replicas", "0", "--rate", "-1")
    assert bad.returncode == 2
    assert "--primary-replicas: must be at least 1, got 0" in bad.stderr
    assert "--rate: must be positive, got -1.0" in bad.stderr
