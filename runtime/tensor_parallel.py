"""Tensor parallelism of a dense target over the ranks of one host (torch.distributed: NCCL on
GPUs, gloo on the CPU), as Megatron-LM splits a transformer:

- attention: each rank holds num_heads / N query heads and num_kv_heads / N KV heads (their
  q/k/v projection rows, their KV cache), and the o_proj columns that read them;
- MLP: each rank holds intermediate_size / N of the gate/up rows and the down_proj columns;
- o_proj and down_proj outputs are partial sums: one all-reduce each per layer makes the residual
  stream whole again on every rank (their biases are added by rank 0 alone);
- embeddings, norms and the LM head are whole on every rank (rank 0 computes the logits, and
  the features captured for the draft are the residual stream: whole after the all-reduce).

The process group is process-wide (one target per process), like the model's own dtype: set by
`init` on every rank before any forward; `all_reduce` is the identity without one, so the
drafter and single-rank targets pay nothing."""
from __future__ import annotations

import dataclasses
import datetime
import math

import torch
import torch.distributed as dist

from runtime.config import ModelConfig

_size = 1                                # ranks of this process's group (1: none)
_rank = 0

# HF tensor name suffix -> the dim it is split on (0: rows, a column-parallel weight; 1: columns,
# a row-parallel one); anything else is whole on every rank
SPLIT_DIM = {
    "self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
    "self_attn.q_proj.bias": 0, "self_attn.k_proj.bias": 0, "self_attn.v_proj.bias": 0,
    "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0,
    "mlp.gate_proj.bias": 0, "mlp.up_proj.bias": 0,
    "self_attn.o_proj.weight": 1, "mlp.down_proj.weight": 1,
}
ROW_PARALLEL_BIASES = ("self_attn.o_proj.bias", "mlp.down_proj.bias")   # added once: rank 0's


class TensorParallelUnsupported(ValueError):
    """A model or a size tensor parallelism cannot split (the message says what is allowed)."""


def init(backend: str, rank: int, size: int, address: str, timeout_s: float) -> None:
    """Joins the group of `size` ranks at tcp://address (blocks until every rank has)."""
    global _size, _rank
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    _size, _rank = size, rank


def size() -> int:
    return _size


def rank() -> int:
    return _rank


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x summed over the ranks, in place (x itself without a group)."""
    if _size > 1:
        dist.all_reduce(x)
    return x


def allowed_sizes(cfg: ModelConfig) -> list[int]:
    """The sizes that divide the query heads, the KV heads and the MLP width."""
    common = math.gcd(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
    return [n for n in range(1, common + 1) if common % n == 0]


def shard_config(cfg: object, n: int, dense: bool = True, model_type: str = "") -> ModelConfig:
    """One rank's share of a dense model's config (its heads and MLP width); refused with what
    is allowed for a model tensor parallelism cannot split yet or a size that does not divide."""
    if n == 1:
        return cfg
    if not dense or not isinstance(cfg, ModelConfig):
        raise TensorParallelUnsupported(
            f"tensor parallelism splits dense Llama / Qwen2 / Qwen3 targets; model_type "
            f"{model_type!r} (mixture-of-experts, MLA or recurrent layers) is not split yet: use "
            f"--tensor-parallel-size 1")
    allowed = allowed_sizes(cfg)
    if n not in allowed:
        raise TensorParallelUnsupported(
            f"--tensor-parallel-size {n} does not divide this model's {cfg.num_heads} attention "
            f"heads, {cfg.num_kv_heads} KV heads and MLP width {cfg.intermediate_size}: "
            f"allowed sizes are {', '.join(map(str, allowed))}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n,
                               num_kv_heads=cfg.num_kv_heads // n,
                               intermediate_size=cfg.intermediate_size // n)


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s part of the HF checkpoint tensor `name` (of n ranks)."""
    if n == 1:
        return tensor
    if name.endswith(ROW_PARALLEL_BIASES):
        return tensor if rank == 0 else torch.zeros_like(tensor)
    for suffix, dim in SPLIT_DIM.items():
        if name.endswith(suffix):
            return tensor.chunk(n, dim=dim)[rank]
    return tensor
