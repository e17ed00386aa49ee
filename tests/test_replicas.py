"""Replicas behind one gateway (issue 37, part 1): several target and draft addresses, placement
at admission on the least-loaded usable replica, requests moved off a replica that dies, drains
or leaves the list through the rebuild path, replicas found at run time (dns: and file:).

Unit tests read the parts (address parsing, resolution, placement, the identity check); the
stack tests run real processes: two tiny-Llama targets and two random DFlash drafts behind one
gateway (`--target A,B --draft C,D`)."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
from support.draft_service import start_draft
from support.gateway_stack import start_gateway, wait_until
from support.procs import free_port, start_target
from support.prom import scrape
from support.reliability import Streams, gauge, request, rpc_count
from support.target_client import greedy_alone

from dflash.make_draft import make_random_drafter
from dflash.v1 import common_pb2, target_pb2
from gateway import compat
from gateway.config import GatewayConfig
from gateway.replicas import ResolveError, Source, parse_sources, resolve
from gateway.state import _least_loaded

PROMPTS = [list(range(5 + i, 37 + 2 * i)) for i in range(16)]
TOKENS = 32
LEASE_S = 4


# -- units ----------------------------------------------------------------------------------------
def test_address_forms_parse_and_bad_ones_name_the_entry():
    assert parse_sources("a:1, dns:///svc.ns:50051,file:/tmp/x,dns:h:2", "--target") == [
        Source("static", "a:1"), Source("dns", "svc.ns:50051"), Source("file", "/tmp/x"),
        Source("dns", "h:2")]
    assert parse_sources("[::1]:5", "--draft") == [Source("static", "[::1]:5")]
    for bad in ("a:1,nohost", "a:0", "dns:name", "file:", " , "):
        with pytest.raises(ValueError) as e:
            parse_sources(bad, "--target")
        assert "--target" in str(e.value) and ("HOST:PORT" in str(e.value)
                                               or "file:" in str(e.value))
    with pytest.raises(ValueError, match="entry 'x:y'"):
        GatewayConfig(target="a:1,x:y", tokenizer_dir="t")


def test_dns_and_file_sources_resolve(tmp_path):
    async def run():
        assert "127.0.0.1:7" in await resolve(Source("dns", "localhost:7"))
        with pytest.raises(ResolveError, match="does not resolve"):
            await resolve(Source("dns", "no-such-host.invalid:7"))
        listing = tmp_path / "targets"
        listing.write_text("# replicas\n10.0.0.1:5  # one\n\n10.0.0.2:5\n")
        assert await resolve(Source("file", str(listing))) == ["10.0.0.1:5", "10.0.0.2:5"]
        listing.write_text("10.0.0.1\n")
        with pytest.raises(ResolveError, match="line 1"):
            await resolve(Source("file", str(listing)))
        with pytest.raises(ResolveError, match="cannot be read"):
            await resolve(Source("file", str(tmp_path / "none")))
    asyncio.run(run())


class _Replica:
    """What placement reads of an Upstream."""

    def __init__(self, address: str, placed: int = 0, sequences: int | None = None,
                 kv_usage: float = 0.0) -> None:
        self.address, self.placed = address, placed
        self.load = (common_pb2.EngineLoad(sequences=sequences, kv_usage=kv_usage)
                     if sequences is not None else None)
        self.load_age_s = 0.0
        self.placed_at_load = placed


def test_placement_takes_the_least_loaded_then_a_stable_prompt_hash():
    a, b = _Replica("a:1", placed=3), _Replica("b:1", placed=1)
    assert _least_loaded([a, b], [1, 2, 3]) is b
    # another gateway's sequences count once the replica reports them
    b.load = common_pb2.EngineLoad(sequences=9)
    assert _least_loaded([a, b], [1, 2, 3]) is a
    b.load_age_s = 60.0                                    # a stale report does not
    assert _least_loaded([a, b], [1, 2, 3]) is b
    # equal loads: KV usage, then the prompt's head decides, the same way every time
    c, d = _Replica("c:1", sequences=2, kv_usage=0.5), _Replica("d:1", sequences=2, kv_usage=0.1)
    assert _least_loaded([c, d], [7]) is d
    e, f = _Replica("e:1"), _Replica("f:1")
    picks = {_least_loaded([e, f], [i, 1, 2]).address for i in range(40)}
    assert picks == {"e:1", "f:1"}                         # different prompts spread
    assert all(_least_loaded([e, f], [5, 1, 2]) is _least_loaded([f, e], [5, 1, 2])
               for _ in range(3))                          # one prompt sticks
    assert _least_loaded([], [1]) is None
    # a report from before this gateway's requests ended counts them no longer
    g, h = _Replica("g:1", placed=3, sequences=3), _Replica("h:1", placed=1, sequences=1)
    g.placed = 0                                            # its three ended since the report
    assert _least_loaded([g, h], [1]) is g
    g.placed_at_load, g.load.sequences = 0, 5               # five of another gateway's
    assert _least_loaded([g, h], [1]) is h


def test_replicas_must_agree_on_what_a_moved_request_needs():
    a = target_pb2.TargetCapabilities(model_id="m", vocab_size=10, max_context=64,
                                      eos_token_ids=[2])
    b = target_pb2.TargetCapabilities()
    b.CopyFrom(a)
    assert compat.replica_differs(a, b, compat.TARGET_IDENTITY) == ""
    b.model_id, b.eos_token_ids[:] = "other", [3]
    why = compat.replica_differs(a, b, compat.TARGET_IDENTITY)
    assert "model_id 'other' (the others: 'm')" in why and "eos_token_ids [3]" in why


# -- the stack ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_llama_02_dir, smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    drafter = make_random_drafter(tiny_llama_02_dir, logs / "drafter", block_size=4)
    targets, drafts = [], []
    for _ in range(2):
        port = free_port()
        t = start_target(tiny_llama_02_dir, logs, "--metrics-port", str(port),
                         "--lease-seconds", str(LEASE_S), "--drain-grace", "60")
        t.metrics_port = port
        targets.append(t)
        port = free_port()
        d = start_draft(tiny_llama_02_dir, logs, "--metrics-port", str(port),
                        "--lease-seconds", str(LEASE_S), "--drain-grace", "60",
                        model_dir=drafter)
        d.metrics_port = port
        drafts.append(d)
    gw = start_gateway(",".join(t.address for t in targets), smollm2_dir, logs,
                       "--speculation", "fixed",
                       draft=",".join(d.address for d in drafts))
    yield targets, drafts, gw, logs
    for p in (gw, *drafts, *targets):
        p.stop()


def _streams(gw, prompts, tokens: int) -> Streams:
    """Greedy streams of the prompts, all at once (support/reliability.py)."""
    return Streams(gw.stub, [request(p, tokens) for p in prompts]).start()


def _tokens(streams: Streams, timeout: float = 300) -> list:
    """Each stream's tokens once all ended (a failed one: its error)."""
    return [r.error or r.tokens for r in streams.join(timeout)]


def _held(service) -> float:
    return gauge(service.metrics_port, "dflash_sequences_active")


def _replicas(gw, role: str, state: str) -> float:
    return sum(v for lb, v in scrape(gw.http_port).get("dflash_gateway_replicas", [])
               if lb.get("role") == role and lb.get("state") == state)


@pytest.mark.slow
def test_streams_spread_over_the_replicas_and_equal_the_target_alone(stack):
    targets, drafts, gw, _ = stack
    expected = [greedy_alone(targets[0].address, p, TOKENS) for p in PROMPTS]
    before = [rpc_count(t.metrics_port, "Prefill", "OK") for t in targets]
    assert _tokens(_streams(gw, PROMPTS, TOKENS)) == expected
    placed = [rpc_count(t.metrics_port, "Prefill", "OK") - b for t, b in zip(targets, before)]
    assert min(placed) >= 4, placed          # 16 requests at once: both replicas take a share
    proposed = [rpc_count(d.metrics_port, "Propose", "OK") for d in drafts]
    assert min(proposed) > 0, proposed
    assert _replicas(gw, "target", "usable") == 2 and _replicas(gw, "draft", "usable") == 2
    for s in (*targets, *drafts):
        wait_until(lambda s=s: _held(s) == 0, timeout=10, what="no sequence held")


@pytest.mark.slow
def test_a_replica_added_to_a_file_list_takes_new_requests(stack, smollm2_dir, tmp_path):
    targets, drafts, _, logs = stack
    listing = tmp_path / "targets.txt"
    listing.write_text(f"{targets[0].address}\n")
    gw = start_gateway(f"file:{listing}", smollm2_dir, logs, "--resolve-interval", "0.3",
                       "--speculation", "fixed", draft=drafts[0].address)
    try:
        assert _replicas(gw, "target", "usable") == 1
        listing.write_text(f"{targets[0].address}\n{targets[1].address}  # added\n")
        wait_until(lambda: _replicas(gw, "target", "usable") == 2, timeout=20,
                   what="the added replica usable")
        before = rpc_count(targets[1].metrics_port, "Prefill", "OK")
        expected = [greedy_alone(targets[0].address, p, 12) for p in PROMPTS[:6]]
        assert _tokens(_streams(gw, PROMPTS[:6], 12), 120) == expected
        assert rpc_count(targets[1].metrics_port, "Prefill", "OK") - before >= 2
        # one removed from the list while streams run on both: its streams move
        long = [greedy_alone(targets[0].address, p, 80) for p in PROMPTS[:4]]
        streams = _streams(gw, PROMPTS[:4], 80)
        streams.wait_tokens(4)
        assert _held(targets[0]) > 0 and _held(targets[1]) > 0, "placed on one replica only"
        listing.write_text(f"{targets[1].address}\n")
        assert _tokens(streams, 120) == long
        assert _replicas(gw, "target", "usable") == 1
        assert f"(from {targets[0].address}: removed from the replica list)" in gw.log()
    finally:
        gw.stop()


@pytest.mark.slow
def test_bad_replicas_are_kept_out_and_the_rest_serves(stack, smollm2_dir, tiny_qwen3_dir,
                                                       tmp_path):
    targets, drafts, _, logs = stack
    silent = f"127.0.0.1:{free_port()}"                    # an address that never answers
    listing = tmp_path / "targets.txt"
    listing.write_text(f"{silent}\n{targets[0].address}\n")
    port = targets[1].address.rsplit(":", 1)[1]            # and one found by its name
    gw = start_gateway(f"file:{listing},dns:no-such-host.invalid:1,dns:localhost:{port}",
                       smollm2_dir, logs,
                       "--resolve-interval", "0.3", "--speculation", "fixed",
                       draft=drafts[0].address)
    other = start_target(tiny_qwen3_dir, logs)             # a replica of another model joins
    try:
        listing.write_text(f"{silent}\n{targets[0].address}\n{other.address}\n")
        wait_until(lambda: _replicas(gw, "target", "kept_out") == 1, timeout=30,
                   what="the other model's replica kept out")
        expected = [greedy_alone(targets[0].address, p, 12) for p in PROMPTS[:4]]
        assert _tokens(_streams(gw, PROMPTS[:4], 12), 120) == expected
        assert _replicas(gw, "target", "usable") == 2          # (localhost may add ::1: down)
        assert _replicas(gw, "target", "down") >= 1
        log = gw.log()
        assert f"target replica {other.address} kept out: it differs from the other target " \
               f"replicas: model_id" in log, log[-3000:]
        assert "dns:no-such-host.invalid:1 does not resolve" in log
    finally:
        gw.stop()
        other.stop()


@pytest.mark.slow
def test_a_killed_target_a_drained_draft_and_a_drained_target_lose_no_stream(stack):
    targets, drafts, gw, _ = stack
    tokens = 160
    expected = [greedy_alone(targets[0].address, p, tokens) for p in PROMPTS]
    streams = _streams(gw, PROMPTS, tokens)
    streams.wait_tokens(4, 120)
    os.kill(targets[0].proc.pid, signal.SIGKILL)           # one target dies ...
    targets[0].proc.wait(10)
    drafts[1].proc.send_signal(signal.SIGTERM)             # ... and one draft drains
    assert _tokens(streams) == expected
    assert drafts[1].proc.wait(60) == 0                    # it drained: its requests moved
    for s in (targets[1], drafts[0]):
        wait_until(lambda s=s: _held(s) == 0, timeout=10, what="no sequence held")

    # the dead target comes back on its address; then the other one drains mid-stream
    targets[0].start().wait_serving()
    wait_until(lambda: _replicas(gw, "target", "usable") == 2, timeout=30,
               what="the restarted target usable")
    streams = _streams(gw, PROMPTS[:8], tokens)
    streams.wait_tokens(4, 120)
    targets[1].proc.send_signal(signal.SIGTERM)
    assert _tokens(streams) == expected[:8]
    assert targets[1].proc.wait(60) == 0
    wait_until(lambda: _held(targets[0]) == 0, timeout=10, what="no sequence held")


# -- the gateway's view of its replicas (no processes: capabilities set by hand) ------------------
def _caps(model: str, tokenizer_hash: str) -> target_pb2.TargetCapabilities:
    return target_pb2.TargetCapabilities(protocol_version=compat.PROTOCOL_VERSION, model_id=model,
                                         vocab_size=100, max_context=64, max_block_size=4,
                                         tokenizer_hash=tokenizer_hash)


def test_the_first_usable_identity_sticks_and_requests_move_only_to_usable_replicas(smollm2_dir):
    from gateway.state import GatewayState

    async def run():
        state = GatewayState(GatewayConfig(target="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
                                           tokenizer_dir=str(smollm2_dir)))
        a, b, c = state.targets
        h = state.tokenizer_hash

        def serve(up, caps):
            up.serving, up.capabilities = caps is not None, caps
            state._recompute()

        serve(b, _caps("m", h))                             # b first: its model is the role's
        serve(a, _caps("other", h))
        serve(c, _caps("m", h))
        assert (a.usable, b.usable, c.usable) == (False, True, True) and state.ready
        assert state.target is b
        route = state.place([1, 2, 3])
        assert route.target in (b, c) and route.target.placed == 1
        assert state.target_for(route) is None              # its replica is fine: it stays
        serve(route.target, None)                           # it goes down: another usable one
        other = ({b, c} - {route.target}).pop()
        assert state.target_for(route) is other
        serve(other, None)          # none of its model left: the other model's takes over for
        assert a.usable and state.ready and state.target_caps.model_id == "other"  # new requests
        assert state.target_for(route) is None      # but this request may not move there
        assert state.place([1]).target is a
        serve(a, None)                              # all down: the identity stays
        assert not state.ready and state.target_caps.model_id == "other"
        serve(b, _caps("m", h))                     # m back, alone: the role's again, and the
        assert b.usable and state.target_caps.model_id == "m"   # request may go on there
        assert state.target_for(route) is (None if route.target is b else b)
        route.close()
        assert route.target.placed == 0
        await state.close()
    asyncio.run(run())
