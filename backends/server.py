"""Start, await and stop real vLLM OpenAI-compatible servers (plain, n-gram, draft model) on CPU.

One :class:`VllmServer` owns one ``vllm.entrypoints.openai.api_server`` process group and one work
folder (the inductor cache, RPC sockets, TMPDIR and, by default, the log), and removes both on
stop, so nothing is left behind; vLLM's own cache of model-class inspections is shared by every
server of the environment (:attr:`~backends.setup.VllmEnv.vllm_cache`), saving each start a fresh
interpreter. It is a context manager, sync (``with``) or async (``async with``; the
blocking waits run in a worker thread). :func:`start_servers` launches several at once and waits
for all of them — on a 2-core machine three start in about the time of one and a half.

The command line and environment are built by pure functions (:func:`server_command`,
:func:`server_environment`), following docs/vllm.md ("Servers"): fp32, a 256 MiB KV cache,
per-request metrics with the speculative-decoding summary, the hermes tool parser, and
``--enforce-eager`` by default (25–33 s startup instead of 40–50 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from backends.setup import VllmEnv
from core import jsonx
from core.procs import (
    ChildProcess,
    ProcessError,
    free_port,
    http_ok,
    log_tail,
    rss_bytes,
    session_pids,
    wait_http_ready,
)

__all__ = [
    "MAX_MODEL_LEN",
    "SERVED_MODEL_NAME",
    "SpecConfig",
    "VllmServer",
    "VllmServerError",
    "VllmServerSpec",
    "free_port",
    "rss_bytes",
    "running_servers",
    "server_command",
    "server_environment",
    "session_pids",
    "speculative_config",
    "start_servers",
    "stop_servers",
]

log = logging.getLogger(__name__)

SpecConfig = Literal["plain", "ngram", "draft", "suffix"]
SERVED_MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 1024
# A liveness deadline, not a claim: 25–50 s alone; three at once on a busy 2-core box took 150 s;
# the test session's seven at once took 113 s on one machine and over 300 s on a later one (kernel
# 6.18 with a DAMON pageout scheme: the engine core initialised 87 s after its API server).
READY_TIMEOUT_S = 600.0
# 32,768 tokens of the tiny model: 32 requests at the full --max-model-len. The KV cache is
# allocated and written at start, so its size is start time: seven servers at once were ready in
# 279 s with 1 GiB each and in 157 s with 256 MiB (docs/vllm.md, "Servers").
KV_CACHE_BYTES = 256 * 1024 * 1024
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True)
class VllmServerSpec:
    """What to serve: ``port=None`` picks a free port when the server starts."""

    name: str
    config: SpecConfig
    port: int | None = None
    num_speculative_tokens: int = 4
    extra_args: tuple[str, ...] = ()
    enforce_eager: bool = True
    # vLLM's VLLM_CPU_OMP_THREADS_BIND ("0", "1-3"); None keeps vLLM's "auto", which puts the
    # worker of *every* server on a machine on the same first core — two servers side by side
    # then take turns on one core, and a mirror's two legs slow each other down.
    cores: str | None = None
    # Which weights to serve: the target, or the draft model served plainly as if it were the
    # target (under the same served name) — a "different model" for the quality checks.
    weights: Literal["target", "draft"] = "target"
    # --kv-cache-memory-bytes: the KV cache's size (unset, vLLM's CPU worker sizes it as a
    # fraction of the machine's memory, --gpu-memory-utilization).
    kv_cache_bytes: int = KV_CACHE_BYTES


def speculative_config(spec: VllmServerSpec, draft_dir: Path) -> dict[str, object] | None:
    """The ``--speculative-config`` JSON object for ``spec`` (``None`` for a plain server)."""
    if spec.config == "plain":
        return None
    if spec.config == "suffix":  # arctic-inference on PYTHONPATH (backends.setup.ensure_arctic)
        return {"method": "suffix", "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.config == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": spec.num_speculative_tokens,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    return {"model": str(draft_dir), "num_speculative_tokens": spec.num_speculative_tokens}


def server_command(spec: VllmServerSpec, env: VllmEnv, port: int) -> list[str]:
    """The argv that starts ``spec`` on ``port`` with ``env``'s Python."""
    cmd = [
        str(env.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(env.draft_dir if spec.weights == "draft" else env.target_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(spec.kv_cache_bytes),
        "--enable-per-request-metrics",
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
    ]  # fmt: skip
    spec_config = speculative_config(spec, env.draft_dir)
    if spec_config is not None:
        cmd += ["--speculative-config", jsonx.dumps(spec_config).decode()]
        # vLLM 0.32 refuses this flag without a speculative config (plain servers).
        cmd += ["--per-request-spec-decode-metrics", "summary"]
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    cmd += spec.extra_args
    return cmd


def server_environment(
    base: Mapping[str, str], env: VllmEnv, work_dir: Path, cores: str | None = None
) -> dict[str, str]:
    """``base`` plus vLLM's CPU settings, with every file vLLM writes kept inside ``work_dir``
    but its model-class cache, shared by every server of ``env`` (:attr:`VllmEnv.vllm_cache`:
    without it each start pays one more interpreter importing vLLM); ``cores`` binds the worker's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``)."""
    # VLLM_CPU_KVCACHE_SPACE (GiB, vLLM's legacy setting) would override --kv-cache-memory-bytes.
    dropped = ("VIRTUAL_ENV", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE")
    out = {k: v for k, v in base.items() if k not in dropped}
    out.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(env.vllm_cache),
        TORCHINDUCTOR_CACHE_DIR=str(work_dir / "inductor"),
        VLLM_RPC_BASE_PATH=str(work_dir / "rpc"),
        TMPDIR=str(work_dir / "tmp"),
        HF_HOME=str(work_dir / "hf"),
        PYTHONPATH=str(env.pystub),
        PATH=f"{env.venv / 'bin'}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}",
        # vLLM's development endpoints, for GET /server_info?config_format=json: the gateway reads
        # each backend's speculative config (method, depth, verification) from it. Loopback-only
        # test servers; a production vLLM would rather declare it in the policy (docs/vllm.md).
        VLLM_SERVER_DEV_MODE="1",
    )
    if cores is not None:
        out["VLLM_CPU_OMP_THREADS_BIND"] = cores
    return out


def spread_cores(count: int) -> list[str | None]:
    """One core per server, round robin over the cores this process may use (``None`` each on a
    one-core machine, where there is nothing to spread)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return [None] * count
    return [str(cores[i % len(cores)]) for i in range(count)]


class VllmServerError(ProcessError):
    """The server exited or did not become ready; the message ends with the tail of its log."""


class VllmServer:
    """One vLLM API server process group and its work folder."""

    def __init__(
        self,
        spec: VllmServerSpec,
        env: VllmEnv,
        *,
        log_path: Path | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self.spec = spec
        self.env = env
        self.port = spec.port if spec.port is not None else free_port()
        self.ready_timeout_s = ready_timeout_s
        self._log_path = log_path
        self._work_dir: Path | None = None
        self._proc: ChildProcess | None = None
        self.started_s: float | None = None  # launch → ready, seconds

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def log_path(self) -> Path:
        if self._log_path is not None:
            return self._log_path
        if self._work_dir is None:
            raise RuntimeError("server not launched")
        return self._work_dir / "server.log"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has exited, else ``None`` (also before launch)."""
        return None if self._proc is None else self._proc.returncode

    def process_ids(self) -> list[int]:
        """The server's live processes (its session: the API server and the engine workers)."""
        return [] if self._proc is None else session_pids(self._proc.pid)

    @property
    def work_dir(self) -> Path | None:
        return self._work_dir

    def launch(self) -> None:
        """Start the process; return at once (see :meth:`wait_ready`)."""
        self._work_dir = Path(tempfile.mkdtemp(prefix=f"specshadow-vllm-{self.spec.name}-"))
        for sub in ("inductor", "rpc", "tmp", "hf"):
            (self._work_dir / sub).mkdir()
        cmd = server_command(self.spec, self.env, self.port)
        environment = server_environment(os.environ, self.env, self._work_dir, self.spec.cores)
        if self.spec.config == "suffix":
            from backends.setup import ensure_arctic

            lib = ensure_arctic(self.env.venv)
            environment["PYTHONPATH"] = f"{environment['PYTHONPATH']}{os.pathsep}{lib}"
        log.info("starting vLLM %s (%s) on port %d", self.spec.name, self.spec.config, self.port)
        # On the parent's death vLLM gets SIGTERM (not SIGKILL), so it can end its engine workers.
        self._proc = ChildProcess(
            cmd,
            name=f"vLLM {self.spec.name}",
            log_path=self.log_path,
            env=environment,
            cwd=self._work_dir,
            pdeathsig="TERM",
            error=VllmServerError,
            tail_lines=40,
        )

    def _launched(self) -> ChildProcess:
        if self._proc is None:
            raise RuntimeError("server not launched")
        return self._proc

    @property
    def _models_url(self) -> str:
        return f"{self.base_url}/v1/models"

    def _note_started(self, proc: ChildProcess) -> None:
        if self.started_s is None:
            self.started_s = (time.perf_counter_ns() - proc.started_ns) / 1e9

    def poll_ready(self) -> bool:
        """``True`` once ``GET /v1/models`` answers 200; raises if the process has exited."""
        proc = self._launched()
        proc.check_running()
        ready = http_ok(self._models_url, timeout_s=2)
        if ready:
            self._note_started(proc)
        return ready

    def wait_ready(self) -> None:
        proc = self._launched()
        wait_http_ready(self._models_url, proc, self.ready_timeout_s, interval_s=0.5)
        self._note_started(proc)
        log.info("vLLM %s ready at %s in %.1f s", self.spec.name, self.base_url, self.started_s)

    def warm_up(self) -> None:
        """Two short greedy requests (plain and streamed) so first-request costs are paid now."""
        body: dict[str, object] = {
            "model": SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": "one two three one two three one two"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}):
            req = urllib.request.Request(
                f"{self.base_url}/v1/chat/completions",
                data=jsonx.dumps({**body, **extra}),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()

    def start(self) -> None:
        """Launch, wait until ready, warm up; on failure stop and clean up before raising."""
        try:
            if self._proc is None:
                self.launch()
            self.wait_ready()
            self.warm_up()
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = 40) -> str:
        try:
            path = self.log_path
        except RuntimeError:
            return "(no log)"
        return log_tail(path, lines) or "(no log)"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``; remove the work folder."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stop(timeout_s)
            log.info("vLLM %s stopped", self.spec.name)
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)


def start_servers(specs: Iterable[VllmServerSpec], env: VllmEnv) -> list[VllmServer]:
    """Launch all at once, then wait for each; if any fails, stop all and raise."""
    servers = [VllmServer(spec, env) for spec in specs]
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
        for server in servers:
            server.warm_up()
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: Iterable[VllmServer]) -> None:
    for server in servers:
        server.stop()


@contextlib.contextmanager
def running_servers(specs: Iterable[VllmServerSpec], env: VllmEnv) -> Iterator[list[VllmServer]]:
    servers = start_servers(specs, env)
    try:
        yield servers
    finally:
        stop_servers(servers)
