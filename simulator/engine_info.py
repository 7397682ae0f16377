"""What the simulator says it runs, vLLM-shaped (pure): ``GET /server_info?config_format=json``,
``GET /version`` and the ``vllm:cache_config_info`` line of ``/metrics``.

The engine configuration is a :class:`SimEngine` — the server's :class:`~simulator.config.SimConfig`
(model, max model length, ``max_num_seqs``, the speculative block) plus ``SimConfig.engine``'s
overrides (``version``, ``dtype``, ``quantization``, ``kv_cache_dtype``, ``enable_prefix_caching``,
``enable_chunked_prefill``, ``max_num_batched_tokens``, ``tensor_parallel_size``, ``revision``, …)
— held in one mutable object per server, so a test (or ``POST /sim/engine``) can change the version
or any setting mid-run, as a rolling upgrade does, while requests keep flowing. Timing is not
changed by these settings: they are what the server *says*, for the gateway's engine probe.

Like a real vLLM 0.32, a speculative server's answer also differs from a plain one's where no
configuration changed: a fresh ``instance_id`` per server, ``observability_config`` turning
per-request speculative metrics on, and ``scheduler_config.max_num_scheduled_tokens`` set from the
batched-token budget — the fields a confound gate must not call a difference.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulator.config import SimConfig

__all__ = ["ENGINE_KEYS", "SimEngine"]

DEFAULT_VERSION = "0.32.0+sim"
ENGINE_KEYS: Mapping[str, object] = {
    "version": DEFAULT_VERSION,
    "revision": None,
    "dtype": "bfloat16",
    "quantization": None,
    "kv_cache_dtype": "auto",
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 2048,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
}


def check_engine(overrides: Mapping[str, object], where: str = "engine") -> dict[str, object]:
    """``overrides`` checked against :data:`ENGINE_KEYS` (a ValueError names the key)."""
    unknown = sorted(set(overrides) - set(ENGINE_KEYS))
    if unknown:
        raise ValueError(
            f"{where}.{unknown[0]}: unknown engine setting (known: {sorted(ENGINE_KEYS)})"
        )
    return dict(overrides)


class SimEngine:
    """One server's engine settings; :meth:`update` changes them at once (mid-run)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.settings: dict[str, object] = {**ENGINE_KEYS, **check_engine(config.engine)}
        self.instance_id = str(random.getrandbits(60))

    def update(self, **changes: object) -> None:
        self.settings.update(check_engine(changes))

    @property
    def version(self) -> str:
        return str(self.settings["version"])

    def speculative_config(self) -> dict[str, Any] | None:
        config = self.config
        if not config.speculative:
            return None
        # A lookup window only where drafts really are vLLM's n-gram proposer (replay): drawn
        # acceptance (the probabilistic stand-in) is no proposer a replay could reproduce.
        window = config.proposer == "ngram" and config.drafting == "replay"
        return {
            "method": config.proposer,
            "model": config.proposer if config.proposer == "ngram" else f"{config.model}-draft",
            "num_speculative_tokens": config.num_speculative_tokens,
            "prompt_lookup_min": config.prompt_lookup_min if window else None,
            "prompt_lookup_max": config.prompt_lookup_max if window else None,
            "rejection_sample_method": config.rejection_sample_method,
            "num_speculative_tokens_per_batch_size": None,
            **config.speculative_settings,
        }

    def server_info(self) -> dict[str, Any]:
        """vLLM's ``/server_info?config_format=json`` (dev mode), the parts that matter."""
        s, config = self.settings, self.config
        spec = self.speculative_config()
        return {
            "vllm_config": {
                "model_config": {
                    "model": config.model,
                    "served_model_name": config.model,
                    "revision": s["revision"],
                    "dtype": f"torch.{s['dtype']}",
                    "quantization": s["quantization"],
                    "max_model_len": config.max_model_len,
                },
                "cache_config": {
                    "cache_dtype": s["kv_cache_dtype"],
                    "enable_prefix_caching": s["enable_prefix_caching"],
                    "block_size": 16,
                },
                "scheduler_config": {
                    "max_num_seqs": config.max_num_seqs,
                    "max_num_batched_tokens": s["max_num_batched_tokens"],
                    # vLLM sets this itself when speculation is on: derived, not configured.
                    "max_num_scheduled_tokens": s["max_num_batched_tokens"] if spec else None,
                    "enable_chunked_prefill": s["enable_chunked_prefill"],
                },
                "parallel_config": {
                    "tensor_parallel_size": s["tensor_parallel_size"],
                    "pipeline_parallel_size": s["pipeline_parallel_size"],
                    "data_parallel_size": s["data_parallel_size"],
                },
                "observability_config": {
                    "per_request_spec_decode_metrics": "summary" if spec else "none"
                },
                "speculative_config": spec,
                "instance_id": self.instance_id,
            }
        }

    def cache_config_info(self) -> bytes:
        """The ``vllm:cache_config_info`` gauge, its labels the cache settings (as vLLM)."""
        s = self.settings
        labels = {
            "block_size": "16",
            "cache_dtype": str(s["kv_cache_dtype"]),
            "enable_prefix_caching": str(bool(s["enable_prefix_caching"])),
            "engine": "0",
        }
        body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{body}}} 1.0\n"
        ).encode()
