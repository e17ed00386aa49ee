"""The hybrid models (Bamba: Mamba2 + attention; Granite-4.0-H: Bamba's layers with MoE and
Granite's scalings; Qwen3.5: Gated DeltaNet + gated attention; Qwen3.5-MoE; Qwen3-Next:
Qwen3.5's layers with MoE and fused checkpoint projections) against transformers'
implementations, on random-initialised tiny checkpoints, fp32: prefill at
lengths around the scans' chunk sizes (Bamba 8 tokens, Qwen3.5 64), chunked prefill,
step-by-step decoding, mixed batches; the chunked scans against their recurrences; and
checkpoint checks."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from support.hybrid import (
    HybridSeq,
    attention_at,
    forward_many,
    hf_logits,
    hf_model,
    make_tiny_hybrid,
)
from support.inproc_target import loaded_worker

from runtime.layers.gated_deltanet import delta_chunked, delta_recurrent
from runtime.layers.mamba2 import ssd_chunked, ssd_step
from runtime.models.registry import load_model

TOL = 1e-4


@pytest.fixture(scope="module", params=["bamba", "granitemoehybrid", "qwen3_5", "qwen3_5_moe",
                                        "qwen3_next", "nemotron_h", "falcon_h1"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, family):
    return make_tiny_hybrid(tmp_path_factory.mktemp(f"tiny_{family}"), family=family)


@pytest.fixture(scope="module")
def hf(hybrid_dir):
    return hf_model(hybrid_dir)


@pytest.fixture(scope="module")
def worker(hybrid_dir):
    return loaded_worker(hybrid_dir, state_slots=6, max_block_size=16)


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("length", [1, 7, 8, 9, 17, 40, 70])
def test_prefill_logits_match_transformers(worker, hf, length):
    ids = prompt(length, seed=length)
    seq = HybridSeq(worker, "p")
    try:
        ours = seq.run(ids)
    finally:
        seq.release()
    ref = hf_logits(hf, ids)
    assert (ours - ref).abs().max().item() <= TOL


def test_chunked_prefill_matches_one_prefill(worker, hf):
    """A prompt fed in chunks of 5, 11, 3, 13 tokens (crossing the scan's chunks each time)."""
    ids = prompt(32, seed=3)
    seq = HybridSeq(worker, "c")
    try:
        ours = torch.cat([seq.run(ids[a:b]) for a, b in [(0, 5), (5, 16), (16, 19), (19, 32)]])
    finally:
        seq.release()
    assert (ours - hf_logits(hf, ids)).abs().max().item() <= TOL


def test_step_by_step_decoding_matches_transformers(worker, hf):
    """Prefill 12 tokens, then 28 single-token forwards (the recurrence, not the scan)."""
    ids = prompt(40, seed=4)
    seq = HybridSeq(worker, "d")
    try:
        steps = [seq.run(ids[:12])] + [seq.run([t]) for t in ids[12:]]
    finally:
        seq.release()
    ours = torch.cat(steps)
    assert (ours - hf_logits(hf, ids)).abs().max().item() <= TOL


def test_mixed_batch_matches_separate_sequences(worker, hf):
    """One forward holding a prefill chunk, two decode steps and two verify blocks."""
    ids = [prompt(30, seed=s) for s in range(5)]
    seqs = [HybridSeq(worker, f"m{i}") for i in range(4)]
    try:
        for seq, p in zip(seqs, ids):
            seq.run(p[:10])
        a = HybridSeq(worker, "m4")
        seqs.append(a)
        parts = [(a, ids[4][:9], False), (seqs[0], ids[0][10:11], False),
                 (seqs[1], ids[1][10:11], False), (seqs[2], ids[2][10:16], True),
                 (seqs[3], ids[3][10:16], True)]
        outs = forward_many(worker, parts)
    finally:
        for seq in seqs:
            seq.release()
    refs = [hf_logits(hf, ids[4][:9])[0:9], hf_logits(hf, ids[0][:11])[10:11],
            hf_logits(hf, ids[1][:11])[10:11], hf_logits(hf, ids[2][:16])[10:16],
            hf_logits(hf, ids[3][:16])[10:16]]
    for ours, ref in zip(outs, refs):
        assert (ours - ref).abs().max().item() <= TOL


def test_chunked_scan_equals_the_recurrence():
    """ssd_chunked over 21 tokens in chunks of 4 == 21 single steps (state and outputs)."""
    g = torch.Generator().manual_seed(0)
    b, L, nh, hd, N = 2, 21, 3, 4, 5
    x = torch.randn(b, L, nh, hd, generator=g)
    dt = torch.rand(b, L, nh, generator=g)
    dA = -dt * torch.rand(nh, generator=g)
    B, C = torch.randn(b, L, nh, N, generator=g), torch.randn(b, L, nh, N, generator=g)
    D, h0 = torch.randn(nh, generator=g), torch.randn(b, nh, hd, N, generator=g)
    y, h = ssd_chunked(h0, x, dt, dA, B, C, D, chunk=4)
    hs, ys = h0, []
    for t in range(L):
        yt, hs = ssd_step(hs, x[:, t], dt[:, t], dA[:, t], B[:, t], C[:, t], D)
        ys.append(yt)
    assert torch.allclose(y, torch.stack(ys, dim=1), atol=1e-5)
    assert torch.allclose(h, hs, atol=1e-5)


def _with_config(src, dst, drop=(), **changes):
    """A copy of checkpoint src with config.json's fields `drop` removed and `changes` set."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_delta_rule_in_chunks_equals_the_recurrence():
    """delta_chunked over 21 tokens in chunks of 4 == 21 single steps (state and outputs), with
    4 value heads, from a nonzero state."""
    g = torch.Generator().manual_seed(0)
    b, L, nv, dk, dv = 2, 21, 4, 5, 3
    q, k = (torch.nn.functional.normalize(torch.randn(b, L, nv, dk, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(b, L, nv, dv, generator=g)
    decay = -torch.rand(b, L, nv, generator=g)
    beta = torch.rand(b, L, nv, generator=g)
    S0 = torch.randn(b, nv, dk, dv, generator=g)
    o, S = delta_chunked(S0, q, k, v, decay, beta, chunk=4)
    o_ref, S_ref = delta_recurrent(S0, q, k, v, decay, beta, keep_states=False)
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(S, S_ref, atol=1e-5)


def test_layer_pattern_disagreeing_with_weights_fails_naming_the_layer(family, hybrid_dir,
                                                                      tmp_path):
    """config.json says layers 1 and 2 attend; the weights have attention at 1 and 3 (NemotronH:
    1 and 4, its layer 2 a mamba block)."""
    if family == "falcon_h1":
        pytest.skip("every Falcon-H1 layer attends and scans: config.json has no layer pattern")
    bad = _with_config(hybrid_dir, tmp_path / "bad", **attention_at(family, 4, [1, 2]))
    mixer = {"bamba": "mamba", "granitemoehybrid": "mamba", "nemotron_h": "mamba"}.get(
        family, "linear_attn")
    with pytest.raises(ValueError, match=rf"layer 2 is 'full_attention'.*\['{mixer}'\]"):
        load_model(bad)


def test_layers_beyond_config_fail_at_load(family, hybrid_dir, tmp_path):
    bad = _with_config(hybrid_dir, tmp_path / "short", **attention_at(family, 3, [1]))
    with pytest.raises(ValueError, match=r"layers \[3(, \d+)*\] beyond the 3 layers"):
        load_model(bad)


def test_a_qwen3_5_layout_the_project_does_not_know_fails_naming_the_field(tmp_path):
    """A layer kind other than linear_attention / full_attention, or value heads that the key
    heads do not divide: a start-up error naming the config field, before any weights load."""
    src = make_tiny_hybrid(tmp_path / "q", family="qwen3_5")
    odd = _with_config(src, tmp_path / "odd", layer_types=["linear_attention", "mamba",
                                                          "linear_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"layer_types .*'mamba'.*'linear_attention'"):
        load_model(odd)
    heads = _with_config(src, tmp_path / "heads", linear_num_value_heads=3)
    with pytest.raises(ValueError, match="linear_num_value_heads 3 is not a multiple of "
                                         "linear_num_key_heads 2"):
        load_model(heads)


def test_a_nemotron_h_pattern_from_the_hub_loads_and_one_it_does_not_know_fails(tmp_path):
    """The hub's configs give hybrid_override_pattern ("M*M-*E") instead of layers_block_type:
    the same model. A character other than M * - E, an activation other than relu2, latent
    expert projections: start-up errors naming the field."""
    src = make_tiny_hybrid(tmp_path / "n", family="nemotron_h")
    hub = _with_config(src, tmp_path / "hub", drop=["layers_block_type"],
                       hybrid_override_pattern="M*M-*E")
    ids = prompt(20, seed=9)
    assert torch.equal(run_once(hub, ids), run_once(src, ids))
    for name, changes, error in (
            ("x", {"hybrid_override_pattern": "M*X-*E"}, r"hybrid_override_pattern .*\['X'\]"),
            ("act", {"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported"),
            ("latent", {"moe_latent_size": 32}, "moe_latent_size")):
        bad = _with_config(src, tmp_path / name, drop=["layers_block_type"] if name == "x" else (),
                           **changes)
        with pytest.raises(ValueError, match=error):
            load_model(bad)


def test_falcon_h1_mixer_norm_variants_match_transformers(tmp_path):
    """Falcon-H1's mixer output: rms(y) * silu(z) (the tiny checkpoint: mamba_norm_before_gate),
    rms(y * silu(z)) per group (norm_before_gate off), y * silu(z) (mamba_rms_norm off)."""
    src = make_tiny_hybrid(tmp_path / "f", family="falcon_h1")
    after = _with_config(src, tmp_path / "after", mamba_norm_before_gate=False)
    plain = make_tiny_hybrid(tmp_path / "plain", family="falcon_h1", mamba_rms_norm=False)
    ids = prompt(19, seed=10)
    for model_dir in (after, plain):
        assert (run_once(model_dir, ids) - hf_logits(hf_model(model_dir), ids)).abs().max() <= TOL
    assert (hf_logits(hf_model(after), ids) - hf_logits(hf_model(src), ids)).abs().max() > 10 * TOL


def test_a_falcon_h1_option_the_project_does_not_implement_fails_naming_the_field(tmp_path):
    src = make_tiny_hybrid(tmp_path / "f", family="falcon_h1")
    for name, changes, error in (
            ("act", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
            ("mup", {"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers .* must have 5 entries"),
            ("rope", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
             "rope scaling type 'dynamic'")):
        with pytest.raises(ValueError, match=error):
            load_model(_with_config(src, tmp_path / name, **changes))


def run_once(model_dir, ids: list[int]) -> torch.Tensor:
    """The logits of one prefill of ids on a fresh worker of model_dir."""
    seq = HybridSeq(loaded_worker(model_dir, state_slots=2, max_block_size=4), "once")
    try:
        return seq.run(ids)
    finally:
        seq.release()


def test_the_text_model_of_a_multimodal_qwen3_5_checkpoint_loads_and_matches(tmp_path):
    """The checkpoints Qwen publishes are Qwen3_5ForConditionalGeneration: the text model under
    model.language_model.*, beside a vision tower (not loaded). Their text logits match."""
    src = make_tiny_hybrid(tmp_path / "mm", family="qwen3_5_multimodal")
    assert json.loads((src / "config.json").read_text())["model_type"] == "qwen3_5"
    ids = prompt(20, seed=5)
    assert (run_once(src, ids) - hf_logits(hf_model(src), ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["qwen3_5_moe", "nemotron_h"])
def test_experts_stored_stacked_load_as_per_expert_ones(tmp_path, family):
    """transformers 5 keeps a MoE layer's experts as two stacked tensors (experts.gate_up_proj
    [E, 2I, H] - NemotronH's squared-ReLU experts: experts.up_proj [E, I, H] -,
    experts.down_proj [E, H, I]); a checkpoint saved that way loads into the same model as the
    per-expert layout (same logits)."""
    from safetensors.torch import load_file, save_file
    src = make_tiny_hybrid(tmp_path / "per_expert", family=family)
    stacked = _with_config(src, tmp_path / "stacked")
    tensors = load_file(str(src / "model.safetensors"))
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name in sorted(tensors):
        if m := re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = tensors.pop(name)
    for (stem, proj), per in experts.items():
        if proj != "gate_proj":
            tensors[f"{stem}.{proj}"] = torch.stack([per[e] for e in range(len(per))])
    for (stem, proj), per in experts.items():
        if proj == "gate_proj":
            gate = torch.stack([per[e] for e in range(len(per))])
            tensors[f"{stem}.gate_up_proj"] = torch.cat([gate, tensors.pop(f"{stem}.up_proj")],
                                                        dim=1)
    save_file(tensors, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    ids = prompt(12, seed=6)
    assert torch.equal(run_once(src, ids), run_once(stacked, ids))


def test_granite_without_rotary_embeddings_matches_transformers(tmp_path):
    """Granite-4.0-H's released models set no position_embedding_type: their attention has no
    rotary embedding at all (NoPE)."""
    src = make_tiny_hybrid(tmp_path / "g", family="granitemoehybrid")
    nope = _with_config(src, tmp_path / "nope", position_embedding_type=None)
    ids = prompt(24, seed=8)
    ref = hf_logits(hf_model(nope), ids)
    assert (run_once(nope, ids) - ref).abs().max().item() <= TOL
    assert (ref - hf_logits(hf_model(src), ids)).abs().max().item() > 10 * TOL   # RoPE mattered


def test_random_weights_give_zero_centred_norms_a_unit_scale(tmp_path):
    """Benchmarks' random weights: an RMSNorm's scale is 1 - weight 1 for Bamba's norms,
    weight 0 for Qwen3.5's zero-centred ones (x / rms(x) * (1 + w))."""
    for family, want in (("bamba", 1.0), ("qwen3_5", 0.0)):
        model = load_model(make_tiny_hybrid(tmp_path / family, family=family),
                           random_weights=True)
        assert model.layers[0].input_layernorm.weight.unique().tolist() == [want]


@pytest.mark.parametrize("family", ["granitemoehybrid", "falcon_h1", "nemotron_h"])
def test_a_drafter_s_target_head_scales_and_names_as_the_target(family, tmp_path):
    """What a DFlash drafter borrows from the target (runtime/models/dflash.TargetHead): the
    embedding under the family's checkpoint name (NemotronH: backbone.embeddings), times its
    embedding multiplier, and logits scaled as the target scales its own; the fingerprint
    counts the layers of a NemotronH config that leaves num_hidden_layers out."""
    from runtime.models.dflash import TargetFingerprint, TargetHead
    src = make_tiny_hybrid(tmp_path / family, family=family)
    model = load_model(src, torch.float32, "cpu")
    head = TargetHead.load(src, torch.float32, "cpu")
    ids = torch.tensor(prompt(9))
    torch.testing.assert_close(
        head.embed(ids), model.embed_tokens(ids) * model.hybrid_cfg.embedding_multiplier)
    hidden = torch.randn(5, model.cfg.hidden_size)
    torch.testing.assert_close(head.logits(hidden), model.compute_logits(hidden))
    if family == "nemotron_h":
        bare = _with_config(src, tmp_path / "bare", drop=("num_hidden_layers",))
        assert TargetFingerprint.of_target(bare).num_layers == len(model.layers)
