"""What a record keeps of the run a call belongs to, through the real gateway: the client's
trace id (never one the gateway minted), the session header the policy names, the workflow
type header the policy names; and the policy's field-path errors for those names."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from core.exchange import CAPTURE_OFF
from core.wire import WORKFLOW_HEADER
from evidence.worker import build_evidence
from policies import PolicyError, parse_policy
from records.reader import read
from records.writer import build_record
from tests.reliability.helpers import chat

TID = "4bf92f3577b34da6a3ce929d0e0e4736"
POLICY = """\
version: 1
backends:
  prod: {{url: "{url}", kind: sim}}
primary: prod
workflows:
  session_header: x-conversation
  type_header: x-agent
"""


async def send(url: str, headers: dict[str, str]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=chat(stream=True), headers=headers) as r,
    ):
        assert r.status == 200
        await r.read()


async def test_the_record_names_the_clients_trace_the_session_and_the_type(
    gateway: Any, sims: Any, tmp_path: Any, write_policy: Any
) -> None:
    sim = await sims()
    gw = await gateway(None, policy_path=write_policy(POLICY.format(url=sim.base_url)))
    parent = f"00-{TID}-00f067aa0ba902b7-01"
    await send(gw.url, {"traceparent": parent, "X-Conversation": "c-7", "x-agent": "triage"})
    await send(gw.url, {WORKFLOW_HEADER: "not-the-policy-s-header"})  # no trace, no session
    await gw.sink.wait_for(lambda e: len(gw.sink.exchanges) >= 2)
    first, second = gw.sink.exchanges
    assert (first.trace_id, first.session, first.workflow) == (TID, "c-7", "triage")
    assert (second.trace_id, second.session, second.workflow) == (None, None, None)

    w = read(build_record(build_evidence(first), capture=CAPTURE_OFF)).workflow
    assert w is not None and (w.trace_id, w.session, w.type) == (TID, "c-7", "triage")
    assert read(build_record(build_evidence(second), capture=CAPTURE_OFF)).workflow is None


@pytest.mark.parametrize(
    ("block", "path"),
    [
        ({"session_header": "not a header"}, "workflows.session_header"),
        ({"type_header": ""}, "workflows.type_header"),
        ({"sesion_header": "x-session"}, "workflows.sesion_header"),
    ],
)
def test_a_bad_workflows_block_names_its_field(block: dict[str, Any], path: str) -> None:
    raw = {"version": 1, "backends": {"p": {"url": "http://p:1", "kind": "openai"}}, "primary": "p"}
    with pytest.raises(PolicyError) as info:
        parse_policy({**raw, "workflows": block}, source="test")
    assert any(p.startswith(path) for p in info.value.problems), info.value.problems


def test_the_default_groups_by_trace_and_types_by_the_specshadow_header() -> None:
    raw = {"version": 1, "backends": {"p": {"url": "http://p:1", "kind": "openai"}}, "primary": "p"}
    wf = parse_policy(raw, source="test").workflows
    assert (wf.session_header, wf.type_header) == (None, WORKFLOW_HEADER)
    named = parse_policy({**raw, "workflows": {"session_header": "X-Session"}}, source="t")
    assert named.workflows.session_header == "x-session"
