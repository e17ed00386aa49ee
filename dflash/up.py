"""`dflash up`: the local stack (dflash/stack.py) in the foreground until Ctrl-C or SIGTERM, which
stop all three processes. A process that dies meanwhile is started again (dflash/supervisor.py)."""
from __future__ import annotations

import argparse
import signal
import sys
import time

from dflash.stack import (
    CPU_DFLASH_BLOCK,
    CPU_SPEC_DISABLE_BATCH,
    DEFAULT_DRAFTER,
    DRAFTERS,
    GPU_DFLASH_TREE_NODES,
    Stack,
    StackOptions,
)
from dflash.supervisor import Supervisor


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = StackOptions()
    p.add_argument("--host", default=d.host, help="address every service listens on")
    p.add_argument("--http-port", type=int, default=d.http_port, help="OpenAI-compatible HTTP API")
    p.add_argument("--port", type=int, default=d.port, help="gateway gRPC port")
    p.add_argument("--target-port", type=int, default=d.target_port)
    p.add_argument("--draft-port", type=int, default=d.draft_port)
    p.add_argument("--target-metrics-port", type=int, default=d.target_metrics_port, help="0 = off")
    p.add_argument("--draft-metrics-port", type=int, default=d.draft_metrics_port, help="0 = off")
    p.add_argument("--model", default="", help="target HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=d.dtype, help="target dtype (fp32 is fastest on CPU; "
                                                    "bfloat16 on a GPU)")
    p.add_argument("--draft-dtype", default=d.draft_dtype,
                   help="draft dtype, or auto: bfloat16 where the device computes it natively, "
                        "else float32 (default: auto for dflash on the CPU, else --dtype)")
    p.add_argument("--device", default=d.device, help="cpu | cuda | cuda:N (target and draft)")
    p.add_argument("--attention-backend", default=d.attention_backend,
                   help="torch | triton | flashinfer (default: triton on CUDA, torch on CPU)")
    p.add_argument("--drafter", default=d.drafter, choices=DRAFTERS,
                   help=f"default {DEFAULT_DRAFTER}")
    p.add_argument("--draft-model", default="", help="DFlash drafter directory (--drafter dflash)")
    p.add_argument("--block-size", type=int, default=0,
                   help=f"verify block size (0 = {CPU_DFLASH_BLOCK} for dflash on the CPU, else the "
                        f"draft's trained block)")
    p.add_argument("--spec-disable-batch-size", type=int, default=-1,
                   help=f"above this many running requests the gateway stops drafting (-1 = "
                        f"{CPU_SPEC_DISABLE_BATCH} for dflash on the CPU, else 0 = always draft)")
    p.add_argument("--spec-tree-nodes", type=int, default=d.spec_tree_nodes,
                   help=f"greedy requests verify a tree of this many drafts per step instead of "
                        f"a chain (gateway --spec-tree-nodes; -1 = {GPU_DFLASH_TREE_NODES} for "
                        f"dflash on a GPU, else 0 = chains)")
    p.add_argument("--speculation", default=d.speculation,
                   help="gateway --speculation: auto (each step's chain length or tree size, or "
                        "no drafting, chosen from measured cost and acceptance), fixed (the "
                        "block and tree defaults below), or a fixed verify block N")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels on the target and the draft: output bitwise "
                        "equal to autoregressive decoding in bf16, at any load (CUDA, triton "
                        "backend, dense models)")
    p.add_argument("--wire", default="", choices=("unary", "stream", "socket"),
                   help="gateway --wire: Propose/Verify as unary RPCs, on one stream per "
                        "upstream, or that stream on each service's unix call socket "
                        "(default: the gateway's)")
    p.add_argument("--max-running", type=int, default=None,
                   help="gateway --max-running: requests generating at once")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="gateway --max-waiting: requests queued beyond those (then 429)")
    p.add_argument("--log-dir", default="", help="children's logs (default: under the models home)")
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout_s)


def options_from_args(args: argparse.Namespace, **overrides) -> StackOptions:
    return StackOptions(
        host=args.host, http_port=args.http_port, port=args.port, target_port=args.target_port,
        draft_port=args.draft_port, target_metrics_port=args.target_metrics_port,
        draft_metrics_port=args.draft_metrics_port, model_dir=args.model, dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        drafter=args.drafter, draft_model=args.draft_model, block_size=args.block_size,
        spec_disable_batch_size=args.spec_disable_batch_size,
        spec_tree_nodes=args.spec_tree_nodes, speculation=args.speculation, wire=args.wire, log_dir=args.log_dir, ready_timeout_s=args.ready_timeout,
        device=args.device, attention_backend=args.attention_backend,
        deterministic=args.deterministic, gateway_args=_admission_args(args), **overrides)


def _admission_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The gateway's admission flags that were given."""
    out: tuple[str, ...] = ()
    for flag, value in (("--max-running", args.max_running), ("--max-waiting", args.max_waiting)):
        if value is not None:
            out += (flag, str(value))
    return out


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop()


def run(args: argparse.Namespace) -> int:
    stack = Stack(options_from_args(args))
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stack.start()
        print(f"starting target, {'draft, ' if args.drafter != 'none' else ''}gateway "
              f"(logs in {stack.log_dir}) ...", flush=True)
        stack.wait_ready()
        print(f"dflash stack is up (drafter: {args.drafter})\n{stack.endpoints()}\n"
              f"Ctrl-C stops everything.", flush=True)
        supervisor = Supervisor(stack.children, say=lambda text: print(text, flush=True))
        while (fatal := supervisor.check()) is None:
            time.sleep(0.5)
        print(fatal, file=sys.stderr)
        return 1
    except _Stop:
        print("stopping ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"dflash up failed: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        for s, h in previous.items():
            signal.signal(s, h)
