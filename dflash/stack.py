"""The local stack: target, draft and gateway as child processes on this machine
(SmolLM2-135M-Instruct in fp32 on CPU by default), ready when the gateway says so; `stop()` ends
all three (`dflash up`, `dflash demo`, benchmarks and tests start it).

Each child runs in its own process group (killed as a group) and gets SIGTERM if the launcher
itself dies (PR_SET_PDEATHSIG), so nothing is left behind."""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash.harness import NO_HOOK_FLAGS, HookFlags
from runtime.attention.registry import default_backend
from runtime.home import models_home
from services.common import internal_auth

DEFAULT_DRAFTER = "dflash"
# Verify block of a DFlash stack on the CPU when --block-size is 0: there a verify of 1..4 tokens
# costs about one decode step (runtime/layers/linear.py) and each larger block costs more than
# its extra accepted drafts bring (docs/benchmarks.md, "CPU compute"). On a GPU: the trained block.
CPU_DFLASH_BLOCK = 4
# ... and above this many running requests it stops drafting: the autoregressive stack batches
# its one-token verifies, while speculative blocks are compute-bound on a CPU (docs/benchmarks.md).
CPU_SPEC_DISABLE_BATCH = 1
# ... and its draft gets --dtype auto when --draft-dtype is "": bf16 where torch runs bf16 GEMMs
# natively (AVX-512 core), else fp32. A draft forward is a few rows, where bf16 reads half the
# bytes (a Propose of 4 new rows and a block of 4: 5.4 ms against 8.2; docs/benchmarks.md, "Draft
# service (CPU)"). The drafter was trained in bf16, and drafts only decide how much is accepted:
# the fp32 target alone decides the output.
CPU_DFLASH_DRAFT_DTYPE = "auto"
# On a GPU a DFlash drafter drafts a tree of this many nodes for greedy requests: on the H200 a
# tree of 15 ran 2.41x / 1.19x / 1.17x our autoregressive path at 1 / 8 / 32 requests in flight,
# where the chain ran 2.07x / 0.80x / 0.73x and a tree of 63 2.03x / 0.80x / 0.90x (SmolLM2 bf16,
# docs/benchmarks.md, "End to end on the H200").
GPU_DFLASH_TREE_NODES = 15
# The DFlash drafter trained by this project for SmolLM2-135M-Instruct (models/ in the repo).
SHIPPED_DRAFTER = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
DRAFTERS = ("dflash", "prompt-lookup", "none")
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StackOptions:
    host: str = "127.0.0.1"
    http_port: int = 8000
    port: int = 50050                  # gateway gRPC
    target_port: int = 50051
    draft_port: int = 50052
    target_metrics_port: int = 0
    draft_metrics_port: int = 0
    model_dir: str = ""                # "" = SmolLM2-135M-Instruct fp32, prepared on first use
    dtype: str = "float32"
    draft_dtype: str = ""              # "" = CPU_DFLASH_DRAFT_DTYPE for dflash on the CPU, else dtype
    drafter: str = DEFAULT_DRAFTER
    draft_model: str = ""              # dflash: checkpoint dir ("" = the shipped one for SmolLM2)
    block_size: int = 0
    spec_disable_batch_size: int = -1  # gateway's; -1 = CPU_SPEC_DISABLE_BATCH for dflash on the CPU, else 0
    spec_tree_nodes: int = -1          # gateway's; -1 = GPU_DFLASH_TREE_NODES for dflash on CUDA, else 0 (chains)
    # gateway --speculation: auto (sizes chosen every step from measured cost and acceptance),
    # or fixed (then the CPU_* / GPU_* defaults above apply where the options are left unset)
    speculation: str = "auto"
    wire: str = ""                     # gateway --wire ("" = its default; socket: the services
                                       # get call sockets too)
    log_dir: str = ""
    ready_timeout_s: float = 600.0
    quiet: bool = False
    device: str = "cpu"                # target and draft
    attention_backend: str = ""        # target and draft; "" = triton on CUDA, torch on CPU
    deterministic: bool = False        # target and draft: batch-invariant kernels
    target_args: tuple[str, ...] = ()  # extra flags, appended as given (benchmarks)
    draft_args: tuple[str, ...] = ()
    target_hooks: HookFlags = NO_HOOK_FLAGS   # tests and benchmarks: through dflash.harness
    draft_hooks: HookFlags = NO_HOOK_FLAGS
    gateway_args: tuple[str, ...] = ()
    # the internal ports' shared secret (services/common/internal_auth.py), handed to the three
    # processes in their environment: None = $DFLASH_INTERNAL_TOKEN, else a new random one;
    # "" = none (the ports are open to anyone on this host)
    internal_token: str | None = None


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict, repr=False)   # added to the environment
    proc: subprocess.Popen | None = None
    log_file: object = field(default=None, repr=False)

    def start(self, append: bool = False) -> None:
        """append: a restart (the log goes on after the previous run's)."""
        if self.log_file:
            self.log_file.close()
        # open while the child runs; readable by this user only (logs name requests)
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self.log_file = os.fdopen(os.open(self.log_path, mode, 0o600), "a" if append else "w")
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509 - no threads yet

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text() if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:
    """Child side, before exec: SIGTERM when the launcher dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


class Stack:
    """start() -> wait_ready() -> ... -> stop(). Children are target, draft (unless
    drafter none) and gateway, all `python -m ...` of this interpreter."""

    def __init__(self, opts: StackOptions) -> None:
        self.opts = opts
        self.log_dir = Path(opts.log_dir or models_home() / "logs" / time.strftime("%Y%m%d-%H%M%S"))
        self.children: list[Child] = []
        self.model_dir = ""
        self.socket_dir = ""           # --wire socket: the services' call sockets (short paths)
        token = opts.internal_token
        if token is None:
            token = os.environ.get(internal_auth.ENV) or secrets.token_urlsafe(32)
        self.internal_token = token

    @property
    def http_url(self) -> str:
        return f"http://{self.opts.host}:{self.opts.http_port}"

    def start(self) -> None:
        children = self.plan()
        if self.socket_dir:
            os.makedirs(self.socket_dir, mode=0o700, exist_ok=True)
        for child in children:
            child.start()

    def plan(self) -> list[Child]:
        """The children (not started yet): their command lines and logs."""
        o = self.opts
        if o.drafter not in DRAFTERS:
            raise ValueError(f"--drafter {o.drafter!r}: allowed {list(DRAFTERS)}")
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.model_dir = o.model_dir or str(_prepare_default_model(o.dtype, o.quiet))
        self.children = []
        draft_model = (o.draft_model or str(self._default_drafter())) if o.drafter == "dflash" else ""
        self._add("target", o.target_hooks.module("target"), "--model", self.model_dir, "--dtype", o.dtype,
                  "--port", o.target_port, "--host", o.host, "--metrics-port", o.target_metrics_port,
                  *self._device_args(), *self._graph_args(draft_model),
                  *self._socket_args("target"), *o.target_args)
        if o.drafter != "none":
            self._add("draft", o.draft_hooks.module("draft"), *self._draft_args(draft_model))
        self._add("gateway", ["gateway"], *self.gateway_args(o.port, o.http_port))
        return self.children

    def gateway_args(self, port: int, http_port: int, *extra: str) -> list:
        """A gateway's flags on this stack's target (and draft), listening on these ports."""
        o = self.opts
        return ["--target", f"{o.host}:{o.target_port}",
                "--draft", f"{o.host}:{o.draft_port}" if o.drafter != "none" else "",
                "--tokenizer", self.model_dir, "--port", port, "--http-port", http_port,
                "--host", o.host, "--speculation", o.speculation,
                "--block-size", self.verify_block(),
                "--spec-disable-batch-size", self.spec_disable_batch(),
                "--spec-tree-nodes", self.tree_nodes(),
                *(("--wire", o.wire) if o.wire else ()), *o.gateway_args, *extra]

    @property
    def dflash_on_cpu(self) -> bool:
        """A DFlash drafter on the CPU: the case that takes the CPU_* gateway defaults (with
        --speculation fixed; auto measures instead)."""
        return self.opts.drafter == "dflash" and self.opts.device == "cpu" and self.fixed

    @property
    def fixed(self) -> bool:
        """Speculation sizes by flags and these defaults, not chosen by the gateway."""
        return self.opts.speculation != "auto"

    def verify_block(self) -> int:
        """The gateway's default verify block: --block-size, else CPU_DFLASH_BLOCK for a DFlash
        drafter on the CPU, else 0 (the draft's trained block)."""
        if self.opts.block_size or not self.dflash_on_cpu:
            return self.opts.block_size
        return CPU_DFLASH_BLOCK

    def draft_dtype(self) -> str:
        """The draft's --dtype: --draft-dtype, else CPU_DFLASH_DRAFT_DTYPE for a DFlash drafter
        on the CPU, else the target's dtype."""
        if self.opts.draft_dtype:
            return self.opts.draft_dtype
        on_cpu = self.opts.drafter == "dflash" and self.opts.device == "cpu"
        return CPU_DFLASH_DRAFT_DTYPE if on_cpu else self.opts.dtype

    def tree_nodes(self) -> int:
        """The gateway's --spec-tree-nodes: the option, else GPU_DFLASH_TREE_NODES for a DFlash
        drafter on a GPU, else 0 (chains)."""
        if self.opts.spec_tree_nodes >= 0:
            return self.opts.spec_tree_nodes
        gpu = (self.opts.drafter == "dflash" and self.opts.device.startswith("cuda")
               and self.fixed)
        return GPU_DFLASH_TREE_NODES if gpu else 0

    def spec_disable_batch(self) -> int:
        """The gateway's --spec-disable-batch-size: the option, else CPU_SPEC_DISABLE_BATCH for
        a DFlash drafter on the CPU, else 0 (always draft)."""
        if self.opts.spec_disable_batch_size >= 0:
            return self.opts.spec_disable_batch_size
        return CPU_SPEC_DISABLE_BATCH if self.dflash_on_cpu else 0

    def add_gateway(self, name: str, port: int, http_port: int, *extra: str) -> Child:
        """Starts one more gateway on the running target and draft (benchmarks: another wire);
        it is stopped with the stack."""
        self._add(name, ["gateway"], *self.gateway_args(port, http_port, *extra))
        child = self.children[-1]
        child.start()
        return child

    def _draft_args(self, draft_model: str) -> list:
        o = self.opts
        args = ["--drafter", o.drafter, "--target-model", self.model_dir, "--port", o.draft_port,
                "--host", o.host, "--metrics-port", o.draft_metrics_port]
        if draft_model:
            args += ["--model", draft_model]
        return args + ["--dtype", self.draft_dtype(), *self._device_args(),
                       *self._socket_args("draft"), *o.draft_args]

    def _graph_args(self, draft_model: str) -> list[str]:
        """A DFlash drafter reads the features of its target layers at every verify: the target
        captures its CUDA graphs with those layers too (else those verifies run eagerly)."""
        if not draft_model or "--graph-capture-layers" in self.opts.target_args:
            return []
        from runtime.models.dflash import DFlashConfig
        taps = DFlashConfig.from_dir(draft_model).target_layer_ids
        return ["--graph-capture-layers", ",".join(map(str, taps))]

    def _device_args(self) -> list[str]:
        o = self.opts
        backend = o.attention_backend or default_backend(o.device)
        return ["--device", o.device, "--attention-backend", backend,
                *(["--deterministic"] if o.deterministic else [])]

    def _default_drafter(self) -> Path:
        return _shipped_or_random_drafter(self.model_dir, self.opts.quiet)

    def _add(self, name: str, module: list[str], *args) -> None:
        argv = [sys.executable, "-m", *module, *[str(a) for a in args]]
        self.children.append(Child(name, argv, self.log_dir / f"{name}.log",
                                   {internal_auth.ENV: self.internal_token}))

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.exited() is not None), None)

    def wait_ready(self) -> None:
        """Until the gateway's /readiness is 200; raises if a child dies or time runs out."""
        deadline = time.monotonic() + self.opts.ready_timeout_s
        reason = "not started"
        while time.monotonic() < deadline:
            dead = self.dead_child()
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with {dead.exited()}; its log "
                                   f"({dead.log_path}) ends with:\n{dead.tail()}")
            ready, reason = readiness(self.http_url)
            if ready:
                return
            time.sleep(0.25)
        raise TimeoutError(f"the stack was not ready after {self.opts.ready_timeout_s:.0f} s: "
                           f"{reason}")

    def _socket_args(self, role: str) -> list[str]:
        """--wire socket: the service's --call-socket, in a directory of its own under /tmp (a
        unix socket's path must stay under 108 bytes). None for a service given TLS flags (the
        two do not combine: its calls stay on gRPC)."""
        extra = self.opts.target_args if role == "target" else self.opts.draft_args
        if self.opts.wire != "socket" or any(a.startswith("--tls-") for a in extra):
            return []
        if not self.socket_dir:             # made by start() (plan() alone leaves nothing)
            self.socket_dir = os.path.join(tempfile.gettempdir(),
                                           f"dflash-{secrets.token_hex(6)}")
        return ["--call-socket", os.path.join(self.socket_dir, f"{role}.sock")]

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to every group (gateway first), then SIGKILL what is left."""
        for child in reversed(self.children):
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.signal_group(signal.SIGKILL)
                child.proc.wait(5)
            if child.log_file:
                child.log_file.close()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def endpoints(self) -> str:
        o = self.opts
        lines = [f"  OpenAI API  {self.http_url}/v1",
                 f"  gRPC        {o.host}:{o.port}  (dflash.v1.Gateway, reflection on)",
                 f"  health      {self.http_url}/health  {self.http_url}/readiness",
                 f"  metrics     {self.http_url}/metrics"]
        for name, port in (("target", o.target_metrics_port), ("draft", o.draft_metrics_port)):
            if port:
                lines.append(f"  {name} metrics  http://{o.host}:{port}/metrics")
        lines.append(f"  logs        {self.log_dir}")
        return "\n".join(lines)



def readiness(http_url: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"{http_url}/readiness", timeout=2) as r:
            return True, json.loads(r.read()).get("reason", "")
    except urllib.error.HTTPError as e:
        try:
            return False, json.loads(e.read()).get("reason", str(e))
        except ValueError:
            return False, str(e)
    except (OSError, ValueError) as e:
        return False, f"gateway not answering: {e}"


def _prepare_default_model(dtype: str, quiet: bool) -> Path:
    from dflash.prepare.smollm2 import prepare_smollm2
    return prepare_smollm2([dtype], progress=not quiet)[dtype]


def _shipped_or_random_drafter(model_dir: str, quiet: bool) -> Path:
    """The shipped trained drafter when the target is the default SmolLM2 (its fingerprint
    matches), else a random-weight one for trying the path."""
    from runtime.models.dflash import DFlashConfig, TargetFingerprint
    shipped = DFlashConfig.from_dir(SHIPPED_DRAFTER).target_fingerprint
    if shipped == TargetFingerprint.of_target(model_dir):
        return SHIPPED_DRAFTER
    return _random_drafter(model_dir, quiet)


def _random_drafter(model_dir: str, quiet: bool) -> Path:
    """A random-weight DFlash drafter for the target (acceptance near zero: for trying the path)."""
    from runtime.config import default_model_id
    out = models_home() / "drafters" / f"random-{default_model_id(model_dir)}"
    if not (out / "config.json").is_file():
        from dflash.make_draft import make_random_drafter
        make_random_drafter(model_dir, out)
    if not quiet:
        print(f"note: using a RANDOM DFlash drafter ({out}); pass --draft-model for a trained one")
    return out
