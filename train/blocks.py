"""The DFlash training forward: many blocks per sequence in one pass.

For a sequence of ids [L] with target features [L, K*H], block j starts at anchor position p_j
(a committed token of the response): input [ids[p_j], MASK x (B-1)] at positions p_j..p_j+B-1,
context = features of positions 0..p_j-1 (exactly what the drafter sees at inference, where the
anchor is the token the target has just produced), labels ids[p_j+1..p_j+B-1]. All blocks of a
sequence attend to one shared context K/V with a mask: context key i is visible to block j iff
i < p_j; block keys only inside their own block (bidirectional; sliding layers causal+window)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.models.dflash import DFlashDraftModel, TargetHead


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int,
                 lengths: torch.Tensor, greedy: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [S, L], anchors [S, nb] -> block ids [S, nb, B], positions [S, nb, B], labels
    [S, nb, B-1] (-100 where the position is past the sequence's end).

    Labels are the sequence's own tokens ids[p+k], or with `greedy` ([S, L], the target's argmax
    after each position) the target's greedy chain from the anchor: label k = greedy[p+k-1],
    kept only while the sequence's tokens p+1..p+k-1 are that chain (-100 after it leaves).
    For a greedy answer both are the same; for a sampled one the chain labels are what a greedy
    draft must propose to be accepted (the drafter drafts argmax tokens at any temperature)."""
    offs = torch.arange(block, device=ids.device)
    pos = anchors[..., None] + offs                                   # [S, nb, B]
    block_ids = torch.full_like(pos, mask_id)
    block_ids[..., 0] = ids.gather(1, anchors)
    label_pos = pos[..., 1:]
    valid = label_pos < lengths[:, None, None]
    last = ids.shape[1] - 1
    if greedy is None:
        labels = _gather(ids, label_pos.clamp(max=last))
    else:
        labels = _gather(greedy, (label_pos - 1).clamp(max=last))
        on_chain = torch.ones_like(ids, dtype=torch.bool)             # [S, L]: ids[t] == greedy[t-1]
        on_chain[:, 1:] = ids[:, 1:] == greedy[:, :-1]
        agree = _gather(on_chain, label_pos.clamp(max=last))         # token p+k on the chain
        before = torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1]], dim=-1)
        valid &= before.int().cumprod(-1).bool()                     # p+1..p+k-1 all on it
    return block_ids, pos, labels.masked_fill(~valid, -100)


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [S, L], index [S, ...] -> x[s, index[s, ...]]."""
    return x.gather(1, index.flatten(1)).view_as(index)


def attention_mask(anchors: torch.Tensor, ctx_len: int, block: int, causal: bool,
                   window: int | None) -> torch.Tensor:
    """bool [S, nb*B, ctx_len + nb*B] (True = attend)."""
    s, nb = anchors.shape
    dev = anchors.device
    qblk = torch.arange(nb, device=dev).repeat_interleave(block)       # [nb*B]
    qoff = torch.arange(block, device=dev).repeat(nb)
    qpos = anchors[:, qblk] + qoff                                    # [S, nb*B]
    kctx = torch.arange(ctx_len, device=dev)
    ctx_ok = kctx[None, None, :] < anchors[:, qblk][:, :, None]       # [S, nb*B, L]
    same = qblk[:, None] == qblk[None, :]                             # [nb*B, nb*B]
    blk_ok = same[None].expand(s, -1, -1).clone()
    if causal:
        blk_ok &= qoff[None, :] <= qoff[:, None]
    if window is not None:
        ctx_ok &= kctx[None, None, :] > qpos[:, :, None] - window
        blk_ok &= (qoff[None, :] > qoff[:, None] - window)
    return torch.cat([ctx_ok, blk_ok], dim=-1)


def draft_hidden(draft: DFlashDraftModel, head: TargetHead, feats: torch.Tensor,
                 block_ids: torch.Tensor, block_pos: torch.Tensor) -> torch.Tensor:
    """feats [S, L, K*H], block ids/positions [S, nb, B] -> norm(hidden) [S, nb, B, H]."""
    s, nb, b = block_ids.shape
    L = feats.shape[1]
    ctx = draft.project_context(feats.reshape(s * L, -1))
    ctx_pos = torch.arange(L, device=feats.device).repeat(s)
    x = head.embed(block_ids.reshape(-1)).to(ctx.dtype) * draft.cfg.input_embedding_scale
    qpos = block_pos.reshape(-1)
    anchors = block_pos[..., 0]
    masks: dict[tuple[bool, int | None], torch.Tensor] = {}
    context = draft.projected_context_kv(ctx, ctx_pos)      # per layer, shared by every pass
    for i in draft.cfg.layer_schedule():
        layer = draft.layers[i]
        attn = layer.self_attn
        key = (attn.causal, attn.window)
        if key not in masks:
            masks[key] = attention_mask(anchors, L, b, *key)[:, None]
        kc, vc = context[i]
        h = layer.input_layernorm(x)
        q, k, v = attn.project_qkv(h, qpos, draft.rope)
        keys = torch.cat([kc.view(s, L, attn.nkv, attn.hd), k.view(s, nb * b, attn.nkv, attn.hd)], 1)
        vals = torch.cat([vc.view(s, L, attn.nkv, attn.hd), v.view(s, nb * b, attn.nkv, attn.hd)], 1)
        rep = attn.nh // attn.nkv
        out = F.scaled_dot_product_attention(
            q.view(s, nb * b, attn.nh, attn.hd).transpose(1, 2),
            keys.repeat_interleave(rep, 2).transpose(1, 2),
            vals.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=masks[key])
        x = x + attn.o_proj(out.transpose(1, 2).reshape(s * nb * b, attn.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x).view(s, nb, b, -1)


def accepted_drafts(hidden: torch.Tensor, labels: torch.Tensor, head: TargetHead) -> torch.Tensor:
    """hidden [S, nb, B, H] (draft_hidden), labels [S, nb, B-1] -> int [S, nb]: how many of each
    block's greedy drafts the target accepts - the leading drafts equal to their labels (an
    unlabelled position, -100, ends the run)."""
    h = hidden[:, :, 1:]
    drafts = head.greedy(h.reshape(-1, h.shape[-1])).view(labels.shape)
    return ((drafts == labels) & (labels >= 0)).int().cumprod(-1).sum(-1)


@torch.no_grad()
def hop_anchors(draft: DFlashDraftModel, head: TargetHead, feats: torch.Tensor, ids: torch.Tensor,
                anchors: torch.Tensor, lengths: torch.Tensor, block: int, mask_id: int,
                hops: int, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """anchors [S, nb] -> [S, nb]: where the speculative loop puts its next block after `hops`
    blocks drafted from each anchor (p -> p + accepted + 1, the position of the target's bonus
    token). The loop's anchors follow the drafter's rejections, so they sit where drafting is
    hard; uniform anchors also land inside runs the drafter would have accepted, which the loop
    skips. A hop that would pass the last anchor with a label (length - 2) stays put."""
    last = lengths[:, None] - 2
    for _ in range(hops):
        bids, bpos, labels = block_inputs(ids, anchors, block, mask_id, lengths, greedy)
        accepted = accepted_drafts(draft_hidden(draft, head, feats, bids, bpos), labels, head)
        nxt = anchors + accepted + 1
        anchors = torch.where(nxt <= last, nxt, anchors)
    return anchors


def position_weights(block: int, gamma: float, device) -> torch.Tensor:
    """[B-1]: exp(-(k-1)/gamma) for draft positions k = 1..B-1 (early positions matter most:
    a draft is only useful while every earlier one was accepted)."""
    k = torch.arange(1, block, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def soft_targets(final: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """final [S, L, H] (the target's LM head input after each position), anchors [S, nb] ->
    [S, nb, B-1, H]: for draft position k, the target's at p+k-1 (whose logits predict the token
    p+k; on the greedy chain, which is where labels are kept, the distribution the draft's
    position k should match). Positions past L read row L-1 (their labels are -100)."""
    s, nb = anchors.shape
    pos = (anchors[..., None] + torch.arange(block - 1, device=anchors.device)).clamp(
        max=final.shape[1] - 1)                                       # [S, nb, B-1]
    rows = pos.reshape(s, -1, 1).expand(-1, -1, final.shape[-1])
    return final.gather(1, rows).view(s, nb, block - 1, -1)


def block_loss(hidden: torch.Tensor, labels: torch.Tensor, head: TargetHead,
               weights: torch.Tensor, target_final: torch.Tensor | None = None,
               soft_weight: float = 0.0, reach_weight: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [S, nb, B, H], labels [S, nb, B-1] -> (weighted loss, per-position accuracy
    [B-1]). The loss is CE against the labels, plus soft_weight x KL(target || draft) with the
    target's distributions from target_final [S, nb, B-1, H] (soft_targets), where labelled.
    With reach_weight R > 0, position k's weight is also scaled by (1 - R) + R x reach_k
    (reach_weights), normalised by the weights without it: training effort goes to the draft
    positions the drafter would get to verify.

    Only labelled rows go through the LM head: with greedy-chain labels, most draft positions
    of sampled answers are off the chain (label -100, loss weight 0), and the [rows, V] logits
    are the step's largest tensors."""
    width = labels.shape[-1]
    flat = labels.reshape(-1)
    rows = (flat >= 0).nonzero().squeeze(1)             # [N] labelled rows (one host sync a step)
    h = hidden[:, :, 1:].reshape(-1, hidden.shape[-1])[rows]
    logits = head.logits(h)                             # [N, V]
    y = flat[rows]
    ce = F.cross_entropy(logits, y, reduction="none")
    loss_rows = ce
    if target_final is not None and soft_weight > 0:
        with torch.no_grad():
            t_logp = F.log_softmax(
                head.logits(target_final.reshape(-1, target_final.shape[-1])[rows]), dim=-1)
        kl = (t_logp.exp() * (t_logp - F.log_softmax(logits, dim=-1))).sum(-1)
        loss_rows = loss_rows + soft_weight * kl
    k = rows % width                                    # each row's draft position - 1
    w = weights[k]
    norm = w.sum().clamp(min=1.0)
    if reach_weight > 0:
        reach = reach_weights(ce, rows, flat.numel(), width)
        w = w * ((1.0 - reach_weight) + reach_weight * reach)
    loss = (loss_rows * w).sum() / norm
    correct = (logits.argmax(-1) == y).float()
    seen = torch.zeros(width, device=flat.device).index_add_(0, k, torch.ones_like(correct))
    acc = torch.zeros(width, device=flat.device).index_add_(0, k, correct) / seen.clamp(min=1.0)
    return loss, acc


def reach_weights(ce_rows: torch.Tensor, rows: torch.Tensor, cells: int, width: int
                  ) -> torch.Tensor:
    """ce_rows [N] (the CE of labelled rows `rows`, indices into the [cells] = [S*nb*(B-1)]
    grid of draft positions) -> [N]: for each row at position k, the drafter's own probability
    of the labels at positions 1..k-1 of its block, prod exp(-CE) (1 at k = 1; unlabelled
    positions count as 1). A draft at k is only verified, and so only useful, when those were
    all accepted. No gradient flows through it."""
    p = torch.ones(cells, device=ce_rows.device)
    p[rows] = torch.exp(-ce_rows.detach().float())
    grid = p.view(-1, width).cumprod(-1)                # [S*nb, B-1]: prod over 1..k
    before = torch.cat([torch.ones_like(grid[:, :1]), grid[:, :-1]], dim=-1)
    return before.reshape(-1)[rows]
