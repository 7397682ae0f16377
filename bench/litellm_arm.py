"""LiteLLM's proxy as a comparison arm: its own virtual environment, config, key, one worker.

The venv lives at ``~/.cache/specshadow/litellm-venv`` (never the project's: LiteLLM pins many
packages). :func:`ensure_litellm` creates it and installs ``litellm[proxy]`` on first use; a marker
file written after a successful install makes later calls a no-op (idempotent, and a half-finished
install is retried rather than trusted). Facts about running it are in /work/shared/PEERS.md:
it refuses to start without a master key, fetches a cost map from the network unless told not to,
and answers readiness at ``/health/liveliness``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

VENV = Path.home() / ".cache" / "specshadow" / "litellm-venv"
MARKER = VENV / ".specshadow-installed"
MASTER_KEY = "sk-specshadow-bench"
HEALTH_PATH = "/health/liveliness"
ENV = {
    "LITELLM_MASTER_KEY": MASTER_KEY,
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no network fetch at startup
    "LITELLM_LOG": "ERROR",
    "LITELLM_TELEMETRY": "False",
}
HEADERS = (("authorization", f"Bearer {MASTER_KEY}"),)


class LiteLLMUnavailable(RuntimeError):
    """The LiteLLM arm cannot run here; the message says precisely why."""


def litellm_bin(venv: Path = VENV) -> Path:
    return venv / "bin" / "litellm"


def ensure_litellm(*, venv: Path = VENV, log: Callable[[str], None] = print) -> Path:
    """The ``litellm`` executable, installing it into ``venv`` on first use.

    Raises:
        LiteLLMUnavailable: the venv could not be created or the install failed (pip's tail).
    """
    exe = litellm_bin(venv)
    if (venv / MARKER.name).exists() and exe.exists():
        return exe
    log(f"installing litellm[proxy] into {venv} (first use; takes a few minutes)")
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "litellm[proxy]"],
    ]
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise LiteLLMUnavailable(f"`{' '.join(argv)}` failed ({done.returncode}):\n{tail}")
    if not exe.exists():
        raise LiteLLMUnavailable(f"litellm[proxy] installed but {exe} is missing")
    (venv / MARKER.name).write_text("ok\n")
    return exe


def write_config(path: Path, upstream: str, model: str) -> Path:
    """A one-model config that sends ``model`` to the OpenAI-compatible ``upstream``."""
    path.write_text(
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{model}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: sk-upstream\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
        "  set_verbose: false\n"
    )
    return path


def argv_for(exe: Path, config: Path) -> Callable[[int], list[str]]:
    return lambda port: [
        str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
        "--num_workers", "1",
    ]  # fmt: skip
