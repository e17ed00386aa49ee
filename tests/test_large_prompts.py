"""Large prompts do not freeze the gateway (issue 39, hole 3).

Before: a 7.8 MB prompt (under the 8 MiB body limit) was tokenized on the event loop for 4-6 s
before its 400; three in a row stalled every other stream for 17.7 s and /health for up to 6 s.
Now a text that cannot fit is refused before tokenizing (gateway/prompts.py), and what is
tokenized is tokenized on a worker thread with the GIL released. Measured here (SmolLM2 fp32,
autoregressive): while 3 prompts of 7.8 MB and 3 of 600 kB (just under the bound, so they are
tokenized: about 0.3 s each, then refused for the context) arrive, another stream keeps getting
its tokens with no gap over 1.5 s, and /health answers within 1 s every time (measured on an
Intel Xeon, 2 cores: 0.28 s and 0.23 s; with the code before, 14.5 s and 14.4 s)."""
from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest
from support.reliability import request, start_stack

from dflash.v1 import gateway_pb2

pytestmark = pytest.mark.slow

MAX_GAP_S = 1.5          # measured 0.28 s (Intel Xeon, 2 cores); 14.5 s before the change
MAX_HEALTH_S = 1.0       # measured 0.23 s; 14.4 s before


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    st = start_stack(smollm2_dir, tmp_path_factory.mktemp("large_prompts"), drafter="none")
    yield st
    st.stop()


def test_large_prompts_do_not_stall_other_streams_or_health(stack):
    gw = stack.gateway
    url = gw.http_url
    with httpx.Client(base_url=url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        arrivals: list[float] = []

        def stream():
            for msg in gw.stub.Generate(request("Tell me a long story.", 120), timeout=600):
                arrivals.extend([time.monotonic()] * len(msg.token_ids))
        streamer = threading.Thread(target=stream)
        streamer.start()
        while len(arrivals) < 5:
            time.sleep(0.01)
        answers: list[tuple[int, str, float]] = []

        def big(chars: int):
            t0 = time.monotonic()
            with httpx.Client(base_url=url, timeout=120) as c:
                r = c.post("/v1/completions", json={"model": model, "max_tokens": 4,
                                                    "prompt": "word " * (chars // 5)})
            answers.append((r.status_code, r.json()["error"]["message"], time.monotonic() - t0))
        senders = [threading.Thread(target=big, args=(n,)) for n in [7_800_000] * 3 + [600_000] * 3]
        health: list[float] = []
        burst_start = time.monotonic()
        for s in senders:
            s.start()
        while any(s.is_alive() for s in senders):
            t0 = time.monotonic()
            assert client.get("/health").status_code == 200
            health.append(time.monotonic() - t0)
            time.sleep(0.05)
        burst_end = time.monotonic()
        streamer.join(600)
    assert len(answers) == 6 and all(code == 400 for code, _, _ in answers), answers
    assert sum("cannot fit" in m for _, m, _ in answers) >= 3          # the 7.8 MB ones at once
    assert sum("context holds" in m for _, m, _ in answers) >= 3       # tokenized, then refused
    assert max(health) < MAX_HEALTH_S, max(health)
    during = [b - a for a, b in itertools.pairwise(arrivals) if burst_start <= b <= burst_end + 1]
    assert len(arrivals) == 120
    assert max(during, default=0) < MAX_GAP_S, max(during)
    # and the gateway serves the next request normally
    tokens = list(gw.stub.Generate(gateway_pb2.GenerateRequest(
        text="Hello", max_tokens=4, ignore_eos=True), timeout=120))
    assert sum(len(m.token_ids) for m in tokens) == 4
