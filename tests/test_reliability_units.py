"""Units of the reliability and security plumbing (no processes): the admission queue, backoff,
API keys, the body-size limit, the TLS configuration checks and the guard's decode fallback."""
from __future__ import annotations

import asyncio
import time

import pytest

from dflash.v1 import target_pb2
from gateway.admission import Admission, Overloaded
from gateway.auth import ApiKeys, load_keys
from gateway.backoff import Backoff
from gateway.body_limit import BodyLimitMiddleware
from services.common.guard import Undecodable, _safe_deserializer
from services.common.tls import ClientTls, ServerTls, TlsConfigError


def test_admission_bounds_running_and_waiting():
    async def main():
        seen = []
        a = Admission(2, 1, 2.5, lambda r, w: seen.append((r, w)))
        tickets = [a.reserve() for _ in range(3)]
        with pytest.raises(Overloaded) as e:
            a.reserve()
        assert e.value.retry_after == "3" and "at most 2" in str(e.value) and a.refused == 1
        await tickets[0].run()
        await tickets[1].run()
        third = asyncio.create_task(tickets[2].run())
        await asyncio.sleep(0.01)
        assert not third.done() and (a.running, a.waiting) == (2, 1)
        tickets[0].close()
        await asyncio.wait_for(third, 1)
        assert (a.running, a.waiting) == (2, 0)
        for t in tickets:
            t.close()
            t.close()                                   # idempotent
        assert (a.running, a.waiting, a.active) == (0, 0, 0) and seen[-1] == (0, 0)
    asyncio.run(main())


def test_a_ticket_closed_while_waiting_gives_its_place_back():
    async def main():
        a = Admission(1, 1, 1.0)
        first, second = a.reserve(), a.reserve()
        await first.run()
        waiter = asyncio.create_task(second.run())
        await asyncio.sleep(0.01)
        waiter.cancel()                                  # the client went away while queued
        await asyncio.gather(waiter, return_exceptions=True)
        second.close()
        first.close()
        assert a.active == 0
        third = a.reserve()
        await asyncio.wait_for(third.run(), 1)           # the slot was not lost
        third.close()
    asyncio.run(main())


def test_backoff_doubles_and_stops_at_the_deadline():
    async def main():
        b = Backoff(0.01, 0.04, deadline_s=0.15)
        t0 = time.monotonic()
        n = 0
        while await b.wait():
            n += 1
        assert 2 <= n <= 12 and time.monotonic() - t0 < 0.5 and b.next_s == 0.04
    asyncio.run(main())


def test_api_keys():
    keys = ApiKeys(["k" * 20, "j" * 20])
    assert keys.check("Bearer " + "k" * 20) is None and keys.check("bearer " + "j" * 20) is None
    assert "required" in keys.check(None) and "Bearer scheme" in keys.check("k" * 20)
    assert "not valid" in keys.check("Bearer " + "x" * 20) and keys.rejected == 3
    assert ApiKeys([]).check(None) is None                # no keys: open


def test_load_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n\n" + "a" * 16 + "\n")
    assert load_keys("b" * 16 + ", ", str(f)) == ("b" * 16, "a" * 16)
    with pytest.raises(ValueError, match="shorter than 16"):
        load_keys("short", "")
    with pytest.raises(ValueError, match="cannot be read"):
        load_keys("", str(tmp_path / "missing"))


def test_body_limit_refuses_declared_and_streamed_bodies():
    async def app(scope, receive, send):
        msg = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": msg["body"]})

    async def call(chunks: list[bytes], declared: int | None):
        sent = []
        queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                 for i, c in enumerate(chunks)]

        async def receive():
            return queue.pop(0) if queue else {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)
        headers = [(b"content-length", str(declared).encode())] if declared is not None else []
        await BodyLimitMiddleware(app, 10)({"type": "http", "headers": headers}, receive, send)
        return sent[0]["status"], sent[1]["body"], queue

    assert asyncio.run(call([b"0123456789"], 10))[:2] == (200, b"0123456789")
    status, body, left = asyncio.run(call([b"01234", b"56789", b"x"], None))
    assert status == 413 and b"at most 10" in body and not left      # read to the end first
    assert asyncio.run(call([b"0" * 11], 11))[0] == 413


def test_tls_config_checks(tmp_path):
    with pytest.raises(TlsConfigError, match="go together"):
        ServerTls(cert="c.pem")
    with pytest.raises(TlsConfigError, match="needs --tls-cert"):
        ServerTls(client_ca="ca.pem")
    with pytest.raises(TlsConfigError, match="needs --upstream-ca"):
        ClientTls(cert="c.pem", key="k.pem")
    bad = tmp_path / "x.pem"
    bad.write_text("not a certificate")
    with pytest.raises(TlsConfigError, match="not a PEM"):
        ServerTls(cert=str(bad), key=str(bad)).credentials()
    with pytest.raises(TlsConfigError, match="cannot be read"):
        ClientTls(ca=str(tmp_path / "missing.pem")).credentials()
    assert not ServerTls().enabled and not ClientTls().enabled


def test_guard_turns_undecodable_bytes_into_a_marker():
    parse = _safe_deserializer(target_pb2.PrefillRequest.FromString, "dflash.v1.PrefillRequest")
    assert isinstance(parse(b"\x0a\xff\xff"), Undecodable)
    assert parse(target_pb2.PrefillRequest(sequence_id="s").SerializeToString()).sequence_id == "s"
