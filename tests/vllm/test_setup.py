"""The vLLM cache layout: where it lives, and what its model key depends on."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.setup import BUILD_SCRIPT, cache_root, env_dir, models_key

VERSIONS = {"torch": "2.13.0+cpu", "transformers": "5.19.0", "tokenizers": "0.23.3"}


def test_cache_root_defaults_to_user_cache_and_honours_the_override(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SPECSHADOW_CACHE", raising=False)
    assert cache_root() == Path.home() / ".cache" / "specshadow"
    monkeypatch.setenv("SPECSHADOW_CACHE", str(tmp_path))
    assert cache_root() == tmp_path


def test_env_dir_is_keyed_by_vllm_and_python_versions(tmp_path: Path) -> None:
    assert env_dir(tmp_path).name == "vllm-0.32.0-py311"


def test_models_key_is_stable_and_changes_with_script_library_or_python() -> None:
    script = BUILD_SCRIPT.read_bytes()
    key = models_key(script, VERSIONS, "3.11.7")
    assert key == models_key(script, dict(reversed(VERSIONS.items())), "3.11.7")
    assert len(key) == 16
    assert models_key(script + b"\n", VERSIONS, "3.11.7") != key
    assert models_key(script, {**VERSIONS, "torch": "2.14.0"}, "3.11.7") != key
    assert models_key(script, VERSIONS, "3.11.8") != key
