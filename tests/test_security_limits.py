"""Input limits of the gateway and the services, each with a status and a message saying what
is allowed, and the service serving on afterwards:

    --max-prompt-tokens, --max-tokens-limit    400 / INVALID_ARGUMENT
    --max-request-bytes                         413 (declared or streamed body) / gRPC
                                                RESOURCE_EXHAUSTED (message larger than max)
    --max-message-mib (target, draft)           RESOURCE_EXHAUSTED
    --metrics-auth                              /metrics needs the API key"""
from __future__ import annotations

import grpc
import httpx
import pytest
from support.reliability import TARGET_FLAGS, report, request, start_stack, tiny_hybrid

from dflash.v1 import gateway_pb2, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

KEY = "limits-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
META = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_dir):
    model = tiny_hybrid(tmp_path_factory, smollm2_dir)
    st = start_stack(model, tmp_path_factory.mktemp("security_limits"),
                     "--max-prompt-tokens", "64", "--max-tokens-limit", "32",
                     "--max-request-bytes", "64KiB", "--api-keys", KEY, "--metrics-auth",
                     drafter="none", target_flags=(*TARGET_FLAGS, "--max-message-mib", "1"))
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.gateway.http_url, headers=AUTH, timeout=60) as c:
        c.model = c.get("/v1/models").json()["data"][0]["id"]
        yield c


def still_serving(client) -> None:
    """Greedy: the tiny model's active vocabulary has no EOS, so exactly 3 tokens come back.
    (OpenAI's default temperature 1 samples the whole vocabulary, where the random model's
    inactive rows are flat, and once drew the EOS id as the first token.)"""
    r = client.post("/v1/completions", json={"model": client.model, "prompt": "hi",
                                             "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_prompt_and_max_tokens_limits(stack, client):
    long_prompt = list(range(1000, 1065))                    # 65 token ids
    cases = [({"prompt": long_prompt}, "at most 64"),
             ({"prompt": "hi", "max_tokens": 33}, "at most 32 tokens")]
    for fields, words in cases:
        r = client.post("/v1/completions", json={"model": client.model, **fields})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    with pytest.raises(grpc.RpcError) as e:
        list(stack.gateway.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=long_prompt)), timeout=30, metadata=META))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 64" in e.value.details()
    # no max_tokens: the default is capped at the limit (chat's default is the whole context)
    r = client.post("/v1/chat/completions", json={
        "model": client.model, "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
    still_serving(client)
    report("limits_tokens", rejected=3, default_capped_at=32)


def test_request_size_limits(stack, client):
    big = {"model": client.model, "prompt": "a" * 70_000}
    r = client.post("/v1/completions", json=big)                       # declared length
    assert r.status_code == 413 and "at most 65536" in r.json()["error"]["message"]

    def chunks():
        for _ in range(20):
            yield b'{"model": "m", "prompt": "' + b"a" * 8192
    r = client.post("/v1/completions", content=chunks(),
                    headers={"content-type": "application/json"})     # chunked: no length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(grpc.RpcError) as e:
        list(stack.gateway.stub.Generate(request("a" * 70_000, 4), timeout=30, metadata=META))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max" in e.value.details()
    still_serving(client)
    report("limits_size", http_413=2, grpc_resource_exhausted=1, limit_bytes=65536)


def test_service_message_limit(stack, client):
    with grpc.insecure_channel(stack.target.address) as ch:
        stub = target_pb2_grpc.TargetStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(target_pb2.PrefillRequest(sequence_id="big", token_ids=[1000] * 600_000),
                         timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    still_serving(client)


def test_metrics_need_the_key_with_metrics_auth(stack):
    url = stack.gateway.http_url
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/readiness", timeout=10).status_code == 200
