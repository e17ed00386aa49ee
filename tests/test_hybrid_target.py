"""A hybrid (Mamba2 + attention) target: the start-up order of the commit decision, and real
servers over gRPC - capabilities, state slots running out, Verify without verify states,
and speculative verify with partial accepts equal to greedy decoding (and wrong without the
commit)."""
from __future__ import annotations

import grpc
import pytest
import torch
from support import prom
from support.hybrid import hf_greedy, hf_model, make_tiny_hybrid, speculate
from support.procs import free_port, start_target
from support.target_client import TargetClient, expect_status

from dflash.harness import HookFlags
from runtime.attention.hybrid import HybridAttnBackend, can_commit_mamba_state
from services.common.errors import NotReady
from services.common.tensor_codec import decode
from services.target.config import TargetConfig
from services.target.hooks import TargetHooks
from services.target.servicer import capabilities
from services.target.worker import TargetWorker

PROMPT = [1, 17, 42, 99, 7, 3, 250, 18, 64, 5, 77, 120, 9, 31]
SMALL = ("--page-size", "4", "--kv-budget", "16MiB", "--max-block-size", "8")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp("tiny_bamba"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def server(hybrid_dir, logs):
    """A hybrid target with default state flags (64 slots, all with verify states)."""
    proc = start_target(hybrid_dir, logs, *SMALL)
    yield proc
    assert proc.stop() == 0


# -- start-up order (in-process) ------------------------------------------------------------

def _worker(model_dir, **hooks) -> TargetWorker:
    return TargetWorker(TargetConfig(model_dir=str(model_dir), page_size=4,
                                     kv_budget_bytes=16 << 20, max_block_size=8),
                        TargetHooks(**hooks))


def _not_ready(worker: TargetWorker) -> str:
    with pytest.raises(NotReady) as e:
        _ = worker.need_mamba_verify_commit
    return str(e.value)


@pytest.mark.parametrize("model, hooks, need", [
    ("hybrid", {}, True),
    ("hybrid", {"mamba_commit": False}, False),      # a state backend without the method
    ("dense", {"hybrid_wrapper": True}, False),      # a wrapper that only delegates
])
def test_need_mamba_verify_commit_is_decided_in_init_attention_backends(
        hybrid_dir, tiny_llama_dir, model, hooks, need):
    worker = _worker(hybrid_dir if model == "hybrid" else tiny_llama_dir, **hooks)
    assert "stage 'loaded'" in _not_ready(worker)
    worker.alloc_memory_pools()
    assert "stage 'pools'" in _not_ready(worker)
    worker.init_attention_backends()
    assert worker.need_mamba_verify_commit is need
    assert isinstance(worker.attn_backend, HybridAttnBackend)
    assert can_commit_mamba_state(worker.attn_backend) is need
    worker.mark_ready()
    caps = capabilities(worker)
    assert (caps.hybrid, caps.mamba_verify_commit) == (model == "hybrid", need)


def test_a_hybrid_backend_without_commit_has_no_commit_method(hybrid_dir):
    worker = _worker(hybrid_dir, mamba_commit=False)
    worker.alloc_memory_pools()
    worker.init_attention_backends()
    assert not hasattr(worker.attn_backend.mamba, "commit_verified_state")
    with pytest.raises(RuntimeError, match="no mamba state backend that can commit"):
        worker.attn_backend.update_mamba_state_after_mtp_verify([(0, 0)])


# -- gRPC ---------------------------------------------------------------------------------------

@pytest.mark.slow              # two target processes
def test_capabilities_report_hybrid_commit_and_state_slots(hybrid_dir, logs, server):
    refused = start_target(hybrid_dir, logs, *SMALL, "--state-slots", "5",
                           hooks=HookFlags(no_mamba_commit=True))
    try:
        for proc, commit, slots in ((server, True, 64), (refused, False, 5)):
            client = TargetClient(proc.address)
            caps = client.capabilities()
            assert (caps.hybrid, caps.mamba_verify_commit) == (True, commit)
            assert caps.architecture == "bamba"
            assert caps.state_slots_total == slots and caps.num_layers == 4
            client.close()
        assert "need_mamba_verify_commit=False" in refused.log()
    finally:
        assert refused.stop() == 0


def test_a_hybrid_target_verifies_trees_and_commits_the_accepted_path(server):
    """Trees within its verify states (max_tree_nodes = --max-block-size - 1): a tree whose
    greedy path runs through nodes 2, 4, 5 - beside wrong siblings at rows 1 and 3 - commits
    the greedy tokens, and decoding after it goes on as plain greedy decoding does (the
    recurrent state committed is row 5's, the path's end, not row 3's, the accepted count's).
    A tree over the limit is refused naming it."""
    client = TargetClient(server.address)
    try:
        assert client.capabilities().max_tree_nodes == 7
        want = client.greedy("ref", PROMPT, 8)
        first = client.prefill("tree", PROMPT).next_token
        g1, g2, g3 = want[1:4]
        wrong1, wrong2 = (g1 + 1) % 256, (g2 + 1) % 256
        resp = client.verify("tree", [first, wrong1, g1, wrong2, g2, g3], [0, 0, 2, 2, 4])
        assert resp.accepted == 3 and list(resp.committed_tokens) == want[1:5]
        out = want[:5]
        while len(out) < 8:
            out += list(client.verify("tree", [out[-1]]).committed_tokens)
        assert out == want
        client.release("tree")
        first = client.prefill("big", PROMPT).next_token
        expect_status(lambda: client.verify("big", [first] + [5] * 8, [0] * 8),
                      grpc.StatusCode.INVALID_ARGUMENT, "max_tree_nodes 7")
        client.release("big")
    finally:
        client.close()


def test_state_slots_run_out_and_nothing_leaks(hybrid_dir, logs):
    """3 state slots, 2 of them with verify states: a 4th Prefill is RESOURCE_EXHAUSTED (every
    time, holding nothing); the 3rd sequence can verify 1-token blocks only."""
    port = free_port()
    server = start_target(hybrid_dir, logs, *SMALL, "--state-slots", "3",
                          "--verify-state-slots", "2", "--metrics-port", str(port))
    client = TargetClient(server.address)

    def gauge(name: str) -> float | None:
        return prom.value(port, name)

    try:
        for i in range(3):
            client.prefill(f"s{i}", PROMPT)
        for _ in range(3):
            expect_status(lambda: client.prefill("s3", PROMPT), grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "all 3 state slots", "--state-slots")
        assert gauge("dflash_state_pool_usage_ratio") == 1.0
        assert gauge("dflash_sequences_active") == 3
        expect_status(lambda: client.verify("s2", PROMPT[:3]), grpc.StatusCode.FAILED_PRECONDITION,
                      "'s2' holds no verify states", "1-token blocks")
        assert len(client.verify("s2", PROMPT[:1]).committed_tokens) == 1
        assert client.verify("s0", PROMPT[:4]).seq_len >= len(PROMPT) + 1   # others still served
        for i in range(3):
            assert client.release(f"s{i}")
        assert gauge("dflash_state_pool_usage_ratio") == 0.0
        assert gauge("dflash_kv_cache_usage_ratio") == 0.0
        for i in range(3):                                  # all three slots are free again
            client.prefill(f"again{i}", PROMPT)
        expect_status(lambda: client.prefill("again3", PROMPT), grpc.StatusCode.RESOURCE_EXHAUSTED)
        for i in range(3):            # a SIGTERM'd target waits (--drain-grace) for held sequences
            assert client.release(f"again{i}")
    finally:
        client.close()
        assert server.stop() == 0


@pytest.mark.slow              # two target processes
def test_speculative_verify_equals_greedy_and_needs_the_commit(hybrid_dir, logs, server):
    n = 40
    reference = hf_greedy(hf_model(hybrid_dir), PROMPT, n)
    unsafe = start_target(hybrid_dir, logs, *SMALL, hooks=HookFlags(skip_mamba_commit=True))
    try:
        client = TargetClient(server.address)
        assert client.greedy("ar", PROMPT, n) == reference       # 1-token blocks
        out, partial = speculate(client, "spec", PROMPT, reference, n)
        print(f"partial accepts: {partial}")
        assert partial >= 5
        assert out == reference
        client.close()
        client = TargetClient(unsafe.address)
        caps = client.capabilities()
        assert caps.mamba_verify_commit          # advertised, but skipped
        assert client.greedy("ar", PROMPT, n) == reference       # no commit needed for B=1
        skipped, _ = speculate(client, "spec", PROMPT, reference, n)
        assert skipped != reference
        client.close()
        assert "UNSAFE testing hook" in unsafe.log()
    finally:
        assert unsafe.stop() == 0


def test_prefill_features_of_a_hybrid_target_are_the_residual_stream(hybrid_dir, server):
    """capture_layers count model layers (mamba and attention alike), as for dense targets."""
    client = TargetClient(server.address)
    r = client.prefill("f", PROMPT, capture_layers=(0, 1, 3), feature_dtype="float32")
    client.release("f")
    client.close()
    feats = decode(r.features)
    with torch.no_grad():
        hs = hf_model(hybrid_dir)(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[1][0], hs[2][0]], dim=-1)         # hidden_states[0]: the embeddings
    assert feats.shape == (len(PROMPT), 3 * 64)
    assert (feats[:, :128] - ref).abs().max().item() <= 1e-4
