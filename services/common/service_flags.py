"""The flags every model service (target, draft) shares: where it listens, the device and
memory it uses, its leases, limits, logs, drain and TLS. Each also reads DFLASH_<FLAG>."""
from __future__ import annotations

import argparse

from runtime.layers.linear import CPU_GEMMS, DEFAULT_CPU_GEMM
from services.common import flags, internal_auth, tls

UNIX_PATH_MAX = 107                  # sun_path's 108 bytes, with the terminating NUL


def add_model_service_flags(p: argparse.ArgumentParser, *, port: int, kv_budget: str,
                            kv_help: str, token_budget: int, token_help: str,
                            drain_help: str,
                            dtype_help: str = "float32 | bfloat16 | float16") -> None:
    flags.add(p, "--port", port, int, "gRPC port")
    flags.add(p, "--host", "127.0.0.1", str, "listen address of its gRPC and metrics ports (this "
              "host only by default: the gateway's upstream; 0.0.0.0 to serve other hosts, then "
              "with client certificates, --tls-client-ca)")
    flags.add(p, "--device", "cpu", str, "cpu | cuda | cuda:N")
    flags.add(p, "--dtype", "float32", str, dtype_help)
    flags.add(p, "--attention-backend", "torch", str, "torch | triton | flashinfer")
    flags.add(p, "--cpu-gemm", DEFAULT_CPU_GEMM, str,
              f"fp32 CPU GEMM of linear layers: {' | '.join(sorted(CPU_GEMMS))} (torch = MKL)")
    flags.add(p, "--deterministic", action="store_true",
              help="batch-invariant kernels: a token's logits are bitwise the same alone, in a "
                   "verify block or beside other sequences, so speculative output equals "
                   "autoregressive output in bf16 (CUDA with the triton backend, dense models; "
                   "runtime/batch_invariance.py)")
    flags.add(p, "--kv-budget", kv_budget, flags.parse_size, kv_help)
    flags.add(p, "--page-size", 16, int, "tokens per KV page")
    flags.add(p, "--enable-prefix-caching", "on", flags.parse_switch, "on | off: full KV pages "
              "of committed tokens stay cached (keyed by their prefix) for later prompts that "
              "start the same way, until their pages are needed", nargs="?", const="on")
    flags.add(p, "--prefix-cache-max-pages", 0, int, "the most cached pages kept once no "
              "sequence uses them (0 = every spare page of the pool)")
    flags.add(p, "--token-budget", token_budget, int, token_help)
    flags.add(p, "--lease-seconds", 120.0, float, "idle time after which a sequence is freed")
    flags.add(p, "--model-id", "", str, "name reported in capabilities and metrics "
                                        "(default: the model directory's name)")
    flags.add(p, "--metrics-port", 0, int, "Prometheus /metrics port (0 = off)")
    flags.add(p, "--max-message-mib", 256, int, "gRPC message size limit")
    flags.add(p, "--log-level", "INFO", str, "DEBUG | INFO | WARNING")
    flags.add(p, "--drain-grace", 30.0, float, drain_help)
    flags.add(p, "--call-socket", "", str, "also serve the per-step call stream on this unix "
              "socket (a gateway on this host with --wire socket uses it instead of gRPC's "
              "transport; not with TLS)")
    flags.add(p, "--no-cuda-graphs", action="store_true",
              help="run every forward eagerly (graphs are captured during warm-up on CUDA with "
                   "the triton backend only)")
    tls.add_server_flags(p)
    internal_auth.add_flag(p, "every dflash.v1 call must carry it")


def check_server_tls(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A bad --tls-* path or a non-PEM file is an argument error at start-up, with its reason."""
    try:
        server_tls = tls.server_from_args(args)
        tls.check_readable(server_tls)
    except tls.TlsConfigError as e:
        p.error(str(e))
    if len(args.call_socket.encode()) > UNIX_PATH_MAX:
        p.error(f"--call-socket {args.call_socket!r}: a unix socket's path must be at most "
                f"{UNIX_PATH_MAX} bytes")
    if args.call_socket and server_tls.enabled:
        p.error("--call-socket cannot be combined with --tls-*: a unix socket carries no "
                "certificates, and with TLS callers are told apart by theirs; drop one of them")
