"""The internal ports' shared secret: with `--internal-token` (env DFLASH_INTERNAL_TOKEN) set on
the target and the draft, every dflash.v1 call must carry it in the metadata entry
`x-dflash-internal-token`, else it is answered UNAUTHENTICATED (health and reflection stay open:
probes and grpcurl). The gateway sends it on every call to its upstreams, the draft on its
subscription to a target's feature stream; `dflash up` generates one per stack and hands it to
its three processes in their environment (never on a command line, which every user can read).
With TLS, client certificates (--tls-client-ca) do the same job; both may be used."""
from __future__ import annotations

import argparse
import hmac

from services.common import flags

HEADER = "x-dflash-internal-token"
ENV = "DFLASH_INTERNAL_TOKEN"


def add_flag(p: argparse.ArgumentParser, who: str) -> None:
    flags.add(p, "--internal-token", "", str, f"shared secret of the internal gRPC ports: {who} "
              f"(metadata {HEADER}; '' = none). Prefer the environment ({ENV}): a command "
              f"line is visible to every user", secret=True)


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    """What a client adds to each call (nothing without a token)."""
    return ((HEADER, token),) if token else ()


def metadata_value(invocation_metadata, name: str) -> str:
    """The first value of metadata entry `name` a call carries ('' when none)."""
    value = next((v for k, v in invocation_metadata or () if k == name), "")
    return value.decode() if isinstance(value, bytes) else value


def allowed(token: str, invocation_metadata) -> bool:
    """Whether a call's metadata carries the token (always, when there is none to check)."""
    if not token:
        return True
    return hmac.compare_digest(metadata_value(invocation_metadata, HEADER).encode(),
                               token.encode())
