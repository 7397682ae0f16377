"""``specshadow simulate`` as a real process: prints its URL, serves, stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiohttp
import pytest


@pytest.mark.e2e
async def test_simulate_command_serves_on_the_printed_url_and_stops_on_sigterm():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "specshadow", "simulate", "--port", "0", "--mode", "speculative",
        "--model", "cli-model", "--k", "3", "--acceptance", "0.9,0.5,0.2",
        "--category-acceptance", "code=1.0", "--prefill-ms", "0", "--step-ms", "0",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        url = line.rsplit(" ", 1)[-1].strip()
        assert url.startswith("http://127.0.0.1:")
        body = {
            "model": "cli-model",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 30,
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{url}/v1/chat/completions",
                json=body,
                headers={"x-request-id": "cli", "x-specshadow-category": "code"},
            ) as resp:
                assert resp.status == 200
            async with session.get(f"{url}/sim/requests", params={"id": "cli"}) as resp:
                record = json.loads(await resp.read())
        assert record["mode"] == "speculative" and record["category"] == "code"
        assert record["num_accepted_tokens"] == record["num_draft_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


def test_the_default_speculative_simulator_replays_real_drafts_unless_drawn_ones_are_asked():
    """Its n-gram drafts follow vLLM's rule over the real token ids (what the counterfactual
    replays), so the live check can check it; a flag of drawn drafting keeps drawn drafting."""
    import argparse

    from simulator.cli import config_from_args, register
    from simulator.config import SimConfig

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def config(*flags: str) -> SimConfig:
        return config_from_args(parser.parse_args(["simulate", "--mode", "speculative", *flags]))

    default = config()
    assert (default.drafting, default.proposer) == ("replay", "ngram")
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (2, 4)
    for flags in (["--acceptance", "0.8"], ["--coverage", "0.5"],
                  ["--category-acceptance", "code=0.9"], ["--proposer", "eagle3"],
                  ["--drafting", "probabilistic"]):  # fmt: skip
        assert config(*flags).drafting == "probabilistic", flags
    drawn = config("--drafting", "probabilistic")
    assert (drawn.acceptance, drawn.coverage) == (0.7, 1.0)  # the documented defaults
    assert config("--drafting", "replay", "--acceptance", "0.8").drafting == "replay"
