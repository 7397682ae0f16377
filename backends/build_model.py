"""Build the tiny deterministic target and draft models that the real-vLLM tests and demo serve.

This is a standalone script that runs *inside vLLM's own virtual environment* (it imports torch,
transformers and tokenizers, none of which the gateway depends on); ``backends.setup`` runs it
and caches its output outside the repo, keyed by a hash of this file and the library versions.

Nothing is downloaded. The training text is text that ships with CPython: the pydoc topic help
(``pydoc_data.topics``) plus a fixed, sorted list of standard-library sources.

Output (``OUT``)::

    OUT/target/   LlamaForCausalLM, 4 layers, hidden 256, 4 heads × head_dim 64 (≈4 M parameters), 240 steps
    OUT/draft/    LlamaForCausalLM, 2 layers, hidden 128, 2 heads × head_dim 64 (≈1 M parameters), 160 steps

Both hold the same byte-level BPE tokenizer (``tokenizer.json``, ``tokenizer_config.json`` and,
as transformers 5 saves it, ``chat_template.jinja``: ChatML that renders tools Hermes-style, with
``<tool_call>`` tags) and a
``generation_config.json`` whose end tokens are ``<|im_end|>`` and ``<|endoftext|>``. Weights are
fp32 safetensors. Same script + same library versions ⇒ same bytes (fixed seeds, one BPE thread,
two torch threads; checked by building twice).

Usage: ``python build_model.py OUT [--target-steps N] [--draft-steps N]``
"""

# This file is type-checked by the gateway's mypy, where torch & co. are not installed.
# ruff: noqa: T201  (a script: it reports progress on stdout, which setup logs)
# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc,unused-ignore"

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the BPE trainer: one thread, one merge order
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

SEED = 20240611
VOCAB_SIZE = 4096
SEQ_LEN = 128
BATCH = 16
MAX_MODEL_LEN = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Plain (non-special) added tokens, so they survive detokenization and vLLM's hermes parser finds them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

# Standard-library sources in the corpus: fixed and sorted (relative to the stdlib directory).
STDLIB_SOURCES = (
    "argparse.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "string.py",
    "textwrap.py",
)

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures are within <tools></tools>:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    'For each call return <tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
    "</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{% if message.content %}{{ message.content }}\n{% endif %}"
    "{%- for call in message.tool_calls %}{% set f = call.function if call.function else call %}"
    '<tool_call>\n{"name": "{{ f.name }}", "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus_documents() -> list[str]:
    """The training text, in a fixed order: the pydoc topics, then the stdlib sources.

    Deliberately no ChatML: trained on conversations for this few steps, the model learned to
    emit ``<|im_start|>assistant`` over and over. Never seeing the special tokens as targets, it
    continues a chat prompt with prose instead (and, like any tiny model, rarely ends by itself).
    """
    from pydoc_data.topics import topics  # ships with CPython

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [topics[name] for name in sorted(topics)]
    docs += [(stdlib / rel).read_text(encoding="utf-8") for rel in STDLIB_SOURCES]
    return docs


def build_tokenizer(docs: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=MAX_MODEL_LEN,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_stream(tok: PreTrainedTokenizerFast, docs: list[str]) -> torch.Tensor:
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok.backend_tokenizer.encode(doc, add_special_tokens=False).ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def make_config(tok: PreTrainedTokenizerFast, *, layers: int, hidden: int) -> LlamaConfig:
    head_dim = 64  # vLLM's CPU attention supports 32, 64, 80, ...; 64 for both models
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=hidden // head_dim,
        head_dim=head_dim,
        max_position_embeddings=MAX_MODEL_LEN,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
        attn_implementation="eager",  # faster than sdpa for training at this size on CPU
    )


def train(config: LlamaConfig, data: torch.Tensor, *, steps: int, lr: float, name: str) -> Any:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1.0 - s / steps)
    )
    gen = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(SEQ_LEN)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (BATCH,), generator=gen)
        batch = data[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - started
            print(
                f"{name}: {params / 1e6:.2f} M params, step {step + 1}/{steps}, "
                f"loss {loss.item():.3f}, {elapsed:.0f} s",
                flush=True,
            )
    model.eval()
    return model


def save(model: Any, tok: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=[tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")],
        pad_token_id=tok.pad_token_id,
    ).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--target-steps", type=int, default=240)
    parser.add_argument("--draft-steps", type=int, default=160)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    docs = corpus_documents()
    tok = build_tokenizer(docs)
    data = token_stream(tok, docs)
    print(
        f"tokenizer: vocab {len(tok)}, corpus {len(data)} tokens, "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    target = train(
        make_config(tok, layers=4, hidden=256),
        data,
        steps=args.target_steps,
        lr=3e-3,
        name="target",
    )
    save(target, tok, args.out / "target")
    draft = train(
        make_config(tok, layers=2, hidden=128), data, steps=args.draft_steps, lr=4e-3, name="draft"
    )
    save(draft, tok, args.out / "draft")
    print(
        f"built in {time.perf_counter() - started:.0f} s (python {sys.version.split()[0]}, "
        f"torch {torch.__version__})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
