"""The recurrent state of a hybrid target across verify blocks: the commit after a partial
accept, the live state left alone by verify, 1-token blocks, the pool's slots and memory - for
Mamba2 (Bamba, Granite-4.0-H, NemotronH with its MLP / MoE blocks between, Falcon-H1 with
attention beside each mixer) and Gated DeltaNet (Qwen3.5, Qwen3-Next) layers alike."""
from __future__ import annotations

import pytest
import torch
from support.hybrid import HybridSeq, forward_many, hf_logits, hf_model, make_tiny_hybrid
from support.inproc_target import loaded_worker

from runtime.attention.mamba_state_backend import MissingVerifyStates
from runtime.kv_cache import PagedKVCache
from runtime.state_pool import MambaStatePool, OutOfStateSlots

STATE_TOL = 1e-5


@pytest.fixture(scope="module", params=["bamba", "granitemoehybrid", "qwen3_5", "qwen3_next",
                                        "nemotron_h", "falcon_h1"])
def hybrid_dir(tmp_path_factory, request):
    return make_tiny_hybrid(tmp_path_factory.mktemp(f"tiny_{request.param}"),
                            family=request.param)


@pytest.fixture(scope="module")
def worker(hybrid_dir):
    return loaded_worker(hybrid_dir, state_slots=4, max_block_size=8)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def assert_same_state(a: HybridSeq, b: HybridSeq) -> None:
    (ca, sa), (cb, sb) = a.state(), b.state()
    assert sa.abs().max() > 0.01, "the SSM state is ~0: the comparison would prove nothing"
    assert (ca - cb).abs().max().item() <= STATE_TOL
    assert (sa - sb).abs().max().item() <= STATE_TOL


@pytest.mark.parametrize("last", [0, 2, 5, 7])
def test_state_after_partial_accept_equals_decoding_the_accepted_tokens(worker, last):
    """Verify an 8-token block, keep positions 0..last; a twin decodes those tokens one by one."""
    ids = prompt(18, seed=last)
    spec, twin = HybridSeq(worker, "spec"), HybridSeq(worker, "twin")
    try:
        spec.run(ids[:10]), twin.run(ids[:10])
        spec.run(ids[10:18], verify=True)
        spec.commit(last)
        for t in ids[10: 11 + last]:
            twin.run([t])
        assert spec.seq_len == twin.seq_len == 11 + last
        assert_same_state(spec, twin)
        nxt = prompt(3, seed=99)
        assert (spec.run(nxt) - twin.run(nxt)).abs().max().item() <= 1e-4
    finally:
        spec.release(), twin.release()


def test_batched_verify_commits_each_sequence_at_its_own_index(worker, hybrid_dir):
    ids = [prompt(20, seed=s) for s in (1, 2)]
    a, b = HybridSeq(worker, "a"), HybridSeq(worker, "b")
    try:
        a.run(ids[0][:9]), b.run(ids[1][:12])
        forward_many(worker, [(a, ids[0][9:15], True), (b, ids[1][12:18], True)])
        worker.commit_mamba_state([(a.slot, 1), (b.slot, 4)])
        a.seq_len, b.seq_len = 11, 17
        worker.kv_cache.trim(a.table, 11), worker.kv_cache.trim(b.table, 17)
        hf = hf_model(hybrid_dir)
        for seq, p in ((a, ids[0]), (b, ids[1])):
            end = seq.seq_len + 3
            ours = seq.run(p[seq.seq_len: end])
            ref = hf_logits(hf, p[:end])[-3:]
            assert (ours - ref).abs().max().item() <= 1e-4
    finally:
        a.release(), b.release()


def test_verify_leaves_the_live_state_alone_until_the_commit(worker):
    ids = prompt(16, seed=5)
    seq = HybridSeq(worker, "v")
    try:
        seq.run(ids[:10])
        before = seq.state()
        seq.run(ids[10:16], verify=True)
        after = seq.state()
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
        seq.commit(3)
        assert not torch.equal(before[1], seq.state()[1])
    finally:
        seq.release()


def test_one_token_block_advances_like_a_decode_step(worker):
    ids = prompt(11, seed=6)
    spec, twin = HybridSeq(worker, "one"), HybridSeq(worker, "step")
    try:
        spec.run(ids[:10]), twin.run(ids[:10])
        spec.run(ids[10:], verify=True)
        spec.commit(0)
        twin.run(ids[10:])
        assert_same_state(spec, twin)
    finally:
        spec.release(), twin.release()


def test_verify_without_a_verify_slot_is_refused(hybrid_dir):
    w = loaded_worker(hybrid_dir, state_slots=2, verify_state_slots=1, max_block_size=8)
    first, second = HybridSeq(w, "first"), HybridSeq(w, "second")
    assert w.state_pool.verify_slot(first.slot) is not None
    assert w.state_pool.verify_slot(second.slot) is None
    ids = prompt(14, seed=7)
    second.run(ids[:10])
    with pytest.raises(MissingVerifyStates, match="holds no verify slot"):
        second.run(ids[10:14], verify=True)
    second.run(ids[10:11], verify=True)            # a 1-token block needs no verify states
    second.commit(0)
    first.run(ids[:10])
    first.run(ids[10:14], verify=True)


def test_pool_slots_are_zeroed_counted_and_returned(hybrid_dir):
    w = loaded_worker(hybrid_dir, state_slots=2, verify_state_slots=1, max_block_size=8)
    pool = w.state_pool
    seq = HybridSeq(w, "dirty")
    seq.run(prompt(12, seed=8))
    assert pool.ssm[:, seq.slot].abs().max() > 0
    slot = seq.slot
    seq.release()
    assert pool.used_slots == 0 and pool.used_verify_slots == 0
    again = pool.allocate("fresh")
    assert again == slot
    assert pool.ssm[:, slot].abs().max() == 0 and pool.conv[:, slot].abs().max() == 0
    pool.allocate("other")
    with pytest.raises(OutOfStateSlots, match="all 2 state slots"):
        pool.allocate("third")
    pool.free(again)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(again)


def test_state_pool_memory_is_taken_from_the_kv_budget(hybrid_dir):
    budget = 8 << 20
    w = loaded_worker(hybrid_dir, kv_budget_bytes=budget, state_slots=8, max_block_size=16)
    pool, cfg = w.state_pool, w.model.hybrid_cfg
    expected = MambaStatePool.bytes_needed(cfg.state, len(cfg.recurrent_layers), 8, 8, 16,
                                           torch.float32)
    assert pool.nbytes == expected
    # 8 live states + 8 x 16 verify states, per recurrent layer: conv window + fp32 state
    # (Mamba2 [heads, head dim, state size], Gated DeltaNet [value heads, key dim, value dim])
    m = cfg.state
    state = m.ssm_state_shape
    per_state = m.conv_dim * 3 * 4 + state[0] * state[1] * state[2] * 4
    assert expected == len(cfg.recurrent_layers) * per_state * (8 + 8 * 16)
    base = w.model.cfg
    per_page = PagedKVCache.bytes_per_page(w.num_attention_layers, base.num_kv_heads,
                                           base.head_dim, 4, torch.float32)
    assert w.kv_cache.num_pages == (budget - pool.nbytes) // per_page
    # 2 attention layers (NemotronH: of 6 blocks; Falcon-H1: all 4 layers, beside the mixers)
    assert w.kv_cache.k.shape[0] == len(cfg.attention_layers) == (
        4 if cfg.base.architecture == "falcon_h1" else 2)


def test_a_state_pool_larger_than_the_budget_is_refused_at_start(hybrid_dir):
    with pytest.raises(ValueError, match="recurrent state pool alone needs"):
        loaded_worker(hybrid_dir, kv_budget_bytes=1 << 20, state_slots=64, max_block_size=32)


def test_blocks_of_one_token_need_no_verify_states(hybrid_dir):
    """max_block_size 1 (plain decoding through Verify): the pool holds live states only."""
    w = loaded_worker(hybrid_dir, state_slots=2, max_block_size=1, token_budget=64)
    assert w.state_pool.verify_ssm.numel() == 0
    cfg = w.model.hybrid_cfg
    assert w.state_pool.nbytes == MambaStatePool.bytes_needed(
        cfg.state, len(cfg.recurrent_layers), 2, 2, 1, torch.float32)
    ids = prompt(12, seed=9)
    spec, twin = HybridSeq(w, "one"), HybridSeq(w, "step")
    spec.run(ids[:10]), twin.run(ids[:10])
    for t in ids[10:]:
        spec.run([t], verify=True)
        spec.commit(0)
        twin.run([t])
    assert_same_state(spec, twin)
