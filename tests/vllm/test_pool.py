"""The shared vLLM server pool (``vllm_server`` in conftest) without vLLM: its "python" is a shell
script that serves HTTP 200 on the port it is given, so the lifecycle is real (processes, ports,
work folders) and nothing needs the vLLM environment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from core.procs import session_pids
from tests.vllm.conftest import EXTRA_SPECS, MAX_EXTRAS, VllmServerPool
from tests.vllm.test_server import fake_env

SERVE_200 = (
    'port=""; prev=""\n'
    'for a in "$@"; do [ "$prev" = "--port" ] && port="$a"; prev="$a"; done\n'
    f"exec {sys.executable} -c '\n"
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200)\n"
    '        self.send_header("content-length", "2")\n'
    "        self.end_headers()\n"
    '        self.wfile.write(b"{}")\n'
    "    def do_POST(self):\n"
    '        self.rfile.read(int(self.headers.get("content-length") or 0))\n'
    "        self.do_GET()\n"
    "    def log_message(self, *args):\n"
    "        pass\n"
    'http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()\n'
    '\' "$port"'
)


def test_a_configuration_starts_on_the_first_ask_and_every_ask_shares_it(tmp_path: Path) -> None:
    assert MAX_EXTRAS == 1
    pool = VllmServerPool(fake_env(tmp_path, SERVE_200), {})
    try:
        other = pool("other")
        assert other.spec == EXTRA_SPECS["other"] and other.spec.weights == "draft"
        assert pool("other") is other  # a second ask (another module) reuses it
        leader, work_dir = other.pid, other.work_dir
        assert leader is not None and work_dir is not None and session_pids(leader)

        k2 = pool("ngram-k2")  # one extra at a time: the least recently asked one stops
        assert k2.spec.num_speculative_tokens == 2
        assert list(pool.extras) == ["ngram-k2"]
        assert session_pids(leader) == [] and not work_dir.exists()
        assert [name for name, _, _ in pool.started] == ["other", "ngram-k2"]

        with pytest.raises(KeyError):
            pool("nobody-declared-this")
    finally:
        pool.close()
    assert pool.extras == {}
    assert all(pid is None or session_pids(pid) == [] for _, pid, _ in pool.started)
    assert all(d is not None and not d.exists() for _, _, d in pool.started)
