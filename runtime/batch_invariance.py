"""`--deterministic`: batch-invariant inference, so that a row's logits are bitwise the same
whether its token is decoded alone, verified in a block of drafts, or batched beside other
sequences - which makes speculative output bit-identical to autoregressive output in bf16 on a
GPU, not only in fp32 on the CPU (issue 38; docs/deterministic.md).

Why the default path is not: cuBLAS picks its GEMM kernel (tiling, split-K) by the row count,
and the Triton attention kernel packs more query rows per program for a verify block than for a
decode step (runtime/attention/triton_backend.py), so a token's result depends on how many
tokens share its forward; bf16 rounds those differences into near-ties that fork greedy paths.

What the switch changes, process-wide (the target's and the draft's worker set it at start-up):
  - every linear layer (runtime/layers/linear.py: projections, MLPs, the LM head) runs the
    Triton GEMM of runtime/layers/invariant_gemm.py, which reduces each row over K in one fixed
    order (its K split, if any, fixed per weight; its tile, on a GPU, from one family of tiles
    that give a row the same bits whatever the row count);
  - the Triton attention kernel runs blocks of ATTENTION_BLOCK_M query rows (token x GQA head)
    whatever the forward holds - a decode's one token, a verify block's 16, a prompt's chunk -
    so a row meets the same MMA shape and the same key tiles in each: keys are walked from
    position 0 in fixed tiles, every row of a block does the same operations on its own
    scores (where it sits in the block changes nothing), and the keys a row may not see (later
    tokens of its block, positions past the sequence) add exact zeros;
  - a tree of drafts: each node gathers its ancestors' keys in depth order at the positions
    they take once committed (the kernel's PATHS input), instead of reading the block with its
    siblings masked - the tiles and order of the decode of that node after its path.
The fused norms, rotary and SiLU kernels are per row already. Needs CUDA and the triton
attention backend (on the CPU the kernels run only under Triton's interpreter,
TRITON_INTERPRET=1: the tests), and a dense model (not recurrent, MoE or MLA layers)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("dflash.batch_invariance")

ATTENTION_BLOCK_M = 64            # query rows (token x GQA head) per attention program
_enabled = [False]


def enable(on: bool) -> None:
    """Sets the process's mode (before the model's first forward and any graph capture)."""
    if on != _enabled[0]:
        log.info("batch-invariant kernels %s", "on" if on else "off")
    _enabled[0] = on


def enabled() -> bool:
    return _enabled[0]


def check(device: str, attention_backend: str) -> None:
    """ValueError naming what --deterministic needs, for a device or backend it cannot cover."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not device.startswith("cuda") and not interpreted:
        raise ValueError(f"--deterministic needs --device cuda (batch-invariant Triton kernels); "
                         f"got --device {device}. On the CPU, fp32 is the exact path")
    if attention_backend != "triton":
        raise ValueError(f"--deterministic needs --attention-backend triton (its kernel is made "
                         f"batch-invariant); got {attention_backend!r}")
