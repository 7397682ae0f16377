"""A canary re-qualifies when its candidate's engine changes (issue 30): the promotion was earned
by another build, so the rule goes back to its first canary step (or, with
``on_config_change: hold``, stays but promotes no further); a rolled-back candidate stays rolled
back until its configuration changes. The candidate is a simulator whose version the test
changes mid-run (:mod:`simulator.engine_info`); the gateway's probe sees it within a second."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.test_rollout import FAST, TOKEN, Rig, policy


@pytest.fixture
async def rig2(servers, tmp_path, write_policy, sims):
    r = Rig(servers, tmp_path, write_policy)
    r.primary_url = (await sims(**FAST)).base_url  # type: ignore[attr-defined]
    r.cand = await sims(mode="speculative", acceptance=0.8, **FAST)  # type: ignore[attr-defined]
    return r


STEPS = {"steps": [0.3, 0.6, 1.0], "hold": {"min_requests": 5, "min_s": 0.05},
         "guards": {"window": 60, "min_samples": 10}}  # fmt: skip


async def until(rig: Any, check: Any, batch: int = 8, rounds: int = 60) -> dict[str, Any]:
    """Send ``batch`` requests at a time until the rule's status satisfies ``check``."""
    status: dict[str, Any] = {}
    for _ in range(rounds):
        await rig.send(batch)
        await rig.settle(rig.sent)
        status = (await rig.status())["rules"]["default"]
        if check(status):
            return status
    raise AssertionError(status)


async def test_an_engine_change_sends_a_promoted_canary_back_to_its_first_step(rig2):
    rig = rig2
    await rig.start(policy(rig.primary_url, rig.cand.base_url, **STEPS))
    first = await until(rig, lambda s: s["engine"] is not None and (s["step"] or 0) >= 1)
    engine = first["engine"]
    rig.cand.engine.update(version="0.33.0")  # a new build behind the same URL
    back = await until(rig, lambda s: s["engine"] != engine, batch=2)
    assert (back["stage"], back["step"], back["serve_ratio"]) == ("canary", 0, 0.3)
    last = back["last_transition"]
    assert last["by"] == "schedule"
    assert "engine configuration changed" in last["reason"]
    assert "back to the first canary step" in last["reason"]
    await rig.stop()


async def test_on_config_change_hold_stays_and_promotes_no_further(rig2):
    rig = rig2
    await rig.start(policy(rig.primary_url, rig.cand.base_url, on_config_change="hold", **STEPS))
    first = await until(rig, lambda s: s["engine"] is not None and (s["step"] or 0) >= 1)
    rig.cand.engine.update(kv_cache_dtype="fp8")
    held = await until(rig, lambda s: s["engine"] != first["engine"], batch=2)
    last = held["last_transition"]
    assert last["from_stage"] == last["to_stage"] == held["stage"]  # it stayed where it was
    assert "held here" in last["reason"]
    step, ratio = held["step"], held["serve_ratio"]
    await rig.send(40)  # far past the hold: no step up
    await rig.settle(rig.sent)
    after = (await rig.status())["rules"]["default"]
    assert (after["step"], after["serve_ratio"]) == (step, ratio)
    await rig.stop()


async def test_a_rolled_back_candidate_stays_back_until_its_configuration_changes(rig2):
    rig = rig2
    await rig.start(policy(rig.primary_url, rig.cand.base_url, **STEPS))
    seen = await until(rig, lambda s: s["engine"] is not None)
    status, _ = await rig.change("rollback", reason="bad deploy")
    assert status == 200
    await rig.send(30)  # the same build: it stays rolled back
    await rig.settle(rig.sent)
    still = (await rig.status())["rules"]["default"]
    assert (still["stage"], still["rolled_back"], still["engine"]) == (
        "shadow",
        True,
        seen["engine"],
    )
    rig.cand.engine.update(version="0.33.1")  # a new build
    again = await until(rig, lambda s: s["engine"] != seen["engine"], batch=2)
    assert (again["stage"], again["rolled_back"], again["step"]) == ("canary", False, 0)
    assert "the rollback is lifted" in again["last_transition"]["reason"]
    await rig.stop()


def test_the_default_leaves_existing_rollout_fingerprints_alone() -> None:
    from policies.compile import parse_policy

    def fp(**extra: Any) -> str:
        import yaml

        raw = yaml.safe_load(policy("http://127.0.0.1:1", "http://127.0.0.1:2", **extra))
        (rule,) = [r for r in parse_policy(raw, source="p").all_rules if r.rollout is not None]
        assert rule.rollout is not None
        return rule.rollout.fingerprint

    assert fp() == fp(on_config_change="restart") != fp(on_config_change="hold")
    assert TOKEN  # the rig's admin token
