"""Gateway configuration: one frozen dataclass filled from flags and DFLASH_* variables."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from gateway.auth import load_keys
from gateway.replicas import parse_sources
from services.common import callers, flags, internal_auth, tls
from services.common.tls import ClientTls, ServerTls

MiB = 1024 * 1024
# How Propose and Verify travel: one unary RPC per call, one long-lived bidirectional stream per
# upstream carrying every call, or that stream on the service's unix call socket when it has one
# that opens here (measured: bench/wire_cpu.py, bench/smollm2_gpu.py, docs/benchmarks.md).
WIRES = ("unary", "stream", "socket")
DEFAULT_WIRE = "stream"
LOGPROBS_MODES = ("raw", "processed")
SPECULATION_MODES = ("auto", "fixed")   # or a number: a fixed verify block of that many tokens


@dataclass(frozen=True)
class GatewayConfig:
    # the target's replicas (required) and the draft's ("" = always autoregressive): comma-
    # separated HOST:PORT, dns:NAME:PORT or file:PATH entries (gateway/replicas.py)
    target: str
    tokenizer_dir: str                   # the target's HF directory: tokenizer.json (+ chat template)
    draft: str = ""
    resolve_interval_s: float = 10.0     # dns: names and file: lists are read again this often
    host: str = "0.0.0.0"
    port: int = 50050                    # gRPC dflash.v1.Gateway (0 = off)
    http_port: int = 8000                # OpenAI-compatible HTTP API + /metrics (0 = off)
    block_size: int = 0                  # default verify block; 0 = the draft's trained block size
    spec_disable_batch_size: int = 0     # above this many running requests: no drafting (0 = never)
    spec_tree_nodes: int = 0             # a tree of this many drafts (0 = a chain)
    # auto: each step's chain length or tree size chosen from measured cost and acceptance
    # (gateway/speculation_policy.py); fixed: --block-size / --spec-tree-nodes (or the draft's
    # block); N: a fixed verify block of N tokens. --block-size or --spec-tree-nodes set: fixed
    speculation: str = "auto"
    logprobs_mode: str = "raw"           # OpenAI logprobs: "raw" | "processed" (runtime/logprobs.py)
    model_name: str = ""                 # name served on the API; "" = the target's model_id
    startup_timeout_s: float = 600.0     # target SERVING + compatible within this, else exit 1 (0 = wait forever)
    backoff_initial_s: float = 0.1       # reconnect backoff of the health watches
    backoff_max_s: float = 5.0
    capabilities_timeout_s: float = 10.0
    prefill_timeout_s: float = 300.0     # deadline of Prefill (long prompts on CPU)
    step_timeout_s: float = 60.0         # deadline of Propose and Verify
    wire: str = DEFAULT_WIRE             # Propose/Verify: "unary" RPCs, one "stream" per upstream,
                                         # or that stream on its call "socket" when it has one
    release_timeout_s: float = 5.0
    max_message_mib: int = 256           # matches the services' limit
    keepalive_s: float = 30.0            # client pings; the services accept >= 10 s
    liveness_timeout_s: float = 3.0      # a health Check unanswered this long: the upstream is down (0 = off)
    liveness_interval_s: float = 2.0     # how often a SERVING upstream is asked
    max_running: int = 256               # requests in the loop at once; more wait (gauge "waiting")
    max_waiting: int = 512               # requests waiting for a slot; past it 429 / RESOURCE_EXHAUSTED
    retry_after_s: float = 1.0           # Retry-After hint of a 429
    pending_feature_mib: int = 256       # features kept for a draft that is down; past it: rebuild later
    upstream_wait_s: float = 60.0        # how long requests wait for a target that is down to return
    pool_wait_s: float = 60.0            # how long a sequence retries when a service's pools are full
    drain_grace_s: float = 30.0          # SIGTERM: time for requests in flight to finish
    max_request_bytes: int = 8 * MiB     # HTTP body (413) and gRPC request message limit
    max_prompt_tokens: int = 0           # 0 = the target's context
    max_tokens_limit: int = 0            # largest max_tokens (and the default's cap); 0 = context
    server_tls: ServerTls = field(default_factory=ServerTls)   # this gateway's gRPC (and HTTPS) certificate
    upstream_tls: ClientTls = field(default_factory=ClientTls)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    internal_token: str = field(default="", repr=False)   # sent to the target and draft
    # this process's caller key (services/common/callers.py): the services file the gateway's
    # sequences under it, so no other caller can drive them; drawn at start, never logged
    caller_key: str = field(default_factory=callers.new_key, repr=False)
    metrics_auth: bool = False           # /metrics needs an API key too
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("--target HOST:PORT is required")
        parse_sources(self.target, "--target")
        if self.draft:
            parse_sources(self.draft, "--draft")
        if self.resolve_interval_s <= 0:
            raise ValueError(f"--resolve-interval must be > 0 seconds, got {self.resolve_interval_s}")
        if not self.tokenizer_dir:
            raise ValueError("--tokenizer DIR (the target's model directory) is required")
        if self.wire not in WIRES:
            raise ValueError(f"--wire {self.wire!r}: allowed {list(WIRES)}")
        if self.keepalive_s < 10:
            raise ValueError("--keepalive-s must be >= 10: the services reject pings more often")
        if self.liveness_timeout_s < 0 or self.liveness_interval_s <= 0:
            raise ValueError("--liveness-timeout must be >= 0 (0 = off) and --liveness-interval "
                             "> 0")
        if self.block_size < 0 or self.max_running < 1 or self.max_waiting < 0:
            raise ValueError("--block-size must be >= 0, --max-running >= 1, --max-waiting >= 0")
        if self.spec_tree_nodes < 0:
            raise ValueError(f"--spec-tree-nodes must be >= 0 (0 = chains), got "
                             f"{self.spec_tree_nodes}")
        if self.speculation not in SPECULATION_MODES and not (
                self.speculation.isdigit() and int(self.speculation) >= 1):
            raise ValueError(f"--speculation {self.speculation!r}: allowed auto (sizes chosen "
                             f"every step), fixed (--block-size, --spec-tree-nodes), or a verify "
                             f"block size >= 1 (1 = no drafting)")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode {self.logprobs_mode!r}: allowed "
                             f"{list(LOGPROBS_MODES)}")
        if self.spec_disable_batch_size < 0:
            raise ValueError(f"--spec-disable-batch-size must be >= 0 (0 = always draft), got "
                             f"{self.spec_disable_batch_size}")
        if min(self.max_prompt_tokens, self.max_tokens_limit) < 0 or self.max_request_bytes < 1024:
            raise ValueError("--max-prompt-tokens and --max-tokens-limit must be >= 0 (0 = the "
                             "context) and --max-request-bytes >= 1KiB")

    @property
    def auto_speculation(self) -> bool:
        """--speculation auto, not overridden by a fixed --block-size or --spec-tree-nodes."""
        return self.speculation == "auto" and not self.block_size and not self.spec_tree_nodes

    @property
    def fixed_block(self) -> int:
        """The verify block asked for: --speculation N, else --block-size (0 = the draft's)."""
        return int(self.speculation) if self.speculation.isdigit() else self.block_size

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mib * MiB


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add(p, "--target", "", str, "the target service's replicas: HOST:PORT, dns:NAME:PORT "
              "(every address the name resolves to: a headless Service) or file:PATH (HOST:PORT "
              "lines), comma-separated for several; each request runs on the least-loaded one")
    flags.add(p, "--draft", "", str, "the draft service's replicas, as --target ('' = "
              "autoregressive only)")
    flags.add(p, "--resolve-interval", 10.0, float, "seconds between resolutions of dns: names "
              "and readings of file: lists in --target / --draft")
    flags.add(p, "--tokenizer", "", str, "the target's model directory (tokenizer.json, chat template)")
    flags.add(p, "--host", "0.0.0.0", str, "listen address")
    flags.add(p, "--port", 50050, int, "gRPC port of dflash.v1.Gateway (0 = off)")
    flags.add(p, "--http-port", 8000, int, "OpenAI-compatible HTTP port, also /metrics (0 = off)")
    flags.add(p, "--block-size", 0, int, "default verify block size (0 = the draft's)")
    flags.add(p, "--spec-disable-batch-size", 0, int,
              "above this many running requests, steps verify one token without drafting (the "
              "draft's features are kept for later); 0 = always draft")
    flags.add(p, "--spec-tree-nodes", 0, int,
              "requests draft a tree of this many nodes (the likeliest prefixes of the block) and "
              "the target verifies it in one forward (greedy and sampled requests alike: both "
              "stay exact); 0 = a chain of block - 1 drafts. "
              "Clamped to what the target and draft allow")
    flags.add(p, "--speculation", "auto", str, "auto: each step, every request's chain length or "
              "tree size (or no drafting) chosen for the most committed tokens per second of the "
              "batch, from the target's measured verify cost and each request's acceptance; "
              "fixed: --block-size and --spec-tree-nodes (which also override auto when set); "
              "N: a fixed verify block of N tokens")
    flags.add(p, "--logprobs-mode", "raw", str, "OpenAI logprobs from the model's raw "
              "distribution (raw, as vLLM's raw_logprobs) or from the one tokens are drawn from, "
              "after temperature, top-k/p, min_tokens and structured-output masks (processed)")
    flags.add(p, "--model-name", "", str, "model name on the API (default: the target's model_id)")
    flags.add(p, "--startup-timeout", 600.0, float, "seconds for the target to be ready (0 = forever)")
    flags.add(p, "--backoff-initial", 0.1, float, "first reconnect delay of the health watches (s)")
    flags.add(p, "--backoff-max", 5.0, float, "largest reconnect delay (s)")
    flags.add(p, "--prefill-timeout", 300.0, float, "deadline of a Prefill call (s)")
    flags.add(p, "--step-timeout", 60.0, float, "deadline of Propose and Verify calls (s)")
    flags.add(p, "--wire", DEFAULT_WIRE, str, "Propose and Verify calls: one unary RPC each, "
              "all on one long-lived bidirectional stream per upstream, or that stream on the "
              "service's unix call socket when it has one on this host (--call-socket; else "
              "the gRPC stream)", choices=WIRES)
    flags.add(p, "--max-message-mib", 256, int, "gRPC message size limit")
    flags.add(p, "--keepalive-s", 30.0, float, "keepalive ping interval to upstreams (>= 10)")
    flags.add(p, "--liveness-timeout", 3.0, float, "an upstream that leaves two health Checks in "
              "a row unanswered this long each (frozen) is treated as down: not ready, its calls "
              "in flight fail over as for a dead one (0 = off)")
    flags.add(p, "--liveness-interval", 2.0, float, "seconds between the health Checks of a "
              "SERVING upstream")
    flags.add(p, "--max-running", 256, int, "requests generating at once (more wait)")
    flags.add(p, "--max-waiting", 512, int, "requests waiting for a slot; more get 429 / "
              "RESOURCE_EXHAUSTED at once")
    flags.add(p, "--retry-after", 1.0, float, "Retry-After (s) sent with a 429")
    flags.add(p, "--pending-feature-mib", 256, int, "features buffered per request while the draft is down")
    flags.add(p, "--upstream-wait", 60.0, float, "seconds requests wait for a target that went "
              "down to come back (then UNAVAILABLE / 503)")
    flags.add(p, "--pool-wait", 60.0, float, "seconds a sequence retries (with backoff) while a "
              "service's KV or state pool is full")
    flags.add(p, "--drain-grace", 30.0, float, "SIGTERM: seconds for requests in flight to finish")
    flags.add(p, "--max-request-bytes", "8MiB", flags.parse_size, "largest HTTP body (413) and "
              "gRPC request message")
    flags.add(p, "--max-prompt-tokens", 0, int, "largest prompt in tokens (0 = the context)")
    flags.add(p, "--max-tokens-limit", 0, int, "largest max_tokens, also caps the default "
              "(0 = the rest of the context)")
    tls.add_server_flags(p)
    tls.add_client_flags(p)
    internal_auth.add_flag(p, "sent on every call to the target and the draft")
    flags.add(p, "--api-keys", "", str, "comma-separated API keys ('' and no file = open API)",
              secret=True)
    flags.add(p, "--api-key-file", "", str, "file of API keys, one per line")
    flags.add(p, "--metrics-auth", action="store_true", help="/metrics needs an API key too")
    flags.add(p, "--log-level", "INFO", str, "DEBUG | INFO | WARNING")


def from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        target=args.target, tokenizer_dir=args.tokenizer, draft=args.draft,
        resolve_interval_s=args.resolve_interval, host=args.host,
        port=args.port, http_port=args.http_port, block_size=args.block_size,
        spec_disable_batch_size=args.spec_disable_batch_size,
        spec_tree_nodes=args.spec_tree_nodes, speculation=args.speculation,
        logprobs_mode=args.logprobs_mode,
        model_name=args.model_name, startup_timeout_s=args.startup_timeout,
        backoff_initial_s=args.backoff_initial, backoff_max_s=args.backoff_max,
        prefill_timeout_s=args.prefill_timeout, step_timeout_s=args.step_timeout, wire=args.wire,
        max_message_mib=args.max_message_mib, keepalive_s=args.keepalive_s,
        liveness_timeout_s=args.liveness_timeout, liveness_interval_s=args.liveness_interval,
        max_running=args.max_running, max_waiting=args.max_waiting,
        retry_after_s=args.retry_after, pending_feature_mib=args.pending_feature_mib,
        upstream_wait_s=args.upstream_wait, pool_wait_s=args.pool_wait,
        drain_grace_s=args.drain_grace, max_request_bytes=args.max_request_bytes,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
        server_tls=tls.server_from_args(args), upstream_tls=tls.client_from_args(args),
        api_keys=load_keys(args.api_keys, args.api_key_file), metrics_auth=args.metrics_auth,
        internal_token=args.internal_token,
        log_level=args.log_level)
