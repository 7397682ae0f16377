"""``specshadow vllm setup | serve | up`` and ``specshadow llamacpp setup | up``: the real
engines' backends from the command line.

- ``setup``: create vLLM's environment and the tiny models (cached; instant when done).
- ``serve --config plain|ngram|draft --port P``: one server in the foreground; Ctrl-C stops it.
- ``up [--base-port P]``: plain, n-gram and draft-model servers on P, P+1, P+2 for a demo.
``specshadow vllm agreement`` (which needs the gateway) is added by :mod:`specshadow.agreement`.

- ``llamacpp setup``: llama.cpp's environment (PyPI ``xllamacpp``) and GGUFs of the tiny models.
- ``llamacpp up [--base-port P]``: plain, draft-model, ngram-mod and ngram-map-k servers on P..P+3.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from backends import llamacpp
from backends.server import (
    SERVED_MODEL_NAME,
    SpecConfig,
    VllmServer,
    VllmServerSpec,
    spread_cores,
    start_servers,
    stop_servers,
)
from backends.setup import setup

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[Any]) -> argparse._SubParsersAction[Any]:
    """Add ``vllm`` and its actions; returns its sub-parsers so ``agreement`` can join them."""
    parser = subparsers.add_parser("vllm", help="real vLLM CPU backends (setup, serve, up)")
    sub: argparse._SubParsersAction[Any] = parser.add_subparsers(
        dest="vllm_command", required=True, metavar="ACTION"
    )

    p_setup = sub.add_parser("setup", help="create vLLM's venv and the tiny models (cached)")
    p_setup.add_argument(
        "--cache", type=Path, help="cache folder (default $SPECSHADOW_CACHE or ~/.cache/specshadow)"
    )
    p_setup.set_defaults(func=_cmd_setup)

    p_serve = sub.add_parser("serve", help="run one vLLM server in the foreground")
    p_serve.add_argument("--config", choices=["plain", "ngram", "draft"], default="plain")
    p_serve.add_argument("--port", type=int, default=8100)
    add_common(p_serve)
    p_serve.set_defaults(func=_cmd_serve)

    p_up = sub.add_parser("up", help="run plain, ngram and draft servers on consecutive ports")
    p_up.add_argument("--base-port", type=int, default=8101)
    p_up.add_argument(
        "--pin",
        action="store_true",
        help="give each server its own core, round robin (vLLM's default binds all to core 0)",
    )
    add_common(p_up)
    p_up.set_defaults(func=_cmd_up)

    return sub


def register_llamacpp(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``llamacpp`` and its actions."""
    parser = subparsers.add_parser("llamacpp", help="real llama.cpp CPU backends (setup, up)")
    sub = parser.add_subparsers(dest="llamacpp_command", required=True, metavar="ACTION")
    p_setup = sub.add_parser("setup", help="llama.cpp's venv and GGUFs of the tiny models (cached)")
    p_setup.add_argument("--cache", type=Path)
    p_setup.set_defaults(func=_cmd_llamacpp_setup)
    p_up = sub.add_parser(
        "up", help="run plain, draft, ngram-mod and ngram-map-k servers on consecutive ports"
    )
    p_up.add_argument("--base-port", type=int, default=8201)
    p_up.add_argument("--draft-max", type=int, default=4, help="draft-simple's depth (n_max)")
    p_up.add_argument("--cache", type=Path)
    p_up.set_defaults(func=_cmd_llamacpp_up)


def _cmd_llamacpp_setup(args: argparse.Namespace) -> int:
    env = llamacpp.setup(args.cache)
    print(f"venv:   {env.venv}\ntarget: {env.target}\ndraft:  {env.draft}")
    return 0


def _cmd_llamacpp_up(args: argparse.Namespace) -> int:
    env = llamacpp.setup(args.cache)
    specs = [
        llamacpp.LlamaServerSpec(
            name=config, config=config, port=args.base_port + i, draft_max=args.draft_max
        )
        for i, config in enumerate(llamacpp.CONFIGS)
    ]
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_interrupt)
    servers: list[llamacpp.LlamaServer] = []
    try:
        servers = llamacpp.start_servers(specs, env)
        for s in servers:
            print(
                f"{s.spec.name:12} {s.base_url}/v1  model={llamacpp.SERVED_MODEL_NAME}  "
                f"metrics={s.base_url}/metrics  log={s.log_path}",
                flush=True,
            )
        print("Ctrl-C stops the servers.", flush=True)
        while True:
            for s in servers:
                if s.returncode is not None:
                    log.error("llama.cpp %s exited:\n%s", s.spec.name, s.log_tail())
                    return 1
            time.sleep(2)
    except KeyboardInterrupt:
        return 0
    finally:
        llamacpp.stop_servers(servers)
        sys.stdout.flush()


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", type=Path)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM compile the model (slower start) instead of --enforce-eager",
    )


def _cmd_setup(args: argparse.Namespace) -> int:
    env = setup(args.cache)
    print(f"venv:   {env.venv}\ntarget: {env.target_dir}\ndraft:  {env.draft_dir}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    spec = VllmServerSpec(
        name=args.config, config=args.config, port=args.port,
        num_speculative_tokens=args.num_speculative_tokens, enforce_eager=not args.compile,
    )  # fmt: skip
    return _serve_until_interrupted([spec], args.cache)


def _cmd_up(args: argparse.Namespace) -> int:
    configs: tuple[SpecConfig, ...] = ("plain", "ngram", "draft")
    cores = spread_cores(len(configs)) if args.pin else [None] * len(configs)
    specs = [
        VllmServerSpec(
            name=config,
            config=config,
            port=args.base_port + i,
            num_speculative_tokens=args.num_speculative_tokens,
            enforce_eager=not args.compile,
            cores=cores[i],
        )
        for i, config in enumerate(configs)
    ]
    return _serve_until_interrupted(specs, args.cache)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _serve_until_interrupted(specs: list[VllmServerSpec], cache: Path | None) -> int:
    env = setup(cache)
    # Explicit for SIGINT too: a shell that starts us in the background sets SIGINT to "ignore".
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_interrupt)
    servers: list[VllmServer] = []
    try:
        servers = start_servers(specs, env)
        for s in servers:
            print(
                f"{s.spec.name:6} {s.base_url}/v1  model={SERVED_MODEL_NAME}  "
                f"metrics={s.metrics_url}  log={s.log_path}",
                flush=True,
            )
        print("Ctrl-C stops the servers.", flush=True)
        while True:
            for s in servers:
                if s.returncode is not None:
                    log.error("vLLM %s exited:\n%s", s.spec.name, s.log_tail())
                    return 1
            time.sleep(5)
    except KeyboardInterrupt:
        return 0
    finally:
        stop_servers(servers)
        sys.stdout.flush()
