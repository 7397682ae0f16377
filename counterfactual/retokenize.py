"""Token ids for records that have none, at scoring time: their captured text through ``/tokenize``.

The gateway's token tap (``evidence.tokens``) is the way to get ids: it tokenizes the request's
messages with the engine's chat template and prefers the ids an engine generated. A store
recorded without it still holds text where the policy's ``capture`` allowed (``full`` or
``redacted``): ``specshadow counterfactual`` then asks a tokenizer — ``--tokenizer URL``, else the
server of the records' first candidate or baseline leg, never the primary's — for the ids of the
primary's output and of the prompt's text. Approximate, and said so in every such record
(``tokens.output_source`` and ``tokens.prompt_source``): the prompt's text is its messages'
contents joined, without the chat template's tokens, and re-tokenized output can spell some
strings differently from what the engine generated (docs/counterfactual.md).

Records stream through once and go to a JSON Lines file beside the outputs; only the ids of the
record at hand are held.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from core import jsonx
from records.reader import Record, read

__all__ = ["TokenizerError", "find_tokenizer", "needs_tokens", "retokenized"]


class TokenizerError(RuntimeError):
    """The tokenizer could not be reached or answered something else than ``/tokenize`` does."""


def _output_text(record: Record) -> str | None:
    """The primary's captured output text; None when there is none (or it is empty)."""
    primary = record.primary
    return (primary.text or None) if primary is not None else None


def needs_tokens(record: Mapping[str, Any] | Record) -> bool:
    """No ids, but the primary's output text was captured."""
    r = read(record)
    return r.tokens is None and _output_text(r) is not None


def find_tokenizer(records: Iterable[Mapping[str, Any] | Record]) -> str | None:
    """``http://host:port`` of the first candidate or baseline leg's server that is not the
    primary's (records name servers, not backends' URLs)."""
    for r in map(read, records):
        ours = r.primary.server_address if r.primary is not None else None
        for leg in r.legs:
            address = leg.server_address
            if leg.role in ("candidate", "baseline") and address and address != ours:
                return f"http://{address}"
    return None


def _tokenize(url: str, body: Mapping[str, Any], timeout_s: float) -> list[int]:
    request = urllib.request.Request(
        url.rstrip("/") + "/tokenize",
        data=jsonx.dumps(body),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            answer = jsonx.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TokenizerError(f"{url}/tokenize: {exc}") from exc
    # ``answer``: the tokenizer's /tokenize response, not a record.
    ids = answer.get("tokens") if isinstance(answer, Mapping) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise TokenizerError(f"{url}/tokenize: no list of token ids in the answer")
    return ids


def retokenized(
    records: Iterable[dict[str, Any]], url: str, out: Path, *, timeout_s: float = 30.0
) -> Iterator[dict[str, Any]]:
    """Every record, those that :func:`needs_tokens` with ``tokens`` added; also written to
    ``out`` (JSON Lines) so a second pass reads the file, not the tokenizer again."""
    with out.open("wb") as sink:
        for record in records:
            r = read(record)
            output_text = _output_text(r)
            if r.tokens is None and output_text is not None:
                assert r.primary is not None
                reported = r.primary.output_tokens  # a count, read as a number: kept an int
                prompt_text = r.request_text or ""
                record = {
                    **record,
                    "tokens": {
                        "source": f"tokenize:{url}",
                        "prompt_source": "record text, without the chat template",
                        "leg": "primary",
                        "prompt": _tokenize(url, {"prompt": prompt_text}, timeout_s),
                        "output": _tokenize(
                            url, {"prompt": output_text, "add_special_tokens": False}, timeout_s
                        ),
                        "output_source": f"tokenize:{url}",
                        "output_tokens_reported": None if reported is None else int(reported),
                        "drafters": {},
                        "legs": {},
                    },
                }
            sink.write(jsonx.dumps(record) + b"\n")
            yield record
