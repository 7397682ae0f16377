"""Real llama.cpp servers as backends for specshadow's tests, demo and benchmarks
(``specshadow llamacpp setup | up``), beside the vLLM ones.

- **environment**: llama.cpp's own C++ HTTP server as the prebuilt CPU wheel PyPI ``xllamacpp``
  (MIT), with ``gguf`` (and numpy) to write the models, in a virtual environment of its own under
  the cache (~120 MB of wheel, ~210 MB installed; installs in seconds). Not the project's
  environment: the gateway never imports it, and the wheel is a tenth of the project's venv;
  :func:`ensure_venv`;
- **models**: the two tiny models that ``specshadow vllm setup`` trains (``backends.setup``),
  written as GGUF files by ``gguf_convert.py`` in that environment — nothing downloaded but
  packages; cached by the models' folder and the converter's hash; :func:`ensure_ggufs`;
- **servers**: ``llamacpp_launch.py`` starts ``xllamacpp.Server`` in a process of its own (a
  real server process, stopped by SIGTERM), ``plain``, ``draft`` (llama.cpp's ``draft-simple``
  with the tiny draft model), ``ngram-mod`` or ``ngram-map-k``; :class:`LlamaServer`.

Cache layout::

    $SPECSHADOW_CACHE (default ~/.cache/specshadow)/
      llamacpp-2026.10.11549-py311/venv/ .complete
      gguf/<models folder>-<converter hash>/target.gguf draft.gguf .complete

Speculation is fixed when a llama.cpp server starts (its per-request speculative fields are
compiled out), so each configuration — and each depth — is a server of its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from backends.setup import COMPLETE, _locked, _run, cache_root, setup as vllm_setup
from core import jsonx
from core.procs import ChildProcess, ProcessError, free_port, wait_http_ready

log = logging.getLogger(__name__)

XLLAMACPP_VERSION = "2026.10.11549"
GGUF_VERSION = "0.19.0"
PIP_PACKAGES = (f"xllamacpp=={XLLAMACPP_VERSION}", f"gguf=={GGUF_VERSION}")
CONVERTER = Path(__file__).with_name("gguf_convert.py")
LAUNCHER = Path(__file__).with_name("llamacpp_launch.py")
SERVED_MODEL_NAME = "tiny-llama"
READY_TIMEOUT_S = 120.0  # ~1 s alone on an idle machine
Config = Literal["plain", "draft", "ngram-mod", "ngram-map-k"]
CONFIGS: tuple[Config, ...] = ("plain", "draft", "ngram-mod", "ngram-map-k")


@dataclass(frozen=True, slots=True)
class LlamaEnv:
    venv: Path
    target: Path  # target.gguf
    draft: Path  # draft.gguf

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def env_dir(cache: Path) -> Path:
    return (
        cache / f"llamacpp-{XLLAMACPP_VERSION}-py{sys.version_info.major}{sys.version_info.minor}"
    )


def ensure_venv(cache: Path | None = None) -> Path:
    """Create (once) the llama.cpp environment; return the venv."""
    root = env_dir(cache or cache_root())
    venv = root / "venv"
    with _locked(root.parent / f"{root.name}.lock"):
        if (root / COMPLETE).exists():
            return venv
        started = time.perf_counter()
        if venv.exists():
            shutil.rmtree(venv)
        _run([sys.executable, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "install", "-q", *PIP_PACKAGES])
        (root / COMPLETE).write_text("\n".join(PIP_PACKAGES) + "\n")
        log.info("llama.cpp environment created in %.0f s", time.perf_counter() - started)
    return venv


def ensure_ggufs(
    venv: Path, models: tuple[Path, Path], cache: Path | None = None
) -> tuple[Path, Path]:
    """Write (once) the tiny target and draft models as GGUF; return their paths."""
    target_dir, draft_dir = models
    key = hashlib.sha256(CONVERTER.read_bytes() + GGUF_VERSION.encode()).hexdigest()[:12]
    final = (cache or cache_root()) / "gguf" / f"{target_dir.parent.name}-{key}"
    with _locked(final.with_name(final.name + ".lock")):
        if not (final / COMPLETE).exists():
            partial = final.with_name(final.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            python = str(venv / "bin" / "python")
            for src, name in ((target_dir, "target"), (draft_dir, "draft")):
                _run([python, str(CONVERTER), str(src), str(partial / f"{name}.gguf")])
            (partial / COMPLETE).write_text(key + "\n")
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
    return final / "target.gguf", final / "draft.gguf"


def setup(cache: Path | None = None) -> LlamaEnv:
    """Everything the llama.cpp servers need; instant when cached. The tiny models come from
    ``specshadow vllm setup`` (built there once, with vLLM's torch)."""
    models = vllm_setup(cache)
    venv = ensure_venv(cache)
    target, draft = ensure_ggufs(venv, (models.target_dir, models.draft_dir), cache)
    return LlamaEnv(venv=venv, target=target, draft=draft)


@dataclass(frozen=True, slots=True)
class LlamaServerSpec:
    """What to serve; ``port=None`` picks a free port when the server starts."""

    name: str
    config: Config = "plain"
    port: int | None = None
    draft_max: int = 4  # draft-simple's n_max: the depth
    slots: int = 2
    ctx_per_slot: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)  # more launcher keys (llamacpp_launch)

    def launch_json(self, env: LlamaEnv, port: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": str(env.target),
            "port": port,
            "alias": SERVED_MODEL_NAME,
            "slots": self.slots,
            "ctx_per_slot": self.ctx_per_slot,
            "threads": 1,
            "config": self.config,
        }
        if self.config == "draft":
            out.update(draft_model=str(env.draft), draft_max=self.draft_max)
        return {**out, **self.extra}


class LlamaServerError(ProcessError):
    """The server exited or did not become ready; the message ends with the tail of its log."""


class LlamaServer:
    """One llama.cpp server process and its work folder (the log), removed on stop."""

    def __init__(self, spec: LlamaServerSpec, env: LlamaEnv) -> None:
        self.spec = spec
        self.env = env
        self.port = spec.port if spec.port is not None else free_port()
        self._work = Path(tempfile.mkdtemp(prefix=f"specshadow-llamacpp-{spec.name}-"))
        self._proc: ChildProcess | None = None
        self.started_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self._work / "server.log"

    @property
    def pid(self) -> int | None:
        """The launcher's pid (its session's id); None before launch and after stop."""
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    def launch(self) -> None:
        argv = [
            str(self.env.python),
            str(LAUNCHER),
            jsonx.dumps(self.spec.launch_json(self.env, self.port)).decode(),
        ]
        log.info(
            "starting llama.cpp %s (%s) on port %d", self.spec.name, self.spec.config, self.port
        )
        self._proc = ChildProcess(
            argv,
            name=f"llama.cpp {self.spec.name}",
            log_path=self.log_path,
            env={k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")},
            cwd=self._work,
            pdeathsig="TERM",
            error=LlamaServerError,
            tail_lines=30,
        )

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        if self._proc is None:
            raise RuntimeError("server not launched")
        wait_http_ready(f"{self.base_url}/v1/models", self._proc, timeout_s, interval_s=0.2)
        self.started_s = (time.perf_counter_ns() - self._proc.started_ns) / 1e9
        log.info(
            "llama.cpp %s ready at %s in %.1f s", self.spec.name, self.base_url, self.started_s
        )

    def warm_up(self) -> None:
        """One short greedy request, so first-request costs are paid now — and a speculative
        server has said how it speculates (``/slots`` shows its type once a slot served a
        request; ``/metrics`` its depth once one drafted) before any gateway asks."""
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": "one two three one two three one two"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        req = urllib.request.Request(
            f"{self.base_url}/v1/chat/completions",
            data=jsonx.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()

    def log_tail(self, lines: int = 30) -> str:
        return self._proc.log_tail(lines) if self._proc is not None else "(not launched)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stop(10.0)
        shutil.rmtree(self._work, ignore_errors=True)


def start_servers(specs: Iterable[LlamaServerSpec], env: LlamaEnv) -> list[LlamaServer]:
    """Launch all at once, then wait for each; if any fails, stop all and raise."""
    servers = [LlamaServer(spec, env) for spec in specs]
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        for s in servers:
            s.warm_up()
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: Iterable[LlamaServer]) -> None:
    for s in servers:
        s.stop()
