"""TargetWorker: owns the model, its memory pools and its attention backend.

Start-up order is a contract (docs/architecture.md §7):
  1. __init__                  config + weights. No backend. need_mamba_verify_commit unknown.
  2. alloc_memory_pools()      KV pages (and the recurrent state pool of hybrid models).
  3. init_attention_backends() build the backend; only now decide need_mamba_verify_commit.
  4. warmup()                  a real prefill + verify.
Asking for the backend-dependent answers before their stage raises NotReady (never an
AttributeError, never a silent False)."""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from runtime import batch_invariance, tensor_parallel
from runtime.attention.base import AttentionBackend
from runtime.attention.hybrid import HybridAttnBackend, can_commit_mamba_state
from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.registry import BackendUnavailable, backend_class
from runtime.config import default_model_id, dtype_name, parse_dtype
from runtime.kv_cache import KVLayout, KVScales, PagedKVCache
from runtime.layers.gemm_calibration import GemmTable
from runtime.layers.linear import calibrate_cpu_gemm, set_cpu_gemm
from runtime.layers.scan_kernels import install as install_scan_kernels
from runtime.models.forward import ForwardBatch, ForwardOutput
from runtime.models.registry import load_model
from runtime.prefix_cache import PrefixCache
from runtime.state_checkpoints import StateCheckpoints
from runtime.tokenizer import tokenizer_fingerprint
from runtime.weights import read_kv_scales
from services.common.errors import NotReady
from services.target.config import TargetConfig
from services.target.cost_curves import CostCurves
from services.target.hooks import NO_TARGET_HOOKS, TargetHooks
from services.target.ranks import TensorParallelRanks

log = logging.getLogger("dflash.target.worker")

STAGES = ("loaded", "pools", "backends", "ready")


@dataclass(frozen=True)
class ModelFacts:
    """What capabilities report about the model itself (known after __init__)."""
    model_id: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    tokenizer_hash: str
    hybrid: bool


class TargetWorker:
    def __init__(self, config: TargetConfig, hooks: TargetHooks = NO_TARGET_HOOKS,
                 rank: int = 0) -> None:
        """rank: this process's tensor-parallel rank (its share of the model; 0 serves)."""
        self.config, self.hooks = config, hooks
        if config.tensor_parallel_size != tensor_parallel.size():
            raise RuntimeError(f"a worker of {config.tensor_parallel_size} tensor-parallel ranks "
                               f"in a process whose group has {tensor_parallel.size()}: the ranks "
                               f"start first (services/target/ranks.py)")
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and config.tensor_parallel_size > 1:
            self.device = torch.device("cuda", rank)
        self.dtype = parse_dtype(config.dtype)
        set_cpu_gemm(config.cpu_gemm)
        batch_invariance.enable(config.deterministic)
        t0 = time.monotonic()
        self.model = load_model(config.model_dir, self.dtype, self.device, hooks.random_weights,
                                tp_rank=rank, tp_size=config.tensor_parallel_size)
        self.scan_kernels = install_scan_kernels(self.model, config.linear_attention_kernels,
                                                 self.device)   # None: no recurrent layers
        self.ranks: TensorParallelRanks | None = None   # rank 0 of several: its followers
        if config.deterministic:
            self._check_deterministic()
        cfg = self.model.cfg
        self.facts = ModelFacts(
            model_id=config.model_id or default_model_id(config.model_dir),
            architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
            max_context=min(cfg.max_position, config.max_context or cfg.max_position),
            eos_token_ids=tuple(cfg.eos_token_ids), bos_token_id=int(cfg.bos_token_id or 0),
            tokenizer_hash=tokenizer_fingerprint(config.model_dir),
            hybrid=bool(getattr(self.model, "hybrid", False)),
        )
        self.kv_cache: PagedKVCache | None = None
        self.state_pool = None
        self.state_checkpoints: StateCheckpoints | None = None   # hybrid prefix caching
        self._attn_backend: AttentionBackend | None = None
        self._need_mamba_verify_commit: bool | None = None
        self._graphs: dict[tuple[int, tuple[int, ...]], object] = {}
        self._tree_graphs: dict[tuple[int, tuple[int, ...]], object] = {}
        self._prefill_graphs: dict[tuple[int, tuple[int, ...]], object] = {}   # one sequence
        self.verify_cost = CostCurves()  # verify time by batch tokens, measured at warm-up
                                         # (services/target/cost_calibration.py); empty = none
        self.stage = "loaded"
        log.info("weights loaded", extra={"model": self.facts.model_id,
                                          "seconds": round(time.monotonic() - t0, 2),
                                          "linear_attention_kernels": self.scan_kernels})

    # -- stage-gated answers -------------------------------------------------------------
    def _require(self, stage: str, what: str) -> None:
        if STAGES.index(self.stage) < STAGES.index(stage):
            raise NotReady(f"{what} is not available yet: the target is at start-up stage "
                           f"'{self.stage}' and needs '{stage}' (order: {' -> '.join(STAGES)})")

    @property
    def attn_backend(self) -> AttentionBackend:
        self._require("backends", "the attention backend")
        return self._attn_backend

    @property
    def need_mamba_verify_commit(self) -> bool:
        self._require("backends", "need_mamba_verify_commit")
        assert self._need_mamba_verify_commit is not None
        return self._need_mamba_verify_commit

    @property
    def ready(self) -> bool:
        return self.stage == "ready"

    # -- start-up stages -----------------------------------------------------------------
    @classmethod
    def started(cls, config: TargetConfig, hooks: TargetHooks = NO_TARGET_HOOKS) -> TargetWorker:
        """A worker taken through the start-up stages in order (weights, pools, backends, ready)
        on this thread: for benchmarks and in-process tools. The service runs the same stages
        one at a time and reports its health between them; it also captures CUDA graphs before
        it is ready, which here is the caller's choice (capture_cuda_graphs())."""
        worker = cls(config, hooks)
        worker.alloc_memory_pools()
        worker.init_attention_backends()
        worker.mark_ready()
        return worker

    def alloc_memory_pools(self) -> None:
        state_bytes = 0
        if self.facts.hybrid:
            verify_slots = self.config.verify_state_slots
            self.state_pool = self.model.make_state_pool(
                self.config.state_slots, self.config.max_block_size, self.device,
                num_verify_slots=None if verify_slots < 0 else verify_slots)
            self.state_checkpoints = self._state_checkpoints()
            state_bytes = self.state_pool.nbytes + (
                self.state_checkpoints.nbytes if self.state_checkpoints is not None else 0)
            if state_bytes >= self.config.kv_budget_bytes:
                raise ValueError(
                    f"the recurrent state pool alone needs {state_bytes} bytes (state slots + "
                    f"verify slots x max block size), the memory budget is "
                    f"{self.config.kv_budget_bytes}: raise --kv-budget or lower --state-slots / "
                    f"--verify-state-slots / --max-block-size")
        layout, kv_dtype = self.model.kv_layout, self.kv_dtype
        per_page = PagedKVCache.layout_bytes_per_page(layout, self.config.page_size, kv_dtype)
        pages = max(0, self.config.kv_budget_bytes - state_bytes) // per_page
        self.kv_cache = PagedKVCache.for_layout(layout, self.config.page_size, int(pages),
                                                kv_dtype, self.device, self._prefix_cache(),
                                                self._kv_scales(layout))
        self.stage = "pools"
        log.info("memory pools allocated", extra={
            "kv_pages": self.kv_cache.usable_pages, "page_size": self.config.page_size,
            "kv_tokens": self.kv_cache.usable_pages * self.config.page_size,
            "kv_dtype": str(kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": per_page // self.config.page_size,
            "latent_kv": bool(layout.latent_value_dim),
            "state_bytes": state_bytes, "prefix_caching": self.prefix_caching})

    @property
    def kv_dtype(self) -> torch.dtype:
        """--kv-cache-dtype: the model's dtype (auto) or float8 e4m3."""
        return torch.float8_e4m3fn if self.config.kv_cache_dtype == "fp8_e4m3" else self.dtype

    def _kv_scales(self, layout: KVLayout) -> KVScales | None:
        """fp8: the checkpoint's per-layer k_scale / v_scale where it has them, else 1.0."""
        if self.kv_dtype != torch.float8_e4m3fn:
            return None
        ids = getattr(self.model, "attention_layer_ids", range(layout.num_layers))
        found = {} if self.hooks.random_weights else read_kv_scales(self.config.model_dir)
        k = tuple(found.get((i, "k"), 1.0) for i in ids)
        v = tuple(found.get((i, "v"), 1.0) for i in ids)
        log.info("fp8 KV cache scales: %s", "from the checkpoint" if found else
                 "1.0 for every layer (the checkpoint has no k_scale / v_scale)")
        return KVScales(k, v)

    def _state_checkpoints(self) -> StateCheckpoints | None:
        """Hybrid prefix caching: --prefix-state-checkpoints, at most as many as a quarter of
        the budget left beside the state pool holds (the rest is for KV pages: a budget sized
        for the pool and its pages keeps them), none when prefix caching is off."""
        wanted = self.config.prefix_state_checkpoints if self.config.prefix_caching else 0
        pool = self.state_pool
        fits = max(0, self.config.kv_budget_bytes - pool.nbytes) // 4 // pool.bytes_per_state
        if wanted > fits:
            log.warning("fewer recurrent-state checkpoints than --prefix-state-checkpoints: a "
                        "quarter of the memory budget left beside the state pool holds %d", fits)
        n = min(wanted, fits)
        return StateCheckpoints(pool, n) if n else None

    def _prefix_cache(self) -> PrefixCache | None:
        """--enable-prefix-caching: None when off, and for hybrid models without state
        checkpoints (a cached prefix would give its KV but not its recurrent state: every
        prefix would have to miss)."""
        if not self.config.prefix_caching:
            return None
        if self.facts.hybrid and self.state_checkpoints is None:
            log.warning("prefix caching is off for this hybrid model: it keeps no recurrent-state "
                        "checkpoints (--prefix-state-checkpoints 0, or no room in the memory "
                        "budget), and a cached prefix needs the state at its end")
            return None
        return PrefixCache(self.config.prefix_cache_max_pages)

    @property
    def prefix_caching(self) -> bool:
        return self.kv_cache is not None and self.kv_cache.prefix_cache is not None

    @property
    def num_attention_layers(self) -> int:
        return self.model.kv_layout.num_layers

    def init_attention_backends(self) -> None:
        self._require("pools", "init_attention_backends")
        layout = self.model.kv_layout
        cls = backend_class(self.config.attention_backend)
        check_backend_fits(cls, layout, self.kv_dtype)
        time.sleep(self.hooks.backend_delay_s)
        full: AttentionBackend = cls(self.kv_cache, layout.num_heads, layout.num_kv_heads,
                                     layout.head_dim, layout.scale)
        # trees of drafts: the backend itself where it reads tree masks, else triton on a GPU
        # (where it is installed) or the reference backend, over the same cache (eager)
        tree = full if full.supports_trees else self._tree_fallback(layout)
        backend, self._tree_backend = full, tree
        if self.facts.hybrid:       # one state backend: a tree's rows follow their parents
            mamba = self.model.make_state_backend(self.state_pool, self.hooks.mamba_commit)
            backend = HybridAttnBackend(full, mamba)
            self._tree_backend = backend if tree is full else HybridAttnBackend(tree, mamba)
        elif self.hooks.hybrid_wrapper:
            backend = HybridAttnBackend(full)
            self._tree_backend = backend if tree is full else tree
        self._attn_backend = backend
        # Decided only now, from the model (does it have mamba layers?) and the backend that
        # exists (can it commit?) - a delegating wrapper alone never makes this True.
        self._need_mamba_verify_commit = self.facts.hybrid and can_commit_mamba_state(backend)
        self.stage = "backends"
        if self.hooks.skip_mamba_commit:
            log.warning("UNSAFE testing hook: the mamba verify commit is advertised but skipped; "
                        "outputs of this hybrid target are wrong")
        log.info("attention backends built", extra={
            "backend": backend.name, "need_mamba_verify_commit": self._need_mamba_verify_commit})

    def _tree_fallback(self, layout: KVLayout) -> AttentionBackend:
        names = (["triton"] if self.device.type == "cuda" else []) + ["torch"]
        for name in names:
            try:
                cls = backend_class(name)
            except BackendUnavailable:
                continue
            return cls(self.kv_cache, layout.num_heads, layout.num_kv_heads, layout.head_dim,
                       layout.scale)
        raise RuntimeError("no attention backend reads tree masks here")

    def _check_deterministic(self) -> None:
        """--deterministic covers the dense decoder's kernels (runtime/batch_invariance.py):
        a model with other layers is a start-up error naming them."""
        if getattr(self.model, "hybrid", False) or self.scan_kernels is not None:
            raise ValueError("--deterministic covers dense attention models; this one has "
                             "recurrent (linear-attention / state-space) layers, whose kernels "
                             "are not batch-invariant")
        if getattr(self.model, "has_moe", False):
            raise ValueError("--deterministic covers dense attention models; this one has "
                             "mixture-of-experts layers, whose grouped GEMMs are not "
                             "batch-invariant")
        if getattr(self.model.cfg, "kv_lora_rank", 0):
            raise ValueError("--deterministic covers dense attention models; this one has "
                             "MLA's latent cache, whose kernel is not batch-invariant")

    @property
    def max_tree_nodes(self) -> int:
        """Draft nodes a tree Verify may carry (a hybrid model: within the recurrent states a
        verify slot keeps, one per block row)."""
        self._require("backends", "max_tree_nodes")
        nodes = min(self.config.max_tree_nodes, self.config.token_budget - 1)
        if self.facts.hybrid:
            nodes = min(nodes, self.state_pool.max_block_size - 1)
        return nodes

    def mark_ready(self) -> None:
        self._require("backends", "readiness")
        self.stage = "ready"

    # -- forward ---------------------------------------------------------------------------
    def forward(self, slices: list[SeqSlice], input_ids: torch.Tensor, positions: torch.Tensor,
                capture_layers: tuple[int, ...], state_slots: list[int | None] | None = None,
                verify: list[bool] | None = None) -> ForwardOutput:
        """One forward over the flattened new tokens of several sequences (causal).
        Hybrid models: state_slots[i] is sequence i's live state slot; verify[i] True keeps one
        intermediate state per block position instead of advancing the live state.
        A batch with a tree mask (a verified tree of drafts) runs on the tree backend: a captured
        tree graph where one fits, else eagerly."""
        if self.ranks is None:
            return self._forward(slices, input_ids, positions, capture_layers, state_slots,
                                 verify)
        with self.ranks.guard():                    # every rank runs it (its heads, its KV)
            self.ranks.send("forward", slices, input_ids, positions, capture_layers,
                            state_slots, verify)
            return self._forward(slices, input_ids, positions, capture_layers, state_slots,
                                 verify)

    def _forward(self, slices: list[SeqSlice], input_ids: torch.Tensor,
                 positions: torch.Tensor, capture_layers: tuple[int, ...],
                 state_slots: list[int | None] | None, verify: list[bool] | None
                 ) -> ForwardOutput:
        backend = self.attn_backend
        trees = any(s.tree is not None for s in slices)
        if trees:
            backend = self._tree_backend
        graphs = self._tree_graphs if trees else self._graphs
        runner = self._graph_for(slices, capture_layers, graphs)
        if runner is None and not trees and len(slices) == 1:        # a prompt chunk
            runner = self._graph_for(slices, capture_layers, self._prefill_graphs)
        if runner is not None:
            with torch.inference_mode():
                return runner.run(slices, input_ids, positions)     # host tensors, packed there
        meta = AttentionMetadata.build(slices, self.kv_cache, causal=True, device=self.device)
        if self.facts.hybrid:
            self.model.set_state_context(meta, state_slots, verify)
        backend.prepare(meta)
        with torch.inference_mode():
            return self.model(input_ids.to(self.device), positions.to(self.device),
                              ForwardBatch(backend, capture_layers))

    # -- CUDA graphs (warm-up) ---------------------------------------------------------------
    def capture_cuda_graphs(self) -> None:
        """Captures verify forwards for each configured block size (and the configured feature
        layers) at bucketed batch sizes, and one sequence's prompt chunks at each prefill size
        (within the token budget). Eager fallback: not on CUDA, a hybrid model, a backend that
        is not captured (torch), or --no-cuda-graphs. Tensor-parallel followers
        capture the same graphs at the same time (their all-reduces pair inside them).
        Mixture-of-experts layers are captured too in bf16: on CUDA their routing and grouped
        GEMMs stay on the device (runtime/layers/moe.py; on an H100 the replay equals the eager
        forward bitwise); in other dtypes torch's grouped GEMM copies its group offsets to the
        host, which no capture allows, so such a model runs eagerly there (logged)."""
        if self.ranks is not None:
            self.ranks.send("capture_cuda_graphs")
        cfg = self.config
        backend = self.attn_backend
        if (not cfg.cuda_graphs or self.device.type != "cuda" or self.facts.hybrid
                or not backend.captures_cuda_graphs):
            return
        if getattr(self.model, "has_moe", False) and self.dtype != torch.bfloat16:
            log.info("cuda graphs off: this model's mixture-of-experts layers run eagerly in "
                     "%s (torch's grouped GEMM copies its offsets to the host outside bf16)",
                     self.dtype)
            return
        # no features (autoregressive verify, drafters without features) and the drafter's layers
        layer_sets = sorted({(), tuple(cfg.graph_capture_layers)})
        self._capture(layer_sets)
        log.info("cuda graphs ready", extra={"block_sizes": cfg.graph_block_sizes,
                                             "prefill_sizes": self._prefill_sizes(),
                                             "tree_sizes": sorted({q for q, _ in self._tree_graphs}),
                                             "capture_layers": layer_sets})

    def _capture(self, layer_sets: list[tuple[int, ...]]) -> None:
        """The graphs capture_cuda_graphs describes, for each set of feature layers."""
        from runtime.cuda_graphs import GraphRunner
        cfg, backend, model = self.config, self.attn_backend, self.model
        with torch.inference_mode():
            for layers in layer_sets:
                def forward(ids, pos, meta, layers=layers):
                    return model(ids, pos, ForwardBatch(backend, layers))
                for q in cfg.graph_block_sizes:
                    runner = GraphRunner(forward, backend, self.kv_cache, q,
                                         self.facts.max_context, causal=True)
                    runner.capture()
                    self._graphs[(q, layers)] = runner
                for q in cfg.graph_tree_sizes if self._tree_backend is backend else ():
                    runner = GraphRunner(forward, backend, self.kv_cache, q,
                                         self.facts.max_context, causal=True, tree=True)
                    runner.capture()
                    self._tree_graphs[(q, layers)] = runner
                for q in self._prefill_sizes():
                    runner = GraphRunner(forward, backend, self.kv_cache, q,
                                         self.facts.max_context, causal=True, buckets=(1,))
                    runner.capture()
                    self._prefill_graphs[(q, layers)] = runner

    @property
    def padded_blocks(self) -> tuple[int, ...]:
        """The chain verify blocks batches are padded to (captured graphs' sizes, or the test
        hook's), ascending; () = none."""
        return tuple(sorted(set(self.hooks.pad_verify_to) or {q for q, _ in self._graphs}))

    def padded_block(self, batch: int, longest: int, capture_layers: tuple[int, ...]) -> int:
        """The block a batch of `batch` chain verifies of at most `longest` tokens each is padded
        to, so that it runs as one captured graph: the smallest captured size that holds them
        and has a bucket for the batch (0: none; it runs as it is). Tests pad on the CPU through
        TargetHooks.pad_verify_to."""
        sizes = self.hooks.pad_verify_to or [
            q for (q, layers), runner in self._graphs.items()
            if layers == tuple(capture_layers) and runner.bucket(batch) is not None]
        return min((q for q in sizes if q >= longest), default=0)

    def _prefill_sizes(self) -> list[int]:
        """The prompt chunk sizes to capture: within the token budget, not a verify block's."""
        cfg = self.config
        return sorted({q for q in cfg.graph_prefill_sizes
                       if q <= cfg.token_budget and q not in cfg.graph_block_sizes})

    def prompts_apart(self) -> bool:
        """Whether prompt chunks run in forwards of their own, taking turns with the verifies
        (EngineLoop.prompts_apart): where prefill graphs were captured, as a batch mixing a
        chunk with verifies matches no graph and runs eagerly (SmolLM2 on an H100: 20-30 ms
        eagerly, launch-bound, against a few ms for each graph replay) - unless --mixed-batches.
        SGLang likewise keeps prefill and decode batches apart unless --enable-mixed-chunk.
        Tests force it on the CPU through TargetHooks.pad_prefill_to."""
        return not self.config.mixed_batches and bool(
            self._prefill_graphs or self.hooks.pad_prefill_to)

    def prefill_block(self, rows: int, capture_layers: tuple[int, ...]) -> int:
        """The size a lone prompt chunk of `rows` tokens is padded to, so that it runs as a
        captured graph: the smallest captured prefill size that holds it (0: none; it runs as it
        is). Tests pad on the CPU through TargetHooks.pad_prefill_to."""
        sizes = self.hooks.pad_prefill_to or [
            q for q, layers in self._prefill_graphs if layers == tuple(capture_layers)]
        return min((q for q in sizes if q >= rows), default=0)

    def _graph_for(self, slices: list[SeqSlice], capture_layers: tuple[int, ...], graphs: dict):
        """The captured runner for this batch, or None (eager): every sequence must append the
        same number of tokens, ask for the captured feature layers, and fit a bucket."""
        if not graphs or len({s.q_len for s in slices}) != 1:
            return None
        runner = graphs.get((slices[0].q_len, tuple(capture_layers)))
        return runner if runner is not None and runner.can_run(slices) else None

    def copy_positions(self, table, src: list[int], dst: list[int]) -> None:
        """KV of positions src moved to dst (a tree's accepted path made a chain), on every
        rank's share of the cache."""
        if self.ranks is None:
            self.kv_cache.copy_positions(table, src, dst)
            return
        with self.ranks.guard():
            self.ranks.send("copy_positions", table, src, dst)
            self.kv_cache.copy_positions(table, src, dst)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.compute_logits(hidden)

    def calibrate_cpu_gemm(self) -> GemmTable | None:
        """On the CPU with --cpu-gemm auto: the fastest fp32 GEMM per row count, measured on this
        host for this model's matrices (runtime/layers/gemm_calibration.py). Run on the engine
        thread (its compute threads) before warm-up, so readiness waits for it. Returns the
        table chosen (None: not the CPU, or not auto)."""
        if self.device.type != "cpu":
            return None
        return calibrate_cpu_gemm(self.model.parameters())

    def commit_mamba_state(self, commits: list[tuple[int, int]]) -> None:
        """(state slot, last committed block index) per verified sequence, right after acceptance
        is decided for a verify batch (hybrid models)."""
        if self.need_mamba_verify_commit and not self.hooks.skip_mamba_commit:
            self.attn_backend.update_mamba_state_after_mtp_verify(commits)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_backend_fits(cls: type[AttentionBackend], layout: KVLayout, kv_dtype: torch.dtype
                       ) -> None:
    """Before the backend is built: a model or cache it cannot read is a start-up error naming
    the flag and the backends that can."""
    from runtime.attention.registry import backends_supporting
    if layout.latent_value_dim and not cls.supports_latent_kv:
        raise ValueError(f"--attention-backend {cls.name} cannot run multi-head latent attention "
                         f"(this model's latent KV cache); backends that can: "
                         f"{backends_supporting('supports_latent_kv')}")
    if kv_dtype == torch.float8_e4m3fn and not cls.supports_fp8_kv:
        raise ValueError(f"--kv-cache-dtype fp8_e4m3 is not supported by --attention-backend "
                         f"{cls.name}; backends that support it: "
                         f"{backends_supporting('supports_fp8_kv')} (or --kv-cache-dtype auto)")
