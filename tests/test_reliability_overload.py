"""Back-pressure through real processes.

- Admission: with --max-running 2 --max-waiting 2, requests past the 4 admitted get HTTP 429
  (Retry-After) / gRPC RESOURCE_EXHAUSTED (trailing `retry-after`) at once; all admitted ones
  complete.
- Pool exhaustion: a target whose KV pool holds 20 pages and whose state pool holds 3 sequences,
  and a DFlash draft with a tiny KV pool, under 6 concurrent requests that together need far
  more: Prefill (no state slot), Verify (no pages) and Propose (no draft pages) answer
  RESOURCE_EXHAUSTED; the gateway waits and retries (a Verify gives its pages back and is
  prefilled again), and every request completes with the output it has when run alone."""
from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest
from support.reliability import (
    PROMPTS,
    Streams,
    gauge,
    report,
    request,
    rpc_count,
    start_stack,
    tiny_hybrid,
    wait_for,
)

from dflash.make_draft import make_random_drafter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("reliability_overload")


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_dir):
    return tiny_hybrid(tmp_path_factory, smollm2_dir)


def gateway_load(st) -> tuple[float, float]:
    from support.prom import scrape
    m = scrape(st.gateway.http_port)
    running = sum(v for lb, v in m.get("dflash_requests_running", []) if lb["service"] == "gateway")
    waiting = sum(v for lb, v in m.get("dflash_requests_waiting", []) if lb["service"] == "gateway")
    return running, waiting


def post(url: str, body: dict, out: list, i: int) -> None:
    t0 = time.monotonic()
    with httpx.Client(timeout=120) as c, c.stream("POST", url, json=body) as r:
        text = "".join(r.iter_text())
        out[i] = (r.status_code, dict(r.headers), text, time.monotonic() - t0)


def test_admission_queue_refuses_the_excess_at_once(model, logs):
    st = start_stack(model, logs, "--max-running", "2", "--max-waiting", "2",
                     "--retry-after", "3", drafter="none")
    url = f"{st.gateway.http_url}/v1/completions"
    body = {"model": "m", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    try:
        model_id = httpx.get(f"{st.gateway.http_url}/v1/models").json()["data"][0]["id"]
        body["model"] = model_id
        admitted: list = [None] * 4
        threads = [threading.Thread(target=post, args=(url, {**body, "prompt": PROMPTS[i],
                                                              "stream": i % 2 == 0}, admitted, i))
                   for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: gateway_load(st) == (2, 2), 30, "2 running and 2 waiting")
        excess: list = [None] * 8
        burst = [threading.Thread(target=post, args=(url, {**body, "prompt": PROMPTS[i],
                                                           "stream": i % 2 == 1}, excess, i))
                 for i in range(8)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(30)
        with pytest.raises(grpc.RpcError) as e:
            list(st.gateway.stub.Generate(request("hi", 4), timeout=10))
        for t in threads:
            t.join(120)
        # the excess: 429 at once, with Retry-After and an OpenAI error body
        assert all(r[0] == 429 for r in excess), [r[0] for r in excess]
        assert all(r[1]["retry-after"] == "3" for r in excess)
        errors = [json.loads(r[2])["error"] for r in excess]
        assert all(e_["code"] == "overloaded" and "at capacity" in e_["message"] for e_ in errors)
        slowest_429 = max(r[3] for r in excess)
        assert slowest_429 < 2.0, slowest_429
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(e.value.trailing_metadata())["retry-after"] == "3"
        # the admitted: all complete, in full
        assert all(r[0] == 200 for r in admitted), [r[:1] + r[2:3] for r in admitted]
        for i, r in enumerate(admitted):
            if i % 2 == 0:                 # streamed
                assert r[2].rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in r[2]
            else:
                assert json.loads(r[2])["usage"]["completion_tokens"] == 120
        wait_for(lambda: gateway_load(st) == (0, 0), 10, "gateway queue empty")
        report("overload_admission", max_running=2, max_waiting=2, offered=13, admitted=4,
               completed=4, refused_429=8, refused_grpc=1,
               slowest_429_ms=round(slowest_429 * 1000), lost=0)
    finally:
        st.stop()


# 3 state slots; 20 usable KV pages of 16 tokens (8 KiB each) after the state pool (3 x 188928 B);
# no prefix-cache state checkpoints (they would take budget from the pages counted here)
POOL_TARGET = ("--max-block-size", "8", "--state-slots", "3", "--prefix-state-checkpoints", "0",
               "--kv-budget", str(3 * 188928 + 21 * 8192))
N = 150


def test_pool_exhaustion_waits_and_retries_never_drops(model, logs, tmp_path):
    dflash = make_random_drafter(model, tmp_path / "dflash", block_size=8)
    st = start_stack(model, logs, "--pool-wait", "120", "--backoff-max", "1", drafter="dflash",
                     draft_model=dflash, target_flags=POOL_TARGET,
                     draft_flags=("--kv-budget", "64KiB"))   # ~15 pages: 240 tokens
    prompts = PROMPTS[:6]
    try:
        alone = []
        for p in prompts:                       # one at a time: everything fits
            r = Streams(st.gateway.stub, [request(p, N)]).start().join()[0]
            assert r.error is None
            alone.append(r.tokens)
        assert rpc_count(st.target_metrics, "Prefill", "RESOURCE_EXHAUSTED") == 0
        assert rpc_count(st.target_metrics, "Verify", "RESOURCE_EXHAUSTED") == 0
        t0 = time.monotonic()
        results = Streams(st.gateway.stub, [request(p, N) for p in prompts]).start().join(300)
        seconds = time.monotonic() - t0
        errors = [r.error for r in results if r.error is not None]
        assert not errors, errors[0]
        assert [r.tokens for r in results] == alone
        prefill_full = rpc_count(st.target_metrics, "Prefill", "RESOURCE_EXHAUSTED")
        verify_full = rpc_count(st.target_metrics, "Verify", "RESOURCE_EXHAUSTED")
        propose_full = rpc_count(st.draft_metrics, "Propose", "RESOURCE_EXHAUSTED")
        assert prefill_full > 0 and verify_full > 0 and propose_full > 0
        preempted = st.gateway.log().count("target pools full: sequence released")
        assert preempted >= verify_full
        wait_for(lambda: gauge(st.target_metrics, "dflash_kv_cache_usage_ratio") == 0
                 and gauge(st.target_metrics, "dflash_state_pool_usage_ratio") == 0, 15,
                 "target pools empty")
        report("overload_pools", requests=6, tokens_each=N, kv_pages=20, state_slots=3,
               prefill_exhausted=int(prefill_full), verify_exhausted=int(verify_full),
               propose_exhausted=int(propose_full), preemptions=preempted, completed=6,
               identical_to_alone=6, dropped=0, seconds=round(seconds, 1))
    finally:
        st.stop()
