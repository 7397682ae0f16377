"""Start, await and stop real vLLM OpenAI-compatible servers (plain, n-gram, draft model) on CPU.

One :class:`VllmServer` owns one ``vllm.entrypoints.openai.api_server`` process group and one work
folder (vLLM's caches, RPC sockets, TMPDIR and, by default, the log), and removes both on stop, so
nothing is left behind. It is a context manager, sync (``with``) or async (``async with``; the
blocking waits run in a worker thread). :func:`start_servers` launches several at once and waits
for all of them — on a 2-core machine three start in about the time of one and a half.

The command line and environment are built by pure functions (:func:`server_command`,
:func:`server_environment`), following ``shared/VLLM_CPU.md``: fp32, 1 GiB KV cache, per-request
metrics with the speculative-decoding summary, the hermes tool parser, and ``--enforce-eager`` by
default (25–33 s startup instead of 40–50 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from core import jsonx
from loadgen.vllm.setup import VllmEnv

log = logging.getLogger(__name__)

SpecConfig = Literal["plain", "ngram", "draft"]
SERVED_MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 1024
READY_TIMEOUT_S = 300.0  # 25–50 s alone; three at once on a busy 2-core box took 150 s
STOP_TIMEOUT_S = 20.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class VllmServerSpec:
    """What to serve: ``port=None`` picks a free port when the server starts."""

    name: str
    config: SpecConfig
    port: int | None = None
    num_speculative_tokens: int = 4
    extra_args: tuple[str, ...] = ()
    enforce_eager: bool = True


def speculative_config(spec: VllmServerSpec, draft_dir: Path) -> dict[str, object] | None:
    """The ``--speculative-config`` JSON object for ``spec`` (``None`` for a plain server)."""
    if spec.config == "plain":
        return None
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
        "--model", str(env.target_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
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


def server_environment(base: Mapping[str, str], env: VllmEnv, work_dir: Path) -> dict[str, str]:
    """``base`` plus vLLM's CPU settings, with every file vLLM writes kept inside ``work_dir``."""
    out = {k: v for k, v in base.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    out.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(work_dir / "vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(work_dir / "inductor"),
        VLLM_RPC_BASE_PATH=str(work_dir / "rpc"),
        TMPDIR=str(work_dir / "tmp"),
        HF_HOME=str(work_dir / "hf"),
        PYTHONPATH=str(env.pystub),
        PATH=f"{env.venv / 'bin'}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}",
    )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class VllmServerError(RuntimeError):
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
        self._proc: subprocess.Popen[bytes] | None = None
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
        return None if self._proc is None else self._proc.poll()

    def process_ids(self) -> list[int]:
        """The server's live processes (its session: the API server and the engine workers)."""
        return [] if self._proc is None else session_pids(self._proc.pid)

    @property
    def work_dir(self) -> Path | None:
        return self._work_dir

    def launch(self) -> None:
        """Start the process; return at once (see :meth:`wait_ready`)."""
        self._work_dir = Path(tempfile.mkdtemp(prefix=f"specshadow-vllm-{self.spec.name}-"))
        for sub in ("vllm-cache", "inductor", "rpc", "tmp", "hf"):
            (self._work_dir / sub).mkdir()
        cmd = server_command(self.spec, self.env, self.port)
        log.info("starting vLLM %s (%s) on port %d", self.spec.name, self.spec.config, self.port)
        with self.log_path.open("wb") as log_file:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=server_environment(os.environ, self.env, self._work_dir),
                cwd=self._work_dir,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self._launched_ns = time.perf_counter_ns()

    def poll_ready(self) -> bool:
        """``True`` once ``GET /v1/models`` answers 200; raises if the process has exited."""
        if self._proc is None:
            raise RuntimeError("server not launched")
        if self._proc.poll() is not None:
            raise VllmServerError(
                f"vLLM {self.spec.name} exited with {self._proc.returncode}:\n{self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as resp:
                ready = bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False
        if ready and self.started_s is None:
            self.started_s = (time.perf_counter_ns() - self._launched_ns) / 1e9
        return ready

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not self.poll_ready():
            if time.monotonic() > deadline:
                raise VllmServerError(
                    f"vLLM {self.spec.name} not ready after {self.ready_timeout_s:.0f} s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.5)
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
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``; remove the work folder."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _terminate_group(proc, timeout_s)
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


def session_pids(sid: int) -> list[int]:
    """Ids of the live processes in session ``sid`` (Linux ``/proc``): a server and its workers."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state ppid pgrp session ...
            pids.append(int(stat.parent.name))
    return sorted(pids)


def rss_bytes(pids: Iterable[int]) -> int:
    """Sum of resident set sizes (``VmRSS``); shared pages are counted once per process."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a reused id we do not own: ours is gone
        return False
    return True


def _terminate_group(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        log.warning("vLLM process group %d ignored SIGTERM for %.0f s: killing", pgid, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    while _group_alive(pgid):  # SIGKILL cannot be ignored; the kernel reaps within milliseconds
        time.sleep(0.05)


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
