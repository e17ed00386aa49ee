"""Property-based fuzzing (hypothesis) of the gateway, through a real stack (tiny hybrid target,
prompt-lookup draft, gateway):

- gRPC Generate and GetModelInfo: arbitrary, field-mutated and byte-mutated requests; every
  answer is a defined status (never UNKNOWN or INTERNAL);
- HTTP /v1/completions and /v1/chat/completions: arbitrary JSON, valid bodies with fields
  replaced by arbitrary JSON (known and unknown names), and raw bytes; every answer is one of
  200 / 400 / 404 / 413 / 429 / 503 with OpenAI's error body (never a 500), and a 200 stream
  never carries an error object;
- after every example, the next unrelated request on the same channel or connection is served
  (a 500 used to reset the connection and fail the client's next request).

--max-tokens-limit 16 keeps each valid example short. Fixed budget: EXAMPLES per kind."""
from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzz import (
    DEFINED,
    JSON,
    Tally,
    byte_mutation,
    call_raw,
    dumps,
    field_mutation,
    fuzz_settings,
    internal_errors,
    message,
)
from support.procs import health_status
from support.reliability import gauge, start_stack, tiny_hybrid, wait_for

from dflash.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow

EXAMPLES = 120                        # per (method or endpoint, kind)
KINDS = ("arbitrary", "mutated-fields", "mutated-bytes")
HTTP_OK = {200, 400, 404, 413, 429, 503}
TALLY = Tally()
TOKEN_IDS = st.lists(st.one_of(st.integers(1000, 1015), st.integers(0, 2**32 - 1)), max_size=40)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_dir):
    model = tiny_hybrid(tmp_path_factory, smollm2_dir)
    st_ = start_stack(model, tmp_path_factory.mktemp("fuzz_gateway"), "--max-tokens-limit", "16",
                      "--max-request-bytes", "256KiB")
    t0 = time.monotonic()
    yield st_
    print(f"\nRELIABILITY fuzz_gateway inputs={TALLY.total} seconds={time.monotonic() - t0:.0f} "
          f"answers={TALLY.summary()}")
    codes = st_.stop()
    assert codes["gateway"] == 0


@pytest.fixture(scope="module")
def model_id(stack) -> str:
    return httpx.get(f"{stack.gateway.http_url}/v1/models").json()["data"][0]["id"]


def assert_healthy(stack) -> None:
    gw = stack.gateway
    assert gw.proc.poll() is None and health_status(gw.address, "dflash.v1.Gateway") == 1
    for p in (stack.target, stack.draft):
        assert not internal_errors(p.log()), p.log()[-3000:]
    assert not internal_errors(gw.log()), gw.log()[-3000:]


# -- gRPC ------------------------------------------------------------------------------------------
GENERATE = gateway_pb2.GenerateRequest(
    text="The cat sat on the mat.", max_tokens=8, stop=["mat"], block_size=4,
    sampling=common_pb2.SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=7,
                                       min_tokens=2))
GRPC_VALID = {"Generate": GENERATE, "GetModelInfo": gateway_pb2.GetModelInfoRequest()}


def grpc_strategy(kind: str, valid) -> st.SearchStrategy:
    hints = {"ids": st.one_of(st.integers(1000, 1015), st.integers(0, 2**32 - 1))}
    if kind == "arbitrary":
        return message(type(valid).DESCRIPTOR, type(valid), hints)
    if kind == "mutated-fields":
        return field_mutation(valid, hints)
    return byte_mutation(valid.SerializeToString())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", list(GRPC_VALID))
def test_fuzz_gateway_grpc(stack, method, kind):
    path = f"/dflash.v1.Gateway/{method}"
    streaming = method == "Generate"
    with grpc.insecure_channel(stack.gateway.address) as ch:
        assert call_raw(ch, path, GRPC_VALID[method].SerializeToString(), streaming) == \
            grpc.StatusCode.OK

        @fuzz_settings(EXAMPLES)
        @given(grpc_strategy(kind, GRPC_VALID[method]))
        def run(x):
            data = x if isinstance(x, bytes) else x.SerializeToString()
            code = call_raw(ch, path, data, streaming)
            TALLY.record(method, code)
            assert code in DEFINED, f"{method} answered {code.name} to {x!r:.300}"
            # and the next, unrelated request on the same channel is served (issue 39)
            info = GRPC_VALID["GetModelInfo"].SerializeToString()
            assert call_raw(ch, "/dflash.v1.Gateway/GetModelInfo", info, False) == \
                grpc.StatusCode.OK, f"not served after {x!r:.300}"

        run()
    assert_healthy(stack)


# -- HTTP ------------------------------------------------------------------------------------------
COMPLETION = {"prompt": "The cat sat on the", "max_tokens": 6, "temperature": 0.5, "seed": 1,
              "stop": ["\n"], "stream": False}
CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hello there"}],
        "max_completion_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "n", "seed", "stop", "stream", "stream_options", "min_tokens",
          "ignore_eos", "stop_token_ids", "skip_special_tokens", "logit_bias", "logprobs",
          "echo", "suffix", "best_of", "tools", "response_format", "user", "metadata"]


def http_strategy(kind: str, base: dict) -> st.SearchStrategy[bytes]:
    if kind == "arbitrary":
        return JSON.map(dumps)
    if kind == "mutated-bytes":
        return byte_mutation(dumps(base))

    @st.composite
    def mutate(draw) -> bytes:
        body = dict(base)
        for name in draw(st.lists(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)),
                                  min_size=1, max_size=3)):
            if draw(st.booleans()):
                body.pop(name, None)
            else:
                body[name] = draw(st.one_of(JSON, TOKEN_IDS))
        return dumps(body)
    return mutate()


def check_http(r: httpx.Response, text: str) -> None:
    assert r.status_code in HTTP_OK, (r.status_code, text[:500])
    if r.status_code != 200:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert '"error"' not in text and text.rstrip().endswith("data: [DONE]"), text[-500:]
    else:
        assert json.loads(text)["choices"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_fuzz_gateway_http(stack, model_id, endpoint, kind):
    base = {"model": model_id, **(COMPLETION if endpoint == "completions" else CHAT)}
    url = f"{stack.gateway.http_url}/v1/{endpoint}"
    with httpx.Client(timeout=60, headers={"content-type": "application/json"}) as client:
        with client.stream("POST", url, content=dumps(base)) as r:
            check_http(r, "".join(r.iter_text()))
            assert r.status_code == 200

        @fuzz_settings(EXAMPLES)
        @given(http_strategy(kind, base))
        def run(body: bytes):
            with client.stream("POST", url, content=body) as r:
                text = "".join(r.iter_text())
            TALLY.record(f"POST /v1/{endpoint}", r.status_code)
            check_http(r, text)
            # and the next, unrelated request on the same connection is served (issue 39)
            after = client.get(f"{stack.gateway.http_url}/v1/models")
            assert after.status_code == 200, f"not served after {body[:300]!r}"

        run()
    assert_healthy(stack)


def test_nothing_left_behind(stack):
    """After all of it: no sequence held on the target or the draft."""
    wait_for(lambda: gauge(stack.target_metrics, "dflash_sequences_active") == 0
             and gauge(stack.draft_metrics, "dflash_sequences_active") == 0, 15,
             "sequences released")
