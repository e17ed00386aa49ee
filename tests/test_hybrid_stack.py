"""Hybrid targets (Bamba: Mamba2 + attention; Granite-4.0-H; Qwen3.5: Gated DeltaNet + gated
attention; Qwen3-Next; NemotronH: Mamba2, attention, MLP and MoE blocks; Falcon-H1: attention
and Mamba2 side by side) through the full stack: target, prompt-lookup draft and
gateway processes. Greedy speculative output equals the target's own autoregressive output and
transformers' generate, with partial accepts (counted); with the commit skipped it differs; a
target that cannot commit is refused by the gateway.

The tiny target has SmolLM2's tokenizer and scores only 16 token ids (see make_tiny_hybrid's
active_vocab), so its greedy output soon repeats and prompt lookup drafts are partly accepted."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from support.draft_service import start_draft
from support.gateway_stack import lookup_partial_accepts
from support.hybrid import hf_greedy, hf_model, make_tiny_hybrid
from support.procs import ServiceProcess, free_port, health_status, start_target

from dflash.harness import HookFlags
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

N = 64                       # tokens generated
BLOCK = 8                    # the draft's block size (anchor + 7 drafts)
TEXT = "The cat sat on the mat. The dog sat on the log. " * 3
TARGET_FLAGS = ("--max-block-size", str(BLOCK), "--kv-budget", "64MiB", "--state-slots", "8")
GATEWAY = "dflash.v1.Gateway"


@pytest.fixture(scope="module", params=["bamba", "granitemoehybrid", "qwen3_5", "qwen3_next",
                                        "nemotron_h", "falcon_h1"])
def model_dir(tmp_path_factory, smollm2_dir, request):
    return make_tiny_hybrid(tmp_path_factory.mktemp(f"tiny_{request.param}_smol"),
                            vocab_from=smollm2_dir, active_vocab=(1000, 1016),
                            family=request.param)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    return ChatTokenizer(model_dir).encode(TEXT)


@pytest.fixture(scope="module")
def reference(model_dir, prompt) -> list[int]:
    return hf_greedy(hf_model(model_dir), prompt, N)


@pytest.fixture(scope="module")
def draft(model_dir, logs):
    proc = start_draft(model_dir, logs, "--drafter", "prompt-lookup", "--block-size", str(BLOCK))
    yield proc
    assert proc.stop() == 0


def start_gateway(target: ServiceProcess, draft: ServiceProcess | None, model_dir, logs,
                  wait: bool = True) -> ServiceProcess:
    port, http = free_port(), free_port()
    args = ["--target", target.address, "--tokenizer", str(model_dir), "--port", str(port),
            "--http-port", str(http), "--host", "127.0.0.1", "--startup-timeout", "0",
            "--speculation", "fixed"]     # every step drafts: partial accepts are counted
    if draft is not None:
        args += ["--draft", draft.address]
    proc = ServiceProcess("gateway", args, GATEWAY, port, logs).start()
    proc.http_port = http
    return proc.wait_serving() if wait else proc


def generate(gateway: ServiceProcess, prompt: list[int], block_size: int = 0
             ) -> tuple[list[int], list[int], gateway_pb2.Usage]:
    """Greedy generation of N tokens: (tokens, accepted drafts per event, usage)."""
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), max_tokens=N, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0), block_size=block_size)
        events = list(stub.Generate(req, timeout=300))
    tokens = [t for e in events for t in e.token_ids]
    return tokens, [e.accepted for e in events], events[-1].usage


def test_speculative_output_equals_autoregressive_and_transformers(
        model_dir, logs, draft, prompt, reference):
    target = start_target(model_dir, logs, *TARGET_FLAGS)
    gateway = start_gateway(target, draft, model_dir, logs)
    try:
        spec, accepted, usage = generate(gateway, prompt)
        auto, auto_accepted, _ = generate(gateway, prompt, block_size=1)
        partial = lookup_partial_accepts(prompt, spec, accepted, usage, BLOCK, N)
        print(f"hybrid speculative: {usage.verify_steps} verify steps, {usage.draft_tokens} "
              f"drafts, {usage.accepted_tokens} accepted, {partial} partial accepts")
        assert sum(auto_accepted) == 0 and len(auto) == N
        assert spec == auto == reference
        assert partial >= 3
    finally:
        assert gateway.stop() == 0 and target.stop() == 0


def test_the_same_run_with_the_commit_skipped_differs(model_dir, logs, draft, prompt, reference):
    target = start_target(model_dir, logs, *TARGET_FLAGS,
                          hooks=HookFlags(skip_mamba_commit=True))
    gateway = start_gateway(target, draft, model_dir, logs)
    try:
        spec, _, usage = generate(gateway, prompt)
        assert usage.accepted_tokens > 0 and len(spec) == N
        assert spec != reference
    finally:
        assert gateway.stop() == 0 and target.stop() == 0


def test_gateway_refuses_a_hybrid_target_that_cannot_commit(model_dir, logs, draft, prompt):
    target = start_target(model_dir, logs, *TARGET_FLAGS, hooks=HookFlags(no_mamba_commit=True))
    gateway = start_gateway(target, draft, model_dir, logs, wait=False)
    try:
        reason = _refusal(gateway)
        assert "mamba_verify_commit=false" in reason and "hybrid" in reason
        assert health_status(gateway.address, GATEWAY) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            generate(gateway, prompt)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert gateway.stop() == 0 and target.stop() == 0


def _refusal(gateway: ServiceProcess, timeout: float = 60.0) -> str:
    """The reason /readiness gives once the gateway has seen the target (503 with a reason)."""
    import time
    deadline = time.monotonic() + timeout
    reason = ""
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{gateway.http_port}/readiness", timeout=2)
            raise AssertionError("the gateway reported ready for a target that cannot commit")
        except urllib.error.HTTPError as e:
            assert e.code == 503
            reason = json.loads(e.read())["reason"]
            if "refused" in reason:
                return reason
        except urllib.error.URLError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no refusal within {timeout} s; last reason {reason!r}:\n{gateway.log()}")
