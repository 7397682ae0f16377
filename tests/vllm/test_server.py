"""Real vLLM CPU servers (plain and n-gram) answer, stream, count drafts and agree greedily."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from backends.server import (
    SERVED_MODEL_NAME,
    VllmServer,
    VllmServerError,
    VllmServerSpec,
    server_command,
    server_environment,
    spread_cores,
)
from backends.setup import VllmEnv
from core import jsonx
from core.procs import rss_bytes, session_pids
from tests.vllm.conftest import trace_requests

SPEC_COUNTER = re.compile(r"^(vllm:spec_decode_\w+_total)\{[^}]*\} ([0-9.e+]+)$", re.M)


async def stream_chat(url: str, body: dict[str, object]) -> list[dict[str, object]]:
    """POST a streaming chat request; return the decoded ``data:`` events (without ``[DONE]``)."""
    events: list[dict[str, object]] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(jsonx.loads(line[len("data: ") :]))
    return events


async def post_chat(url: str, body: dict[str, object]) -> dict[str, object]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        result: dict[str, object] = await resp.json()
        return result


async def spec_counters(server: VllmServer) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(server.metrics_url) as resp:
        text = await resp.text()
    totals: dict[str, float] = {}
    for name, value in SPEC_COUNTER.findall(text):
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def chat(content: str, max_tokens: int = 32) -> dict[str, object]:
    return {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def test_plain_server_command_has_metrics_and_tool_flags_but_no_speculative_config(
    tmp_path: Path,
) -> None:
    cmd = server_command(VllmServerSpec("p", "plain"), fake_env(tmp_path), 8123)
    assert cmd[:3] == [
        str(tmp_path / "venv/bin/python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    assert "--speculative-config" not in cmd
    assert "--per-request-spec-decode-metrics" not in cmd  # vLLM refuses it without speculation
    joined = " ".join(cmd)
    for flag in (
        "--port 8123",
        "--served-model-name tiny-llama",
        "--enable-per-request-metrics",
        "--tool-call-parser hermes",
        "--enforce-eager",
        "--kv-cache-memory-bytes 268435456",
    ):
        assert flag in joined


def test_ngram_and_draft_commands_carry_their_speculative_config(tmp_path: Path) -> None:
    env = fake_env(tmp_path)
    ngram = server_command(VllmServerSpec("n", "ngram", num_speculative_tokens=3), env, 1)
    draft = server_command(
        VllmServerSpec("d", "draft", enforce_eager=False, extra_args=("--seed", "7")), env, 1
    )
    ngram_config = jsonx.loads(ngram[ngram.index("--speculative-config") + 1])
    draft_config = jsonx.loads(draft[draft.index("--speculative-config") + 1])
    assert ngram_config["method"] == "ngram"
    assert ngram_config["num_speculative_tokens"] == 3
    assert draft_config == {"model": str(tmp_path / "draft"), "num_speculative_tokens": 4}
    assert "--enforce-eager" not in draft
    assert ngram[ngram.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert draft[-2:] == ["--seed", "7"]


def test_server_environment_keeps_vllm_files_inside_the_work_dir(tmp_path: Path) -> None:
    base = {
        "PATH": "/usr/bin",
        "VIRTUAL_ENV": "/gateway/.venv",
        "HOME": "/root",
        "VLLM_CPU_KVCACHE_SPACE": "4",  # vLLM's legacy setting would override the command line
    }
    env = server_environment(base, fake_env(tmp_path), tmp_path / "work")
    for key in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH", "TMPDIR"):
        assert env[key].startswith(str(tmp_path / "work"))
    # vLLM's model-class inspections: kept beside the environment, shared by its servers.
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["PYTHONPATH"] == str(tmp_path / "pystub")
    assert env["PATH"].startswith(str(tmp_path / "venv/bin"))
    assert "VIRTUAL_ENV" not in env
    assert env["HOME"] == "/root"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # vLLM's own "auto"
    pinned = server_environment(base, fake_env(tmp_path), tmp_path / "work", cores="1")
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_spread_cores_gives_each_server_its_own_core_round_robin() -> None:
    cores = sorted(os.sched_getaffinity(0))
    spread = spread_cores(len(cores) + 1)
    if len(cores) < 2:
        assert spread == [None] * (len(cores) + 1)
    else:
        assert spread[: len(cores)] == [str(c) for c in cores]
        assert spread[-1] == str(cores[0])


def test_session_pids_finds_a_child_in_its_own_session_and_nothing_after_it_exits() -> None:
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert session_pids(proc.pid) == [proc.pid]
        assert rss_bytes([proc.pid]) > 0
    finally:
        proc.kill()
        proc.wait()
    assert session_pids(proc.pid) == []


def test_a_server_that_exits_at_once_fails_with_its_log_tail_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    env = fake_env(tmp_path, python_script="echo 'ValueError: no such model'; exit 3")
    server = VllmServer(VllmServerSpec("broken", "plain"), env, ready_timeout_s=30)
    with pytest.raises(VllmServerError, match=r"exited with 3:\n.*no such model"):
        server.start()
    assert server.work_dir is None
    assert server.pid is None


def test_stop_kills_a_process_group_that_ignores_sigterm(tmp_path: Path) -> None:
    # The sleeps outlast the test's timeout: stop() returns in time only by killing them.
    env = fake_env(tmp_path, python_script="trap '' TERM; sleep 600 & sleep 600; wait")
    server = VllmServer(VllmServerSpec("stubborn", "plain"), env)
    server.launch()
    leader, work_dir = server.pid, server.work_dir
    assert leader is not None
    assert work_dir is not None
    deadline = time.monotonic() + 30  # liveness only: the loop ends when the three exist
    while len(session_pids(leader)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(server.process_ids()) == 3  # the shell and its two sleeps
    server.stop(timeout_s=0.5)
    assert session_pids(leader) == []
    assert not work_dir.exists()


def fake_env(root: Path, python_script: str = "exit 0") -> VllmEnv:
    """A VllmEnv whose "python" is a shell script: the lifecycle without vLLM."""
    python = root / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f"#!/bin/sh\n{python_script}\n")
    python.chmod(0o755)
    return VllmEnv(
        venv=root / "venv",
        pystub=root / "pystub",
        target_dir=root / "target",
        draft_dir=root / "draft",
    )


# The session fixture builds the environment (minutes when cold) inside the first test.
@pytest.mark.vllm
@pytest.mark.timeout(1800)
class TestRealServers:
    """Against a plain and an n-gram server started once per session (see conftest)."""

    def test_the_kv_cache_holds_the_tokens_its_size_allows(
        self, vllm_servers: dict[str, VllmServer]
    ) -> None:
        server = vllm_servers["plain"]
        if server.pid is None:
            pytest.skip("a reused server (SPECSHADOW_VLLM_URLS): its log is not ours to read")
        config = jsonx.loads((server.env.target_dir / "config.json").read_bytes())
        assert config["dtype"] == "float32"
        # A key and a value per layer, KV head and head dimension, 4 bytes each.
        per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
        per_token *= config["head_dim"] * 4
        found = re.search(r"KV cache size: ([\d,]+) tokens", server.log_path.read_text())
        assert found is not None, server.log_path.read_text()[-2000:]
        assert int(found[1].replace(",", "")) == server.spec.kv_cache_bytes // per_token == 32_768

    async def test_streaming_chat_request_returns_tokens(
        self, vllm_servers: dict[str, VllmServer]
    ) -> None:
        body = {
            **chat("What does the with statement do?"),
            "stream_options": {"include_usage": True},
        }
        events = await stream_chat(vllm_servers["plain"].base_url, body)
        text = "".join(
            c["delta"].get("content") or ""
            for e in events
            for c in e["choices"]  # type: ignore[attr-defined]
        )
        usage = events[-1]["usage"]
        assert text.strip()
        assert isinstance(usage, dict)
        assert usage["completion_tokens"] > 0

    async def test_ngram_server_counts_drafts_in_spec_decode_counters(
        self,
        vllm_servers: dict[str, VllmServer],
    ) -> None:
        server = vllm_servers["ngram"]
        before = await spec_counters(server)
        await post_chat(
            server.base_url, chat("Repeat: the cat sat on the mat, the cat sat on the mat", 48)
        )
        after = await spec_counters(server)
        assert {
            "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total",
        } <= after.keys()
        assert after["vllm:spec_decode_num_drafts_total"] > before.get(
            "vllm:spec_decode_num_drafts_total", 0
        )
        assert after["vllm:spec_decode_num_draft_tokens_total"] > before.get(
            "vllm:spec_decode_num_draft_tokens_total", 0
        )

    async def test_final_usage_chunk_carries_per_request_speculative_metrics(
        self,
        vllm_servers: dict[str, VllmServer],
    ) -> None:
        body = {
            **chat("Repeat: the cat sat on the mat, the cat sat on the mat", 48),
            "stream_options": {"include_usage": True},  # metrics ride on the usage chunk
        }
        events = await stream_chat(vllm_servers["ngram"].base_url, body)
        final = events[-1]
        assert final["usage"] is not None
        metrics = final["metrics"]
        assert isinstance(metrics, dict), final
        spec = metrics["speculative_decoding"]
        assert spec["num_draft_tokens"] > 0
        assert 0 <= spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
        assert spec["mean_acceptance_length"] >= 1.0

    async def test_plain_and_ngram_greedy_outputs_are_identical_on_trace_prompts(
        self,
        vllm_servers: dict[str, VllmServer],
    ) -> None:
        for body in trace_requests("healthbench_chat.jsonl", 5):
            plain = await post_chat(vllm_servers["plain"].base_url, body)
            ngram = await post_chat(vllm_servers["ngram"].base_url, body)
            p_choice, n_choice = plain["choices"][0], ngram["choices"][0]  # type: ignore[index]
            assert p_choice["message"]["content"], plain
            assert n_choice["message"]["content"] == p_choice["message"]["content"]
            assert plain["usage"]["completion_tokens"] == ngram["usage"]["completion_tokens"]  # type: ignore[index]
