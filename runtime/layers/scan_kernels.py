"""Kernels for the recurrent layers' scans, by name: the Gated DeltaNet delta rule
(runtime/layers/gated_deltanet.py) and Mamba2's SSD (runtime/layers/mamba2.py).

  torch  the pure-PyTorch forms of those modules: the reference, and the CPU path
  fla    flash-linear-attention's Triton kernels (the `fla-core` wheel, imported lazily); CUDA
         only. The delta rule: chunk_gated_delta_rule (prefill), fused_recurrent_gated_delta_rule
         (decode). Mamba2's SSD is simple GLA with one decay per head - S_t = exp(dA_t) S_{t-1}
         + B_t (dt_t x_t)^T, y_t = C_t^T S_t + D x_t, with q = C, k = B, v = dt x, g = dA and
         the state kept [head_dim, state] (fla's state_v_first) as our pool keeps it:
         chunk_simple_gla (prefill). Mamba2's one-token step stays ours: fla's
         fused_recurrent_simple_gla took 0.34 ms against our 0.11 ms at one sequence of a
         Bamba-9B layer on an H100 (0.41 against 0.45 at 32)
  auto   fla on a CUDA device where fla-core imports, else torch

Only prefill (the chunked forms) and one-token steps go through the registry: a verify keeps
the state after every block position (and trees follow each row's path), which no fla kernel
returns, so verify blocks always take the layers' closed forms (delta_block, ssd_block /
ssd_tree).

Contracts (b sequences of L tokens; the layers' notation; every tensor fp32):
  delta_chunked(S, q, k, v, g, beta, chunk) -> (o [b, L, nv, dv], S' [b, nv, dk, dv])
  delta_step(S, q, k, v, g, beta)           -> the same for L == 1
      q [b, L, nv, dk] L2-normalised, repeated to the value heads and already scaled; k
      likewise (unscaled); v [b, L, nv, dv]; g (log decay) and beta [b, L, nv]
  ssd_chunked(h, x, dt, dA, B, C, D, chunk) -> (y [b, L, nh, hd], h' [b, nh, hd, N])
      x [b, L, nh, hd]; dt, dA [b, L, nh]; B, C [b, L, nh, N] (groups repeated to heads); D [nh]
  ssd_step(h, x, dt, dA, B, C, D)           -> (y [b, nh, hd], h'): one token, x [b, nh, hd],
      dt, dA [b, nh], B, C [b, nh, N]
fla runs them in fp32 too: on an H100 at a Qwen3.5-9B delta-rule layer it was as fast as with
bf16 q/k/v and 4-5x closer to the torch form (bench.scan_kernels_gpu)."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

Scan = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ScanKernels:
    name: str
    delta_chunked: Scan     # Gated DeltaNet prefill
    delta_step: Scan        # ... one token
    ssd_chunked: Scan       # Mamba2 prefill
    ssd_step: Scan          # ... one token


def _torch() -> ScanKernels:
    from runtime.layers.gated_deltanet import delta_chunked, delta_recurrent
    from runtime.layers.mamba2 import ssd_chunked, ssd_step

    def delta_step(S, q, k, v, g, beta):
        return delta_recurrent(S, q, k, v, g, beta, keep_states=False)
    return ScanKernels("torch", delta_chunked, delta_step, ssd_chunked, ssd_step)


def _fla() -> ScanKernels:
    from fla.ops.gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
    )
    from fla.ops.simple_gla import chunk_simple_gla

    from runtime.layers.mamba2 import ssd_step

    def f32(*xs):
        return (x.float().contiguous() for x in xs)

    def delta_chunked(S, q, k, v, g, beta, chunk):
        q, k, v, g, beta, S = f32(q, k, v, g, beta, S)
        o, S = chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, initial_state=S,
                                      output_final_state=True)
        return o.float(), S.float()

    def delta_step(S, q, k, v, g, beta):
        q, k, v, g, beta, S = f32(q, k, v, g, beta, S)
        o, S = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=1.0,
                                                initial_state=S, output_final_state=True)
        return o.float(), S.float()

    def ssd_chunked(h, x, dt, dA, B, C, D, chunk):
        C, B, xdt, dA, h = f32(C, B, x * dt[..., None], dA, h)
        o, h = chunk_simple_gla(C, B, xdt, g=dA, scale=1.0, initial_state=h,
                                output_final_state=True, state_v_first=True)
        return o.float() + D[:, None] * x, h.float()
    return ScanKernels("fla", delta_chunked, delta_step, ssd_chunked, ssd_step)


KERNELS: dict[str, Callable[[], ScanKernels]] = {"torch": _torch, "fla": _fla}
CHOICES = ("auto", *KERNELS)


def fla_importable() -> str | None:
    """None when fla-core's kernels import, else why not."""
    try:
        for module in ("fla.ops.gated_delta_rule", "fla.ops.simple_gla"):
            importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, or triton failing to initialise
        return f"{type(e).__name__}: {e}"
    return None


def select(name: str, device: torch.device | str) -> ScanKernels:
    """The kernels for `name` on `device` (ValueError naming the allowed values; fla off CUDA
    or not installed is refused when asked for by name, and skipped by auto)."""
    if name not in CHOICES:
        raise ValueError(f"linear-attention kernels {name!r}: allowed values are "
                         f"{', '.join(CHOICES)}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        name = "fla" if cuda and fla_importable() is None else "torch"
    elif name == "fla":
        if not cuda:
            raise ValueError("linear-attention kernels 'fla' run on CUDA devices only "
                             f"(device {device}); use torch or auto")
        why = fla_importable()
        if why is not None:
            raise ValueError(f"linear-attention kernels 'fla' need the fla-core package ({why}); "
                             "install fla-core or use torch or auto")
    return KERNELS[name]()


def install(model: torch.nn.Module, name: str, device: torch.device | str) -> str | None:
    """Give every recurrent layer of `model` (Gated DeltaNet, Mamba2) the kernels `name`
    selects on `device`; -> the kernels' name, or None for a model without such layers
    (nothing is imported)."""
    from runtime.layers.gated_deltanet import GatedDeltaNet
    from runtime.layers.mamba2 import Mamba2Mixer
    layers = [m for m in model.modules() if isinstance(m, (GatedDeltaNet, Mamba2Mixer))]
    if not layers:
        return None
    kernels = select(name, device)
    for layer in layers:
        layer.kernels = kernels
    return kernels.name
