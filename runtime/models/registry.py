"""Build a model from a HF-format directory: pick the class, materialise, load weights."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import init

from runtime.config import ModelConfig, read_config_json
from runtime.layers.norm import OffsetRMSNorm
from runtime.weights import KV_SCALE_SUFFIXES, load_weights

# torch.nn.init's in-place initialisers, made no-ops while an empty model is built: on the meta
# device they dispatch to torch._refs, whose first use imports torch._dynamo (about 2.5 s of a
# service's start-up on a CPU; the weights are loaded or drawn next anyway)
_INITIALISERS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def _initialisers_skipped() -> Iterator[None]:
    saved = {name: getattr(init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def build_empty(cls: type[nn.Module], cfg, device: torch.device | str, dtype: torch.dtype
                ) -> nn.Module:
    """Construct without initialising weights (they are loaded next); rebuild fixed buffers."""
    with torch.device("meta"), _initialisers_skipped():
        model = cls(cfg)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(torch.device(device))
    return model


def model_class(raw: dict) -> tuple[type[nn.Module], object]:
    """(class, parsed config) for a config.json dict."""
    model_type = raw.get("model_type", "")
    from runtime.models import families
    family = families.lookup(model_type)
    if family is not None:
        return family(raw)
    from runtime.models.dense import DenseDecoder
    return DenseDecoder, ModelConfig.from_dict(raw)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", random_weights: bool = False,
               tp_rank: int = 0, tp_size: int = 1) -> nn.Module:
    """random_weights (benchmarks: ServiceHooks): initialised at random instead of loaded.
    tp_size > 1: rank tp_rank's share of a dense model (runtime/tensor_parallel.py)."""
    raw = read_config_json(path)
    cls, cfg = model_class(raw)
    shard = None
    if tp_size > 1:
        from runtime import tensor_parallel
        from runtime.models.dense import DenseDecoder
        cfg = tensor_parallel.shard_config(cfg, tp_size, dense=cls is DenseDecoder,
                                           model_type=raw.get("model_type", ""))

        def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return tensor_parallel.shard_tensor(name, tensor, tp_rank, tp_size)
    model = build_empty(cls, cfg, device, dtype)
    if random_weights:
        return init_random_weights(model)
    check = getattr(model, "check_checkpoint", None)   # hybrid: layer pattern vs weights
    if check is not None:
        check(path)
    ignore = ("rotary_emb.inv_freq", *KV_SCALE_SUFFIXES) + (
        ("lm_head.weight",) if getattr(cfg, "tie_word_embeddings", False) else ())
    # a model whose decoder is not model.* (a multimodal checkpoint's text model) says where
    # (another layout of some tensors: the model converts them)
    load_weights(model, path, strip_prefix=getattr(model, "checkpoint_prefix", "model."),
                 ignore=ignore, skip=getattr(model, "checkpoint_skip", ()),
                 convert=getattr(model, "convert_checkpoint_tensor", None), shard=shard)
    model.eval().requires_grad_(False)
    return model


@torch.no_grad()
def init_random_weights(model: nn.Module, std: float = 0.02) -> nn.Module:
    """Benchmark-only: Normal(0, std) matrices, unit norms, on the model's device."""
    offset = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, OffsetRMSNorm)}
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std)
        elif "norm" in name:
            p.fill_(0.0 if name in offset else 1.0)     # zero-centred norms: 1 + w
        else:
            p.zero_()
    return model.eval().requires_grad_(False)
