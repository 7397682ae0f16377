"""``specshadow llamacpp setup``: the GGUFs are written locally and the same input gives the same
bytes (the cache key is the converter's hash: a second conversion must not differ)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from backends.llamacpp import CONVERTER, LlamaEnv
from backends.setup import setup as vllm_setup

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(300)]


def test_the_draft_gguf_is_written_again_byte_for_byte(
    llamacpp_env: LlamaEnv, tmp_path: Path
) -> None:
    models = vllm_setup()
    again = tmp_path / "draft.gguf"
    subprocess.run(
        [str(llamacpp_env.python), str(CONVERTER), str(models.draft_dir), str(again)],
        check=True,
        capture_output=True,
    )

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    assert digest(again) == digest(llamacpp_env.draft)
