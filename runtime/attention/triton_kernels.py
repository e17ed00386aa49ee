"""Triton kernel: attention of a block of new query tokens per sequence over its paged K/V.

One program = (sequence, kv head, block of BLOCK_M query rows). The query rows of a program
pack the GQA group: row r is token r // GROUP of the sequence's new tokens, head
kv_head * GROUP + r % GROUP, so verify (q_len = B) and decode (q_len = 1) both fill the MMA.
Keys are walked in BLOCK_N steps through the page table with an online softmax (fp32).

  q        [T, NH, D]       new tokens of all sequences, flattened (cu_q gives the offsets)
  k, v     [S, NKV, D]      one layer of the paged cache (S = pages * PAGE)
  out      [T, NH, D]       times out_scale (an fp8 cache's value scale; its key scale is
                            in `scale`; fp8 pages are read as q's dtype)
  cu_q     int32 [bs+1]     token offsets; prefix int32 [bs]: cached tokens before them
  tables   int32 [bs, P]    page ids per sequence
  CAUSAL:  query at position prefix+i sees keys <= prefix+i (else all prefix+q_len keys);
  WINDOW > 0 also limits it to keys > prefix+i-WINDOW. PRECISION: "ieee" for fp32 inputs (exact
  tests), "tf32" otherwise (ignored for 16-bit inputs).
  TREE:    tree int64 [T, W]: bit j of word j // 32 of a new token's row set where it sees new
           token j of its sequence (a verified tree of drafts: its ancestors and itself; parents
           come first, so this stays within the causal bound). Cached keys are all visible.
  GROUP_PAD: query rows per token, GROUP or more (rows past GROUP are idle). --deterministic
           trees (runtime/batch_invariance.py) pad the group to the program's BLOCK_M: one
           token per program, each reading its own path (PATHS).
  PATHS:   (--deterministic trees) tree int64 [T, W]: row t = [depth, a_0 .. a_depth, -1 ..],
           the block indices of token t's ancestors by depth (itself last). Its keys are the
           cached ones and then those ancestors, gathered at positions prefix + depth: the keys,
           tiles and order of the decode of that token after its path was committed.
"""
import triton
import triton.language as tl


@triton.jit
def _key_range(pre, kv_len, mblk, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[first, last) of the key positions a block of query rows can see: up to its last row's
    own position when causal, from its first row's window start (rounded down to BLOCK_N).
    GROUP: query rows per token (the GQA group, or its padding: GROUP_PAD)."""
    if CAUSAL:
        last = tl.minimum(pre + (mblk * BLOCK_M + BLOCK_M - 1) // GROUP + 1, kv_len)
    else:
        last = kv_len
    first = 0
    if WINDOW > 0:
        first = tl.maximum(pre + (mblk * BLOCK_M) // GROUP - WINDOW + 1, 0)
        first = (first // BLOCK_N) * BLOCK_N
    return first, last


@triton.jit
def _tree_visible(tree, stride_tree, qrow, row_ok, kpos, k_ok, pre):
    """[rows, keys] mask of a draft tree: every key before the block (the committed context) is
    visible; a key of the block is visible when bit j (its block index) of the query row's mask
    words is set (the row itself and its ancestors)."""
    j = tl.where(kpos >= pre, kpos - pre, 0)                      # new-token index of a key
    new = (kpos >= pre) & k_ok
    word = tl.load(tree + qrow[:, None] * stride_tree + (j // 32)[None, :],
                   mask=row_ok[:, None] & new[None, :], other=0)
    seen = ((word >> (j % 32).to(tl.int64)[None, :]) & 1) != 0
    return ~new[None, :] | seen


@triton.jit
def _key_slots(table, kpos, k_ok, pre, path, PAGE: tl.constexpr, PATHS: tl.constexpr):
    """Cache slots of the keys at positions kpos (through the sequence's page table). PATHS: a
    key of the block (kpos >= pre) is the program's token's ancestor at depth kpos - pre
    (path: [depth, a_0, ..]), read where the block holds it."""
    src = kpos
    if PATHS:
        new = (kpos >= pre) & k_ok
        src = tl.where(new, pre + tl.load(path + 1 + (kpos - pre), mask=new, other=0), kpos)
    page = tl.load(table + src // PAGE, mask=k_ok, other=0)
    return page * PAGE + src % PAGE


@triton.jit
def _softmax_step(s, ok, vb, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of keys of the online softmax: scores s [rows, keys] (fp32, scaled) where ok,
    values vb [keys, D] -> the running max m_i, sum l_i [rows] and accumulator acc [rows, D]."""
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def paged_block_attention(
    q, k, v, out, cu_q, prefix, tables, tree,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb, stride_tree,
    scale, out_scale,
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, TREE: tl.constexpr,
    GROUP_PAD: tl.constexpr = 0, PATHS: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    q_lo = tl.load(cu_q + b)
    q_len = tl.load(cu_q + b + 1) - q_lo
    pre = tl.load(prefix + b)
    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    PAD: tl.constexpr = GROUP if GROUP_PAD == 0 else GROUP_PAD
    tok = rows // PAD
    head = kvh * GROUP + rows % PAD
    row_ok = (tok < q_len) & (rows % PAD < GROUP)
    if mblk * BLOCK_M < q_len * PAD:
        d = tl.arange(0, D)
        q_ptrs = q + (q_lo + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        qb = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        qpos = pre + tok                                         # absolute query positions
        kv_len = pre + q_len
        first, last = _key_range(pre, kv_len, mblk, PAD, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
        path = tree + (q_lo + (mblk * BLOCK_M) // PAD) * stride_tree
        if PATHS:                              # one token per program: its path's keys
            depth = tl.load(path)
            last = pre + depth + 1
            qpos = pre + depth + tok * 0
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(first, last, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            k_ok = kpos < last
            slot = _key_slots(tables + b * stride_tb, kpos, k_ok, pre, path, PAGE, PATHS)
            kb = tl.load(k + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                         mask=k_ok[:, None], other=0.0).to(qb.dtype)
            s = tl.dot(qb, tl.trans(kb), input_precision=PRECISION).to(tl.float32) * scale
            ok = k_ok[None, :] & row_ok[:, None]
            if CAUSAL:
                ok = ok & (kpos[None, :] <= qpos[:, None])
            if WINDOW > 0:
                ok = ok & (kpos[None, :] > qpos[:, None] - WINDOW)
            if TREE:
                ok = ok & _tree_visible(tree, stride_tree, q_lo + tok, row_ok, kpos, k_ok, pre)
            vb = tl.load(v + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                         mask=k_ok[:, None], other=0.0).to(qb.dtype)
            m_i, l_i, acc = _softmax_step(s, ok, vb, m_i, l_i, acc, PRECISION)
        acc = acc * out_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out + (q_lo + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _latent_scores(q_lat, q_rope, k, kr, slot, k_ok, lat_ok, rope_ok, dl, dr, stride_ks,
                   stride_rs, PRECISION: tl.constexpr):
    """A tile of keys of the latent cache: scores [rows, keys] = latent part + rope part (the
    two pools' rows at `slot`, read as the queries' dtype), and the latent tile (the values)."""
    k_lat = tl.load(k + slot[:, None] * stride_ks + dl[None, :],
                    mask=k_ok[:, None] & lat_ok, other=0.0).to(q_lat.dtype)
    k_rope = tl.load(kr + slot[:, None] * stride_rs + dr[None, :],
                     mask=k_ok[:, None] & rope_ok, other=0.0).to(q_lat.dtype)
    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION).to(tl.float32)
    s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION).to(tl.float32)
    return s, k_lat


# Multi-head latent attention (weight-absorbed, runtime/models/deepseek.py) over a latent
# cache: one KV "head" per token, its key [DL latent | DR rope key]; the values are the latent.
#
#   q    [T, NH, DL+DR]   queries already in the latent space (W_UK applied), rope part last
#   k    [S, 1, DL]       one layer's latent pool, kr [S, 1, DR] its rope pool (fp8 pages
#                         are read as q's dtype)
#   out  [T, NH, DL]      times out_scale (an fp8 cache's scale; its key scale is in `scale`)
# DLP, DRP: DL and DR padded to powers of two of at least 16 (what tl.dot takes; the pad is
# masked). Causal, as target layers are; TREE as in paged_block_attention. One program = (sequence,
# -, block of BLOCK_M rows); row r is new token r // GROUP, head r % GROUP (GROUP = NH: every
# head shares the one latent head, so a decode step of 16 heads fills a 16-row MMA).
@triton.jit
def paged_mla_attention(
    q, k, kr, out, cu_q, prefix, tables, tree,
    stride_qt, stride_qh, stride_ks, stride_rs, stride_ot, stride_oh, stride_tb, stride_tree,
    scale, out_scale,
    GROUP: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, DLP: tl.constexpr,
    DRP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, TREE: tl.constexpr,
):
    """MLA over a latent cache: see the comment above."""
    b = tl.program_id(0)
    mblk = tl.program_id(2)
    q_lo = tl.load(cu_q + b)
    q_len = tl.load(cu_q + b + 1) - q_lo
    pre = tl.load(prefix + b)
    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = rows % GROUP
    row_ok = tok < q_len
    if mblk * BLOCK_M < q_len * GROUP:
        dl = tl.arange(0, DLP)
        dr = tl.arange(0, DRP)
        lat_ok = dl[None, :] < DL
        rope_ok = dr[None, :] < DR
        q_row = q + (q_lo + tok)[:, None] * stride_qt + head[:, None] * stride_qh
        q_lat = tl.load(q_row + dl[None, :], mask=row_ok[:, None] & lat_ok, other=0.0)
        q_rope = tl.load(q_row + DL + dr[None, :], mask=row_ok[:, None] & rope_ok, other=0.0)
        qpos = pre + tok
        last = tl.minimum(pre + (mblk * BLOCK_M + BLOCK_M - 1) // GROUP + 1, pre + q_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DLP], tl.float32)
        for start in range(0, last, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            k_ok = kpos < last
            page = tl.load(tables + b * stride_tb + kpos // PAGE, mask=k_ok, other=0)
            slot = (page * PAGE + kpos % PAGE).to(tl.int64)
            s, k_lat = _latent_scores(q_lat, q_rope, k, kr, slot, k_ok, lat_ok, rope_ok, dl, dr,
                                      stride_ks, stride_rs, PRECISION)
            s = s * scale
            ok = k_ok[None, :] & row_ok[:, None] & (kpos[None, :] <= qpos[:, None])
            if TREE:
                ok = ok & _tree_visible(tree, stride_tree, q_lo + tok, row_ok, kpos, k_ok, pre)
            m_i, l_i, acc = _softmax_step(s, ok, k_lat, m_i, l_i, acc, PRECISION)
        acc = acc * out_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out + (q_lo + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dl[None, :]
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & lat_ok)
