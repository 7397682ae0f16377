"""A slim gateway: ``pip install specshadow`` brings what the gateway needs and nothing for
reports or load generation, and the gateway starts and serves without numpy, matplotlib or the
openai SDK. Commands that need an extra say which one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from importlib.metadata import requires
from pathlib import Path

import aiohttp
import pytest
from packaging.requirements import Requirement

from core.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("numpy", "matplotlib", "openai")
pytestmark = pytest.mark.e2e

# Runs specshadow in a child interpreter in which the heavy packages cannot be imported.
BLOCKED = textwrap.dedent(
    """
    import sys
    from importlib.abc import MetaPathFinder

    HEAVY = {heavy!r}

    class Absent(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HEAVY:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    from specshadow.main import main
    code = main(sys.argv[1:])
    assert not [m for m in HEAVY if m in sys.modules], "a heavy package was imported"
    sys.exit(code)
    """
).format(heavy=HEAVY)


def blocked(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BLOCKED, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_default_install_requires_nothing_for_reports_or_load() -> None:
    default = [Requirement(r) for r in requires("specshadow") or ()]
    unconditional = {r.name for r in default if r.marker is None or "extra" not in str(r.marker)}
    assert not unconditional & set(HEAVY)
    assert {"aiohttp", "orjson", "opentelemetry-sdk", "pydantic"} <= unconditional
    report = {
        r.name for r in default if r.marker is not None and r.marker.evaluate({"extra": "report"})
    }
    assert {"numpy", "matplotlib"} <= report


async def test_the_gateway_starts_and_relays_without_numpy_matplotlib_or_openai(
    sims: object,
) -> None:
    sim = await sims()  # type: ignore[operator]
    port = free_port()
    proc = blocked(
        "serve", "--port", str(port), "--primary", sim.base_url, "--shadow", sim.base_url
    )
    try:
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
        }
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.post(
                        f"http://127.0.0.1:{port}/v1/chat/completions", json=body
                    ) as resp:
                        assert resp.status == 200
                        assert (await resp.json())["choices"][0]["message"]["content"]
                        break
                except aiohttp.ClientConnectionError:
                    assert proc.poll() is None, proc.communicate()[1]
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("the gateway never answered")
            for _ in range(100):  # the evidence worker records the exchange moments later
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    if b"gen_ai_client_operation_duration_seconds" in await resp.read():
                        break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the exchange's metrics never appeared")
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err  # SIGTERM: a clean shutdown, and no heavy import happened


def test_a_command_that_needs_an_extra_names_it(tmp_path: Path) -> None:
    """Here, the clone's own editable install: the hint installs the extra from the clone, with
    this environment's interpreter (`pip install 'specshadow[report]'` would ask an index).
    tests/e2e/test_wheel.py has the installed-from-a-wheel and installed-from-a-clone cases."""
    proc = blocked("report", "--store", str(tmp_path / "none.sqlite"), "--out", str(tmp_path))
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    python = Path(sys.executable)
    shown = python.relative_to(ROOT) if python.is_relative_to(ROOT) else python
    assert err.strip() == (
        "specshadow report needs numpy, matplotlib, which the 'report' extra installs: "
        f"{shown} -m pip install -e '.[report]'"
    )
