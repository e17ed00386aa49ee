"""What the gateway knows about its upstreams right now, and its own readiness derived from it.

Ready = the target is SERVING with usable capabilities, and the draft (when configured) is
SERVING and compatible - or, once it has been seen, or once the start-up deadline has passed,
merely absent (requests then run autoregressively). An incompatible pair is refused: the
gateway stays NOT_SERVING and says why."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from dflash.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from gateway import compat
from gateway.config import GatewayConfig
from gateway.cost_model import CostModel
from gateway.grammar import GrammarCompiler
from gateway.planes import PlaneChoice
from gateway.replicas import ReplicaSet
from gateway.route import Route
from gateway.speculation_policy import SpeculationPolicy
from gateway.upstream import Upstream
from runtime.tokenizer import ChatTokenizer, tokenizer_fingerprint
from services.common import metrics
from services.common.errors import Unavailable
from services.common.server import Readiness

log = logging.getLogger("dflash.gateway.state")

SERVICE_NAME = "dflash.v1.Gateway"
TARGET_SERVICE = "dflash.v1.Target"
DRAFT_SERVICE = "dflash.v1.Draft"
AFFINITY_TOKENS = 64          # placement's tie-break hashes this much of the prompt
LOAD_FRESH_S = 5.0            # a replica's load report counts this long


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
        self.metrics_model = ""          # the target's model id, once known (metrics label)
        self.targets = ReplicaSet("target", config.target, self._target_upstream,
                                  config.resolve_interval_s, self._recompute)
        self.drafts = (ReplicaSet("draft", config.draft, self._draft_upstream,
                                  config.resolve_interval_s, self._recompute)
                       if config.draft else None)
        self.target: Upstream | None = None   # the first usable target replica: the reference
        self.draft: Upstream | None = None    # ... and draft replica (capabilities, decision)
        self.readiness = Readiness(SERVICE_NAME)
        self.ready = False
        self.reason = f"waiting for the target at {self.targets.describe()}"
        self.decision = compat.Decision()
        self.planes: dict[tuple[str, str], PlaneChoice] = {}   # where features travel, per pair
        self.draft_ok = False            # speculation available now
        self.draft_seen = False          # the draft was usable once (then its absence degrades)
        self.draft_grace_over = False    # start-up deadline passed: serve without the draft
        self.ready_once = False          # it was ready before: requests wait for upstreams to return
        self.closing = False             # SIGTERM: never ready again
        self.ready_event = asyncio.Event()
        self._changed = asyncio.Event()          # set (and replaced) on every re-evaluation
        self.policy = SpeculationPolicy()   # --speculation auto (gateway/speculation_policy.py)
        self._policy_caps: target_pb2.TargetCapabilities | None = None  # the caps it read
        self._policy_curve: tuple | None = None     # (chains, trees, padded blocks) it was built on
        self._policy_draft: draft_pb2.DraftCapabilities | None = None   # the Propose prior it took
        self._grammars: GrammarCompiler | None = None    # built at the first structured request
        self._grammars_lock = asyncio.Lock()
        self._published: bool | None = None
        self._publish_lock = asyncio.Lock()
        self._logged_reason = ""
        self._kept_out: dict[str, str] = {}   # replica address -> why it is not used (logged once)
        self._target_identity: target_pb2.TargetCapabilities | None = None   # what replicas of
        self._draft_identity: draft_pb2.DraftCapabilities | None = None      # a role agree on

    def _target_upstream(self, address: str) -> Upstream:
        up = Upstream("target", address, TARGET_SERVICE, target_pb2_grpc.TargetStub, self.config,
                      self._recompute, {"Verify": (target_pb2.VerifyStreamRequest,
                                                  target_pb2.VerifyStreamResponse)})
        up.model_name = self.metrics_model
        return up

    def _draft_upstream(self, address: str) -> Upstream:
        up = Upstream("draft", address, DRAFT_SERVICE, draft_pb2_grpc.DraftStub, self.config,
                      self._recompute, {"Propose": (draft_pb2.ProposeStreamRequest,
                                                   draft_pb2.ProposeStreamResponse)})
        up.model_name = self.metrics_model
        return up

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
        self.targets.start()
        if self.drafts is not None:
            self.drafts.start()

    async def close(self) -> None:
        for replicas in (self.targets, self.drafts):
            if replicas is not None:
                await replicas.close()

    # -- placement ------------------------------------------------------------------------------
    def place(self, prompt: Sequence[int]) -> Route:
        """A new request's replicas: the least-loaded usable target and draft (gateway/route.py).
        Load: the requests this gateway placed there, or the sequences the replica last
        reported holding (other gateways' too, with this gateway's requests placed or ended since
        the report added or taken off) when more; then its KV usage; then, as the hook
        for prefix-cache affinity, a hash of the prompt's first tokens (requests that share
        them prefer one replica when loads tie)."""
        target = _least_loaded(_usable(self.targets), prompt) or _first(self.targets)
        if target is None:
            raise Unavailable(f"no target replica is known: {self.reason}")
        draft = None
        if self.drafts is not None:
            draft = _least_loaded(_usable(self.drafts), prompt) or _first(self.drafts)
        return Route(target, draft, self._target_identity)

    def target_for(self, route: Route) -> Upstream | None:
        """A usable target replica to move to when the route's is not usable (None: stay):
        one that agrees with what the request was admitted under (after the role's identity
        changed - every replica of its model gone, another model's serving - it has none)."""
        if route.target.usable and self.admits(route):
            return None
        return _least_loaded([u for u in _usable(self.targets) if u is not route.target
                              and _agrees(u, route.identity, compat.TARGET_IDENTITY)], ())

    def admits(self, route: Route) -> bool:
        """The route's target replica serves what its request was admitted under (asked every
        step: a usable replica agrees with the role's identity already, so only a request of an
        older identity, or on an unusable replica, compares fields)."""
        if route.identity is self._target_identity and route.target.usable:
            return True
        return _agrees(route.target, route.identity, compat.TARGET_IDENTITY)

    def draft_for(self, route: Route) -> Upstream | None:
        """The same for the route's draft (any usable one: drafts change speed, not output)."""
        if self.drafts is None or route.draft is None or route.draft.usable:
            return None
        return _least_loaded([u for u in _usable(self.drafts) if u is not route.draft], ())

    async def wait_changed(self, timeout: float) -> None:
        """Until the upstreams' state is evaluated again (or timeout)."""
        changed = self._changed
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)

    def plane(self, route: Route) -> PlaneChoice | None:
        """The feature plane negotiation of the route's pair (None: no draft)."""
        if route.draft is None:
            return None
        return self.planes.get((route.target.address, route.draft.address))

    # -- what requests read --------------------------------------------------------------------
    @property
    def target_caps(self) -> target_pb2.TargetCapabilities | None:
        """The reference target replica's capabilities; while none is usable (a drain, a
        restart), the role's identity: what requests in flight were admitted under."""
        return self.target.capabilities if self.target is not None else self._target_identity

    @property
    def model_name(self) -> str:
        caps = self.target_caps
        return self.config.model_name or (caps.model_id if caps is not None else "")

    def speculation(self, route: Route | None = None) -> Speculation:
        """What a request on `route` may use now (None: the reference pair's, for model info)."""
        draft = route.draft if route is not None else self.draft
        if self.draft_ok and draft is not None and draft.usable:
            d = self.decision
            return Speculation(draft.capabilities, d.block_size, d.max_block_size,
                               draft.generation, d.tree_nodes, d.max_tree_nodes)
        caps = self.target_caps
        return Speculation(None, 1, caps.max_block_size if caps else 1, 0)

    def speculation_policy(self) -> SpeculationPolicy | None:
        """--speculation auto's policy on the target's cost curve; None = fixed speculation
        (configured so, or the target reports no curve: warned once per target), and no
        decisions at all without a draft (each step's would be the same: no drafting)."""
        caps = self.target_caps
        if not self.config.auto_speculation or caps is None or self.drafts is None:
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

    def known_draft(self, route: Route) -> draft_pb2.DraftCapabilities | None:
        """The route's draft's last known capabilities when they fit the target (for feature
        capture while the draft is briefly down)."""
        draft = route.draft
        if draft is None or draft.capabilities is None or not self.decision.ok:
            return None
        return draft.capabilities if self.draft_seen else None

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
        self._changed.set()
        self._changed = asyncio.Event()
        self._export_replicas()
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
        if self.closing:
            return False, "shutting down: requests in flight are finishing, new ones are refused"
        return ready, reason

    def _evaluate_upstreams(self) -> tuple[bool, str]:
        """Which target replicas are usable: SERVING, accepted, and agreeing with the role's
        identity (the first accepted one's, kept while an accepted replica has it or none is
        accepted: a replica of another model added later stays out rather than taking over);
        then the drafts."""
        accepted = [t for t in self.targets if t.serving and t.capabilities is not None
                    and not compat.check_target(t.capabilities, self.tokenizer_hash)]
        self._target_identity = _identity(self._target_identity, accepted,
                                          compat.TARGET_IDENTITY)
        self.target, refused = None, []
        for t in self.targets:
            problems = self._target_problems(t)
            t.usable = t.serving and t.capabilities is not None and not problems
            if problems:
                refused.append(problems)
            if t.usable and self.target is None:
                self.target = t
        if self.target is None:
            self.draft_ok, self.draft = False, None
            self._planes_off()
            if refused:
                return False, "target refused: " + "; ".join(refused[0])
            return False, self._not_serving(self.targets, "target")
        self._init_metrics(self.target.capabilities)
        return self._evaluate_drafts(self.target.capabilities)

    def _target_problems(self, t: Upstream) -> list[str]:
        if not t.serving or t.capabilities is None:
            return []
        problems = compat.check_target(t.capabilities, self.tokenizer_hash)
        if not problems and self._target_identity is not None:
            diff = compat.replica_differs(self._target_identity, t.capabilities,
                                          compat.TARGET_IDENTITY)
            if diff:
                problems = [f"it differs from the other target replicas: {diff}"]
        self._keep_out(t, problems)
        return problems

    def _evaluate_drafts(self, tcaps: target_pb2.TargetCapabilities) -> tuple[bool, str]:
        if self.drafts is None:
            self.decision, self.draft_ok = compat.autoregressive(tcaps), False
            return True, "serving (autoregressive: no draft configured)"
        pairs = {d: compat.check_pair(tcaps, d.capabilities, self.config.fixed_block,
                                      self.config.spec_tree_nodes)
                 for d in self.drafts if d.serving and d.capabilities is not None}
        self._draft_identity = _identity(self._draft_identity,
                                         [d for d, pair in pairs.items() if pair.ok],
                                         compat.DRAFT_IDENTITY)
        self.draft, decision, refused = None, None, []
        for d in self.drafts:
            pair = self._draft_decision(d, pairs.get(d))
            d.usable = pair is not None and pair.ok
            if pair is not None and not pair.ok:
                refused.append(pair.problems)
            if d.usable and self.draft is None:
                self.draft, decision = d, pair
        if self.draft is None:
            self.draft_ok = False
            self._planes_off()
            if refused:
                return False, "draft refused: " + "; ".join(refused[0])
            if self.draft_seen or self.draft_grace_over:
                return True, (f"serving autoregressively: "
                              f"{self._not_serving(self.drafts, 'draft')}")
            return False, f"waiting for the {self._not_serving(self.drafts, 'draft')}"
        if decision != self.decision:
            for note in decision.notes:
                log.info("draft/target: %s", note)
        self.decision, self.draft_ok = decision, True
        self._refresh_planes()
        if not self.draft_seen:
            log.info("speculative decoding on", extra={
                "drafter": self.draft.capabilities.drafter_kind,
                "block_size": decision.block_size, "tree_nodes": decision.tree_nodes})
        self.draft_seen = True
        return True, f"serving (speculative, block size {decision.block_size})"

    def _draft_decision(self, d: Upstream, decision: compat.Decision | None
                        ) -> compat.Decision | None:
        """The pair's decision for a SERVING draft replica (None: not serving); one unlike the
        role's identity is refused too."""
        if decision is None:
            return None
        if decision.ok and self._draft_identity is not None:
            diff = compat.replica_differs(self._draft_identity, d.capabilities,
                                          compat.DRAFT_IDENTITY)
            if diff:
                decision = compat.Decision([f"it differs from the other draft replicas: {diff}"])
        self._keep_out(d, decision.problems)
        return decision

    def _keep_out(self, up: Upstream, problems: list[str]) -> None:
        """Logs once why a SERVING replica is not used (and once when it is again)."""
        why = "; ".join(problems)
        if why != self._kept_out.get(up.address, ""):
            if why and (len(self.targets) > 1 or (self.drafts and len(self.drafts) > 1)):
                log.error("%s replica %s kept out: %s", up.role, up.address, why)
            elif not why:
                log.info("%s replica %s is usable", up.role, up.address)
            self._kept_out[up.address] = why

    @staticmethod
    def _not_serving(replicas: ReplicaSet, role: str) -> str:
        ups = list(replicas)
        if len(ups) == 1:
            return f"{role} at {ups[0].address} is not serving: {ups[0].status}"
        if not ups:
            problems = "; ".join(replicas.problems.values()) or "none resolved yet"
            return f"{role} replicas at {replicas.describe()}: none known ({problems})"
        return (f"no {role} replica is serving: "
                + "; ".join(f"{u.address}: {u.status}" for u in ups))

    def _refresh_planes(self) -> None:
        """Negotiates the feature plane of every usable (target, draft) pair; the rest off."""
        pairs = {(t.address, d.address): (t, d) for t in _usable(self.targets)
                 for d in _usable(self.drafts)}
        for key in [k for k in self.planes if k not in pairs]:
            self.planes.pop(key).off()
        for key, (t, d) in pairs.items():
            choice = self.planes.get(key)
            if choice is None:
                choice = self.planes[key] = PlaneChoice(self.config.capabilities_timeout_s,
                                                        t.address)
            choice.refresh(t.capabilities, d)

    def _planes_off(self) -> None:
        for choice in self.planes.values():
            choice.off()

    def _init_metrics(self, caps: target_pb2.TargetCapabilities) -> None:
        if not self.metrics_model:
            self.metrics_model = caps.model_id
            metrics.init(caps.model_id, "gateway")
            for replicas in (self.targets, self.drafts):
                for up in replicas or ():
                    up.model_name = caps.model_id

    def _export_replicas(self) -> None:
        """dflash_gateway_replicas: each role's replicas by state."""
        if not self.metrics_model:
            return
        for role, replicas in (("target", self.targets), ("draft", self.drafts)):
            counts = {"usable": 0, "kept_out": 0, "down": 0}
            for u in replicas or ():
                counts["usable" if u.usable else "kept_out" if u.serving else "down"] += 1
            for state, n in counts.items():
                metrics.REPLICAS.labels(self.metrics_model, role, state).set(n)

    async def _publish(self) -> None:
        async with self._publish_lock:
            if self.ready != self._published and self.metrics_model:
                self._published = self.ready
                await self.readiness.set(self.ready)


def _identity(current, accepted: list[Upstream], fields: tuple[str, ...]):
    """The capabilities a role's replicas must agree with: the current identity while an
    accepted replica has it or none is accepted (all down: they come back as they were), else
    the first accepted one's."""
    if not accepted or current is not None and any(_agrees(u, current, fields)
                                                   for u in accepted):
        return current
    return accepted[0].capabilities


def _agrees(up: Upstream, identity, fields: tuple[str, ...]) -> bool:
    return identity is None or not compat.replica_differs(identity, up.capabilities, fields)


def _usable(replicas: ReplicaSet | None) -> list[Upstream]:
    return [u for u in replicas or () if u.usable]


def _first(replicas: ReplicaSet) -> Upstream | None:
    return next(iter(replicas), None)


def _least_loaded(ups: list[Upstream], prompt: Sequence[int]) -> Upstream | None:
    """By load (see GatewayState.place), then by a hash of (the prompt's first tokens,
    the replica): the hook for prefix-cache affinity."""
    head = ",".join(map(str, list(prompt)[:AFFINITY_TOKENS]))

    def key(u: Upstream) -> tuple:
        load = u.load if u.load is not None and u.load_age_s < LOAD_FRESH_S else None
        # the report counts this gateway's requests as they were then: the ones placed or
        # ended here since are added or taken off (a report from the last step of requests
        # that have ended would otherwise count them for LOAD_FRESH_S more)
        reported = load.sequences + u.placed - u.placed_at_load if load is not None else 0
        sequences = max(u.placed, reported)
        usage = load.kv_usage if load is not None else 0.0
        digest = hashlib.blake2b(f"{head}|{u.address}".encode(), digest_size=8).digest()
        return sequences, round(usage, 2), digest

    return min(ups, key=key, default=None)
