"""Kernels for the Gated DeltaNet delta rule (runtime/layers/gated_deltanet.py), by name.

  torch  the pure-PyTorch forms of gated_deltanet.py: the reference, and the CPU path
  fla    flash-linear-attention's Triton kernels (the `fla-core` wheel, imported lazily):
         chunk_gated_delta_rule for prefill and fused_recurrent_gated_delta_rule for decode;
         CUDA only
  auto   fla on a CUDA device where fla-core imports, else torch

Only prefill (the chunked form) and one-token steps go through the registry: a verify keeps
the state after every block position (and trees follow each row's path), which neither fla
kernel returns, so verify blocks always take gated_deltanet.delta_block.

Contract of both entries (b sequences of L tokens; the layer's notation):
  chunked(S, q, k, v, g, beta, chunk) -> (o [b, L, nv, dv] fp32, S' [b, nv, dk, dv] fp32)
  step(S, q, k, v, g, beta)            -> the same for L == 1
q [b, L, nv, dk] is L2-normalised, repeated to the value heads and already scaled; k likewise
(unscaled); v [b, L, nv, dv]; g (log decay) and beta [b, L, nv]; all fp32. fla runs them in
fp32 too: on an H100 at a Qwen3.5-9B layer's shape it was as fast as with bf16 q/k/v and 4-5x
closer to the torch form (bench.delta_kernels_gpu)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Chunked = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DeltaKernels:
    name: str
    chunked: Chunked    # (S, q, k, v, g, beta, chunk) -> (o, S')
    step: Chunked       # (S, q, k, v, g, beta) -> (o, S')


def _torch() -> DeltaKernels:
    from runtime.layers.gated_deltanet import delta_chunked, delta_recurrent

    def step(S, q, k, v, g, beta):
        return delta_recurrent(S, q, k, v, g, beta, keep_states=False)
    return DeltaKernels("torch", delta_chunked, step)


def _fla() -> DeltaKernels:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def chunked(S, q, k, v, g, beta, chunk):
        q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
        o, S = chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, initial_state=S.contiguous(),
                                      output_final_state=True)
        return o.float(), S.float()

    def step(S, q, k, v, g, beta):
        q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
        o, S = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=1.0,
                                                initial_state=S.contiguous(),
                                                output_final_state=True)
        return o.float(), S.float()
    return DeltaKernels("fla", chunked, step)


KERNELS: dict[str, Callable[[], DeltaKernels]] = {"torch": _torch, "fla": _fla}
CHOICES = ("auto", *KERNELS)


def fla_importable() -> str | None:
    """None when fla-core's delta-rule kernels import, else why not."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or triton failing to initialise
        return f"{type(e).__name__}: {e}"
    return None


def select(name: str, device: torch.device | str) -> DeltaKernels:
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
    """Give every Gated DeltaNet layer of `model` the kernels `name` selects on `device`;
    -> the kernels' name, or None for a model without such layers (nothing is imported)."""
    from runtime.layers.gated_deltanet import GatedDeltaNet
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    if not layers:
        return None
    kernels = select(name, device)
    for layer in layers:
        layer.kernels = kernels
    return kernels.name
