"""The DFlash drafter through its real code (checkpoint loading, paged context KV, batched block
forward) against an independent from-scratch forward (tests/support/dflash_reference.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.dflash_reference import ReferenceDFlash
from support.tiny_models import make_tiny

from dflash.make_draft import default_mask_token_id, make_random_drafter
from runtime.models.dflash import (
    DFlashConfig,
    TargetFingerprint,
    TargetHead,
    build_target_layer_ids,
    checkpoint_tensors,
    load_dflash,
    save_dflash,
)
from services.draft.config import DraftConfig
from services.draft.dflash_drafter import DFlashDrafter, compatibility_problems
from services.draft.drafter import DrafterRefused, ProposeItem
from services.draft.sequence import DraftSequence
from train.blocks import draft_hidden

LAYER_IDS = [1, 2]           # tiny targets have 4 layers


@pytest.fixture(scope="module")
def tiny_draft(tiny_qwen3_dir: Path, tmp_path_factory) -> Path:
    out = make_random_drafter(tiny_qwen3_dir, tmp_path_factory.mktemp("draft"), num_layers=2,
                              block_size=8, target_layer_ids=LAYER_IDS, seed=1)
    # Unit norm weights would hide a norm applied twice or skipped: make every norm distinct.
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.3 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def sliding_draft(tiny_draft: Path, tmp_path_factory) -> Path:
    """The same weights with a causal sliding-window first layer."""
    out = tmp_path_factory.mktemp("sliding")
    cfg = json.loads((tiny_draft / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").write_bytes((tiny_draft / "model.safetensors").read_bytes())
    return out


def drafter_for(draft_dir: Path, target_dir: Path, page_size: int = 4) -> DFlashDrafter:
    d = DFlashDrafter(DraftConfig(target_dir=str(target_dir), model_dir=str(draft_dir),
                                  page_size=page_size, kv_budget_bytes=8 << 20))
    d.init_backend()
    return d


def step(drafter: DFlashDrafter, seq: DraftSequence, feats: torch.Tensor | None, anchor: int,
         block: int):
    """One Propose as the engine does it: reserve, run, commit."""
    n = 0 if feats is None else feats.shape[0]
    item = ProposeItem(seq, seq.context_len, n, feats, [], anchor, block)
    drafter.reserve(item)
    out = drafter.run([item])
    seq.context_len = item.context_len
    return out


@pytest.mark.parametrize("which", ["full", "sliding"])
def test_incremental_context_equals_from_scratch(which, tiny_draft, sliding_draft, tiny_qwen3_dir):
    draft_dir = tiny_draft if which == "full" else sliding_draft
    drafter = drafter_for(draft_dir, tiny_qwen3_dir)
    ref = ReferenceDFlash(draft_dir, tiny_qwen3_dir)
    gen = torch.Generator().manual_seed(0)
    width = drafter.facts.feature_width
    all_feats = torch.randn(40, width, generator=gen).to(torch.bfloat16)
    seq = DraftSequence("s")
    # (new context rows, anchor, block): a prompt, then accepted blocks of varying size,
    # a call without new rows, and blocks smaller than the trained 8.
    plan = [(11, 7, 8), (1, 9, 8), (5, 3, 8), (0, 4, 8), (8, 100, 4), (2, 17, 2), (6, 200, 8)]
    seen = 0
    for n, anchor, block in plan:
        out = step(drafter, seq, all_feats[seen: seen + n] if n else None, anchor, block)
        seen += n
        expected = ref.block_hidden(all_feats[:seen], anchor, block)
        torch.testing.assert_close(out.hidden, expected, rtol=0, atol=1e-5)
        assert out.drafts == [ref.drafts(expected)]
        assert len(out.drafts[0]) == block - 1
        # only committed context keeps pages: the block's slots were given back
        assert len(seq.table.pages) == drafter.cache.pages_for(seen)
    assert seq.context_len == seen


def test_batched_equals_one_at_a_time(tiny_draft, tiny_qwen3_dir):
    lengths = [1, 3, 5, 8, 13, 2, 21, 7]
    blocks = [8, 8, 4, 8, 2, 8, 6, 8]
    gen = torch.Generator().manual_seed(3)
    batched = drafter_for(tiny_draft, tiny_qwen3_dir)
    single = drafter_for(tiny_draft, tiny_qwen3_dir)
    width = batched.facts.feature_width
    seqs_b = [DraftSequence(f"b{i}") for i in range(8)]
    seqs_s = [DraftSequence(f"s{i}") for i in range(8)]
    for round_ in range(2):                # prompts, then one more accepted block each
        news = lengths if round_ == 0 else [1 + i % 4 for i in range(8)]
        feats = [torch.randn(n, width, generator=gen).to(torch.bfloat16) for n in news]
        anchors = [int(a) for a in torch.randint(0, 256, (8,), generator=gen)]
        items = [ProposeItem(s, s.context_len, n, f, [], a, b)
                 for s, n, f, a, b in zip(seqs_b, news, feats, anchors, blocks)]
        for item in items:
            batched.reserve(item)
        out_b = batched.run(items)
        for item in items:
            item.seq.context_len = item.context_len
        hidden_s, drafts_s = [], []
        for s, f, a, b in zip(seqs_s, feats, anchors, blocks):
            out = step(single, s, f, a, b)
            hidden_s.append(out.hidden)
            drafts_s.extend(out.drafts)
        assert out_b.drafts == drafts_s
        torch.testing.assert_close(out_b.hidden, torch.cat(hidden_s), rtol=0, atol=1e-5)


def test_zlab_round_trip(tiny_draft, tiny_qwen3_dir, tmp_path):
    names = set(load_file(str(tiny_draft / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.1.post_attention_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n or "qkv" in n for n in names)
    cfg = json.loads((tiny_draft / "config.json").read_text())
    assert cfg["dflash_config"] == {"target_layer_ids": LAYER_IDS, "mask_token_id": 255}
    assert cfg["block_size"] == 8
    model = load_dflash(tiny_draft)
    again = save_dflash(model, tmp_path / "copy")
    reloaded = load_dflash(again)
    for name, t in checkpoint_tensors(model).items():
        assert torch.equal(t, checkpoint_tensors(reloaded)[name]), name
    feats = torch.randn(9, 128).to(torch.bfloat16)
    outs = []
    for d in (tiny_draft, again):
        drafter = drafter_for(d, tiny_qwen3_dir)
        outs.append(step(drafter, DraftSequence("x"), feats, 5, 8))
    assert outs[0].drafts == outs[1].drafts
    assert torch.equal(outs[0].hidden, outs[1].hidden)


@pytest.fixture(scope="module")
def two_pass_draft(tiny_draft: Path, tmp_path_factory) -> Path:
    """The same weights with dflash_config.layer_passes 2: the block runs the stack twice."""
    out = tmp_path_factory.mktemp("two_pass")
    cfg = json.loads((tiny_draft / "config.json").read_text())
    cfg["dflash_config"]["layer_passes"] = 2
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").write_bytes((tiny_draft / "model.safetensors").read_bytes())
    return out


def test_layer_passes_run_the_stack_again_when_served_and_in_training(two_pass_draft, tiny_draft,
                                                                      tiny_qwen3_dir):
    assert DFlashConfig.from_dir(two_pass_draft).layer_schedule() == [0, 1, 0, 1]
    gen = torch.Generator().manual_seed(4)
    feats = torch.randn(12, 128, generator=gen).to(torch.bfloat16)
    ref = ReferenceDFlash(two_pass_draft, tiny_qwen3_dir)
    seq = DraftSequence("p")
    first = step(drafter_for(two_pass_draft, tiny_qwen3_dir), seq, feats[:9], 7, 8)
    again = step(drafter_for(two_pass_draft, tiny_qwen3_dir), DraftSequence("q"), feats[:9], 7, 8)
    expected = ref.block_hidden(feats[:9], 7, 8)
    torch.testing.assert_close(first.hidden, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(again.hidden, first.hidden, rtol=0, atol=0)
    one_pass = step(drafter_for(tiny_draft, tiny_qwen3_dir), DraftSequence("r"), feats[:9], 7, 8)
    assert (one_pass.hidden - first.hidden).abs().max() > 1e-2      # the second pass did run
    # the training forward (dense attention over all rows, context K/V once per layer) agrees;
    # the rows after the anchor are masked out of its context
    draft = load_dflash(two_pass_draft, torch.float32)
    head = TargetHead.load(tiny_qwen3_dir, torch.float32, "cpu")
    ids = torch.tensor([[[7] + [255] * 7]])
    pos = torch.arange(9, 17)[None, None]
    trained = draft_hidden(draft, head, feats.float()[None], ids, pos)
    torch.testing.assert_close(trained[0, 0], expected, rtol=0, atol=1e-4)


def test_layer_passes_below_one_are_refused(tiny_draft):
    raw = json.loads((tiny_draft / "config.json").read_text())
    raw["dflash_config"]["layer_passes"] = 0
    with pytest.raises(ValueError, match="layer_passes must be >= 1, got 0"):
        DFlashConfig.from_dict(raw)


def test_top_level_dflash_keys_and_default_layer_ids(tiny_draft, tmp_path):
    """Some checkpoints keep mask_token_id / target_layer_ids at the top level (z-lab's lookup
    reads dflash_config first, then the top level)."""
    cfg = json.loads((tiny_draft / "config.json").read_text())
    dc = cfg.pop("dflash_config")
    cfg.update(mask_token_id=dc["mask_token_id"], target_layer_ids=dc["target_layer_ids"])
    parsed = DFlashConfig.from_dict(cfg)
    assert parsed.mask_token_id == 255 and parsed.target_layer_ids == (1, 2)
    cfg.pop("target_layer_ids")
    assert DFlashConfig.from_dict(cfg).target_layer_ids == tuple(build_target_layer_ids(4, 2))
    cfg.pop("num_target_layers")
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_dict(cfg)


def test_wrong_fc_shape_fails_clearly(tiny_draft, tiny_qwen3_dir, tmp_path):
    tensors = load_file(str(tiny_draft / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(64, 3 * 64)              # K = 3, config says K = 2
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((tiny_draft / "config.json").read_text())
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 192\), expected \(64, 128\)"):
        load_dflash(bad)
    with pytest.raises(DrafterRefused, match=r"fc.weight input width 192 != K\*H_target = 2 x 64"):
        DFlashDrafter(DraftConfig(target_dir=str(tiny_qwen3_dir), model_dir=str(bad)))


def test_compatibility_problems_name_expected_and_got(tiny_draft):
    cfg = DFlashConfig.from_dir(tiny_draft)
    same = TargetFingerprint(256, 64, 4, "")
    assert compatibility_problems(cfg, (64, 128), same) == []
    other = TargetFingerprint(200, 96, 2, "abc")
    text = "\n".join(compatibility_problems(cfg, (64, 128), other))
    for needle in ("vocab_size: the drafter was made for 256, the target has 200",
                   "hidden_size: the drafter was made for 64, the target has 96",
                   "num_layers: the drafter was made for 4, the target has 2",
                   "tokenizer_hash: the drafter was made for '', the target has 'abc'",
                   "mask_token_id 255 is outside the target vocabulary: expected an id in [0, 200)",
                   "fc.weight input width 128 != K*H_target = 2 x 96 = 192",
                   "target_layer_ids [1, 2] must be distinct ids in [0, 2)"):
        assert needle in text


def test_build_target_layer_ids_rule():
    assert build_target_layer_ids(30, 1) == [15]
    assert build_target_layer_ids(30, 2) == [1, 27]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]     # Qwen3-8B's released taps


def test_make_random_rejects_what_cannot_be_served(tiny_qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match=r"\[1, 1\] must be distinct.*pass --target-layer-ids"):
        make_random_drafter(tiny_qwen3_dir, tmp_path / "a", num_layers=2)
    with pytest.raises(ValueError, match=r"mask token id 256 is outside the target vocabulary \[0, 256\)"):
        make_random_drafter(tiny_qwen3_dir, tmp_path / "b", mask_token_id=256)


def test_make_draft_cli(tiny_llama_dir, tmp_path, capsys):
    from dflash.cli import main
    out = tmp_path / "d"
    assert main(["make-draft", "--target", str(tiny_llama_dir), "--out", str(out),
                 "--block-size", "4", "--seed", "3", "--dtype", "bfloat16"]) == 0
    cfg = DFlashConfig.from_dir(out)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (4, (2,), 255)
    assert cfg.target_fingerprint == TargetFingerprint.of_target(tiny_llama_dir)
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert "wrote a random DFlash drafter" in capsys.readouterr().out
    assert main(["make-draft", "--target", str(tiny_llama_dir), "--out", str(tmp_path / "e"),
                 "--target-layer-ids", "9"]) == 2


def test_tied_target_head_reads_the_embedding(tiny_llama_dir, tmp_path):
    draft = make_random_drafter(tiny_llama_dir, tmp_path / "d", block_size=4)
    drafter = drafter_for(draft, tiny_llama_dir)
    assert drafter.head.lm_head_weight is drafter.head.embed_weight
    ref = ReferenceDFlash(draft, tiny_llama_dir)
    feats = torch.randn(6, 64).to(torch.bfloat16)
    out = step(drafter, DraftSequence("t"), feats, 3, 4)
    torch.testing.assert_close(out.hidden, ref.block_hidden(feats, 3, 4), rtol=0, atol=1e-5)


def test_other_tiny_target_with_another_hidden_size_is_refused(tiny_draft, tmp_path):
    """A z-lab checkpoint (no recorded fingerprint) against a target of another width."""
    target = make_tiny(tmp_path / "wide", "llama", hidden_size=96)
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    cfg = json.loads((tiny_draft / "config.json").read_text())
    cfg.pop("target_fingerprint")
    (zlab / "config.json").write_text(json.dumps(cfg))
    (zlab / "model.safetensors").write_bytes((tiny_draft / "model.safetensors").read_bytes())
    with pytest.raises(DrafterRefused) as e:
        DFlashDrafter(DraftConfig(target_dir=str(target), model_dir=str(zlab)))
    assert "draft hidden_size 64 != target hidden_size 96" in str(e.value)
    assert "fc.weight input width 128 != K*H_target = 2 x 96 = 192" in str(e.value)


@pytest.mark.slow
def test_smollm2_default_mask_token(smollm2_dir):
    assert default_mask_token_id(smollm2_dir) == 16        # <empty_output>
