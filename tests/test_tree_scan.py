"""Recurrent layers over a verified tree (runtime/layers/tree_scan.py): on a chain they give the
chain scans' results, and on a tree each row's output and state equal running the chain scan
along that row's path (root to the row) from the same live state - Mamba2's conv and SSD, and
Gated DeltaNet's conv and delta rule."""
from __future__ import annotations

import torch

from runtime.layers.gated_deltanet import delta_recurrent
from runtime.layers.mamba2 import causal_conv, ssd_block
from runtime.layers.tree_scan import (
    ancestor_mask,
    chain_parents,
    conv_taps,
    parents_from_mask,
    ssd_tree,
    tree_conv,
)

# rows 1, 2 children of the anchor; 3, 4 of row 2; 5 of row 4; 6 of row 1
TREE = [-1, 0, 0, 2, 2, 4, 1]
NODES = len(TREE)


def path_of(parents: list[int], row: int) -> list[int]:
    out = [row]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def test_parents_and_masks_round_trip_and_a_chain_reads_consecutive_inputs():
    parents = torch.tensor([TREE])
    mask = ancestor_mask(parents)[0]
    assert parents_from_mask(mask) == TREE
    for t in range(len(TREE)):
        assert sorted(i for i in range(len(TREE)) if mask[t, i]) == sorted(path_of(TREE, t))
    taps = conv_taps(chain_parents(1, 5, "cpu"), 4)[0]
    assert taps.tolist() == [[j, j + 1, j + 2, j + 3] for j in range(5)]


def conv_inputs(b=2, L=NODES, C=6, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, C, K - 1, generator=g), torch.randn(b, L, C, generator=g),
            torch.randn(C, 1, K, generator=g), torch.randn(C, generator=g))


def test_tree_conv_on_a_chain_is_the_causal_conv():
    window, xs, w, bias = conv_inputs()
    out, windows = tree_conv(window, xs, w, bias, chain_parents(2, xs.shape[1], "cpu"))
    ref, ref_windows = causal_conv(window, xs, w, bias, keep_windows=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(windows, ref_windows)


def test_tree_conv_follows_each_rows_path():
    window, xs, w, bias = conv_inputs()
    parents = torch.tensor([TREE, [-1, 0, 1, 2, 3, 4, 5]])      # a tree and a chain
    out, windows = tree_conv(window, xs, w, bias, parents)
    for b, tree in enumerate(parents.tolist()):
        for t in range(len(tree)):
            path = path_of(tree, t)
            ref, ref_window = causal_conv(window[b:b + 1], xs[b:b + 1, path], w, bias, False)
            torch.testing.assert_close(out[b, t], ref[0, -1])
            torch.testing.assert_close(windows[b, t], ref_window[0])


def ssd_inputs(b=2, L=NODES, nh=3, hd=4, N=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, nh, hd, generator=g)
    dt = torch.rand(b, L, nh, generator=g) * 0.5 + 0.1
    dA = dt * -torch.rand(nh, generator=g)
    return (torch.randn(b, nh, hd, N, generator=g), x, dt, dA,
            torch.randn(b, L, nh, N, generator=g), torch.randn(b, L, nh, N, generator=g),
            torch.randn(nh, generator=g))


def test_ssd_tree_on_a_chain_is_the_chain_block():
    h0, x, dt, dA, B, C, D = ssd_inputs()
    y, states = ssd_tree(h0, x, dt, dA, B, C, D, chain_parents(2, x.shape[1], "cpu"))
    ref_y, ref_states = ssd_block(h0, x, dt, dA, B, C, D, keep_states=True)
    torch.testing.assert_close(y, ref_y)
    torch.testing.assert_close(states, ref_states)


def test_ssd_tree_follows_each_rows_path():
    h0, x, dt, dA, B, C, D = ssd_inputs()
    parents = torch.tensor([TREE, TREE[:4] + [1, 4, 5]])
    y, states = ssd_tree(h0, x, dt, dA, B, C, D, parents)
    for b, tree in enumerate(parents.tolist()):
        for t in range(len(tree)):
            p = path_of(tree, t)
            ref_y, ref_states = ssd_block(h0[b:b + 1], x[b:b + 1, p], dt[b:b + 1, p],
                                          dA[b:b + 1, p], B[b:b + 1, p], C[b:b + 1, p], D,
                                          keep_states=True)
            torch.testing.assert_close(y[b, t], ref_y[0, -1])
            torch.testing.assert_close(states[b, t], ref_states[0, -1])


def test_the_delta_rules_closed_form_keeps_every_rows_state_on_chains_and_trees():
    """delta_block (a verify block in a few batched products) against the recurrence: on a
    chain, and along every path of a tree."""
    from runtime.layers.gated_deltanet import delta_block
    g = torch.Generator().manual_seed(3)
    b, L, nv, dk, dv = 2, len(TREE), 2, 4, 3
    S = torch.randn(b, nv, dk, dv, generator=g)
    q, k = (torch.nn.functional.normalize(torch.randn(b, L, nv, dk, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(b, L, nv, dv, generator=g)
    gate = -torch.rand(b, L, nv, generator=g)
    beta = torch.rand(b, L, nv, generator=g)
    chain = ancestor_mask(chain_parents(b, L, "cpu"))
    o, states = delta_block(S, q, k, v, gate, beta, chain)
    ref_o, ref_states = delta_recurrent(S, q, k, v, gate, beta, keep_states=True)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(states, ref_states)
    o, states = delta_block(S, q, k, v, gate, beta, ancestor_mask(torch.tensor([TREE, TREE])))
    for t in range(L):
        p = path_of(TREE, t)
        ref_o, ref_states = delta_recurrent(S, q[:, p], k[:, p], v[:, p], gate[:, p],
                                            beta[:, p], keep_states=True)
        torch.testing.assert_close(o[:, t], ref_o[:, -1])
        torch.testing.assert_close(states[:, t], ref_states[:, -1])
