"""A bounded soak (DFLASH_SOAK_SECONDS, default 100): 32 concurrent clients against the tiny
hybrid stack with a DFlash draft (random weights), mixing streamed and whole requests over
HTTP and gRPC, random cancellations (clients that hang up mid-stream, client timeouts) and
about 20% bad requests of 11 kinds.

Passes when: no 5xx and no unexpected answer at all; greedy requests under load equal the
reference taken before; at the end KV pages, state slots and sequences are back to zero on the
target and the draft and the gateway's queue is empty; the resident memory (VmRSS) of each
process at the end is within RSS_MARGIN of its value after the warm-up (the first third)."""
from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
from support.prom import scrape
from support.reliability import (
    Streams,
    gauge,
    request,
    rss_mib,
    start_stack,
    tiny_hybrid,
    wait_for,
)
from support.soak import REF_TOKENS, WORDS, Load, Target

from dflash.make_draft import make_random_drafter

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("DFLASH_SOAK_SECONDS", "100"))
WORKERS = 32
RSS_MARGIN = (0.10, 48.0)          # growth allowed: 10% of the post-warm-up RSS + 48 MiB


def rss_allowed(base: float) -> float:
    return base * (1 + RSS_MARGIN[0]) + RSS_MARGIN[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_dir):
    model = tiny_hybrid(tmp_path_factory, smollm2_dir)
    dflash = make_random_drafter(model, tmp_path_factory.mktemp("dflash"), block_size=8)
    st = start_stack(model, tmp_path_factory.mktemp("soak"), "--max-request-bytes", "512KiB",
                     drafter="dflash", draft_model=dflash)
    yield st
    st.stop()


def handed_back(stack, service: str, port: int, gauges: tuple[str, ...],
                timeout: float = 30) -> None:
    """Waits for the usage gauges on a service's metrics port to reach zero; on failure says what
    its RPCs and the gateway's upstream calls ended with (the evidence a leak leaves)."""
    try:
        wait_for(lambda: all(gauge(port, m) == 0 for m in gauges), timeout,
                 f"{service} usage at zero")
    except TimeoutError as e:
        usage = {m: gauge(port, m) for m in gauges}
        rpcs = {f"{lb.get('method')}/{lb.get('code')}": v
                for lb, v in scrape(port).get("dflash_rpc_requests_total", [])}
        upstream = {f"{lb.get('upstream')}/{lb.get('code')}": v
                    for lb, v in scrape(stack.gateway.http_port).get(
                        "dflash_upstream_errors_total", [])}
        raise AssertionError(f"{e}: usage {usage}; {service} RPCs {rpcs}; gateway upstream "
                             f"errors {upstream}") from None


def test_soak(stack):
    gw = stack.gateway
    model = httpx.get(f"{gw.http_url}/v1/models").json()["data"][0]["id"]
    prompts = [" ".join(WORDS[i:i + 8]) for i in range(0, 24, 6)]
    ref = Streams(gw.stub, [request(p, REF_TOKENS) for p in prompts]).start().join()
    reference = {p: r.tokens for p, r in zip(prompts, ref)}
    procs = {"gateway": gw, "target": stack.target, "draft": stack.draft}
    load = Load(Target(gw.http_url, gw.address, model, reference))
    warm = {}

    async def run():
        task = asyncio.create_task(load.run(WORKERS, SECONDS))
        await asyncio.sleep(SECONDS / 3)
        warm.update({name: rss_mib(p.proc.pid) for name, p in procs.items()})
        return await task

    t0 = time.monotonic()
    out = asyncio.run(run())
    seconds = time.monotonic() - t0
    # everything handed back
    handed_back(stack, "target", stack.target_metrics, (
        "dflash_kv_cache_usage_ratio", "dflash_state_pool_usage_ratio",
        "dflash_feature_plane_usage_ratio", "dflash_sequences_active"))
    handed_back(stack, "draft", stack.draft_metrics,
                ("dflash_kv_cache_usage_ratio", "dflash_sequences_active"))
    gw_metrics = scrape(gw.http_port)
    queue = sum(v for lb, v in gw_metrics.get("dflash_requests_running", []) +
                gw_metrics.get("dflash_requests_waiting", []) if lb.get("service") == "gateway")
    end = {name: rss_mib(p.proc.pid) for name, p in procs.items()}
    bad = sum(n for (kind, _), n in out.counts.items() if kind.startswith("bad:"))
    cancelled = out.total("cancelled")
    print(f"\nRELIABILITY soak seconds={seconds:.0f} workers={WORKERS} "
          f"requests={sum(out.counts.values())} completed={out.total('completed')} "
          f"cancelled={cancelled} bad_inputs={bad} greedy_checks={out.total('identical')} "
          f"tokens_streamed_grpc={out.tokens} statuses={dict(out.statuses)} "
          f"violations={len(out.violations)} "
          f"rss_warm_mib={ {k: round(v) for k, v in warm.items()} } "
          f"rss_end_mib={ {k: round(v) for k, v in end.items()} }")
    print("RELIABILITY soak_outcomes " + " ".join(f"{k}/{o}={n}" for (k, o), n in
                                                   sorted(out.counts.items())))
    assert not out.violations, out.violations[:10]
    assert not out.mismatches
    assert not any(s.startswith("5") for s in out.statuses)
    assert queue == 0
    assert cancelled > 10 and bad > 10 and out.total("completed") > 50
    for name in procs:
        assert end[name] <= rss_allowed(warm[name]), (name, warm[name], end[name])
