"""Hybrid (Mamba2 or Gated DeltaNet + attention) test support: tiny checkpoints, transformers' reference, and
sequences driven straight through TargetWorker.forward (prefill, decode, verify, commit)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.prepare.tiny_hybrid import TINY_NEMOTRON_H, make_tiny_hybrid
from runtime.attention.metadata import SeqSlice
from runtime.kv_cache import PageTable
from services.target.worker import TargetWorker
from support.target_client import TargetClient

__all__ = ["HybridSeq", "attention_at", "forward_many", "hf_greedy", "hf_logits", "hf_model", "make_tiny_hybrid"]


def hf_model(model_dir: str | Path):
    """transformers' model of the checkpoint's family (Bamba, Qwen3.5, NemotronH, ...), fp32."""
    import json

    import transformers
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    cls = {"bamba": "BambaForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM",
           "qwen3_5_text": "Qwen3_5ForCausalLM",
           "qwen3_5": "Qwen3_5ForConditionalGeneration",
           "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
           "nemotron_h": "NemotronHForCausalLM", "falcon_h1": "FalconH1ForCausalLM"
           }[model_type]
    return getattr(transformers, cls).from_pretrained(str(model_dir),
                                                      dtype=torch.float32).eval()


def attention_at(family: str, layers: int, attn: list[int]) -> dict:
    """config.json fields putting full attention at layers `attn` (the rest recurrent; NemotronH:
    the rest as in its tiny checkpoint, mamba where that attends; Falcon-H1: every layer attends
    and scans, only the count changes)."""
    if family == "bamba":
        return {"num_hidden_layers": layers, "attn_layer_indices": attn}
    if family == "falcon_h1":
        return {"num_hidden_layers": layers}
    if family == "nemotron_h":
        tiny = TINY_NEMOTRON_H["layers_block_type"]
        return {"layers_block_type": [
            "full_attention" if i in attn else
            "linear_attention" if tiny[i] == "full_attention" else tiny[i]
            for i in range(layers)]}
    return {"num_hidden_layers": layers, "layer_types": [
        "full_attention" if i in attn else "linear_attention" for i in range(layers)]}


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), V] of one full forward (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' generate: n greedy tokens after prompt (its cache: scan, then recurrence)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@dataclass
class HybridSeq:
    """A sequence with a live state slot and a page table, on a worker past
    init_attention_backends."""
    worker: TargetWorker
    seq_id: str
    table: PageTable = field(default_factory=PageTable)
    seq_len: int = 0
    slot: int = -1

    def __post_init__(self) -> None:
        self.slot = self.worker.state_pool.allocate(self.seq_id)

    def run(self, tokens: list[int], verify: bool = False) -> torch.Tensor:
        """tokens at positions seq_len.. -> logits [n, V]. Without verify the state and seq_len
        advance; a verify block waits for commit()."""
        return forward_many(self.worker, [(self, tokens, verify)])[0]

    def commit(self, last: int) -> None:
        """After a verify block: keep block positions 0..last."""
        self.worker.commit_mamba_state([(self.slot, last)])
        self.seq_len += last + 1
        self.worker.kv_cache.trim(self.table, self.seq_len)

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows [mamba layers, C, K-1], ssm states [mamba layers, nh, hd, N]) copies."""
        pool = self.worker.state_pool
        return pool.conv[:, self.slot].clone(), pool.ssm[:, self.slot].clone()

    def release(self) -> None:
        self.worker.kv_cache.release(self.table)
        self.worker.state_pool.free(self.slot)


def forward_many(worker: TargetWorker, parts: list[tuple[HybridSeq, list[int], bool]]
                 ) -> list[torch.Tensor]:
    """One forward over several sequences: (sequence, new tokens, verify?) -> logits per part."""
    slices, ids, positions = [], [], []
    for seq, tokens, _ in parts:
        worker.kv_cache.ensure(seq.table, seq.seq_len + len(tokens))
        slices.append(SeqSlice(seq.table, seq.seq_len, len(tokens)))
        ids.extend(tokens)
        positions.extend(range(seq.seq_len, seq.seq_len + len(tokens)))
    device = worker.device
    out = worker.forward(slices, torch.tensor(ids, device=device),
                         torch.tensor(positions, device=device), (),
                         [seq.slot for seq, _, _ in parts], [v for _, _, v in parts])
    for seq, tokens, verify in parts:
        if not verify:
            seq.seq_len += len(tokens)
    return list(worker.logits(out.hidden).split([len(t) for _, t, _ in parts]))


def speculate(client: TargetClient, seq: str, prompt: list[int], reference: list[int], n: int,
              block: int = 6) -> tuple[list[int], int]:
    """Greedy speculative decoding where the drafts are the reference continuation with one
    token broken per block (so most blocks accept part of their drafts). Returns (output,
    number of partial accepts)."""
    out = [client.prefill(seq, prompt).next_token]
    partial, step = 0, 0
    while len(out) < n:
        pos = len(out)
        drafts = list(reference[pos: pos + block - 1])
        if drafts:
            k = step % len(drafts)
            drafts[k] = (drafts[k] + 1) % 256
        r = client.verify(seq, [out[-1]] + drafts)
        partial += 0 < r.accepted < len(drafts)
        out.extend(r.committed_tokens)
        step += 1
    client.release(seq)
    return out[:n], partial
