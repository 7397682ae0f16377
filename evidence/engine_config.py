"""Each backend's resolved engine configuration, reduced to what changes speed or output, and its
fingerprint (pure; the probe that asks is :class:`evidence.serverinfo.ServerInfoProbe`).

An engine says far more than matters: vLLM 0.32's ``/server_info`` holds some 600 fields, and
between a plain server and the same server with n-gram speculation they differ in fields that are
no change of configuration at all — the ``instance_id``, ``observability_config`` flags (vLLM turns
``per_request_spec_decode_metrics`` on with speculation), ``parallel_config`` internals, and
``scheduler_config.max_num_scheduled_tokens``, which vLLM *derives* from the speculative block. A
gate that diffed every field would call every clean candidate confounded. So the configuration is
**reduced** to a fixed list of fields (:data:`FIELDS`), each read from wherever the engine says it:

- vLLM: ``GET /server_info?config_format=json`` (dev mode) or ``GET /inference/v1/config`` (newer
  releases; the same ``vllm_config`` object), ``GET /version`` (``/server_info`` carries none),
  and the ``vllm:cache_config_info`` labels of ``/metrics`` (served without dev mode: the KV-cache
  dtype and prefix caching);
- SGLang: ``GET /server_info`` (``/get_server_info``): flat server arguments and ``version``;
- llama.cpp: ``GET /props`` (build, model file, its quantization type, context per slot, slots)
  and ``GET /slots`` (whether the slots speculate, and — once a slot has served a request — the
  speculative type, ``speculative.types``); its draft limits are not served, so the depth is the
  number of positions of ``llamacpp:spec_decode_num_accepted_tokens_per_pos_total`` once the first
  speculative request finished, else the policy's declaration (:func:`from_llamacpp`).

What no endpoint says is taken from the policy's declaration (``backends.<name>.engine``) and
marked ``declared`` in :attr:`EngineConfig.sources`; what the engine reports wins.

The **speculative block** (method, depth, drafter, lookup window, verification sampler) is one
more field, ``speculative``. Two fingerprints: :attr:`EngineConfig.fingerprint` over everything,
and :attr:`EngineConfig.base_fingerprint` over everything *but* the speculative block — equal base
fingerprints mean two legs differ at most in their speculation. A fingerprint is the first 16 hex
digits of the SHA-256 of the canonical JSON (sorted keys, no spaces) of the reduced values, so it
is the same on every machine and every run. ``kv_cache_dtype`` ``auto`` resolves to the model's
dtype (vLLM's meaning), so a leg that says ``auto`` and one that says ``bfloat16`` for a bfloat16
model are one configuration; a dtype reads without vLLM's ``torch.`` prefix.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.jsonx import as_int, dumps

__all__ = [
    "FIELDS",
    "SPECULATIVE",
    "EngineConfig",
    "cache_config_info",
    "diff",
    "fingerprint_of",
    "from_llamacpp",
    "from_sglang",
    "from_vllm",
    "llamacpp_speculative_type",
    "per_position_width",
    "resolve_engine",
    "version_of",
]

SPECULATIVE = "speculative"
# The fields that change speed or output, in the order reports list them.
FIELDS: tuple[str, ...] = (
    "engine",
    "version",
    "model",
    "revision",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "max_num_seqs",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "max_model_len",
    SPECULATIVE,
)
# The speculative block as fingerprinted: what the proposer is, how deep, which drafter, how
# drafts are verified. Derived or per-instance parts (draft/target model configs copied from the
# target, parallel configs, suffix-decoding caches) are left out.
SPEC_FIELDS: tuple[str, ...] = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "rejection_sample_method",
    "draft_tensor_parallel_size",
    "quantization",
)
_SGLANG_SPEC = {
    "speculative_algorithm": "method",
    "speculative_num_steps": "num_speculative_tokens",
    "speculative_draft_model_path": "model",
    "speculative_eagle_topk": "eagle_topk",
    "speculative_num_draft_tokens": "num_draft_tokens",
    "speculative_accept_threshold_single": "accept_threshold_single",
    "speculative_accept_threshold_acc": "accept_threshold_acc",
}

Value = str | int | float | bool | None | dict[str, Any]


def _scalar(value: object) -> str | int | float | bool | None:
    if value is None or isinstance(value, str | bool | int | float):
        return value
    return str(value)


def _dtype(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    return value.removeprefix("torch.")


def fingerprint_of(values: Mapping[str, Any]) -> str:
    """16 hex digits of the SHA-256 of the canonical JSON of ``values`` (sorted keys)."""
    return hashlib.sha256(dumps(dict(values), sort_keys=True)).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A leg's reduced engine configuration: ``values`` by :data:`FIELDS` (absent: unknown),
    ``sources`` naming where each came from (an endpoint, or ``declared``)."""

    values: Mapping[str, Value]
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(self.values)

    @property
    def base_fingerprint(self) -> str:
        return fingerprint_of({k: v for k, v in self.values.items() if k != SPECULATIVE})

    @property
    def declared(self) -> tuple[str, ...]:
        return tuple(k for k in FIELDS if self.sources.get(k) == "declared")

    def to_json(self) -> dict[str, Any]:
        """The record's ``legs[].engine``."""
        return {
            "config_fingerprint": self.fingerprint,
            "base_fingerprint": self.base_fingerprint,
            "settings": dict(self.values),
            "sources": dict(self.sources),
            "declared": list(self.declared),
        }


# -- readers, one per thing an engine serves -------------------------------------------------------


# Fingerprinted only where they differ from vLLM's defaults (every vLLM reports them, and a
# fingerprint taken before they were read must not move): adaptive verification, sampled
# drafts, a drafter with its own vocabulary.
_SPEC_NON_DEFAULT: Mapping[str, object] = {
    "enable_adaptive_verification": False,
    "draft_sample_method": "greedy",
    "use_heterogeneous_vocab": False,
}
# Suffix decoding's knobs (vLLM reports them whatever the method): only for ``suffix``.
SUFFIX_FIELDS: tuple[str, ...] = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)


def _vllm_spec(spec: object) -> dict[str, Any] | None:
    if not isinstance(spec, Mapping):
        return None
    out = {k: _scalar(spec.get(k)) for k in SPEC_FIELDS}
    if not spec.get("prompt_lookup_max"):  # 0 / None: no lookup window (not an n-gram proposer)
        out["prompt_lookup_min"] = out["prompt_lookup_max"] = None
    for k, default in _SPEC_NON_DEFAULT.items():
        if k in spec and spec[k] != default:
            out[k] = _scalar(spec[k])
    if spec.get("method") == "suffix":
        out.update({k: _scalar(spec.get(k)) for k in SUFFIX_FIELDS})
    return out


def from_vllm(info: Mapping[str, Any]) -> dict[str, Value] | None:
    """vLLM's ``/server_info`` (or ``/inference/v1/config``) JSON → reduced values (None: not that
    shape). ``scheduler_config.max_num_scheduled_tokens`` is not read: vLLM sets it when
    speculation is on."""
    config = info.get("vllm_config", info)
    if not isinstance(config, Mapping) or not isinstance(config.get("model_config"), Mapping):
        return None

    def part(name: str) -> Mapping[str, Any]:
        v = config.get(name)
        return v if isinstance(v, Mapping) else {}

    model, cache, sched, par = (
        part("model_config"),
        part("cache_config"),
        part("scheduler_config"),
        part("parallel_config"),
    )
    out: dict[str, Value] = {"engine": "vllm"}
    out["model"] = _scalar(model.get("model"))
    out["revision"] = _scalar(model.get("revision"))
    out["dtype"] = _dtype(model.get("dtype"))
    out["quantization"] = _scalar(model.get("quantization"))
    out["max_model_len"] = as_int(model.get("max_model_len"))
    if cache:
        out["kv_cache_dtype"] = _scalar(cache.get("cache_dtype"))
        out["enable_prefix_caching"] = _scalar(cache.get("enable_prefix_caching"))
    if sched:
        out["enable_chunked_prefill"] = _scalar(sched.get("enable_chunked_prefill"))
        out["max_num_seqs"] = as_int(sched.get("max_num_seqs"))
        out["max_num_batched_tokens"] = as_int(sched.get("max_num_batched_tokens"))
    if par:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            out[name] = as_int(par.get(name))
    if "speculative_config" in config:
        out[SPECULATIVE] = _vllm_spec(config.get("speculative_config"))
    return out


def from_sglang(info: Mapping[str, Any]) -> dict[str, Value] | None:
    """SGLang's ``/server_info`` (flat server arguments) → reduced values (None: not that shape)."""
    if "model_path" not in info:
        return None
    chunk = as_int(info.get("chunked_prefill_size"))
    radix_off = info.get("disable_radix_cache")
    algorithm = info.get("speculative_algorithm")
    out: dict[str, Value] = {
        "engine": "sglang",
        "version": _scalar(info.get("version")),
        "model": _scalar(info.get("model_path")),
        "revision": _scalar(info.get("revision")),
        "dtype": _dtype(info.get("dtype")),
        "quantization": _scalar(info.get("quantization")),
        "kv_cache_dtype": _scalar(info.get("kv_cache_dtype")),
        "enable_prefix_caching": None if radix_off is None else not bool(radix_off),
        "enable_chunked_prefill": None if chunk is None else chunk > 0,
        "max_num_seqs": as_int(info.get("max_running_requests")),
        "max_num_batched_tokens": as_int(info.get("max_prefill_tokens")),
        "tensor_parallel_size": as_int(info.get("tp_size")),
        "pipeline_parallel_size": as_int(info.get("pp_size")),
        "data_parallel_size": as_int(info.get("dp_size")),
        "max_model_len": as_int(info.get("context_length")),
        SPECULATIVE: {v: _scalar(info.get(k)) for k, v in _SGLANG_SPEC.items()}
        if isinstance(algorithm, str) and algorithm
        else None,
    }
    return out


def llamacpp_speculative_type(slots: object) -> tuple[bool | None, str | None]:
    """(whether any slot speculates, the speculative type a slot reports) from llama.cpp's
    ``GET /slots``; (None, None) when it is not that shape. A slot shows its ``params`` (with
    ``speculative.types``, e.g. ``draft-simple``, ``ngram-mod``) only once it served a request."""
    if not isinstance(slots, list) or not slots:
        return None, None
    flags = [s.get("speculative") for s in slots if isinstance(s, Mapping)]
    if not flags or not all(isinstance(f, bool) for f in flags):
        return None, None
    kinds = {
        s["params"]["speculative.types"]
        for s in slots
        if isinstance(s, Mapping)
        and isinstance(s.get("params"), Mapping)
        and isinstance(s["params"].get("speculative.types"), str)
        and s["params"]["speculative.types"] != "none"
    }
    return any(flags), ",".join(sorted(kinds)) or None


def from_llamacpp(
    props: Mapping[str, Any], slots: object = None, positions: int | None = None
) -> dict[str, Value] | None:
    """llama.cpp's ``/props`` (+ ``/slots`` and the per-position counter's width) → reduced values
    (None: not that shape). The speculative block — ``method`` (the speculative type) and
    ``num_speculative_tokens`` (the width of the per-position counter: the server's draft maximum,
    ``n_max``) — is left out until the server has said both (a slot served a request, a request
    drafted): unknown, not changed, so the fingerprint does not move when it becomes known. A
    server whose slots do not speculate has none (``None``)."""
    if not isinstance(props.get("model_path"), str) or "build_info" not in props:
        return None
    gen = props.get("default_generation_settings")
    n_ctx = as_int(gen.get("n_ctx")) if isinstance(gen, Mapping) else None
    out: dict[str, Value] = {
        "engine": "llamacpp",
        "version": _scalar(props.get("build_info")),
        "model": _scalar(props.get("model_path")),
        "quantization": _scalar(props.get("model_ftype")),
        "max_num_seqs": as_int(props.get("total_slots")),
        "max_model_len": n_ctx,
    }
    speculates, kind = llamacpp_speculative_type(slots)
    if speculates is False:
        out[SPECULATIVE] = None
    elif speculates and kind is not None and positions:
        out[SPECULATIVE] = {"method": kind, "num_speculative_tokens": positions}
    return out


def per_position_width(metrics_text: object) -> int | None:
    """How many positions llama.cpp's per-position acceptance counter has (its draft maximum);
    None before the first speculative request finished."""
    if not isinstance(metrics_text, str):
        return None
    name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total{"
    width = sum(1 for line in metrics_text.splitlines() if line.startswith(name))
    return width or None


def version_of(body: object) -> str | None:
    """vLLM's ``/version`` JSON (``{"version": "0.32.0"}``)."""
    if isinstance(body, Mapping) and isinstance(body.get("version"), str):
        return str(body["version"])
    return None


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def cache_config_info(metrics_text: str) -> dict[str, Value]:
    """The KV-cache dtype and prefix caching from the ``vllm:cache_config_info`` labels of a
    Prometheus exposition (empty when the line is absent)."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(line.split("}", 1)[0]))
            out: dict[str, Value] = {}
            if "cache_dtype" in labels:
                out["kv_cache_dtype"] = labels["cache_dtype"]
            flag = labels.get("enable_prefix_caching")
            if flag in ("True", "False"):
                out["enable_prefix_caching"] = flag == "True"
            return out
    return {}


# -- merging and comparing -----------------------------------------------------------------------


def resolve_engine(
    reported: Mapping[str, tuple[str, Mapping[str, Value]]],
    declared: Mapping[str, Any] | None = None,
) -> EngineConfig | None:
    """One leg's configuration from every source that answered (``source → values``, earlier
    sources win a field) and the policy's declaration (fills what none reported). None when
    nothing at all is known."""
    values: dict[str, Value] = {}
    sources: dict[str, str] = {}
    for source, got in reported.values():
        for k, v in got.items():
            if k in FIELDS and k not in values:
                values[k], sources[k] = v, source
    for k, v in (declared or {}).items():
        if k in FIELDS and k not in values and v is not None:
            values[k], sources[k] = _scalar(v) if k != SPECULATIVE else v, "declared"
    if not values:
        return None
    if values.get("kv_cache_dtype") == "auto" and values.get("dtype") is not None:
        values["kv_cache_dtype"] = values["dtype"]
    return EngineConfig({k: values[k] for k in FIELDS if k in values}, sources)


def diff(a: Mapping[str, Any], b: Mapping[str, Any], *, speculative: bool = False) -> list[str]:
    """The :data:`FIELDS` whose values differ between two configurations' ``config`` maps, in
    order; ``speculative`` False leaves the speculative block out. A field one side does not know
    is not a difference (it is unknown, not changed)."""
    out = []
    for k in FIELDS:
        if k == SPECULATIVE and not speculative:
            continue
        if k in a and k in b and a[k] != b[k]:
            out.append(k)
    return out
