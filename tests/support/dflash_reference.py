"""An independent from-scratch DFlash block forward for tests: reads the z-lab checkpoint and the
target's embedding / LM head straight from safetensors and computes, with plain tensor ops and no
cache, attention of the block over the explicit concatenation [context K/V ; block K/V]."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file


class ReferenceDFlash:
    def __init__(self, draft_dir: str | Path, target_dir: str | Path) -> None:
        draft_dir, target_dir = Path(draft_dir), Path(target_dir)
        self.cfg = json.loads((draft_dir / "config.json").read_text())
        self.w = {k: v.float() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        target_cfg = json.loads((target_dir / "config.json").read_text())
        wanted = {"model.embed_tokens.weight", "lm_head.weight"}
        tw: dict[str, torch.Tensor] = {}
        for f in sorted(target_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                tw.update({n: fh.get_tensor(n) for n in fh.keys() if n in wanted})  # noqa: SIM118
        self.embed = tw["model.embed_tokens.weight"].float()
        self.lm_head = self.embed if target_cfg.get("tie_word_embeddings") else tw["lm_head.weight"].float()
        c = self.cfg
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or c["hidden_size"] // self.nh
        self.eps = c["rms_norm_eps"]
        self.theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
        dc = c.get("dflash_config", {})
        self.mask = dc.get("mask_token_id", c.get("mask_token_id"))
        self.layer_types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
        self.window = c.get("sliding_window")

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [T, heads, hd]; rotate-half layout."""
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))
        ang = pos.double()[:, None] * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
        half = self.hd // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def block_hidden(self, features: torch.Tensor, anchor: int, block: int) -> torch.Tensor:
        """features [L, K*H] (all context so far) -> norm(hidden) [block, H]."""
        w, L = self.w, features.shape[0]
        ctx = self._rms(features.float() @ w["fc.weight"].t(), w["hidden_norm.weight"])
        x = self.embed[torch.tensor([anchor] + [self.mask] * (block - 1))]
        pos_ctx, pos_blk = torch.arange(L), torch.arange(L, L + block)
        pos_all = torch.cat([pos_ctx, pos_blk])
        passes = self.cfg.get("dflash_config", {}).get("layer_passes", 1)
        for i, kind in list(enumerate(self.layer_types)) * passes:
            p = f"layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].t()).view(block, self.nh, self.hd)
            q = self._rope(self._rms(q, w[p + "self_attn.q_norm.weight"]), pos_blk)
            kv_in = torch.cat([ctx, h])                       # context rows, then block rows
            k = (kv_in @ w[p + "self_attn.k_proj.weight"].t()).view(L + block, self.nkv, self.hd)
            k = self._rope(self._rms(k, w[p + "self_attn.k_norm.weight"]), pos_all)
            v = (kv_in @ w[p + "self_attn.v_proj.weight"].t()).view(L + block, self.nkv, self.hd)
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.hd)
            if kind == "sliding_attention":
                visible = (pos_all[None, :] <= pos_blk[:, None]) & \
                          (pos_blk[:, None] - pos_all[None, :] < self.window)
                scores = scores.masked_fill(~visible, float("-inf"))
            o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(block, -1)
            x = x + o @ w[p + "self_attn.o_proj.weight"].t()
            h2 = self._rms(x, w[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h2 @ w[p + "mlp.gate_proj.weight"].t())
            x = x + (gate * (h2 @ w[p + "mlp.up_proj.weight"].t())) @ w[p + "mlp.down_proj.weight"].t()
        return self._rms(x, w["norm.weight"])

    def drafts(self, hidden: torch.Tensor) -> list[int]:
        """Greedy tokens of block positions 1..B-1."""
        return (hidden[1:] @ self.lm_head.t()).argmax(-1).tolist()
