"""No module outside ``records/`` names a record field as a string.

Every field of a record is declared once (``records.reader``, through ``records.fields``); code
elsewhere reads a record through those declarations, never as ``record["legs"]`` or
``leg.get("tpot_s")``. This test parses every product module outside ``records/`` with
:mod:`ast` and fails on a string-keyed read (``x["name"]``, ``x.get("name")``, ``.pop``,
``.setdefault``) whose key is a declared record field's name — unless the module is listed
below with the other JSON it reads under that name (the OpenAI wire format, the policy file, the
rollout state, the matrix's rows, …) and why. A record read added anywhere fails here, naming
the module and the line: checked by adding one (``test_the_check_sees_a_record_read``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from records.fields import declared_paths
from records.reader import Record

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "core",
    "policies",
    "otel",
    "simulator",
    "evidence",
    "gateway",
    "rollout",
    "counterfactual",
    "loadgen",
    "report",
    "backends",
    "specshadow",
)
FIELDS = frozenset(p[-1] for p in declared_paths(Record) if p[-1] != "[]")

OPENAI = "the OpenAI wire format (requests, responses, stream chunks)"
MATRIX = "the counterfactual matrix's own rows and picks (specshadow.matrix/1)"
ROLLOUT = "the rollout state and transitions (the admin API, the state file)"
ANALYSIS = "the report's analysis tables (issue 28's typed report model replaces them)"

# module → (keys it reads from JSON that is not a record, what that JSON is)
NOT_RECORDS: dict[str, tuple[frozenset[str], str]] = {
    "backends/setup.py": (
        frozenset({"sha256"}),
        "PyPI's JSON simple index (a release file's hashes, checked before a source build)",
    ),
    "core/assemble.py": (
        frozenset(
            {"finish_reason", "output", "output_tokens", "reason", "refusal", "status"}
            | {"text", "tokens", "tool_calls"}
        ),
        OPENAI + " and the Responses API's events",
    ),
    "core/classify.py": (frozenset({"prompt", "role"}), OPENAI),
    "core/exchange.py": (frozenset({"seed", "stream", "temperature"}), OPENAI),
    "core/recorder.py": (frozenset({"prompt_tokens"}), OPENAI + ": the usage object"),
    "core/request_body.py": (frozenset({"role", "text"}), OPENAI),
    "counterfactual/cli.py": (frozenset({"label", "reason"}), MATRIX),
    "counterfactual/crossvocab_drafter.py": (
        frozenset({"concurrency", "text"}),
        "the --cross-vocab knobs and vLLM's /v1/completions answer",
    ),
    "counterfactual/live.py": (frozenset({"flag", "greedy", "sampled"}), MATRIX),
    "counterfactual/matrix.py": (
        frozenset(
            {"category", "label", "mean_acceptance_length", "output_length_bucket"}
            | {"prompt_lookup_max", "prompt_lookup_min", "tokens_per_pass"}
        ),
        MATRIX,
    ),
    "counterfactual/rejections.py": (frozenset({"prompt"}), "vLLM's /detokenize answer"),
    "counterfactual/render.py": (
        frozenset(
            {"backend", "category", "flag", "label", "mean_acceptance_length", "reason"}
            | {"output_length_bucket", "tokens_per_pass", "prompt_lookup_max", "prompt_lookup_min"}
            | {"draft_acceptance_rate", "output_tokens", "rule", "share"}
        ),
        MATRIX,
    ),
    "counterfactual/rows.py": (frozenset({"mean_acceptance_length", "tokens_per_pass"}), MATRIX),
    "counterfactual/retokenize.py": (frozenset({"tokens"}), "vLLM's /tokenize answer"),
    "evidence/counts.py": (frozenset({"count", "tokens"}), "vLLM's /tokenize answer"),
    "evidence/likelihood.py": (frozenset({"tokens"}), "vLLM's /tokenize answer"),
    "evidence/serverinfo.py": (
        frozenset(
            {
                "draft_sample_method",
                "method",
                "num_speculative_tokens",
                "prompt_lookup_max",
                "prompt_lookup_min",
            }
        ),
        "vLLM's and SGLang's server info (speculative_config)",
    ),
    "evidence/engine_config.py": (
        frozenset({"method", "prompt_lookup_max", "prompt_lookup_min", "speculative"}),
        "vLLM's and SGLang's server info (the whole engine configuration); llama.cpp's /slots",
    ),
    "evidence/tokens.py": (frozenset({"prompt", "tokens"}), "vLLM's /tokenize answer"),
    "gateway/admin.py": (frozenset({"reason", "rule", "stage"}), ROLLOUT),
    "gateway/cli.py": (frozenset({"reason", "rule", "stage", "status"}), ROLLOUT),
    "rollout/state.py": (frozenset({"engine", "episode", "stage"}), ROLLOUT),
    "loadgen/client.py": (frozenset({"stream"}), OPENAI),
    "loadgen/matrix.py": (
        frozenset({"backend", "concurrency", "schema"}),
        "the benchmark matrix's rows",
    ),
    "loadgen/results.py": (
        frozenset(
            {"category", "e2e_s", "error_type", "output_tokens", "tokens_source", "tpot_s"}
            | {"ttft_s"}
        ),
        "the load generator's result rows (specshadow.loadgen/1)",
    ),
    "loadgen/trace.py": (frozenset({"category"}), "trace rows"),
    "gateway/workers.py": (frozenset({"status"}), "a worker's last exit in workers.json"),
    "otel/multiproc.py": (frozenset({"count"}), "a worker's metric snapshot (a histogram point)"),
    "otel/attributes.py": (
        frozenset({"draft_acceptance_rate", "mean_acceptance_length", "prompt", "role"}),
        OPENAI + " and vLLM's per-request metrics",
    ),
    "policies/compile.py": (
        frozenset({"engine"}),
        "the policy's declared engine block (docs/confounds.md)",
    ),
    "policies/shape.py": (frozenset({"seed", "stream", "temperature"}), OPENAI),
    "report/export.py": (frozenset({"candidates"}), "report.json being written"),
    "report/plots.py": (
        frozenset(
            {"backend", "category", "label", "mean_acceptance_length"}
            | {"num_speculative_tokens", "output_length_bucket", "prompt_lookup_max"}
            | {"prompt_lookup_min", "rule", "tokens_per_pass"}
        ),
        MATRIX,
    ),
    "report/render.py": (
        frozenset({"backend", "flag", "label", "latency", "mean_acceptance_length", "reason"}),
        MATRIX + "; the figures by name",
    ),
    "report/rollbacks.py": (frozenset({"exchange_id", "reason", "rule"}), ROLLOUT),
    "report/rollout.py": (frozenset({"tokens_per_event"}), "rollout.yaml being written"),
    "report/sections.py": (
        frozenset({"e2e_s", "json_valid"}),
        ANALYSIS + ": the latency and quality tallies it builds",
    ),
    "report/sql.py": (frozenset({"b"}), "rows the engine returns"),
    "simulator/request.py": (
        frozenset({"prompt", "role", "schema", "seed", "stream", "text", "tokens"}),
        OPENAI + " (the simulator parses requests)",
    ),
    "simulator/state.py": (frozenset({"sampling"}), "the simulator's request log"),
    "simulator/tokens.py": (frozenset({"role"}), OPENAI),
    "specshadow/agreement.py": (frozenset({"role"}), OPENAI),
    "specshadow/demo.py": (frozenset({"prompt"}), "trace rows"),
    "specshadow/story.py": (
        frozenset(
            {"backend", "exchange_id", "flag", "label", "mean_acceptance_length"}
            | {"reason", "stage", "category", "output_length_bucket", "rule"}
        ),
        ROLLOUT + "; " + MATRIX,
    ),
}


def string_keys(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(key, line) of every string-keyed read in ``tree``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            yield node.slice.value, node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, node.lineno


def record_reads(module: str, source: str) -> list[str]:
    allowed = NOT_RECORDS.get(module, (frozenset(), ""))[0]
    return [
        f"{module}:{line}: {key!r}"
        for key, line in string_keys(ast.parse(source))
        if key in FIELDS and key not in allowed
    ]


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path


def test_no_module_outside_records_names_a_record_field() -> None:
    found = [hit for name, path in modules() for hit in record_reads(name, path.read_text())]
    assert not found, (
        "record fields named as strings outside records/ (read them through records.reader; "
        "if it is another JSON, list it in NOT_RECORDS with what it is):\n" + "\n".join(found)
    )


def test_the_check_sees_a_record_read() -> None:
    source = (ROOT / "report" / "analysis.py").read_text()
    assert record_reads("report/analysis.py", source) == []
    mutated = source + '\n\ndef _bad(record):\n    return record["legs"][0].get("tpot_s")\n'
    hits = record_reads("report/analysis.py", mutated)
    assert len(hits) == 2 and {h.rsplit(" ", 1)[1] for h in hits} == {"'legs'", "'tpot_s'"}


def test_every_listed_module_still_reads_what_it_lists() -> None:
    """The allowances shrink with the code: a key a module no longer reads is taken off."""
    stale = []
    for module, (keys, _why) in NOT_RECORDS.items():
        path = ROOT / module
        read = {k for k, _ in string_keys(ast.parse(path.read_text()))} if path.exists() else set()
        stale += [f"{module}: {k!r}" for k in sorted(keys - read)]
    assert not stale, "NOT_RECORDS lists keys no longer read:\n" + "\n".join(stale)
