"""What the gateway knows about its upstreams right now, and its own readiness derived from it.

Ready = the target is SERVING with usable capabilities, and the draft (when configured) is
SERVING and compatible - or, once it has been seen, or once the start-up deadline has passed,
merely absent (requests then run autoregressively). An incompatible pair is refused: the
gateway stays NOT_SERVING and says why."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from dflash.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from gateway import compat
from gateway.config import GatewayConfig
from gateway.cost_model import CostModel
from gateway.grammar import GrammarCompiler
from gateway.planes import PlaneChoice
from gateway.speculation_policy import SpeculationPolicy
from gateway.upstream import Upstream
from runtime.tokenizer import ChatTokenizer, tokenizer_fingerprint
from services.common import metrics
from services.common.server import Readiness

log = logging.getLogger("dflash.gateway.state")

SERVICE_NAME = "dflash.v1.Gateway"
TARGET_SERVICE = "dflash.v1.Target"
DRAFT_SERVICE = "dflash.v1.Draft"


@dataclass(frozen=True)
class Speculation:
    """What a request may use at this moment. draft None: autoregressive (Verify of the anchor)."""
    draft: draft_pb2.DraftCapabilities | None
    block_size: int                  # default block (anchor + drafts)
    max_block_size: int
    generation: int                  # the draft's capabilities generation (changes on restart)
    tree_nodes: int = 0              # drafts per tree (0 = a chain)
    max_tree_nodes: int = 0          # the largest tree the pair takes (--speculation auto)

    @property
    def capture_layers(self) -> list[int]:
        return list(self.draft.target_layer_ids) if self.draft and self.draft.needs_features else []

    def block_for(self, requested: int, remaining: int, room: int) -> int:
        """A step's verify block: the request's (or the default) block within the pair's max,
        the tokens the request may still produce and the room left in the context."""
        return max(1, min(requested or self.block_size, self.max_block_size, remaining, room))

    def tree_for(self, room: int) -> int:
        """Drafts per tree for a step, greedy and sampled requests alike (the target keeps both
        exact: its greedy path, or recursive rejection sampling), within the context's room;
        0 = a chain."""
        return max(0, min(self.tree_nodes, room)) if self.tree_nodes else 0


class GatewayState:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tokenizer = ChatTokenizer(config.tokenizer_dir)
        self.tokenizer_hash = tokenizer_fingerprint(config.tokenizer_dir)
        self.target = Upstream("target", config.target, TARGET_SERVICE, target_pb2_grpc.TargetStub,
                               config, self._recompute, {"Verify": target_pb2.VerifyStreamRequest})
        self.draft = (Upstream("draft", config.draft, DRAFT_SERVICE, draft_pb2_grpc.DraftStub,
                               config, self._recompute, {"Propose": draft_pb2.ProposeStreamRequest})
                      if config.draft else None)
        self.readiness = Readiness(SERVICE_NAME)
        self.ready = False
        self.reason = f"waiting for the target at {config.target}"
        self.decision = compat.Decision()
        self.planes = PlaneChoice(config.capabilities_timeout_s, config.target)   # where features travel
        self.draft_ok = False            # speculation available now
        self.draft_seen = False          # the draft was usable once (then its absence degrades)
        self.draft_grace_over = False    # start-up deadline passed: serve without the draft
        self.metrics_model = ""
        self.ready_once = False          # it was ready before: requests wait for upstreams to return
        self.closing = False             # SIGTERM: never ready again
        self.ready_event = asyncio.Event()
        self.upstreams_event = asyncio.Event()   # upstreams usable (also while closing)
        self.policy = SpeculationPolicy()   # --speculation auto (gateway/speculation_policy.py)
        self._policy_caps: target_pb2.TargetCapabilities | None = None  # the caps it read
        self._policy_curve: tuple | None = None     # (chains, trees, padded blocks) it was built on
        self._policy_draft: draft_pb2.DraftCapabilities | None = None   # the Propose prior it took
        self._grammars: GrammarCompiler | None = None    # built at the first structured request
        self._grammars_lock = asyncio.Lock()
        self._published: bool | None = None
        self._publish_lock = asyncio.Lock()
        self._logged_reason = ""

    async def grammar_compiler(self) -> GrammarCompiler:
        """Structured output's compiler for the target's vocabulary, built once (on a worker
        thread: it reads the tokenizer) when the first request needs it; the target must be
        known (the service checks readiness first)."""
        caps = self.target_caps
        async with self._grammars_lock:
            if self._grammars is None or self._grammars.vocab_size != caps.vocab_size:
                self._grammars = await asyncio.to_thread(
                    GrammarCompiler, self.config.tokenizer_dir, caps.vocab_size,
                    list(caps.eos_token_ids))
        return self._grammars

    def start_watching(self) -> None:
        self.target.start()
        if self.draft is not None:
            self.draft.start()

    async def close(self) -> None:
        for up in (self.target, self.draft):
            if up is not None:
                await up.close()

    # -- what requests read --------------------------------------------------------------------
    @property
    def target_caps(self) -> target_pb2.TargetCapabilities | None:
        return self.target.capabilities

    @property
    def model_name(self) -> str:
        caps = self.target_caps
        return self.config.model_name or (caps.model_id if caps is not None else "")

    def speculation(self) -> Speculation:
        if self.draft_ok and self.draft is not None:
            d = self.decision
            return Speculation(self.draft.capabilities, d.block_size, d.max_block_size,
                               self.draft.generation, d.tree_nodes, d.max_tree_nodes)
        caps = self.target_caps
        return Speculation(None, 1, caps.max_block_size if caps else 1, 0)

    def speculation_policy(self) -> SpeculationPolicy | None:
        """--speculation auto's policy on the target's cost curve; None = fixed speculation
        (configured so, or the target reports no curve: warned once per target)."""
        caps = self.target_caps
        if not self.config.auto_speculation or caps is None:
            return None
        if caps is not self._policy_caps:           # new capabilities (a target (re)start)
            self._policy_caps = caps
            self._rebuild_policy_cost(caps)
        dcaps = self.draft.capabilities if self.draft is not None else None
        if dcaps is not None and dcaps is not self._policy_draft:   # a draft (re)start
            self._policy_draft = dcaps
            self.policy.cost.seed_proposes(
                [(p.tokens, p.seconds) for p in dcaps.propose_cost],
                [(p.tokens, p.seconds) for p in dcaps.propose_cost_tree])
        return self.policy if self.policy.usable else None

    def _rebuild_policy_cost(self, caps: target_pb2.TargetCapabilities) -> None:
        """A new cost model when the target's curves changed (the learned one is kept when a
        refresh of the capabilities brought the same curves)."""
        curve = tuple((p.tokens, p.seconds) for p in caps.verify_cost)
        tree_curve = tuple((p.tokens, p.seconds) for p in caps.verify_cost_tree)
        padded = tuple(caps.verify_padded_blocks)
        if (curve, tree_curve, padded) != self._policy_curve:
            self._policy_curve = curve, tree_curve, padded
            self.policy.cost = CostModel(curve, tree_curve, padded)
            self._policy_draft = None               # the new model takes the draft's prior
            if curve:
                log.info("speculation auto: verify cost curves from the target", extra={
                    "chains_ms": " ".join(f"{t}:{s * 1e3:.2f}" for t, s in curve),
                    "trees_ms": " ".join(f"{t}:{s * 1e3:.2f}" for t, s in tree_curve),
                    "padded_blocks": padded})
            else:
                log.warning("speculation auto: the target reports no verify cost curve (its "
                            "--cost-calibration-s is 0 or its calibration failed); fixed "
                            "speculation (--block-size, --spec-tree-nodes) until it does")

    def known_draft(self) -> draft_pb2.DraftCapabilities | None:
        """The draft's last known capabilities when they fit the target (for feature capture
        while the draft is briefly down)."""
        if self.draft is None or self.draft.capabilities is None or not self.decision.ok:
            return None
        return self.draft.capabilities if self.draft_seen else None

    # -- readiness ------------------------------------------------------------------------------
    def end_draft_grace(self) -> None:
        self.draft_grace_over = True
        self._recompute()

    def start_closing(self) -> None:
        """SIGTERM: NOT_SERVING from now on; requests in flight go on."""
        self.closing = True
        self._recompute()

    def _recompute(self) -> None:
        ready, reason = self._evaluate()
        self.ready, self.reason = ready, reason
        if not ready and reason != self._logged_reason:
            refused = reason.startswith(("target refused", "draft refused"))
            log.log(logging.ERROR if refused else logging.INFO, "not ready: %s", reason)
        self._logged_reason = "" if ready else reason
        if ready:
            self.ready_once = True
            self.ready_event.set()
        else:
            self.ready_event.clear()
        asyncio.get_running_loop().create_task(self._publish())

    def _evaluate(self) -> tuple[bool, str]:
        ready, reason = self._evaluate_upstreams()     # draft_ok stays right while closing
        if ready:
            self.upstreams_event.set()
        else:
            self.upstreams_event.clear()
        if self.closing:
            return False, "shutting down: requests in flight are finishing, new ones are refused"
        return ready, reason

    def _evaluate_upstreams(self) -> tuple[bool, str]:
        t = self.target
        if not t.serving or t.capabilities is None:
            self.draft_ok = False
            return False, f"target at {t.address} is not serving: {t.status}"
        self._init_metrics(t.capabilities)
        problems = compat.check_target(t.capabilities, self.tokenizer_hash)
        if problems:
            self.draft_ok = False
            return False, "target refused: " + "; ".join(problems)
        return self._evaluate_draft(t.capabilities)

    def _evaluate_draft(self, tcaps: target_pb2.TargetCapabilities) -> tuple[bool, str]:
        d = self.draft
        if d is None:
            self.decision, self.draft_ok = compat.autoregressive(tcaps), False
            return True, "serving (autoregressive: no draft configured)"
        if d.serving and d.capabilities is not None:
            decision = compat.check_pair(tcaps, d.capabilities, self.config.fixed_block,
                                         self.config.spec_tree_nodes)
            if decision != self.decision:
                for note in decision.notes:
                    log.info("draft/target: %s", note)
            self.decision = decision
            self.draft_ok = decision.ok
            if not decision.ok:
                self.planes.off()
                return False, "draft refused: " + "; ".join(decision.problems)
            self.planes.refresh(tcaps, d)
            if not self.draft_seen:
                log.info("speculative decoding on", extra={
                    "drafter": d.capabilities.drafter_kind, "block_size": decision.block_size,
                    "tree_nodes": decision.tree_nodes})
            self.draft_seen = True
            return True, f"serving (speculative, block size {decision.block_size})"
        self.draft_ok = False
        self.planes.off()
        if self.draft_seen or self.draft_grace_over:
            return True, f"serving autoregressively: draft at {d.address} is not serving ({d.status})"
        return False, f"waiting for the draft at {d.address}: {d.status}"

    def _init_metrics(self, caps: target_pb2.TargetCapabilities) -> None:
        if not self.metrics_model:
            self.metrics_model = caps.model_id
            metrics.init(caps.model_id, "gateway")
            for up in (self.target, self.draft):
                if up is not None:
                    up.model_name = caps.model_id

    async def _publish(self) -> None:
        async with self._publish_lock:
            if self.ready != self._published and self.metrics_model:
                self._published = self.ready
                await self.readiness.set(self.ready)
