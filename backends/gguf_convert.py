"""Write a tiny Hugging Face Llama folder (the ones ``build_model.py`` trains) as a GGUF file that
llama.cpp's server loads — locally, with ``gguf.GGUFWriter``, nothing downloaded.

A standalone script that runs *inside the llama.cpp environment* (``backends.llamacpp_setup``
installs ``gguf`` and numpy there; the gateway's interpreter has neither). It reads:

- ``config.json``: a ``LlamaForCausalLM`` (heads, layers, sizes, RoPE base, RMS epsilon; tied
  embeddings: llama.cpp reuses ``token_embd`` as the output matrix when ``output`` is absent);
- ``model.safetensors``: fp32 weights, parsed here (an 8-byte header length, a JSON header, raw
  little-endian arrays) so no ``safetensors`` package is needed;
- ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: the byte-level BPE
  vocabulary and merges, the special tokens and the ChatML template.

What llama.cpp needs that a converter would otherwise work out:

- ``q_proj`` / ``k_proj`` rows permuted from Hugging Face's rotate-half RoPE layout to GGML's
  interleaved one (the permutation of llama.cpp's ``convert_hf_to_gguf.py``, ``LlamaModel.permute``);
- the tokenizer named ``gpt2`` with the pre-tokenizer ``gpt-2`` (a custom byte-level BPE has no
  registered pre-tokenizer hash; ``gpt-2`` is llama.cpp's plain byte-level split);
- special tokens typed ``CONTROL``, the tool-call tags ``USER_DEFINED`` (they stay in the text),
  no BOS added (the Hugging Face tokenizer adds none), end of generation ``<|im_end|>``.

Same input ⇒ same bytes (no timestamps, no randomness). Weights stay F32 (file type 0).

Usage: ``python gguf_convert.py HF_DIR OUT.gguf [--name NAME]``
"""

# This file is type-checked by the gateway's mypy, where gguf and numpy are not installed.
# ruff: noqa: T201  (a script: it reports on stdout, which setup logs)
# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc,unused-ignore"

from __future__ import annotations

import argparse
import json  # noqa: TID251  (runs in the llama.cpp environment, which has no orjson)
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def read_safetensors(path: Path) -> dict[str, Any]:
    """name → numpy array of a safetensors file (the formats a tiny fp32 model uses)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    base = 8 + size
    out: dict[str, Any] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        dtype = _DTYPES[meta["dtype"]]
        array = np.frombuffer(raw[base + start : base + end], dtype=dtype)
        out[name] = array.reshape(meta["shape"]).copy()
    return out


def permute(w: Any, heads: int) -> Any:
    """Hugging Face's rotate-half Q/K rows → GGML's interleaved RoPE pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tensor_name(hf: str) -> str | None:
    """GGUF's name for a Hugging Face Llama tensor (None: not written)."""
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        sub = _LAYER.get(".".join(parts[3:]))
        return f"blk.{int(parts[2])}.{sub}" if sub is not None else None
    return None


def convert(src: Path, out: Path, name: str) -> None:
    config = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    template_file = src / "chat_template.jinja"
    template = (
        template_file.read_text() if template_file.exists() else tok_config.get("chat_template")
    )
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(name)
    w.add_context_length(int(config["max_position_embeddings"]))
    w.add_embedding_length(hidden)
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(config.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(int(config["vocab_size"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    # The vocabulary: the BPE model's tokens and the added ones, by id, no holes.
    vocab: dict[int, str] = {i: t for t, i in tok["model"]["vocab"].items()}
    types: dict[int, int] = dict.fromkeys(vocab, gguf.TokenType.NORMAL)
    for added in tok.get("added_tokens", []):
        vocab[added["id"]] = added["content"]
        types[added["id"]] = (
            gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        )
    size = int(config["vocab_size"])
    if sorted(vocab) != list(range(size)):
        raise SystemExit(f"vocabulary ids are not 0..{size - 1}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    ids = {t: i for i, t in vocab.items()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([vocab[i] for i in range(size)])
    w.add_token_types([int(types[i]) for i in range(size)])
    w.add_token_merges(merges)
    eos = ids[tok_config.get("eos_token") or "<|im_end|>"]
    w.add_eos_token_id(eos)
    w.add_eot_token_id(eos)
    bos = config.get("bos_token_id")
    if isinstance(bos, int):
        w.add_bos_token_id(bos)
    pad = config.get("pad_token_id")
    if isinstance(pad, int):
        w.add_pad_token_id(pad)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    if template:
        w.add_chat_template(template)

    tensors = read_safetensors(src / "model.safetensors")
    for hf in sorted(tensors):
        target = tensor_name(hf)
        if target is None:
            continue
        data = tensors[hf].astype(np.float32)
        if hf.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif hf.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        w.add_tensor(target, data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out}: {len(tensors)} tensors, vocab {size}, {out.stat().st_size} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--name", default="tiny-llama")
    args = parser.parse_args()
    convert(args.src, args.out, args.name)


if __name__ == "__main__":
    main()
