"""The Gated DeltaNet kernel registry (runtime/layers/delta_kernels.py): the choice by name and
device, the refusals, the target's flag; and on a GPU with fla-core (skipped elsewhere, CI
included) fla's prefill and decode kernels against the torch forms, and a tiny Qwen3.5 target
running them against the same target on the torch forms."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.hybrid import HybridSeq, make_tiny_hybrid
from support.inproc_target import loaded_worker

from runtime.layers.delta_kernels import KERNELS, fla_importable, install, select
from runtime.layers.gated_deltanet import GatedDeltaNet, l2_normalize
from services.target.__main__ import config_from_args, parse_args
from services.target.config import TargetConfig

GPU_FLA = torch.cuda.is_available() and fla_importable() is None
needs_fla = pytest.mark.skipif(not GPU_FLA, reason="fla-core kernels need CUDA and fla-core")


def test_auto_takes_torch_on_the_cpu_and_names_are_checked():
    assert select("auto", "cpu").name == "torch"
    assert select("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="allowed values are auto, torch, fla"):
        select("cuda", "cpu")
    with pytest.raises(ValueError, match="CUDA devices only"):
        select("fla", "cpu")


def test_fla_asked_for_without_the_package_is_refused_with_the_reason(monkeypatch):
    import runtime.layers.delta_kernels as dk
    monkeypatch.setattr(dk, "fla_importable", lambda: "ModuleNotFoundError: No module named 'fla'")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="need the fla-core package .*No module named 'fla'"):
        dk.select("fla", "cuda")
    assert dk.select("auto", "cuda").name == "torch"      # auto falls back


def test_the_target_config_and_flag_carry_the_choice(tmp_path):
    with pytest.raises(ValueError, match="allowed auto | torch | fla"):
        TargetConfig(model_dir=str(tmp_path), linear_attention_kernels="flash")
    args = parse_args(["--model", str(tmp_path), "--linear-attention-kernels", "torch"])
    assert config_from_args(args).linear_attention_kernels == "torch"
    assert config_from_args(parse_args(["--model", str(tmp_path)])).linear_attention_kernels \
        == "auto"


def test_install_sets_every_layer_and_skips_models_without_them(tmp_path):
    src = make_tiny_hybrid(tmp_path / "q", family="qwen3_5")
    worker = loaded_worker(src, state_slots=2, max_block_size=4)
    layers = [m for m in worker.model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers and worker.delta_kernels == "torch"
    assert all(layer.kernels.name == "torch" for layer in layers)
    assert install(torch.nn.Linear(2, 2), "fla", "cpu") is None     # nothing to install into


def _inputs(b: int, L: int, device: str, nv: int = 4, dk: int = 32, dv: int = 16):
    g = torch.Generator().manual_seed(b * 100 + L)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)
    q = l2_normalize(r(b, L, nv, dk)) * dk ** -0.5
    return (r(b, nv, dk, dv) * 0.1, q, l2_normalize(r(b, L, nv, dk)), r(b, L, nv, dv),
            -F.softplus(r(b, L, nv)) * 0.5, r(b, L, nv).sigmoid())


@needs_fla
@pytest.mark.parametrize("b,L", [(1, 1), (3, 1), (1, 70), (2, 200)])
def test_fla_matches_the_torch_forms(b, L):
    args = _inputs(b, L, "cuda")
    ref, fla = KERNELS["torch"](), KERNELS["fla"]()
    if L == 1:
        (o_ref, s_ref), (o, s) = ref.step(*args), fla.step(*args)
    else:
        (o_ref, s_ref), (o, s) = ref.chunked(*args, 64), fla.chunked(*args, 64)
    for x, want in ((o, o_ref), (s, s_ref)):
        assert x.shape == want.shape and x.dtype == torch.float32
        assert ((x - want).abs().max() / want.abs().max()).item() < 5e-3


@needs_fla
def test_a_qwen3_5_target_on_fla_matches_the_torch_kernels(tmp_path):
    """Prefill of 70 tokens (two chunks), then decode steps, on the GPU in fp32: fla against
    the torch forms (which the CPU tests hold to transformers; transformers itself calls fla
    when it is installed, so it is no independent reference here)."""
    src = make_tiny_hybrid(tmp_path / "q", family="qwen3_5")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (80,), generator=g).tolist()
    logits = {}
    for name in ("torch", "fla"):
        worker = loaded_worker(src, device="cuda", attention_backend="triton", state_slots=2,
                               max_block_size=4, linear_attention_kernels=name)
        assert worker.delta_kernels == name
        seq = HybridSeq(worker, name)
        try:
            logits[name] = torch.cat([seq.run(ids[:70])] + [seq.run([t]) for t in ids[70:]])
        finally:
            seq.release()
    ours, ref = logits["fla"].float().cpu(), logits["torch"].float().cpu()
    err = (ours - ref).abs().amax(-1) / ref.abs().max()           # per position
    assert err.max().item() < 1e-2, f"relative error by position: {err.tolist()}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
