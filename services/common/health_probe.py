"""python -m services.common.health_probe HOST:PORT SERVICE [--timeout S] [--ca PEM [--cert PEM
--key PEM]]

The docker-compose healthcheck of the three services, and the Kubernetes probe of a service that
serves TLS (Kubernetes' own gRPC probes speak plaintext only): one grpc.health.v1 Check of SERVICE
(e.g. dflash.v1.Target; "" = the whole server). Exit 0 iff the answer is SERVING; otherwise
exit 1 with one line on stderr saying what it got (NOT_SERVING, UNKNOWN, an unknown service,
nothing listening, a deadline, a handshake that failed). With --ca the Check goes over TLS
verifying the server against that CA; --cert/--key add a client certificate (mutual TLS). Bad
arguments: exit 2 (argparse)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def check(address: str, service: str, timeout_s: float,
          credentials: grpc.ChannelCredentials | None = None) -> tuple[bool, str]:
    """(serving, what the probe saw). credentials: TLS (None: plaintext)."""
    try:
        with (grpc.secure_channel(address, credentials) if credentials is not None
              else grpc.insecure_channel(address)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return False, f"{address} does not know the service {service!r}"
        return False, f"{address}: {e.code().name}: {(e.details() or '').splitlines()[0][:200]}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == SERVING, f"{address} {service or '(server)'}: {name}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.common.health_probe",
                                description=__doc__.splitlines()[0])
    p.add_argument("address", help="HOST:PORT of the gRPC server")
    p.add_argument("service", nargs="?", default="",
                   help="health service name, e.g. dflash.v1.Target ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="deadline of the Check (s)")
    p.add_argument("--ca", default="", help="TLS: the CA (PEM) that signed the server's certificate")
    p.add_argument("--cert", default="", help="mutual TLS: this client's certificate (PEM)")
    p.add_argument("--key", default="", help="mutual TLS: this client's private key (PEM)")
    args = p.parse_args(argv)
    if (args.cert or args.key) and not (args.ca and args.cert and args.key):
        p.error("--cert and --key go together, with --ca")
    if ":" not in args.address:
        p.error(f"address {args.address!r} must be HOST:PORT")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    return args


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from --ca/--cert/--key (None: plaintext). Exits 1 on an unreadable file."""
    if not args.ca:
        return None
    try:
        read = [Path(path).read_bytes() if path else None for path in (args.ca, args.key, args.cert)]
    except OSError as e:
        print(f"cannot read a TLS file: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    return grpc.ssl_channel_credentials(*read)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serving, seen = check(args.address, args.service, args.timeout, credentials(args))
    print(seen, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    raise SystemExit(main())
