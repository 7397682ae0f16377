"""Tests mirror the packages: the tests of product package ``p`` live in ``tests/<p>/``, and every
other folder under ``tests/`` is one of the tiers or helpers named here (so the next engineer
finds a module's tests in the first place they look, and a new folder has to say what it is)."""

from __future__ import annotations

from pathlib import Path

from tests.test_architecture import PACKAGES

ROOT = Path(__file__).resolve().parent

TIERS = {
    "e2e": "the product as subprocesses (slower)",
    "reliability": "faults, security and load across the whole gateway",
    "vllm": "against a real vLLM (CPU build)",
    "llamacpp": "against a real llama.cpp server (PyPI xllamacpp)",
    "bench": "the benchmark scripts in bench/ run small",
    "deploy": "the Dockerfile and the deployment manifests in deploy/",
    "fakes": "test doubles with known ground truth (scripted upstreams)",
    "receivers": "real receivers the telemetry tests export to (OTLP, Prometheus, ClickHouse)",
    "data": "recorded answers and traces the tests read",
    "trace": "the gateway's traces read back from a real trace store (Phoenix) and its UI",
}


def test_every_test_folder_is_a_package_or_a_named_tier() -> None:
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    unknown = folders - PACKAGES - set(TIERS)
    assert not unknown, f"tests/ folders that are neither a product package nor a tier: {unknown}"


def test_the_check_sees_an_unknown_folder(tmp_path: Path) -> None:
    (tmp_path / "compare").mkdir()
    (tmp_path / "core").mkdir()
    folders = {p.name for p in tmp_path.iterdir() if p.is_dir()}
    assert folders - PACKAGES - set(TIERS) == {"compare"}
