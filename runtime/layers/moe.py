"""Mixture-of-experts feed-forward layers: a router (softmax or sigmoid scores, optionally
group-limited, as DeepSeek-V2/V3, Qwen3-Next and NemotronH route) over SwiGLU experts (or
NemotronH's squared-ReLU ones) whose weights are stacked for one grouped GEMM per projection on
CUDA, plus shared experts (optionally gated)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import Linear
from runtime.layers.mlp import GatedMLP, silu_and_mul
from runtime.layers.ungated_mlp import UngatedMLP, relu2


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int       # each routed expert's
    norm_topk_prob: bool             # the chosen experts' weights renormalised to sum to 1
    routed_scaling_factor: float = 1.0
    router: str = "softmax"          # "softmax" | "sigmoid" (DeepSeek-V3: + a correction bias)
    group_limited: bool = False      # route within the best topk_group of n_group groups
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0   # the shared experts' SwiGLU (0: none)
    shared_name: str = "shared_experts"
    shared_gate: bool = False        # Qwen3-Next: sigmoid(shared_expert_gate x) scales them
    # "swiglu": each expert down(silu(gate x) * up x); "relu2" (NemotronH): down(relu(up x)^2),
    # the shared expert too, with biases when shared_bias
    expert_mlp: str = "swiglu"
    shared_bias: bool = False

    def __post_init__(self) -> None:
        if self.expert_mlp not in ("swiglu", "relu2"):
            raise ValueError(f"expert MLP {self.expert_mlp!r}: one of 'swiglu', 'relu2'")


class Router(nn.Module):
    """x [T, H] -> (weights [T, k] fp32, expert ids [T, k]). Scores in fp32 as transformers."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(cfg.n_routed_experts))
                                        if cfg.router == "sigmoid" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        if cfg.router == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            group_score = choice.unflatten(-1, (cfg.n_group, -1)).topk(2, dim=-1)[0].sum(-1)
            masked = float("-inf")
        else:
            scores = choice = logits.softmax(dim=-1)
            group_score = choice.unflatten(-1, (cfg.n_group, -1)).amax(-1)
            masked = 0.0
        if cfg.group_limited:
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1)[1], True)
            keep = keep.repeat_interleave(cfg.n_routed_experts // cfg.n_group, dim=-1)
            choice = choice.masked_fill(~keep, masked)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


def _expert(cfg: MoEConfig, intermediate: int, bias: bool = False) -> nn.Module:
    if cfg.expert_mlp == "relu2":
        return UngatedMLP(cfg.hidden_size, intermediate, bias)
    return GatedMLP(cfg.hidden_size, intermediate, bias)


def _in_proj(expert: nn.Module) -> nn.Module:
    """An expert's first projection: gate_up_proj [2I, H] (SwiGLU) or up_proj [I, H]."""
    return expert.gate_up_proj if isinstance(expert, GatedMLP) else expert.up_proj


class MoE(nn.Module):
    """Routed experts (each a SwiGLU MLP, checkpoint names experts.N.{gate,up,down}_proj, or with
    expert_mlp "relu2" a squared-ReLU one, experts.N.{up,down}_proj) plus the shared experts
    (one MLP of the same kind and shared_intermediate_size, named shared_name; with
    shared_gate, times sigmoid(shared_expert_gate x) - Qwen3-Next).

    The experts' weights live in two stacked tensors ([E, 2I or I, H] and [E, H, I], built once the
    model is materialised: init_buffers); each expert's parameters are views into them, so the
    checkpoint fills both. Two forwards: the reference loop (each expert on its own tokens, in
    id order, as transformers sums them; the CPU) and one grouped GEMM per projection over the
    tokens sorted by expert (torch._grouped_mm, no host sync; CUDA)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.act = relu2 if cfg.expert_mlp == "relu2" else silu_and_mul
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(_expert(cfg, inter) for _ in range(cfg.n_routed_experts))
        if cfg.shared_intermediate_size:
            setattr(self, cfg.shared_name,
                    _expert(cfg, cfg.shared_intermediate_size, cfg.shared_bias))
        self.shared_expert_gate = Linear(h, 1, bias=False) if cfg.shared_gate else None
        self._w13: torch.Tensor | None = None
        self._w2: torch.Tensor | None = None

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Stack the experts' weights and make each expert's parameters views into the stacks
        (after materialisation, before the weights are loaded)."""
        if self.experts[0].down_proj.weight.device.type == "meta":
            return
        self._w13 = torch.stack([_in_proj(e).weight.data for e in self.experts])
        self._w2 = torch.stack([e.down_proj.weight.data for e in self.experts])
        for i, e in enumerate(self.experts):
            _in_proj(e).weight.data = self._w13[i]
            e.down_proj.weight.data = self._w2[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = self.gate(x)
        out = self._grouped(x, weights, ids) if x.is_cuda else self._loop(x, weights, ids)
        if not self.cfg.shared_intermediate_size:
            return out
        shared = getattr(self, self.cfg.shared_name)(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Experts in id order, each on its own tokens (as transformers sums them, so fp32
        results match it closely)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The T*k (token, expert) pairs sorted by expert; one grouped GEMM per projection
        (offsets: each expert's end in the sorted rows); no host sync."""
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(len(self.experts), dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        token = order // k
        h = torch._grouped_mm(x[token], self._w13.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(self.act(h), self._w2.transpose(-2, -1), offs=offs)
        y = y * weights.flatten()[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


def split_stacked_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's stacked experts (transformers 5's layout: ...experts.gate_up_proj
    [E, 2I, H] - or NemotronH's ...experts.up_proj [E, I, H] -, ...experts.down_proj [E, H, I])
    -> the per-expert tensors the model names (...experts.N.gate_proj.weight, up_proj,
    down_proj); any other tensor as it is."""
    stem, _, last = name.rpartition(".")
    if not stem.endswith(".experts") or last not in ("gate_up_proj", "up_proj", "down_proj"):
        return [(name, tensor)]
    if last != "gate_up_proj":
        return [(f"{stem}.{e}.{last}.weight", w) for e, w in enumerate(tensor)]
    out = []
    for e, w in enumerate(tensor):
        gate, up = w.chunk(2, dim=0)
        out += [(f"{stem}.{e}.gate_proj.weight", gate), (f"{stem}.{e}.up_proj.weight", up)]
    return out
