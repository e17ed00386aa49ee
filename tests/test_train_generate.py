"""Training-time use of the target (`TargetRunner`): answer generation in waves is exactly the
target's greedy output (against transformers) and samples the target's distribution; features
come with the target's greedy next token; labels follow the target's greedy chain."""
from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch

from runtime.models.dflash import TargetHead, load_dflash
from runtime.tokenizer import ChatTokenizer
from train.acceptance import simulate_each
from train.blocks import (
    accepted_drafts,
    block_inputs,
    block_loss,
    draft_hidden,
    hop_anchors,
    reach_weights,
    soft_targets,
)
from train.features import FeatureCache, FeatureExtractor
from train.generate import answer_wave, chat_prompt_ids
from train.target_runner import TargetRunner

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
PROMPTS = ["Hi", "Explain why the sky is blue in two sentences please.", "List 3 fruits.",
           "What is 2+2? Answer with a number only."]


@pytest.fixture(scope="module")
def runner(smollm2_dir) -> TargetRunner:
    return TargetRunner(str(smollm2_dir), 300 * 40, torch.float32, "cpu")


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    tok = ChatTokenizer(smollm2_dir)
    return [chat_prompt_ids(tok, t) for t in PROMPTS]


def test_greedy_wave_is_the_targets_own_output(runner, prompts, smollm2_reference):
    out = answer_wave(runner, prompts, 0.0, 40, seed=0)
    eos = set(runner.eos_token_ids)
    for p, resp in zip(prompts, out):
        assert resp == smollm2_reference(p, 40)[: len(resp)]
        assert len(resp) == 40 or (resp[-1] in eos and not eos & set(resp[:-1]))
    assert any(len(r) < 40 for r in out) and any(len(r) == 40 for r in out)
    assert runner.cache.used_pages == 0                 # pages go back after the wave


def test_sampled_wave_is_seeded_and_draws_from_the_targets_distribution(runner, prompts):
    a = answer_wave(runner, prompts, 0.7, 12, seed=1)
    assert a == answer_wave(runner, prompts, 0.7, 12, seed=1)
    assert a != answer_wave(runner, prompts, 0.7, 12, seed=2)
    # The first answer token of one prompt drawn 256 times vs softmax(logits / T).
    p = prompts[1]
    draws = [r[0] for r in answer_wave(runner, [p] * 256, 0.7, 1, seed=3)]
    with torch.no_grad():
        logits = runner.model.compute_logits(_last_hidden(runner, p))
    probs = torch.softmax(logits / 0.7, -1)
    seen = torch.bincount(torch.tensor(draws), minlength=probs.numel()).float() / len(draws)
    tv = 0.5 * float((seen - probs).abs().sum())
    assert tv < 0.15, tv                                # sampling noise at n=256 is ~0.05
    greedy = set(answer_wave(runner, [p], 0.0, 1, seed=0)[0])
    assert len(set(draws)) > 1 and greedy <= set(draws)


def _last_hidden(runner: TargetRunner, prompt: list[int]) -> torch.Tensor:
    from runtime.attention.metadata import SeqSlice
    tables = runner.tables([len(prompt)])
    try:
        out = runner.forward([SeqSlice(tables[0], 0, len(prompt))], torch.tensor(prompt))
    finally:
        runner.release(tables)
    return out.hidden[-1:]


def test_features_come_with_the_targets_greedy_next_tokens(smollm2_dir, prompts):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ext = FeatureExtractor(str(smollm2_dir), (1, 8), 1024, torch.float32, "cpu")
    seqs = prompts[:2]
    out = ext(seqs, final=True)
    assert out.feats.shape == (2, max(map(len, seqs)), 2 * 576)
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([s]), output_hidden_states=True)
        assert out.greedy[i, : len(s)].tolist() == ref.logits[0].argmax(-1).tolist()
        # the LM head's input: its logits are the target's (soft labels)
        with torch.no_grad():
            logits = out.final[i, : len(s)] @ hf.lm_head.weight.t()
        torch.testing.assert_close(logits, ref.logits[0], atol=2e-3, rtol=1e-4)
        torch.testing.assert_close(out.feats[i, : len(s), 576:], ref.hidden_states[9][0],
                                   atol=1e-4, rtol=1e-4)
        assert not out.feats[i, len(s):].any()


def test_feature_cache_returns_what_the_extractor_computes(smollm2_dir, prompts):
    ext = FeatureExtractor(str(smollm2_dir), (1, 8), 1024, torch.float32, "cpu")
    cache = FeatureCache(ext, prompts, batch=3, greedy=True, final=True)   # two forwards
    for pick in ([2, 0], [3], [1, 2, 3, 0]):
        seqs = [prompts[i] for i in pick]
        got, ref = cache(pick), ext(seqs, final=True)
        assert got.feats.shape == ref.feats.shape and got.greedy.shape == ref.greedy.shape
        torch.testing.assert_close(got.feats, ref.feats, atol=1e-4, rtol=1e-4)   # pads: zeros
        torch.testing.assert_close(got.final, ref.final, atol=1e-4, rtol=1e-4)
        assert got.greedy.tolist() == ref.greedy.tolist()
    assert ext.width == 1152 and ext(prompts[:1]).final is None
    assert FeatureCache.nbytes(ext, prompts) == sum(map(len, prompts)) * 1152 * 4   # fp32
    assert FeatureCache.nbytes(ext, prompts, final=True) == sum(map(len, prompts)) * 1728 * 4
    assert cache.feats.shape == (sum(map(len, prompts)) + 1, 1152) and not cache.feats[-1].any()


def test_greedy_chain_labels_stop_where_the_sequence_leaves_the_chain():
    # Sequence 0..9; the target's greedy after t is t+1 everywhere except after 4 (it says 99).
    ids = torch.arange(10)[None]
    greedy = (torch.arange(10) + 1)[None].clone()
    greedy[0, 4] = 99
    anchors = torch.tensor([[2, 6]])
    bids, _, labels = block_inputs(ids, anchors, 5, 16, torch.tensor([10]), greedy)
    assert bids.tolist() == [[[2, 16, 16, 16, 16], [6, 16, 16, 16, 16]]]
    # anchor 2: labels 3, 4 on the chain, then the greedy choice after 4 (99); token 5 is off
    # the chain, so nothing after it is a greedy-chain label.
    assert labels[0, 0].tolist() == [3, 4, 99, -100]
    # anchor 6: labels 7, 8, 9, then past the end of the sequence.
    assert labels[0, 1].tolist() == [7, 8, 9, -100]
    # With the sequence's own tokens as labels, nothing is cut but the end.
    _, _, own = block_inputs(ids, anchors, 5, 16, torch.tensor([10]))
    assert own.tolist() == [[[3, 4, 5, 6], [7, 8, 9, -100]]]


def test_soft_targets_are_the_targets_lm_head_inputs_before_each_draft_position():
    # final[s, t] = 100 s + t (one channel): draft position k of the block at anchor p reads
    # the target's state at p+k-1, clamped at the sequence's last row.
    final = (100 * torch.arange(2)[:, None] + torch.arange(10)[None]).float()[..., None]
    got = soft_targets(final, torch.tensor([[2, 7], [0, 5]]), 5)[..., 0]
    assert got.tolist() == [[[2, 3, 4, 5], [7, 8, 9, 9]], [[100, 101, 102, 103], [105, 106, 107, 108]]]


def test_soft_label_loss_is_zero_kl_where_the_draft_matches_the_target_and_only_where_labelled():
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    head = TargetHead(weight, weight)                # tied: embedding = LM head
    hidden = torch.randn(1, 2, 4, 8)                  # [S, nb, B, H]
    labels = torch.tensor([[[3, 4, 5], [6, -100, -100]]])
    w = torch.ones(3)
    ce, _ = block_loss(hidden, labels, head, w)
    # the target's distribution equals the draft's: KL adds nothing
    same, _ = block_loss(hidden, labels, head, w, hidden[:, :, 1:], 1.0)
    torch.testing.assert_close(same, ce)
    # another target: the loss grows by W x the mean KL over the labelled positions only
    other = torch.randn(1, 2, 3, 8)
    got, _ = block_loss(hidden, labels, head, w, other, 0.5)
    t = torch.log_softmax(other @ head.lm_head_weight.t(), -1)
    d = torch.log_softmax(hidden[:, :, 1:] @ head.lm_head_weight.t(), -1)
    kl = (t.exp() * (t - d)).sum(-1)                  # [1, 2, 3]
    labelled = labels >= 0
    torch.testing.assert_close(got, ce + 0.5 * kl[labelled].mean())
    assert float(got) > float(ce)


def _all_rows_loss(hidden, labels, head, weights, target_final, soft_weight):
    """block_loss as it was before it skipped unlabelled rows: every row through the LM head,
    weight 0 where unlabelled (the reference the faster one must equal)."""
    h = hidden[:, :, 1:].reshape(-1, hidden.shape[-1])
    logits = h @ head.lm_head_weight.t()
    flat = labels.reshape(-1)
    valid = (flat >= 0).float()
    ce = torch.nn.functional.cross_entropy(logits, flat.clamp(min=0), reduction="none")
    t = torch.log_softmax(target_final.reshape(h.shape) @ head.lm_head_weight.t(), -1)
    ce = ce + soft_weight * (t.exp() * (t - torch.log_softmax(logits, -1))).sum(-1) * valid
    w = weights.repeat(labels.shape[0] * labels.shape[1]) * valid
    correct = ((logits.argmax(-1) == flat).float() * valid).view(-1, labels.shape[-1])
    acc = correct.sum(0) / valid.view(-1, labels.shape[-1]).sum(0).clamp(min=1.0)
    return (ce * w).sum() / w.sum(), acc


def test_block_loss_over_labelled_rows_equals_the_loss_over_all_rows_and_its_gradient():
    torch.manual_seed(1)
    weight = torch.randn(40, 8)
    head = TargetHead(weight, weight)
    labels = torch.randint(0, 40, (2, 3, 5))
    labels[torch.rand(labels.shape) < 0.5] = -100     # half off the chain, as sampled answers
    labels[1, 2] = -100                               # a block with no label at all
    final = torch.randn(2, 3, 5, 8)
    w = torch.exp(-torch.arange(5.0) / 3)
    hidden = torch.randn(2, 3, 6, 8, requires_grad=True)
    got, got_acc = block_loss(hidden, labels, head, w, final, 0.7)
    (g_got,) = torch.autograd.grad(got, hidden)
    want, want_acc = _all_rows_loss(hidden, labels, head, w, final, 0.7)
    (g_want,) = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_acc, want_acc)
    torch.testing.assert_close(g_got, g_want)
    assert not g_got[1, 2].any()                     # an unlabelled block gets no gradient


def test_reach_weights_are_the_drafters_probability_of_the_labels_before_each_position():
    # two blocks of 4 draft positions; the second's last two positions are unlabelled
    ce = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    got = reach_weights(ce, rows, 8, 4)
    p = torch.exp(-ce)
    want = torch.stack([torch.tensor(1.0), p[0], p[0] * p[1], p[0] * p[1] * p[2],
                        torch.tensor(1.0), p[4]])
    torch.testing.assert_close(got, want)


def test_reach_weight_leaves_position_one_and_cuts_the_gradient_behind_a_hopeless_draft():
    torch.manual_seed(2)
    weight = torch.randn(30, 8)
    head = TargetHead(weight, weight)
    hidden = torch.randn(1, 2, 4, 8)
    logits = hidden[:, :, 1:] @ weight.t()           # [1, 2, 3, V]
    labels = logits.argmax(-1)                        # every position the draft's own argmax ...
    labels[0, 1, 0] = logits[0, 1, 0].argmin()        # ... but block 2's first is hopeless
    w = torch.ones(3)
    hidden.requires_grad_(True)
    plain, _ = block_loss(hidden, labels, head, w)
    (g_plain,) = torch.autograd.grad(plain, hidden)
    got, _ = block_loss(hidden, labels, head, w, reach_weight=1.0)
    (g_got,) = torch.autograd.grad(got, hidden)
    # the weights are linear in R and normalised without the reach factor: R = 0.5 lies halfway
    half, _ = block_loss(hidden, labels, head, w, reach_weight=0.5)
    torch.testing.assert_close(half, (plain + got) / 2)
    # position 1 keeps its gradient; block 2's later positions lose almost all of theirs
    torch.testing.assert_close(g_got[:, :, 1], g_plain[:, :, 1])
    assert g_got[0, 1, 2:].norm() < 1e-3 * g_plain[0, 1, 2:].norm()
    assert g_got[0, 0, 2:].norm() > 0.1 * g_plain[0, 0, 2:].norm()
    assert float(got.detach()) < float(plain.detach())


def test_warm_start_copies_the_targets_last_layers_and_projects_the_deepest_tap(smollm2_dir,
                                                                               prompts):
    """--init-from-target: draft layers 0..2 are the target's layers 27..29, and the first draft
    layer projects the context as target layer 27 projects its input, here tap 27's features."""
    from transformers import AutoModelForCausalLM

    from runtime.config import read_config_json
    from runtime.models.dflash import DFlashConfig, DFlashDraftModel, init_random
    from runtime.models.registry import build_empty
    from train.config import TrainConfig
    from train.trainer import (
        draft_config_dict,
        init_from_target_layers,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    taps = (1, 8, 14, 20, 27)

    def draft_of(**kw) -> DFlashDraftModel:
        cfg = TrainConfig(target_dir=str(smollm2_dir), out_dir="", num_layers=3,
                          mask_token_id=16, **kw)
        raw = draft_config_dict(cfg, read_config_json(smollm2_dir), taps)
        draft = build_empty(DFlashDraftModel, DFlashConfig.from_dict(raw), "cpu", torch.float32)
        init_random(draft, 0)
        return draft

    draft = draft_of()
    assert init_from_target_layers(draft, str(smollm2_dir)) == [27, 28, 29]
    for i, j in enumerate((27, 28, 29)):
        mine, theirs = draft.layers[i], hf.model.layers[j]
        attn, mlp = theirs.self_attn, theirs.mlp
        assert torch.equal(mine.self_attn.qkv_proj.weight, torch.cat(
            [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        assert torch.equal(mine.mlp.gate_up_proj.weight,
                           torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert torch.equal(mine.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight)
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(mine.post_attention_layernorm.weight,
                           theirs.post_attention_layernorm.weight)
    seq = torch.tensor([prompts[1]])
    ext = FeatureExtractor(str(smollm2_dir), taps, 1024, torch.float32, "cpu")
    feats = ext([prompts[1]]).feats[0]                                  # [T, 5 * 576]
    with torch.no_grad():
        deep = hf(seq, output_hidden_states=True).hidden_states[28][0]  # tap 27: layer 27 out
        layer = hf.model.layers[27]
        ctx = layer.input_layernorm(deep)
        _, v = draft.context_kv(feats, torch.arange(len(seq[0])))[0]
        projected = draft.project_context(feats)
    torch.testing.assert_close(projected, ctx, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v.reshape(len(seq[0]), -1), layer.self_attn.v_proj(ctx),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="FFN width 2048 differs from the target's"):
        init_from_target_layers(draft_of(intermediate_size=2048), str(smollm2_dir))


def test_hop_anchors_are_where_the_speculative_loop_of_the_shipped_drafter_goes(runner, prompts,
                                                                                 smollm2_dir):
    # the target's greedy answer, its features, the shipped drafter: the loop run one block at a
    # time (checked against simulate_each) visits the anchors that hop_anchors reaches in 1..4
    answer = answer_wave(runner, prompts[1:2], 0.0, 64, seed=0)[0]
    seq = prompts[1] + answer
    draft = load_dflash(SHIPPED, torch.float32, "cpu")
    head = TargetHead.load(str(smollm2_dir), torch.float32, "cpu")
    ext = FeatureExtractor(str(smollm2_dir), draft.cfg.target_layer_ids, 1024, torch.float32,
                           "cpu")
    feats = ext([seq], greedy=False).feats
    ids, lens = torch.tensor([seq]), torch.tensor([len(seq)])
    block, mask = draft.cfg.block_size, draft.cfg.mask_token_id
    loop, p, committed = [len(prompts[1])], len(prompts[1]), 0
    with torch.no_grad():
        while p < len(seq) - 1:
            bids, bpos, labels = block_inputs(ids, torch.tensor([[p]]), block, mask, lens)
            a = int(accepted_drafts(draft_hidden(draft, head, feats, bids, bpos), labels, head))
            step = min(a + 1, len(seq) - 1 - p)
            p, committed = p + step, committed + step
            loop.append(p)
    (st,) = simulate_each(draft, head, feats, ids, torch.tensor([len(prompts[1])]), lens, block)
    assert (st.steps, st.tokens) == (len(loop) - 1, committed)
    assert max(b - a for a, b in pairwise(loop)) > 1       # the drafter is accepted
    start = torch.tensor([[loop[0], loop[0], loop[1]]])
    for hops in range(1, 5):
        got = hop_anchors(draft, head, feats, ids, start, lens, block, mask, hops)
        assert got.tolist() == [[loop[hops], loop[hops], loop[hops + 1]]]
    # bench.anchor_positions drafts at every position and replays the loop from a(p): the same
    from bench.anchor_positions import by_target_confidence, drafts_everywhere, hop, loop_offsets
    from train.generate import Example
    d = drafts_everywhere(draft, head, ext, Example("p", "c", prompts[1], answer, 0.0))
    acc = d.accepted
    # the target's next token there is the greedy answer's; a first draft that is the target's
    # second choice is rejected
    assert d.target_next == answer[1:] and all(0 < p1 <= 1 for p1 in d.target_top1)
    assert all(a == 0 for a, second in zip(acc, d.second_choice) if second)
    bands = by_target_confidence(list(zip(acc, d.target_top1, d.second_choice)))
    assert abs(sum(b["share"] for b in bands.values()) - 1) < 1e-3
    assert [len(prompts[1]) + o for o in loop_offsets(acc)] == loop[:-1]
    assert len(prompts[1]) + hop(acc, 0, 3) == loop[3] and hop(acc, len(acc) - 1, 1) is None
    # an anchor with a label left (length - 2) does not hop past it
    end = torch.tensor([[len(seq) - 2]])
    assert hop_anchors(draft, head, feats, ids, end, lens, block, mask, 3).tolist() == [[len(seq) - 2]]
