"""Dense decoder-only transformers: Llama, Qwen2 (qkv bias), Qwen3 (per-head q/k norm).
Tokens of all sequences are flattened: hidden states are [T, H]; attention is per sequence
through the backend."""
from __future__ import annotations

import torch
from torch import nn

from runtime.config import ModelConfig
from runtime.kv_cache import KVLayout
from runtime.layers.linear import Linear, linear
from runtime.layers.mlp import GatedMLP
from runtime.layers.norm import RMSNorm
from runtime.layers.rope import RotaryEmbedding
from runtime.models.forward import ForwardBatch, ForwardOutput
from runtime.tensor_parallel import all_reduce


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, nh, hd], k/v [T, nkv, hd], with q/k norm and RoPE applied."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(-1, self.nh, self.hd), k.view(-1, self.nkv, self.hd), v.view(-1, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.project_qkv(x, positions, rope)
        out = batch.backend.forward(self.layer_id, q, k, v)
        return all_reduce(self.o_proj(out.reshape(-1, self.q_size)))   # whole over TP ranks


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP. self_attn / mlp: other families' modules of the same contract
    (attention: (x [T, H], positions, rope, batch) -> [T, H]; MLP: [T, H] -> [T, H])."""

    def __init__(self, cfg: ModelConfig, layer_id: int, self_attn: nn.Module | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn if self_attn is not None else Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                                        cfg.mlp_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch) -> torch.Tensor:
        """x [T, H]: the residual stream before this layer -> the stream after it."""
        x, delta = self.forward_deferred(x, None, positions, rope, batch)
        return x + delta

    def forward_deferred(self, x: torch.Tensor, delta: torch.Tensor | None,
                         positions: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is x + delta [T, H] (x alone when delta is None); each residual
        add happens inside the norm that follows it (one kernel on CUDA). Returns (x', delta')
        whose sum is the stream after this layer: delta' is the MLP output, still to be added.
        On the CPU the sums are the same torch adds as `x + attn`, so results are bit-identical."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.add_forward(x, delta)
        h, x = self.post_attention_layernorm.add_forward(
            x, self.self_attn(h, positions, rope, batch))
        return x, self.mlp(h)


class DenseDecoder(nn.Module):
    """Weights follow HF names (model.layers.N.self_attn.q_proj ...) except the fused
    qkv_proj / gate_up_proj, which runtime.weights fills from the separate HF tensors."""

    hybrid = False

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module] | None = None,
                 rope: RotaryEmbedding | None = None) -> None:
        """layers, rope: another family's (runtime/models/deepseek.py), else Llama/Qwen's."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers if layers is not None else
                                    (DecoderLayer(cfg, i) for i in range(cfg.num_layers)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rope if rope is not None else RotaryEmbedding(cfg.head_dim, cfg.max_position,
                                                                   cfg.rope)

    @property
    def kv_layout(self) -> KVLayout:
        c = self.cfg
        return KVLayout(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
                ) -> ForwardOutput:
        """input_ids, positions: int64 [T] (flattened over sequences).
        Captured layer i = HF `output_hidden_states[i + 1]`: the residual stream after layer i,
        except after the last layer, where HF reports it after the final norm (so do we)."""
        x, delta = self.embed_tokens(input_ids), None     # residual stream = x + delta
        wanted = {layer: None for layer in batch.capture_layers}
        for i, layer in enumerate(self.layers):
            x, delta = layer.forward_deferred(x, delta, positions, self.rope, batch)
            if i in wanted:
                wanted[i] = x + delta
        hidden, _ = self.norm.add_forward(x, delta)
        if len(self.layers) - 1 in wanted:
            wanted[len(self.layers) - 1] = hidden
        captured = torch.cat([wanted[i] for i in batch.capture_layers], dim=-1) if wanted else None
        return ForwardOutput(hidden=hidden, captured=captured)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32."""
        return linear(hidden, self.lm_head_weight).float()
