"""The recurrent layers' kernel registry (runtime/layers/scan_kernels.py): the choice by name and
device, the refusals, the target's flag; and on a GPU with fla-core (skipped elsewhere, CI
included) fla's prefill and decode kernels against the torch forms - the Gated DeltaNet delta
rule and Mamba2's SSD as simple GLA - and tiny Qwen3.5 and Bamba targets running them against
the same targets on the torch forms."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from support.hybrid import HybridSeq, make_tiny_hybrid
from support.inproc_target import loaded_worker
from support.procs import start_target

from runtime.layers.gated_deltanet import GatedDeltaNet, l2_normalize
from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.scan_kernels import KERNELS, fla_importable, install, select
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
    import runtime.layers.scan_kernels as sk
    monkeypatch.setattr(sk, "fla_importable", lambda: "ModuleNotFoundError: No module named 'fla'")
    with pytest.raises(ValueError, match="need the fla-core package .*No module named 'fla'"):
        sk.select("fla", "cuda")
    assert sk.select("auto", "cuda").name == "torch"      # auto falls back


def test_the_target_config_and_flag_carry_the_choice(tmp_path):
    with pytest.raises(ValueError, match=re.escape("allowed auto | torch | fla")):
        TargetConfig(model_dir=str(tmp_path), linear_attention_kernels="flash")
    args = parse_args(["--model", str(tmp_path), "--linear-attention-kernels", "torch"])
    assert config_from_args(args).linear_attention_kernels == "torch"
    assert config_from_args(parse_args(["--model", str(tmp_path)])).linear_attention_kernels \
        == "auto"


def test_a_target_asked_for_fla_on_the_cpu_exits_refusing_before_it_serves(tmp_path):
    src = make_tiny_hybrid(tmp_path / "q", family="qwen3_5")
    p = start_target(src, tmp_path, "--linear-attention-kernels", "fla", wait=False)
    assert p.proc.wait(120) == 2
    assert "'fla' run on CUDA devices only" in p.log()


@pytest.mark.parametrize("family,layer", [("qwen3_5", GatedDeltaNet), ("bamba", Mamba2Mixer)])
def test_install_sets_every_recurrent_layer_and_skips_models_without_them(tmp_path, family,
                                                                          layer):
    src = make_tiny_hybrid(tmp_path / family, family=family)
    worker = loaded_worker(src, state_slots=2, max_block_size=4)
    layers = [m for m in worker.model.modules() if isinstance(m, layer)]
    assert layers and worker.scan_kernels == "torch"
    assert all(m.kernels.name == "torch" for m in layers)
    assert install(torch.nn.Linear(2, 2), "fla", "cpu") is None     # nothing to install into


def _gen(seed: int):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to("cuda")
    return r


def _delta_inputs(b: int, L: int, nv: int = 4, dk: int = 32, dv: int = 16):
    r = _gen(b * 100 + L)
    q = l2_normalize(r(b, L, nv, dk)) * dk ** -0.5
    return (r(b, nv, dk, dv) * 0.1, q, l2_normalize(r(b, L, nv, dk)), r(b, L, nv, dv),
            -F.softplus(r(b, L, nv)) * 0.5, r(b, L, nv).sigmoid())


def _ssd_inputs(b: int, L: int, nh: int = 4, hd: int = 16, N: int = 32):
    """As Mamba2Mixer.scan prepares them: dt > 0, dA = -dt exp(A_log) < 0."""
    r = _gen(b * 100 + L + 1)
    dt = F.softplus(r(b, L, nh))
    return (r(b, nh, hd, N) * 0.1, r(b, L, nh, hd), dt, -dt * 0.7, r(b, L, nh, N) * 0.3,
            r(b, L, nh, N) * 0.3, r(nh))


def _close(x: torch.Tensor, want: torch.Tensor) -> None:
    assert x.shape == want.shape and x.dtype == torch.float32
    assert ((x - want).abs().max() / want.abs().max()).item() < 5e-3


@needs_fla
@pytest.mark.parametrize("b,L", [(1, 1), (3, 1), (1, 70), (2, 200)])
def test_fla_delta_rule_matches_the_torch_forms(b, L):
    args = _delta_inputs(b, L)
    ref, fla = KERNELS["torch"](), KERNELS["fla"]()
    if L == 1:
        pairs = zip(ref.delta_step(*args), fla.delta_step(*args))
    else:
        pairs = zip(ref.delta_chunked(*args, 64), fla.delta_chunked(*args, 64))
    for want, got in pairs:
        _close(got, want)


@needs_fla
@pytest.mark.parametrize("b,L", [(1, 2), (1, 70), (2, 200)])
def test_fla_ssd_as_simple_gla_matches_the_torch_forms(b, L):
    """Prefill only: Mamba2's one-token step stays ours (fla's was slower)."""
    h, x, dt, dA, B, C, D = _ssd_inputs(b, L)
    ref, fla = KERNELS["torch"](), KERNELS["fla"]()
    assert fla.ssd_step is ref.ssd_step
    for want, got in zip(ref.ssd_chunked(h, x, dt, dA, B, C, D, 8),
                         fla.ssd_chunked(h, x, dt, dA, B, C, D, 8)):
        _close(got, want)


@needs_fla
@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_a_hybrid_target_on_fla_matches_the_torch_kernels(tmp_path, family):
    """Prefill of 70 tokens (past the chunks), then decode steps, on the GPU in fp32: fla
    against the torch forms (which the CPU tests hold to transformers; transformers itself
    calls fla when it is installed, so it is no independent reference here)."""
    src = make_tiny_hybrid(tmp_path / family, family=family)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (80,), generator=g).tolist()
    logits = {}
    for name in ("torch", "fla"):
        worker = loaded_worker(src, device="cuda", attention_backend="triton", state_slots=2,
                               max_block_size=4, linear_attention_kernels=name)
        assert worker.scan_kernels == name
        seq = HybridSeq(worker, name)
        try:
            logits[name] = torch.cat([seq.run(ids[:70])] + [seq.run([t]) for t in ids[70:]])
        finally:
            seq.release()
    ours, ref = logits["fla"].float().cpu(), logits["torch"].float().cpu()
    err = (ours - ref).abs().amax(-1) / ref.abs().max()           # per position
    assert err.max().item() < 1e-2, f"relative error by position: {err.tolist()}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
