"""Client behaviour: going away mid-stream with shadows in flight, reading slowly from a fast
large stream (backpressure, bounded memory), and thousands of idle keep-alive connections."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.fakes.upstream import Script
from tests.reliability.helpers import (
    chat,
    fetch,
    shadow_policy,
    spawn_gateway,
    wait_for_exchanges,
)


@pytest.mark.parametrize("policy", ["finish", "cancel"])
async def test_a_client_leaving_mid_stream_finishes_or_cancels_in_flight_shadows(
    sims, gateway, write_policy, policy
):
    primary = await sims(step_s=0.01)
    candidate = await sims(mode="speculative", coverage=0.0, step_s=0.02)  # ~0.8 s for 40 tokens
    text = shadow_policy(
        primary.base_url,
        candidate.base_url,
        extra=f"mirror: {{on_client_disconnect: {policy}}}\n",
    )
    gw = await gateway(None, policy_path=write_policy(text))
    left_ns = []
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            resp = await session.post(
                f"{gw.url}/v1/chat/completions", json=chat(stream=True, max_tokens=40)
            )
            assert (await resp.content.readany()).startswith(b": sent_ns=")
            resp.close()  # the client goes away while primary and shadow are streaming
            left_ns.append(time.perf_counter_ns())
        exchanges = await wait_for_exchanges(gw.sink, 3, timeout_s=10)
    assert {e.primary.outcome for e in exchanges} == {"client_disconnected"}
    shadows = [e.shadows[0] for e in exchanges]
    if policy == "finish":
        assert {s.outcome for s in shadows} == {"completed"}
        assert all(s.recording is not None and s.recording.output_tokens == 40 for s in shadows)
    else:
        assert {s.outcome for s in shadows} == {"cancelled"}
        # cancelled after the client left and before its 40 tokens: how soon is the machine's
        # (a 0.3 s bound on the wall clock was one); that it never ran to its end is a count.
        for shadow, left in zip(shadows, left_ns, strict=True):
            assert shadow.end_ns > left
            rec = shadow.recording
            assert rec is None or (rec.output_tokens or 0) < 40, rec
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/admin/shadow") as resp:
        status = await resp.json()
    assert status["in_flight"] == 0 and status["primary_in_flight"] == 0


MIB = 1024 * 1024
CHUNK = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"  # 64 KiB events


async def test_a_slow_reader_throttles_the_upstream_instead_of_filling_the_gateway(
    fake_upstream, gateway, record_property
):
    total_chunks = 1024  # 64 MiB
    fake, up = await fake_upstream(Script(chunks=[(0.0, CHUNK)] * total_chunks))
    gw = await gateway(up)
    async with aiohttp.ClientSession(read_bufsize=64 * 1024) as session:
        resp = await session.post(f"{gw.url}/v1/chat/completions", json=chat(stream=True))
        got = len(await resp.content.readexactly(64 * 1024))
        # The client stops reading. Once the socket buffers on both hops are full, the upstream
        # must stop too; a proxy that buffers would read on to the end of the stream.
        await asyncio.sleep(0.4)
        sent_early = len(fake.sent_ns)
        await asyncio.sleep(0.4)
        sent_late = len(fake.sent_ns)
        async for chunk in resp.content.iter_any():
            got += len(chunk)
        resp.close()
    stalled_mib = sent_late * len(CHUNK) / MIB
    record_property("upstream_sent_while_client_stalled_mib", round(stalled_mib, 2))
    assert got == total_chunks * len(CHUNK)  # then everything arrives
    assert sent_late - sent_early <= 1  # the upstream was held back, not drained
    assert stalled_mib < 48  # kernel socket buffers, not the 64 MiB stream
    exchange = await gw.sink.wait_for()
    assert exchange.primary.outcome == "completed"


@pytest.mark.e2e
async def test_slow_readers_keep_a_real_gateway_process_memory_bounded(
    fake_upstream, record_property
):
    streams, chunks = 4, 1024  # 4 × 64 MiB
    _fake, up = await fake_upstream(Script(chunks=[(0.0, CHUNK)] * chunks))
    async with spawn_gateway(["--primary", up]) as gp:
        async with aiohttp.ClientSession() as session:
            await fetch(session, gp.url, chat(stream=False))  # warm: imports, pools
        baseline_kib = gp.rss_kib()
        peak_kib = baseline_kib
        async with aiohttp.ClientSession(read_bufsize=64 * 1024) as session:
            resps = [
                await session.post(f"{gp.url}/v1/chat/completions", json=chat(stream=True))
                for _ in range(streams)
            ]
            for resp in resps:
                await resp.content.readexactly(64 * 1024)
            for _ in range(10):  # stalled for 1 s: the gateway must not soak up the streams
                await asyncio.sleep(0.1)
                peak_kib = max(peak_kib, gp.rss_kib())
            received = 0
            for resp in resps:
                async for chunk in resp.content.iter_any():
                    received += len(chunk)
                    if received % (8 * MIB) < len(chunk):
                        peak_kib = max(peak_kib, gp.rss_kib())
                resp.close()
    record_property("rss_baseline_mib", round(baseline_kib / 1024, 1))
    record_property(
        "rss_growth_4_slow_64mib_streams_mib", round((peak_kib - baseline_kib) / 1024, 1)
    )
    assert received == streams * (chunks * len(CHUNK) - 64 * 1024)
    assert (peak_kib - baseline_kib) / 1024 < 48, (baseline_kib, peak_kib)


# The latency of a request among 2,000 idle connections is a wall-clock bound: the timing tier.
@pytest.mark.timing
@pytest.mark.e2e
async def test_thousands_of_idle_keep_alive_connections_cost_nothing_and_leak_nothing(
    sims, record_property
):
    sim = await sims()
    async with spawn_gateway(["--primary", sim.base_url]) as gp:
        async with aiohttp.ClientSession() as session:
            await fetch(session, gp.url, chat(stream=True))
        await asyncio.sleep(0.2)
        baseline_fds = gp.open_fds()
        port = int(gp.url.rsplit(":", 1)[1])
        idle: list[asyncio.StreamWriter] = []
        for i in range(2000):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if i % 2 == 0:  # half made a request and kept the connection; half never spoke
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
            idle.append(writer)
        await asyncio.sleep(0.3)
        with_idle_fds = gp.open_fds()
        async with aiohttp.ClientSession() as session:
            started = time.perf_counter()
            reply = await fetch(session, gp.url, chat(stream=True))
            elapsed_s = time.perf_counter() - started
        assert reply.status == 200 and reply.error is None
        assert elapsed_s < 1.0
        for writer in idle:
            writer.close()
        deadline = time.monotonic() + 10
        while gp.open_fds() > baseline_fds + 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        after_fds = gp.open_fds()
        status = await gp.shadow_status()
    record_property("fds", [baseline_fds, with_idle_fds, after_fds])
    record_property("request_latency_with_2000_idle_s", round(elapsed_s, 4))
    assert with_idle_fds >= baseline_fds + 2000
    assert after_fds <= baseline_fds + 10, (baseline_fds, with_idle_fds, after_fds)
    assert status["primary_in_flight"] == 0
