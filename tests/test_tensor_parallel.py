"""Tensor-parallel targets on the CPU (gloo): runtime/tensor_parallel.py, services/target/ranks.py.

- the split: sizes allowed and refused (saying which are allowed), each checkpoint tensor's
  share, a model that cannot be split refused;
- a tiny Qwen3 (4 heads, 2 KV heads) at --tensor-parallel-size 2 through its gRPC API: greedy
  decoding equal to transformers', chain verifies with rejected drafts and a tree verify equal
  to the same target at 1 rank;
- SmolLM2-135M (9 heads, 3 KV heads) at 3 ranks behind the gateway with the shipped DFlash
  drafter (features captured from the split model): the real `openai` client's greedy output
  equals transformers';
- bad input: 2 ranks of SmolLM2 (2 does not divide 9 heads), a hybrid model: the service exits
  refusing, naming what is allowed;
- a rank that fails at start-up (its error) or is killed at start-up (its exit code): start-up
  fails naming the rank, and no process is left;
- a rank killed mid-stream: the target exits naming it (its followers with it); restarted, the
  gateway's streams finish identical to an undisturbed run."""
from __future__ import annotations

import ast
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from openai import OpenAI
from support.draft_service import start_draft
from support.gateway_stack import start_gateway, wait_until
from support.procs import ServiceProcess, start_target
from support.reliability import PROMPTS, Streams, request, restart
from support.target_client import TargetClient
from support.tiny_models import TINY_PROMPT, make_tiny, wrong

from dflash.harness import HookFlags
from runtime import tensor_parallel
from runtime.config import ModelConfig
from services.target.__main__ import check_tensor_parallel
from services.target.config import TargetConfig
from services.target.ranks import EXIT_RANK_LOST

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
TP_FLAGS = ("--kv-budget", "64MiB", "--max-block-size", "16")


def tiny_cfg(**overrides) -> ModelConfig:
    raw = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4}
    return ModelConfig.from_dict({**raw, **overrides})


# -- the split ------------------------------------------------------------------------------
def test_sizes_that_divide_heads_kv_heads_and_mlp_are_allowed():
    cfg = tiny_cfg()
    assert tensor_parallel.allowed_sizes(cfg) == [1, 2, 4]
    half = tensor_parallel.shard_config(cfg, 2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size) == (4, 2, 48)
    assert half.head_dim == cfg.head_dim and half.hidden_size == cfg.hidden_size
    with pytest.raises(tensor_parallel.TensorParallelUnsupported,
                       match=r"--tensor-parallel-size 3 does not divide .* 8 attention heads, "
                             r"4 KV heads and MLP width 96: allowed sizes are 1, 2, 4"):
        tensor_parallel.shard_config(cfg, 3)
    with pytest.raises(tensor_parallel.TensorParallelUnsupported, match="'bamba' .* not split"):
        tensor_parallel.shard_config(cfg, 2, dense=False, model_type="bamba")


def test_each_checkpoint_tensor_s_share():
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(tensor_parallel.shard_tensor(
        "model.layers.0.self_attn.k_proj.weight", w, 1, 2), w[2:])          # its heads' rows
    assert torch.equal(tensor_parallel.shard_tensor(
        "model.layers.0.mlp.down_proj.weight", w, 1, 2), w[:, 3:])          # its columns
    b = torch.ones(4)
    assert torch.equal(tensor_parallel.shard_tensor("model.layers.3.self_attn.o_proj.bias",
                                                    b, 0, 2), b)            # added once
    assert not tensor_parallel.shard_tensor("model.layers.3.self_attn.o_proj.bias", b, 1, 2).any()
    assert tensor_parallel.shard_tensor("model.norm.weight", b, 1, 2) is b  # whole
    assert tensor_parallel.shard_tensor("model.embed_tokens.weight", w, 1, 2) is w


def test_bad_sizes_are_refused_before_anything_starts(smollm2_dir, tmp_path):
    with pytest.raises(ValueError, match="allowed sizes are 1, 3"):
        check_tensor_parallel(TargetConfig(model_dir=str(smollm2_dir), tensor_parallel_size=2))
    hybrid = tmp_path / "bamba"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(json.dumps(json.loads(
        (smollm2_dir / "config.json").read_text()) | {"model_type": "bamba"}))
    with pytest.raises(ValueError, match="dense Llama / Qwen2 / Qwen3 .* 'bamba'"):
        check_tensor_parallel(TargetConfig(model_dir=str(hybrid), tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        TargetConfig(model_dir=str(smollm2_dir), tensor_parallel_size=0)


def test_the_service_exits_refusing_a_size_that_does_not_divide(smollm2_dir, log_dir):
    p = start_target(smollm2_dir, log_dir, "--tensor-parallel-size", "2", *TP_FLAGS, wait=False)
    assert p.proc.wait(120) == 2
    assert "allowed sizes are 1, 3" in p.log()


# -- exactness ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    """Weights large enough that greedy paths do not loop at once (init range 0.2)."""
    return make_tiny(tmp_path_factory.mktemp("tp_qwen3"), "qwen3", initializer_range=0.2)


@pytest.fixture(scope="module")
def tiny_targets(tiny_qwen3, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp_tiny")
    one = start_target(tiny_qwen3, logs, *TP_FLAGS)
    two = start_target(tiny_qwen3, logs, *TP_FLAGS, "--tensor-parallel-size", "2")
    yield one, two
    codes = two.stop(), one.stop()
    assert codes == (0, 0)
    assert not follower_pids_alive(two)


def test_two_ranks_decode_as_transformers_and_one_rank(tiny_qwen3, tiny_targets):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([TINY_PROMPT]), max_new_tokens=24, do_sample=False)
    expected = out[0, len(TINY_PROMPT):].tolist()
    one, two = (TargetClient(t.address) for t in tiny_targets)
    try:
        assert two.capabilities().model_id == one.capabilities().model_id
        assert two.greedy("g", TINY_PROMPT, 24) == expected
        # chains with a rejected draft and a tree: the same committed tokens and logits
        for client in (one, two):
            client.prefill("c", TINY_PROMPT)
        greedy = expected
        chain = [greedy[0], greedy[1], wrong(greedy[2]), 5]           # 1 accepted, then refused
        a = one.verify("c", chain)
        b = two.verify("c", chain)
        assert list(a.committed_tokens) == list(b.committed_tokens) == greedy[1:3]
        anchor = greedy[2]
        tree = [anchor, greedy[3], wrong(greedy[3]), greedy[4], wrong(greedy[4])]
        parents = [0, 0, 1, 1]
        a = one.verify("c", tree, parents)
        b = two.verify("c", tree, parents)
        assert list(a.committed_tokens) == list(b.committed_tokens) == greedy[3:6]
        assert a.accepted == b.accepted == 2
        after_a = one.verify("c", [greedy[5]])
        after_b = two.verify("c", [greedy[5]])       # the tree's KV moved on every rank
        assert list(after_a.committed_tokens) == list(after_b.committed_tokens) == [greedy[6]]
        assert one.release("c") and two.release("c")
    finally:
        one.close()
        two.close()


def follower_pids(p: ServiceProcess) -> list[int]:
    """The follower ranks' pids from rank 0's log line."""
    m = re.search(r"tensor-parallel ranks started .*?pids=\"?(\[[0-9, ]*\])", p.log())
    assert m, "no 'tensor-parallel ranks started' line in the target's log"
    return ast.literal_eval(m.group(1))


def follower_pids_alive(p: ServiceProcess) -> list[int]:
    alive = []
    for pid in follower_pids(p):
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


# -- start-up failures -----------------------------------------------------------------------
def test_a_rank_that_fails_at_start_up_fails_the_service_naming_it(tiny_qwen3, log_dir):
    p = start_target(tiny_qwen3, log_dir, *TP_FLAGS, "--tensor-parallel-size", "2", wait=False,
                     hooks=HookFlags(fail_tensor_parallel_rank=1))
    assert p.proc.wait(120) != 0
    assert "tensor-parallel rank 1 failed during start-up" in p.log()
    assert "testing hook: this rank fails at start-up" in p.log()
    wait_until(lambda: not follower_pids_alive(p), 15, what="no follower left")


def test_a_rank_killed_at_start_up_fails_the_service_naming_it(tiny_qwen3, log_dir):
    p = start_target(tiny_qwen3, log_dir, *TP_FLAGS, "--tensor-parallel-size", "2", wait=False,
                     hooks=HookFlags(backend_delay_s=5))
    pids = wait_until(lambda: "tensor-parallel ranks started" in p.log() and follower_pids(p),
                      60, what="followers started")
    os.kill(pids[0], signal.SIGKILL)
    assert p.proc.wait(60) != 0
    assert re.search(r"tensor-parallel rank 1 \(pid \d+\) exited with code -9 during start-up",
                     p.log()), p.log()[-2000:]


# -- SmolLM2 behind the gateway ----------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_stack(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp_smollm2")
    target = start_target(smollm2_dir, logs, "--tensor-parallel-size", "3", *TP_FLAGS,
                          "--graph-capture-layers", "1,8,14,20,27")
    draft = start_draft(smollm2_dir, logs, "--drafter", "dflash", model_dir=SHIPPED)
    gateway = start_gateway(target.address, smollm2_dir, logs, "--upstream-wait", "120",
                            draft=draft.address)
    stack = {"target": target, "draft": draft, "gateway": gateway, "logs": logs}
    yield stack
    gateway.stop()
    draft.stop()
    stack["target"].stop()


def test_three_ranks_of_smollm2_speculate_as_transformers(smollm2_stack, smollm2_dir,
                                                            smollm2_reference):
    from runtime.tokenizer import ChatTokenizer
    tok = ChatTokenizer(smollm2_dir)
    gw = smollm2_stack["gateway"]
    client = OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="none")
    for question in ("What is the capital of France?", "Name three colours of the rainbow."):
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                           max_tokens=32, temperature=0)
        prompt = tok.encode(tok.apply_chat_template(messages))
        expected = smollm2_reference(prompt, 32)
        assert r.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert "speculative decoding on" in gw.log()


def test_a_rank_killed_mid_stream_restarts_the_target_and_streams_finish(smollm2_stack):
    gw = smollm2_stack["gateway"]
    reference = [r.tokens for r in Streams(gw.stub, [request(p, 40) for p in PROMPTS[:4]])
                 .start().join()]
    streams = Streams(gw.stub, [request(p, 40) for p in PROMPTS[:4]]).start()
    streams.wait_tokens(4)
    target = smollm2_stack["target"]
    victim = follower_pids(target)[0]
    os.kill(victim, signal.SIGKILL)
    assert target.proc.wait(30) == EXIT_RANK_LOST
    assert re.search(r"tensor-parallel rank 1 \(pid \d+\) exited with code -9 while serving",
                     target.log())
    wait_until(lambda: not follower_pids_alive(target), 15, what="the other follower gone")
    time.sleep(0.5)
    smollm2_stack["target"] = restart(target, smollm2_stack["logs"] / "restarted").wait_serving()
    results = streams.join()
    assert not [r.error for r in results if r.error is not None]
    assert [r.tokens for r in results] == reference
