"""Start llama.cpp's own C++ HTTP server (the PyPI ``xllamacpp`` wheel) from a JSON description and
serve until SIGTERM or SIGINT — the small launcher that makes it a real server process.

A standalone script that runs *inside the llama.cpp environment* (``backends.llamacpp``); the
gateway's interpreter never imports ``xllamacpp``. ``xllamacpp.Server(params)`` runs the server on
its own threads inside this process; this script only fills ``CommonParams`` and waits.

Usage: ``python llamacpp_launch.py '{"model": "target.gguf", "port": 8201, ...}'``

Keys: ``model``, ``port``, ``alias`` (the served model name), ``slots`` (``n_parallel``),
``ctx_per_slot``, ``threads``, ``config`` (``plain``, ``draft``, ``ngram-mod``, ``ngram-map-k``),
``draft_model`` and ``draft_max`` (draft-simple), ``ngram_match``/``ngram_min``/``ngram_max``
(ngram-mod: key length and draft length bounds), ``map_key``/``map_draft``/``map_hits``
(ngram-map-k: key length, draft length, minimum hits), ``synth_len`` (synthetic acceptance of
that mean length: outputs invalid, for benchmarks only).

Field names follow ``dir(xllamacpp.CommonParams())`` (its README's are stale). Every CPU thread
pool has ``poll = 0``: otherwise idle threads busy-wait and a 2-core machine has no CPU left.
"""

# This file is type-checked by the gateway's mypy, where xllamacpp is not installed.
# ruff: noqa: T201  (a script: it reports on stdout, which the server log keeps)
# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc,unused-ignore"

from __future__ import annotations

import json  # noqa: TID251  (runs in the llama.cpp environment, which has no orjson)
import signal
import sys
from typing import Any

import xllamacpp

TYPES = {
    "draft": "COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE",
    "ngram-mod": "COMMON_SPECULATIVE_TYPE_NGRAM_MOD",
    "ngram-map-k": "COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K",
}


def _threads(cpu: Any, n: int) -> None:
    cpu.n_threads = n
    cpu.poll = 0


def params(spec: dict[str, Any]) -> Any:
    p = xllamacpp.CommonParams()
    p.model.path = spec["model"]
    p.model_alias = {spec.get("alias", "tiny-llama")}
    slots = int(spec.get("slots", 2))
    p.n_parallel = slots
    p.n_ctx = slots * int(spec.get("ctx_per_slot", 1024))  # the total, split across slots
    threads = int(spec.get("threads", 1))
    _threads(p.cpuparams, threads)
    _threads(p.cpuparams_batch, threads)
    p.hostnames = ["127.0.0.1"]
    p.port = int(spec["port"])
    p.endpoint_metrics = True
    p.endpoint_slots = True
    p.use_jinja = True  # the GGUF's chat template
    config = spec.get("config", "plain")
    if config == "plain":
        return p
    s = p.speculative
    s.types = [getattr(xllamacpp.common_speculative_type, TYPES[config])]
    if config == "draft":
        s.draft.mparams.path = spec["draft_model"]
        s.draft.n_max = int(spec.get("draft_max", 4))
        s.draft.n_min = 0
        _threads(s.draft.cpuparams, threads)
        _threads(s.draft.cpuparams_batch, threads)
    elif config == "ngram-mod":
        s.ngram_mod.n_match = int(spec.get("ngram_match", 4))
        s.ngram_mod.n_min = int(spec.get("ngram_min", 1))
        s.ngram_mod.n_max = int(spec.get("ngram_max", 8))
    elif config == "ngram-map-k":
        s.ngram_map_k.size_n = int(spec.get("map_key", 2))
        s.ngram_map_k.size_m = int(spec.get("map_draft", 8))
        s.ngram_map_k.min_hits = int(spec.get("map_hits", 1))
    if spec.get("synth_len"):
        s.synth_len = float(spec["synth_len"])
    return p


def main() -> None:
    spec = json.loads(sys.argv[1])
    # Block the stop signals before the server's threads start, so they inherit the mask and the
    # signal is taken here by sigwait.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    server = xllamacpp.Server(params(spec))
    print(
        f"llama.cpp {spec.get('config', 'plain')} serving on 127.0.0.1:{spec['port']}", flush=True
    )
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del server


if __name__ == "__main__":
    main()
