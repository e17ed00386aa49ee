"""A DeepSeek-V3 (MLA + MoE) target through the three services, and the seed's scenario.

- Greedy speculative output equals the target's own autoregressive output and transformers'
  generate: chains from prompt lookup (partial accepts counted), trees from a DFlash drafter made
  for this target (`dflash make-draft`), and with an fp8 KV cache (speculative = our own
  autoregressive output with the same cache: the loop stays lossless relative to the target as
  served).
- The bug this project began from: a pure-MLA target with an fp8 KV cache, a slow attention
  backend initialisation and a DFlash draft. GetCapabilities answers UNAVAILABLE (naming the
  stage) until the backend exists, then reports that no mamba commit is needed; the gateway asks
  only after SERVING (the target's own call counts show it) and becomes ready.

The tiny target has SmolLM2's tokenizer and scores only 16 ids (tiny_mla's active_vocab), so
its greedy output soon repeats and prompt-lookup drafts are partly accepted."""
from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from support.draft_service import start_draft
from support.gateway_stack import lookup_partial_accepts, start_gateway, wait_until
from support.hybrid import hf_greedy
from support.procs import ServiceProcess, free_port, health_status, service_command, start_target
from support.prom import scrape
from support.target_client import TargetClient, rpc_error

from dflash.harness import HookFlags
from dflash.make_draft import make_random_drafter
from dflash.prepare.tiny_mla import make_tiny_mla
from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

N = 40
BLOCK = 8
TEXT = "The cat sat on the mat. The dog sat on the log. " * 3
TARGET_FLAGS = ("--max-block-size", str(BLOCK), "--kv-budget", "16MiB")
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    # seed 1: an output that repeats with variations (8 partial accepts of prompt lookup)
    return make_tiny_mla(tmp_path_factory.mktemp("tiny_mla_smol"), 3, vocab_from=smollm2_dir,
                         seed=1, active_vocab=(1000, 1016))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("mla_logs")


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    return ChatTokenizer(model_dir).encode(TEXT)


@pytest.fixture(scope="module")
def reference(model_dir, prompt) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return hf_greedy(model, prompt, N)


@pytest.fixture(scope="module")
def lookup_draft(model_dir, logs):
    proc = start_draft(model_dir, logs, "--drafter", "prompt-lookup", "--block-size", str(BLOCK))
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def dflash_drafter(model_dir, tmp_path_factory):
    return make_random_drafter(model_dir, tmp_path_factory.mktemp("mla_drafter"), num_layers=1,
                               block_size=BLOCK)


def generate(gateway, prompt: list[int], block_size: int = 0):
    """Greedy, N tokens, EOS ignored: (tokens, accepted per event, usage)."""
    tokens, _, events = gateway.generate(prompt, N, ignore_eos=True, block_size=block_size)
    return tokens, [e.accepted for e in events], events[-1].usage


def test_chains_equal_autoregressive_and_transformers(model_dir, logs, lookup_draft, prompt,
                                                      reference):
    target = start_target(model_dir, logs, *TARGET_FLAGS)
    gateway = start_gateway(target.address, model_dir, logs, "--speculation", str(BLOCK),
                            draft=lookup_draft.address)
    try:
        spec, accepted, usage = generate(gateway, prompt)
        auto, auto_accepted, _ = generate(gateway, prompt, block_size=1)
        partial = lookup_partial_accepts(prompt, spec, accepted, usage, BLOCK, N)
        print(f"MLA speculative: {usage.verify_steps} verify steps, {usage.accepted_tokens} "
              f"accepted of {usage.draft_tokens}, {partial} partial accepts")
        assert sum(auto_accepted) == 0
        assert spec == auto == reference
        assert partial >= 3
        client = TargetClient(target.address)
        caps = client.capabilities()
        client.close()
        assert (caps.architecture, caps.mamba_verify_commit, caps.hybrid) == (
            "deepseek_v3", False, False)
        assert "latent_kv=True" in target.log()
    finally:
        assert gateway.stop() == 0 and target.stop() == 0


def test_trees_from_a_dflash_drafter_equal_transformers(model_dir, logs, dflash_drafter, prompt,
                                                        reference):
    target = start_target(model_dir, logs, *TARGET_FLAGS)
    draft = start_draft(model_dir, logs, model_dir=dflash_drafter)
    gateway = start_gateway(target.address, model_dir, logs, "--spec-tree-nodes", "8",
                            draft=draft.address)
    try:
        tokens, _, usage = generate(gateway, prompt)
        assert usage.draft_tokens > 0
        assert tokens == reference
    finally:
        assert gateway.stop() == 0 and draft.stop() == 0 and target.stop() == 0


def test_fp8_cache_speculation_equals_its_own_autoregressive_output(model_dir, logs, lookup_draft,
                                                                    prompt, reference):
    target = start_target(model_dir, logs, *TARGET_FLAGS, "--kv-cache-dtype", "fp8_e4m3")
    gateway = start_gateway(target.address, model_dir, logs, "--speculation", str(BLOCK),
                            draft=lookup_draft.address)
    try:
        spec, accepted, usage = generate(gateway, prompt)
        auto, _, _ = generate(gateway, prompt, block_size=1)
        assert lookup_partial_accepts(prompt, spec, accepted, usage, BLOCK, N) >= 3
        assert spec == auto
        same = sum(a == b for a, b in zip(spec, reference))
        print(f"fp8 KV cache: {same}/{N} greedy tokens equal to the fp32 reference")
        assert "kv_dtype=float8_e4m3fn" in target.log()
    finally:
        assert gateway.stop() == 0 and target.stop() == 0


def test_seed_scenario_mla_fp8_slow_backend(model_dir, logs, dflash_drafter, prompt):
    """The crash SGLang had: a worker asked the attention backend about the mamba commit before
    the backend existed. Here the target's backend takes 4 s to build; nothing asks it early."""
    port, metrics_port = free_port(), free_port()
    gateway = start_gateway(f"127.0.0.1:{port}", model_dir, logs, wait=False)
    draft = start_draft(model_dir, logs, model_dir=dflash_drafter)
    target = ServiceProcess(*service_command("target", [
        "--model", str(model_dir), "--port", str(port), "--host", "127.0.0.1",
        "--metrics-port", str(metrics_port), "--kv-cache-dtype", "fp8_e4m3", *TARGET_FLAGS],
        HookFlags(backend_delay_s=4)), "dflash.v1.Target", port, logs).start()
    client = TargetClient(target.address)
    try:
        wait_until(lambda: health_status(target.address, "dflash.v1.Target") == NOT_SERVING,
                   timeout=60, what="target listening, building its backend")
        seen = []
        while "dflash.v1.Target -> SERVING" not in target.log():
            # counted before our call: if the call then finds the target not ready, it was not
            # ready when counted either, so an OK there was answered early (counted after the
            # call, the gateway's first call just after SERVING would count too)
            calls = _capability_calls(metrics_port)
            try:
                err = rpc_error(client.capabilities)
            except AssertionError:          # answered: the target became ready meanwhile
                break
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            seen.append(err.details())
            assert not calls.get("OK"), "answered before SERVING"
            time.sleep(0.2)
        assert any("stage 'pools'" in m for m in seen), seen     # while the backend is built
        gateway.wait_serving(timeout=120)
        caps = client.capabilities()
        assert caps.mamba_verify_commit is False and caps.hybrid is False
        log = target.log()
        assert log.index("attention backends built") < log.index("dflash.v1.Target -> SERVING")
        assert "need_mamba_verify_commit=False" in log
        # the gateway's own calls: none answered before SERVING (only ours were UNAVAILABLE)
        calls = _capability_calls(metrics_port)
        assert calls.get("OK", 0) >= 1 and calls.get("UNAVAILABLE", 0) == len(seen), calls
        tokens, _, _ = gateway.generate(prompt, 8, ignore_eos=True)
        assert len(tokens) == 8
    finally:
        client.close()
        gateway.stop()
        draft.stop()
        target.stop()


def _capability_calls(metrics_port: int) -> dict[str, float]:
    return {lb["code"]: v for lb, v in scrape(metrics_port).get("dflash_rpc_requests_total", [])
            if lb["method"] == "GetCapabilities"}
