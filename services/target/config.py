"""Target service configuration (one frozen dataclass; flags and DFLASH_* env fill it). What
only tests and benchmarks change is not here: services/target/hooks.py."""
from __future__ import annotations

from dataclasses import dataclass

from runtime import batch_invariance
from runtime.layers.linear import CPU_GEMMS, DEFAULT_CPU_GEMM
from runtime.layers.scan_kernels import CHOICES as SCAN_KERNELS

PLANE_CHOICES = ("auto", "shm", "cuda-ipc", "stream", "off")     # --feature-plane
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")                             # --kv-cache-dtype


@dataclass(frozen=True)
class TargetConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "torch"
    kv_budget_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"       # auto = the model's dtype; fp8_e4m3 (scales: runtime/kv_cache.py)
    page_size: int = 16
    max_context: int = 0               # 0 = the model's max_position_embeddings
    max_block_size: int = 32
    max_tree_nodes: int = 255          # draft nodes in a tree Verify (greedy; 0 = chains only;
                                       # at most token_budget - 1: one engine iteration)
    token_budget: int = 512            # tokens per engine iteration (chunked prefill)
    lease_seconds: float = 120.0
    state_slots: int = 64              # hybrid models: sequences the state pool holds
    model_id: str = ""
    warmup: bool = True
    cuda_graphs: bool = True           # capture verify forwards during warm-up (CUDA + triton or flashinfer)
    graph_block_sizes: tuple[int, ...] = (1, 16)
    graph_tree_sizes: tuple[int, ...] = (16, 64)   # tree verifies (anchor + drafts) captured as graphs
    # a lone prompt chunk padded to the smallest of these and run as a graph (sizes above
    # token_budget are not captured): eagerly, a short prefill is kernel launches
    graph_prefill_sizes: tuple[int, ...] = (32, 64, 128, 256, 512)
    graph_capture_layers: tuple[int, ...] = ()   # feature layers the graphs return (the drafter's)
    # prompt chunks share forwards with verifies even where prefill graphs are captured (one
    # eager forward instead of two graph replays); off: they take turns (EngineLoop.prompts_apart)
    mixed_batches: bool = False
    # prompts apart: at most this many sequences' chunks in one prompts' forward (1: a lone
    # chunk, run as a captured prefill graph; more: the prompts waiting together in one eager
    # forward - later chat turns arriving together queue behind each other otherwise)
    prompt_batch: int = 1
    # hybrid: sequences that can verify blocks of 2+ tokens (-1 = state_slots); see runtime/state_pool.py
    verify_state_slots: int = -1
    cpu_gemm: str = DEFAULT_CPU_GEMM   # fp32 CPU GEMM (runtime/layers/linear.py): auto | onednn | torch
    # where features can be published (services/target/publisher.py); the service's flag
    # defaults to auto, in-process users (training, benchmarks) need no plane
    feature_plane: str = "off"
    feature_plane_mib: int = 512       # size of each feature plane
    # seconds of start-up spent measuring the verify cost curve for the gateway's --speculation
    # auto (services/target/cost_calibration.py); 0 = off (in-process users need none)
    cost_calibration_s: float = 0.0
    # full KV pages of committed tokens kept for later prompts (runtime/prefix_cache.py); the
    # service's flag defaults to on, in-process users (benchmarks timing a prefill) to off
    prefix_caching: bool = False
    prefix_cache_max_pages: int = 0    # most unreferenced cached pages kept (0: all spare pages)
    # hybrid models: recurrent states kept at page boundaries of cached prefixes
    # (runtime/state_checkpoints.py); 0 = none, so their prefix caching is off
    prefix_state_checkpoints: int = 16
    tensor_parallel_size: int = 1      # ranks the model is split over (services/target/ranks.py)
    # recurrent layers' prefill / decode kernels (runtime/layers/scan_kernels.py): auto | torch | fla
    linear_attention_kernels: str = "auto"
    # batch-invariant kernels (runtime/batch_invariance.py): a verify = its decodes, bitwise
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.max_block_size < 1 or self.token_budget < self.max_block_size:
            raise ValueError("page_size and max_block_size must be >= 1 and token_budget >= max_block_size")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_tree_nodes < 0:
            raise ValueError(f"max_tree_nodes must be >= 0 (0 = chains only), got "
                             f"{self.max_tree_nodes}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.feature_plane not in PLANE_CHOICES or self.feature_plane_mib < 1:
            raise ValueError(f"feature plane {self.feature_plane!r} of {self.feature_plane_mib} MiB: "
                             f"allowed {' | '.join(PLANE_CHOICES)}, at least 1 MiB")
        if self.deterministic:
            batch_invariance.check(self.device, self.attention_backend)
        if self.feature_plane == "cuda-ipc" and not self.device.startswith("cuda"):
            raise ValueError("--feature-plane cuda-ipc needs --device cuda")
        if self.prompt_batch < 1:
            raise ValueError(f"prompt batch {self.prompt_batch}: allowed >= 1 (sequences whose "
                             f"prompt chunks share a forward)")
        if self.prefix_cache_max_pages < 0 or self.prefix_state_checkpoints < 0:
            raise ValueError(f"prefix_cache_max_pages ({self.prefix_cache_max_pages}, 0 = no "
                             f"cap) and prefix_state_checkpoints "
                             f"({self.prefix_state_checkpoints}) must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype {self.kv_cache_dtype!r} is not supported; allowed: "
                             f"{' | '.join(KV_CACHE_DTYPES)}")
        if self.linear_attention_kernels not in SCAN_KERNELS:
            raise ValueError(f"linear-attention kernels {self.linear_attention_kernels!r}: "
                             f"allowed {' | '.join(SCAN_KERNELS)}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"cpu gemm {self.cpu_gemm!r} is not offered by this torch build; "
                             f"allowed: {sorted(CPU_GEMMS)}")
