"""Start-up order, readiness and refusals of the gateway, and its gRPC API's errors.

The ordering test uses the target's own record of calls (dflash_rpc_requests_total by method
and code on its /metrics): had the gateway asked for capabilities before the target was
SERVING, the target would have answered (and counted) UNAVAILABLE."""
from __future__ import annotations

import contextlib
import json
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.draft_service import start_draft
from support.gateway_stack import start_gateway, wait_until
from support.procs import ServiceProcess, free_port, health_status, service_command, start_target
from support.prom import scrape

from dflash.harness import HookFlags
from dflash.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway_startup")


@pytest.fixture(scope="module")
def tiny_target(tiny_llama_dir, logs):
    p = start_target(tiny_llama_dir, logs, "--max-block-size", "8")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def tiny_gateway(tiny_target, smollm2_dir, logs):
    """A ready gateway over the tiny target (vocab 256, context 1024), no draft."""
    gw = start_gateway(tiny_target.address, smollm2_dir, logs)
    yield gw
    gw.stop()


def assert_not_ready(gw, *words: str) -> str:
    status, body = gw.readiness()
    assert status == 503 and body["ready"] is False, body
    assert all(w in body["reason"] for w in words), body["reason"]
    assert health_status(gw.address, "dflash.v1.Gateway") == NOT_SERVING
    return body["reason"]


def capability_calls(metrics_port: int) -> dict[str, float]:
    return {lb["code"]: v for lb, v in scrape(metrics_port).get("dflash_rpc_requests_total", [])
            if lb["method"] == "GetCapabilities"}


def test_gateway_waits_for_a_slow_target_before_asking_capabilities(smollm2_dir, logs):
    port, metrics_port = free_port(), free_port()
    gw = start_gateway(f"127.0.0.1:{port}", smollm2_dir, logs, wait=False)
    target = None
    try:
        wait_until(lambda: gw.readiness()[0] == 503 if _answers(gw) else False, timeout=60,
                   what="gateway HTTP up")
        assert_not_ready(gw, f"target at 127.0.0.1:{port}")
        # not ready: every API says so, none hangs, none is a 500
        r = httpx.post(f"{gw.http_url}/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]
        assert httpx.get(f"{gw.http_url}/v1/models").status_code == 503
        assert httpx.get(f"{gw.http_url}/health").status_code == 200
        with pytest.raises(grpc.RpcError) as e:
            list(gw.stub.Generate(gateway_pb2.GenerateRequest(text="hi"), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            gw.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        target = ServiceProcess(*service_command("target", [
            "--model", str(smollm2_dir), "--port", str(port), "--host", "127.0.0.1",
            "--metrics-port", str(metrics_port)], HookFlags(warmup_delay_s=6)),
            "dflash.v1.Target", port, logs).start()
        wait_until(lambda: health_status(target.address, "dflash.v1.Target") == NOT_SERVING,
                   timeout=60, what="target listening, warming up")
        wait_until(lambda: "NOT_SERVING" in gw.readiness()[1]["reason"], timeout=5,
                   what="gateway sees the target NOT_SERVING")      # it watches the health
        assert_not_ready(gw, "is NOT_SERVING")
        assert capability_calls(metrics_port) == {}    # and asked nothing yet
        gw.wait_serving(timeout=120)
        assert health_status(target.address, "dflash.v1.Target") == SERVING
        calls = capability_calls(metrics_port)
        assert calls.get("OK", 0) >= 1 and set(calls) == {"OK"}, calls
        tokens, _, _ = gw.generate([1, 2, 3, 4], 4)
        assert len(tokens) == 4
    finally:
        gw.stop()
        if target is not None:
            target.stop()


def _answers(gw) -> bool:
    try:
        gw.readiness()
        return True
    except (httpx.HTTPError, OSError):
        return False


def test_startup_timeout_exits_when_the_target_never_comes(smollm2_dir, logs):
    gw = start_gateway(f"127.0.0.1:{free_port()}", smollm2_dir, logs, "--startup-timeout", "2",
                       wait=False)
    assert gw.proc.wait(60) == 1
    assert "target not SERVING after 2 s" in gw.log()


def test_draft_that_never_comes_delays_readiness_until_the_deadline(tiny_target, smollm2_dir,
                                                                    logs):
    draft = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    gw = start_gateway(tiny_target.address, smollm2_dir, logs, "--startup-timeout", "8",
                       draft=draft, wait=False)
    try:
        wait_until(lambda: _answers(gw) and "waiting for the draft" in gw.readiness()[1]["reason"],
                   timeout=7, what="gateway waiting for the draft")
        assert_not_ready(gw, "waiting for the draft", draft)
        gw.wait_serving(timeout=60)
        assert time.monotonic() - t0 >= 8
        status, body = gw.readiness()
        assert status == 200 and "autoregressively" in body["reason"]
        info = gw.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
        assert not info.speculative
        tokens, _, responses = gw.generate([1, 5, 9], 6)
        assert len(tokens) == 6 and responses[-1].usage.draft_steps == 0
    finally:
        gw.stop()


def test_incompatible_draft_is_refused(tiny_target, smollm2_dir, logs):
    """A prompt-lookup draft made for SmolLM2 (vocab 49152) in front of the tiny target (256)."""
    draft = start_draft(smollm2_dir, logs, "--drafter", "prompt-lookup")
    gw = start_gateway(tiny_target.address, smollm2_dir, logs, draft=draft.address, wait=False)
    try:
        wait_until(lambda: _answers(gw) and "refused" in gw.readiness()[1]["reason"], timeout=60,
                   what="refusal")
        reason = assert_not_ready(gw, "draft refused", "vocabulary of 49152", "256")
        assert reason in gw.log() and "ERROR" in gw.log()
        r = httpx.post(f"{gw.http_url}/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and "draft refused" in r.json()["error"]["message"]
    finally:
        gw.stop()
        draft.stop()


# -- the gRPC API -----------------------------------------------------------------------------------
def test_reflection_lists_the_gateway(tiny_gateway):
    with grpc.insecure_channel(tiny_gateway.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(stub.ServerReflectionInfo(iter([req]), timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"dflash.v1.Gateway", "grpc.health.v1.Health"} <= names
    assert health_status(tiny_gateway.address, "dflash.v1.Gateway") == SERVING
    assert health_status(tiny_gateway.address, "") == SERVING


def test_model_info(tiny_gateway):
    info = tiny_gateway.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
    assert (info.vocab_size, info.max_context, info.speculative) == (256, 1024, False)
    assert info.target_architecture == "llama" and list(info.eos_token_ids) == [2]


def test_generate_streams_tokens_and_usage(tiny_gateway):
    tokens, _, responses = tiny_gateway.generate([1, 7, 9], 12, ignore_eos=True)
    assert len(tokens) == 12 and responses[-1].finish_reason == "length"
    assert all(r.finish_reason == "" for r in responses[:-1])
    u = responses[-1].usage
    assert (u.prompt_tokens, u.completion_tokens, u.verify_steps) == (3, 12, 11)


def S(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


IDS = gateway_pb2.TokenIds(ids=[1, 2, 3])
BAD_GRPC = [
    ({}, "prompt is missing"),
    ({"text": ""}, "empty"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[])}, "empty"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[1, 256])}, "vocabulary"),
    ({"token_ids": IDS, "sampling": S(temperature=-1)}, "temperature"),
    ({"token_ids": IDS, "sampling": S(top_p=0)}, "top_p"),
    ({"token_ids": IDS, "sampling": S(top_p=1.5)}, "top_p"),
    ({"token_ids": IDS, "sampling": S(top_k=-3)}, "top_k"),
    ({"token_ids": IDS, "sampling": S(min_tokens=9), "max_tokens": 5}, "min_tokens"),
    ({"token_ids": IDS, "sampling": S(stop_token_ids=[999])}, "stop_token_ids"),
    ({"token_ids": IDS, "max_tokens": 1022}, "at most 1021"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[1] * 1024)}, "none to generate"),
    ({"token_ids": IDS, "stop": [""]}, "stop strings"),
]


@pytest.mark.parametrize("fields,words", BAD_GRPC, ids=[w for _, w in BAD_GRPC])
def test_bad_generate_requests_are_invalid_argument(tiny_gateway, fields, words):
    with pytest.raises(grpc.RpcError) as e:
        list(tiny_gateway.stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details(), e.value.details()
    tokens, _, _ = tiny_gateway.generate([1, 2], 2)     # and it keeps serving
    assert len(tokens) == 2


def test_sigterm_with_a_request_in_flight(tiny_llama_dir, smollm2_dir, logs):
    """Graceful stop: NOT_SERVING at once; the request finishes within the grace period or is
    cut; either way its sequence is released on the target before the gateway exits (0)."""
    metrics_port = free_port()
    target = start_target(tiny_llama_dir, logs, "--metrics-port", str(metrics_port))
    gw = start_gateway(target.address, smollm2_dir, logs)
    try:
        call = gw.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=IDS, max_tokens=1000, ignore_eos=True), timeout=120)
        for _ in range(3):
            next(call)
        gw.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: health_status(gw.address, "dflash.v1.Gateway") != SERVING,
                   timeout=10, what="NOT_SERVING on SIGTERM")
        with contextlib.suppress(grpc.RpcError):
            for _ in call:
                pass
        assert gw.proc.wait(30) == 0
        sequences = scrape(metrics_port).get("dflash_sequences_active", [])
        assert sum(v for _, v in sequences) == 0
    finally:
        gw.stop()
        target.stop()


def test_target_gone_for_good_ends_streams_with_an_error(tiny_llama_dir, smollm2_dir, logs):
    """The target dies mid-stream and does not come back within --upstream-wait: the SSE
    stream ends with an OpenAI error object and [DONE], the gRPC stream with UNAVAILABLE."""
    target = start_target(tiny_llama_dir, logs)
    gw = start_gateway(target.address, smollm2_dir, logs, "--step-timeout", "3",
                       "--upstream-wait", "3")
    try:
        model = httpx.get(f"{gw.http_url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        call = gw.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=IDS, max_tokens=1000, ignore_eos=True), timeout=60)
        next(call)
        with httpx.Client(timeout=30) as c, \
                c.stream("POST", f"{gw.http_url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            target.kill()
            t0 = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and time.monotonic() - t0 < 20
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["type"] == "service_unavailable" and "target" in error["message"]
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gw.stop()
        target.stop()
