"""Loading HF safetensors checkpoints into runtime models (fusing q/k/v and gate/up)."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# HF tensor name piece -> (our fused parameter piece, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def iter_tensors(path: str | Path, names: set[str] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) over a checkpoint directory; only `names` when given (others never read)."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if names is None or name in names:
                    yield name, f.get_tensor(name)


def read_tensors(path: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(path, names))


KV_SCALE_SUFFIXES = {".self_attn.k_scale": "k", ".self_attn.v_scale": "v",
                     ".self_attn.kv_scale": "k"}   # fp8 KV cache scales (vLLM's names)


def tensor_names(path: str | Path) -> list[str]:
    """Tensor names of a checkpoint directory (headers only, no tensor is read)."""
    names: list[str] = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def read_kv_scales(path: str | Path) -> dict[tuple[int, str], float]:
    """(layer id, "k" | "v") -> the checkpoint's fp8 KV scale (model.layers.N.self_attn.k_scale,
    v_scale, or kv_scale for both); empty when it has none."""
    wanted = {n: (int(n.split(".")[2]), kind) for n in tensor_names(path)
              for suffix, kind in KV_SCALE_SUFFIXES.items()
              if n.endswith(suffix) and n.startswith("model.layers.")}
    found = {}
    for name, tensor in iter_tensors(path, set(wanted)):
        layer, kind = wanted[name]
        found[(layer, kind)] = float(tensor.float().max())
        if name.endswith(".kv_scale"):
            found.setdefault((layer, "v"), found[(layer, kind)])
    return found


def _split_sizes(module: nn.Module, fused: str) -> list[int]:
    if fused == "qkv_proj":
        return [module.q_size, module.kv_size, module.kv_size]
    return [module.intermediate, module.intermediate]


def load_weights(model: nn.Module, path: str | Path, strip_prefix: str = "model.",
                 ignore: tuple[str, ...] = ("rotary_emb.inv_freq",),
                 dtype: torch.dtype | None = None, skip: tuple[str, ...] = (),
                 convert: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
                 | None = None,
                 shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Copy checkpoint tensors into `model`'s parameters; every parameter must be filled.
    ignore: name suffixes left out; skip: name prefixes left out (parts of the checkpoint the
    model does not serve: a vision tower, multi-token-prediction layers); convert: a tensor
    stored in another layout -> the tensors the model names (Qwen3-Next's fused projections);
    shard: a tensor -> this rank's part of it (runtime/tensor_parallel.py)."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for name, tensor in iter_tensors(path):
        if any(name.endswith(s) for s in ignore) or name.startswith(skip):
            continue
        for part, value in convert(name, tensor) if convert else [(name, tensor)]:
            target = part.removeprefix(strip_prefix)
            if shard is not None:
                value = shard(part, value)
            _copy_one(model, params, filled, target, part, value)
    missing = [n for n, p in params.items() if filled.get(n, 0) < _expected_fills(n)]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    if dtype is not None:
        model.to(dtype)


def copy_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors (names as in `model`, q/k/v and gate/up unfused) into `model`'s
    parameters; parameters not named keep their values. Shapes must match."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for name, tensor in tensors.items():
        _copy_one(model, params, filled, name, name, tensor)


def _expected_fills(name: str) -> int:
    if ".qkv_proj.weight" in name or ".qkv_proj.bias" in name:
        return 3
    if ".gate_up_proj." in name:
        return 2
    return 1


def _copy_one(model: nn.Module, params: dict[str, nn.Parameter], filled: dict[str, int],
              target: str, source: str, tensor: torch.Tensor) -> None:
    parts = target.split(".")
    for i, piece in enumerate(parts):
        if piece in PACKED:
            fused, shard = PACKED[piece]
            owner = model.get_submodule(".".join(parts[:i]))
            pname = ".".join(parts[:i] + [fused] + parts[i + 1:])
            if pname not in params:      # not fused in this model (MLA's q_proj): as named
                break
            sizes = _split_sizes(owner, fused)
            param = params[pname]
            dst = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
            _check_shape(source, dst, tensor)
            dst.copy_(tensor)
            filled[pname] = filled.get(pname, 0) + 1
            return
    if target not in params:
        raise ValueError(f"unexpected checkpoint tensor {source} (no parameter {target})")
    _check_shape(source, params[target].data, tensor)
    params[target].data.copy_(tensor)
    filled[target] = filled.get(target, 0) + 1


def _check_shape(source: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {source} has shape {tuple(src.shape)}, "
                         f"the model expects {tuple(dst.shape)}")
