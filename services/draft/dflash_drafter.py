"""The DFlash drafter: per-sequence context K/V in a paged cache, one non-causal block forward.

Per engine iteration, over all sequences of the batch:
  1. append: new feature rows [N, K*H] -> fc + hidden_norm -> per layer k_norm(k_proj), v_proj,
     RoPE at their positions -> stored at the sequences' context slots (never recomputed).
  2. block: [anchor, MASK x (B-1)] at positions L..L+B-1 attends over context + block
     (causal=False; sliding layers causal with their window). The block's K/V go to the slots
     past the context and are dropped afterwards (trim): only committed context stays.
  3. drafts = argmax of the target LM head over block positions 1..B-1; or, for a Propose that
     asks for a tree of N drafts, the N likeliest prefixes of the block's per-position
     distributions (runtime/draft_tree.py: best_tree), from each position's TREE_TOP_K
     likeliest tokens."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from runtime import draft_vocab
from runtime.attention.base import AttentionBackend
from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.registry import backend_class
from runtime.config import default_model_id, parse_dtype
from runtime.draft_tree import DraftTree, best_tree
from runtime.kv_cache import PagedKVCache
from runtime.layers.linear import calibrate_cpu_gemm
from runtime.models.dflash import (
    DFlashConfig,
    TargetFingerprint,
    TargetHead,
    checkpoint_shapes,
    load_dflash,
    target_layer_ids_problem,
)
from runtime.models.forward import ForwardBatch, ForwardOutput
from runtime.prefix_cache import PrefixCache, prompt_keys
from services.common.feature_plane import join_rows
from services.draft.config import AUTO_DTYPE, DraftConfig
from services.draft.drafter import Drafter, DrafterFacts, DrafterRefused, ProposeItem
from services.draft.sequence import DraftSequence

log = logging.getLogger("dflash.draft.dflash")
TREE_TOP_K = 16                     # candidates per block position a tree is built from


class Ranked(NamedTuple):
    """Each row's likeliest tokens, best first: log-probabilities and token ids, [rows, k]."""
    values: torch.Tensor
    indices: torch.Tensor


@dataclass
class BlockOutput:
    trees: list[DraftTree]          # per item: a chain of B-1 drafts ([] for B = 1), or its tree
    hidden: torch.Tensor | None     # [sum of B over items with B > 1, H] after the final norm

    @property
    def drafts(self) -> list[list[int]]:
        """Per item, its draft tokens."""
        return [t.tokens for t in self.trees]


def compatibility_problems(cfg: DFlashConfig, fc_shape: tuple[int, ...] | None,
                           target: TargetFingerprint) -> list[str]:
    """Everything that stops this drafter from serving `target`, each as expected vs got."""
    problems = list(cfg.target_fingerprint.differences(target)) if cfg.target_fingerprint else []
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary: "
                        f"expected an id in [0, {target.vocab_size})")
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"draft hidden_size {cfg.hidden_size} != target hidden_size "
                        f"{target.hidden_size} (the draft embeds with the target's embedding)")
    width = len(cfg.target_layer_ids) * target.hidden_size
    if fc_shape is not None and (len(fc_shape) != 2 or fc_shape[1] != width):
        problems.append(f"fc.weight input width {fc_shape[1] if len(fc_shape) == 2 else fc_shape} "
                        f"!= K*H_target = {len(cfg.target_layer_ids)} x {target.hidden_size} = "
                        f"{width}")
    layer_ids = target_layer_ids_problem(cfg.target_layer_ids, target.num_layers)
    if layer_ids:
        problems.append(layer_ids)
    if cfg.block_size < 2:
        problems.append(f"block_size {cfg.block_size}: expected >= 2")
    return problems


class DFlashDrafter(Drafter):
    def __init__(self, config: DraftConfig, random_weights: bool = False) -> None:
        self.config = config
        self.device = torch.device(config.device)
        dtype = config.resolved_dtype()
        self.dtype = parse_dtype(dtype)
        if config.dtype == AUTO_DTYPE:
            log.info("draft dtype auto", extra={"dtype": dtype})
        cfg, shapes = _read_checkpoint(config.model_dir)
        target = TargetFingerprint.of_target(config.target_dir)
        problems = compatibility_problems(
            cfg, shapes.get("fc.weight", shapes.get("model.fc.weight")), target)
        if problems:
            raise DrafterRefused(f"drafter {config.model_dir} cannot serve target "
                                 f"{config.target_dir}:\n  - " + "\n  - ".join(problems))
        try:
            self.model = load_dflash(config.model_dir, self.dtype, self.device, random_weights)
        except ValueError as e:
            raise DrafterRefused(str(e)) from None
        self.head = self._draft_head(TargetHead.load(config.target_dir, self.dtype, self.device,
                                                     random_weights))
        self.facts = DrafterFacts(
            kind="dflash", model_id=config.model_id or default_model_id(config.model_dir),
            block_size=cfg.block_size, max_block_size=config.max_block_size or cfg.block_size,
            target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id,
            hidden_size=target.hidden_size, vocab_size=target.vocab_size,
            max_context=cfg.base.max_position, feature_dtype=config.feature_dtype,
            needs_features=True, needs_tokens=False, target=cfg.target_fingerprint or target,
            max_tree_nodes=config.max_tree_nodes)
        if self.facts.max_block_size > cfg.block_size:
            log.warning("max block size above the trained block size", extra={
                "max_block_size": self.facts.max_block_size, "trained": cfg.block_size})
        self.cache: PagedKVCache | None = None
        self.backend: AttentionBackend | None = None
        self._graph = None                  # GraphRunner of the block forward (CUDA + triton or flashinfer)
        self._tree_graph = None             # ... returning each position's top-k (trees)
        self._append_graphs = None          # RowGraphs of the context append (CUDA)

    def _draft_head(self, head: TargetHead) -> TargetHead:
        """The target's head, restricted to the drafter's vocabulary (config.draft_vocab)."""
        try:
            ids = draft_vocab.resolve(self.config.model_dir, self.config.draft_vocab,
                                      head.vocab_size)
        except ValueError as e:
            raise DrafterRefused(str(e)) from None
        log.info("draft vocabulary", extra={"tokens": len(ids) if ids else head.vocab_size,
                                            "of": head.vocab_size})
        return head.restricted(ids)

    # -- start-up ----------------------------------------------------------------------------
    def calibrate_cpu_gemm(self) -> None:
        if self.device.type == "cpu":
            calibrate_cpu_gemm([*self.model.parameters(), self.head.lm_head_weight])

    def init_backend(self) -> None:
        base = self.model.cfg.base
        per_page = PagedKVCache.bytes_per_page(base.num_layers, base.num_kv_heads, base.head_dim,
                                               self.config.page_size, self.dtype)
        pages = self.config.kv_budget_bytes // per_page
        prefix = (PrefixCache(self.config.prefix_cache_max_pages) if self.config.prefix_caching
                  else None)
        self.cache = PagedKVCache(base.num_layers, base.num_kv_heads, base.head_dim,
                                  self.config.page_size, int(pages), self.dtype, self.device,
                                  prefix)
        cls = backend_class(self.config.attention_backend)
        self.backend = cls(self.cache, base.num_heads, base.num_kv_heads, base.head_dim,
                           base.head_dim ** -0.5)
        log.info("draft KV cache and backend built", extra={
            "pages": self.cache.usable_pages, "tokens": self.cache.usable_pages * self.cache.page_size,
            "backend": self.backend.name})

    # -- engine thread -----------------------------------------------------------------------
    def reserve(self, item: ProposeItem) -> None:
        block = self._run_block(item) if item.block_size > 1 else 0
        self.cache.ensure(item.seq.table, item.context_len + block)

    def _run_block(self, item: ProposeItem) -> int:
        """The block a chain runs at: the captured graph's when it asks for a shorter one that
        the context has room for (its drafts are cut to the ones asked: on a GPU the captured
        full block costs less than a shorter one run eagerly, and adaptive speculation asks for
        every length), else its own."""
        graph = self._graph
        if (graph is not None and not item.tree_nodes and 1 < item.block_size < graph.q_len
                and item.context_len + graph.q_len <= self.facts.max_context):
            return graph.q_len
        return item.block_size

    def release(self, seq) -> None:
        self.cache.release(seq.table)

    # -- prefix caching: the context K/V of a position depends only on its target features,
    # which depend only on the tokens up to it, so the target's page keys name it too --------
    @property
    def prefix_caching(self) -> bool:
        return self.cache is not None and self.cache.prefix_cache is not None

    def attach_prefix(self, seq: DraftSequence, token_ids: list[int]) -> int:
        """Short of the prompt's last token, as on the target (whose forward of it gives the
        first output, and its features)."""
        if not self.prefix_caching:
            return 0
        hit = self.cache.attach_prefix(seq.table, prompt_keys(token_ids, self.cache.page_size))
        seq.tokens = list(token_ids[:hit])
        return hit

    def prefix_cached_pages(self) -> int:
        return self.cache.cached_pages if self.cache is not None else 0

    def _cache_context(self, items: list[ProposeItem]) -> None:
        """The items' new context is committed: its full pages enter the prefix cache, keyed
        by the tokens the Propose named (a sequence whose tokens were not all named stops
        there: its keys would be unknown)."""
        if not self.prefix_caching:
            return
        for item in items:
            seq = item.seq
            if len(seq.tokens) != item.start or len(item.token_ids) != item.num_new:
                continue
            seq.tokens.extend(item.token_ids)
            self.cache.cache_full_pages(seq.table, seq.tokens, item.context_len)

    def kv_usage(self) -> float:
        return self.cache.usage() if self.cache is not None else 0.0

    def capture_cuda_graphs(self) -> None:
        """The block forward + LM-head argmax at the drafter's block size, captured per batch
        bucket (CUDA, a backend that captures_cuda_graphs: triton), and the same forward + each position's
        TREE_TOP_K likeliest tokens for batches with trees (when max_tree_nodes > 0). Other
        block sizes and devices run eagerly."""
        if not (self.config.cuda_graphs and self.device.type == "cuda"
                and self.backend.captures_cuda_graphs):
            return
        from runtime.cuda_graphs import GraphRunner
        from runtime.row_graphs import RowGraphs
        block = self.facts.max_block_size
        with torch.inference_mode():
            runner = GraphRunner(self._block_tokens, self.backend, self.cache, block,
                                 self.facts.max_context, causal=False)
            runner.capture()
            if self.facts.max_tree_nodes:
                self._tree_graph = GraphRunner(self._block_top_k, self.backend, self.cache,
                                               block, self.facts.max_context, causal=False)
                self._tree_graph.capture()
            rows = RowGraphs(self._store_context, self.facts.feature_width,
                             getattr(torch, self.facts.feature_dtype), self.device,
                             self.cache.page_size)
            rows.capture()
        self._graph, self._append_graphs = runner, rows
        log.info("draft cuda graphs ready", extra={"block_size": block})

    def propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        runs = [replace(i, block_size=self._run_block(i)) for i in items]
        out = self._propose(runs)
        self._cache_context(items)
        return [t if len(t.tokens) < i.block_size or not t.is_chain
                else DraftTree.chain(t.tokens[: i.block_size - 1]) for i, t in zip(items, out)]

    def _propose(self, items: list[ProposeItem]) -> list[DraftTree]:
        trees = any(i.tree_nodes for i in items)
        runner = self._graph_for(items, self._tree_graph if trees else self._graph)
        if runner is None:
            return self.run(items).trees
        try:
            with torch.inference_mode():
                self.append([i for i in items if i.num_new > 0])
                slices, ids, positions = self._block_inputs(items)
                out = runner.run(slices, ids, positions)
                q = runner.q_len
                if trees:         # [n, B-1, K] candidates (best first) and log-probabilities
                    cands = out.hidden.view(len(items), q, -1)[:, 1:].tolist()
                    logps = out.captured.view(len(items), q, -1)[:, 1:].tolist()
                else:
                    rows = out.hidden.view(len(items), q)[:, 1:].tolist()      # int64 [n, B-1]
        finally:
            self._trim(items)
        if not trees:
            return [DraftTree.chain(r) for r in rows]
        return [best_tree(c, lp, i.tree_nodes) if i.tree_nodes
                else DraftTree.chain([ranked[0] for ranked in c])
                for i, c, lp in zip(items, cands, logps)]

    def run(self, items: list[ProposeItem]) -> BlockOutput:
        """Append every item's new features, then one block forward over all items with B > 1."""
        try:
            with torch.inference_mode():
                self.append([i for i in items if i.num_new > 0])
                blocks = [i for i in items if i.block_size > 1]
                hidden = self.forward_blocks(blocks) if blocks else None
                trees = self._drafts(blocks, hidden)
        finally:
            self._trim(items)
        return BlockOutput([trees.get(id(i), DraftTree([], [])) for i in items], hidden)

    def _trim(self, items: list[ProposeItem]) -> None:
        for item in items:          # the block's K/V slots are never committed
            self.cache.trim(item.seq.table, item.context_len)

    def _graph_for(self, items: list[ProposeItem], runner):
        """`runner` when every item drafts a block of its size and fits a bucket, else None."""
        if runner is None or any(i.block_size != runner.q_len for i in items):
            return None
        slices = [SeqSlice(i.seq.table, i.context_len, i.block_size) for i in items]
        return runner if runner.can_run(slices) else None

    def append(self, items: list[ProposeItem]) -> None:
        if not items:
            return
        feats = join_rows([i.features for i in items], self.device)             # [N, K*H]
        positions = torch.cat([torch.arange(i.start, i.context_len) for i in items])
        slots = torch.tensor([s for i in items
                              for s in self.cache.slots(i.seq.table, i.start, i.context_len)],
                             dtype=torch.int64)
        graphs = self._append_graphs
        if graphs is None or not graphs.run(feats, positions, slots):
            self._store_context(feats.to(self.device), positions.to(self.device),
                                slots.to(self.device))

    def _store_context(self, feats: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor) -> None:
        """feats [N, K*H], positions / slots int64 [N] on the device: each draft layer's context
        k/v written to the sequences' cache slots (captured per row bucket on CUDA)."""
        for layer, (k, v) in enumerate(self.model.context_kv(feats, positions)):
            self.backend.store_kv(layer, k, v, slots)

    def _block_inputs(self, items: list[ProposeItem]
                      ) -> tuple[list[SeqSlice], torch.Tensor, torch.Tensor]:
        """Each item's block [anchor, MASK x (B-1)] at L..L+B-1: slices, ids and positions
        int64 [sum B] (CPU)."""
        slices = [SeqSlice(i.seq.table, i.context_len, i.block_size) for i in items]
        mask = self.facts.mask_token_id
        ids = torch.tensor([t for i in items for t in [i.anchor] + [mask] * (i.block_size - 1)])
        positions = torch.cat([torch.arange(i.context_len, i.context_len + i.block_size)
                               for i in items])
        return slices, ids, positions

    def _embed_and_forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions int64 [T] on the device -> norm(hidden) [T, H] (backend prepared)."""
        x = self.head.embed(ids)
        scale = self.model.cfg.input_embedding_scale
        if scale != 1.0:
            x = x * scale
        return self.model(x, positions, ForwardBatch(self.backend))

    def _block_tokens(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> ForwardOutput:
        """The captured function: block forward + argmax of the LM head at every position.
        ForwardOutput.hidden carries the int64 tokens [T] here."""
        return ForwardOutput(hidden=self.head.greedy(self._embed_and_forward(ids, positions)),
                             captured=None)

    def _block_top_k(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> ForwardOutput:
        """The captured function of trees: block forward + each position's TREE_TOP_K likeliest
        tokens, hidden = int64 [T, K] ids (best first), captured = fp32 [T, K] log-probabilities."""
        top = self._ranked(self._embed_and_forward(ids, positions), TREE_TOP_K)
        return ForwardOutput(hidden=top.indices, captured=top.values)

    def _ranked(self, hidden: torch.Tensor, k: int):
        """hidden [T, H] -> topk (values: fp32 log-probabilities [T, k], indices [T, k]) of the
        target LM head's distribution at each row, best first."""
        top = torch.log_softmax(self.head.logits(hidden), dim=-1).topk(k, dim=-1)
        return Ranked(top.values, self.head.token_ids(top.indices))

    def forward_blocks(self, items: list[ProposeItem]) -> torch.Tensor:
        """norm(hidden) [sum B, H] of each item's block [anchor, MASK x (B-1)] at L..L+B-1."""
        slices, ids, positions = self._block_inputs(items)
        meta = AttentionMetadata.build(slices, self.cache, causal=False, device=self.device)
        self.backend.prepare(meta)
        return self._embed_and_forward(ids.to(self.device), positions.to(self.device))

    def _drafts(self, items: list[ProposeItem], hidden: torch.Tensor | None
                ) -> dict[int, DraftTree]:
        """id(item) -> its chain of argmax drafts, or its tree (items with tree_nodes); one LM
        head pass for all chains and one for all trees."""
        if hidden is None:
            return {}
        starts, offset = [], 0
        for i in items:
            starts.append(offset)
            offset += i.block_size
        out: dict[int, DraftTree] = {}
        for trees in (False, True):
            group = [(i, s) for i, s in zip(items, starts) if bool(i.tree_nodes) == trees]
            if not group:
                continue
            rows = hidden[[r for i, s in group for r in range(s + 1, s + i.block_size)]]
            if trees:                   # [rows, K] candidates and log-probabilities, best first
                top = self._ranked(rows, TREE_TOP_K)
                cands, logps = top.indices.tolist(), top.values.tolist()
            else:
                tokens = self.head.greedy(rows).tolist()
            k = 0
            for i, _ in group:
                n = i.block_size - 1
                out[id(i)] = (best_tree(cands[k: k + n], logps[k: k + n], i.tree_nodes) if trees
                              else DraftTree.chain(tokens[k: k + n]))
                k += n
        return out


def _read_checkpoint(model_dir: str) -> tuple[DFlashConfig, dict[str, tuple[int, ...]]]:
    if not model_dir:
        raise DrafterRefused("the dflash drafter needs --model DIR (a z-lab format checkpoint)")
    try:
        cfg = DFlashConfig.from_dir(model_dir)
        shapes = checkpoint_shapes(model_dir)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise DrafterRefused(f"draft checkpoint {Path(model_dir)} is unusable: {e}") from None
    return cfg, shapes

