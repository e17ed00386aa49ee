"""Draft service configuration (one frozen dataclass; flags and DFLASH_* env fill it)."""
from __future__ import annotations

from dataclasses import dataclass

from runtime import batch_invariance
from runtime.config import DTYPES
from runtime.layers.linear import CPU_GEMMS, DEFAULT_CPU_GEMM, native_bf16_gemm

FEATURE_DTYPES = ("bfloat16", "float16", "float32")
AUTO_DTYPE = "auto"     # bf16 where the device computes it natively, else fp32 (resolved_dtype)
DRAFT_AHEAD = ("auto", "on", "off")

@dataclass(frozen=True)
class DraftConfig:
    target_dir: str                    # the target's HF directory: embedding, LM head, fingerprint
    model_dir: str = ""                # the drafter checkpoint (dflash); unused by prompt lookup
    drafter: str = "dflash"            # a name in services.draft.drafter.DRAFTERS
    device: str = "cpu"
    dtype: str = "float32"             # or AUTO_DTYPE
    attention_backend: str = "torch"
    kv_budget_bytes: int = 256 << 20   # context KV pages
    page_size: int = 16
    max_block_size: int = 0            # 0 = the drafter's block size
    max_tree_nodes: int = 255          # dflash: draft nodes a tree Propose may ask for (0 = chains)
    # dflash: the token ids drafts come from (runtime/draft_vocab.py): -1 = the checkpoint's
    # draft_vocab.json when it ships one, else all; 0 = every target token; N = its N most frequent
    draft_vocab: int = -1
    block_size: int = 8                # prompt lookup: the advertised block size
    max_ngram: int = 4                 # prompt lookup: longest suffix n-gram tried
    lookup_tree_nodes: int = 0         # prompt lookup: most drafts in a tree of continuations
                                       # (0 = chains)
    min_ngram: int = 1
    token_budget: int = 4096           # feature rows + block tokens per engine iteration
    lease_seconds: float = 120.0
    feature_dtype: str = "bfloat16"    # the dtype Propose features must arrive in
    model_id: str = ""
    cuda_graphs: bool = True           # capture the propose forward during warm-up (CUDA + triton or flashinfer)
    cpu_gemm: str = DEFAULT_CPU_GEMM   # fp32 CPU GEMM (runtime/layers/linear.py): auto | onednn | torch
    deterministic: bool = False        # batch-invariant kernels (runtime/batch_invariance.py)
    # dflash: context pages of committed positions kept for later prompts that start the same
    # way (OpenSequence); the service's flag defaults to on, in-process users to off
    prefix_caching: bool = False
    prefix_cache_max_pages: int = 0    # most unreferenced cached pages kept (0: all spare pages)
    # dflash: draft the next block from the target's commit notices before the gateway's Propose
    # comes, in the draft's idle time (auto: on a CUDA device, where it paid 1.09-1.24x at one
    # request; on a 2-core CPU it would take cores from the target's verify; docs/benchmarks.md)
    draft_ahead: str = "auto"          # auto (on for a CUDA draft) | on | off

    @property
    def ahead(self) -> bool:
        """Whether to subscribe to commit notices and draft ahead (--draft-ahead)."""
        return self.draft_ahead == "on" or (self.draft_ahead == "auto" and self.device != "cpu")

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.deterministic:
            batch_invariance.check(self.device, self.attention_backend)
        if self.draft_ahead not in DRAFT_AHEAD:
            raise ValueError(f"draft ahead {self.draft_ahead!r}: allowed {DRAFT_AHEAD}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"cpu gemm {self.cpu_gemm!r} is not offered by this torch build; "
                             f"allowed: {sorted(CPU_GEMMS)}")
        if self.dtype not in DTYPES and self.dtype != AUTO_DTYPE:
            raise ValueError(f"dtype {self.dtype!r} is not supported; allowed: "
                             f"{sorted(DTYPES) + [AUTO_DTYPE]}")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature dtype {self.feature_dtype!r} is not supported; "
                             f"allowed: {list(FEATURE_DTYPES)}")
        if self.page_size < 1 or self.block_size < 1 or self.max_block_size < 0:
            raise ValueError("page_size and block_size must be >= 1, max_block_size >= 0")
        if self.draft_vocab < -1:
            raise ValueError(f"draft_vocab must be -1 (the drafter's own), 0 (every token) or a "
                             f"count of ids, got {self.draft_vocab}")
        if self.max_tree_nodes < 0:
            raise ValueError(f"max_tree_nodes must be >= 0 (0 = chains only), got "
                             f"{self.max_tree_nodes}")
        if self.lookup_tree_nodes < 0:
            raise ValueError(f"lookup_tree_nodes must be >= 0 (0 = chains only), got "
                             f"{self.lookup_tree_nodes}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                             f"{self.max_ngram}")

    def resolved_dtype(self) -> str:
        """The dtype the drafter computes in. 'auto': bfloat16 on CUDA and on a CPU whose torch
        runs bf16 GEMMs natively (a draft forward is a few rows, where bf16 reads half the
        bytes: docs/benchmarks.md, "Draft service (CPU)"), else float32."""
        if self.dtype != AUTO_DTYPE:
            return self.dtype
        native = self.device != "cpu" or native_bf16_gemm()
        return "bfloat16" if native else "float32"
