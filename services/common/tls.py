"""TLS for every gRPC link, in one place: server credentials (target, draft, gateway) with
optional mutual TLS, and the gateway's client credentials for its upstreams.

    server side   --tls-cert PEM --tls-key PEM [--tls-client-ca PEM]
                  with a client CA the server requires a client certificate signed by it
    client side   --upstream-ca PEM [--upstream-cert PEM --upstream-key PEM]
                  [--upstream-server-name NAME]   (the name the upstreams' certificates carry)

Every flag also reads DFLASH_<FLAG>. A development CA and certificates: scripts/dev_ca.sh."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common import flags


class TlsConfigError(ValueError):
    """A TLS flag combination that cannot work, or a file that cannot be read."""


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"{what} {path!r} cannot be read: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TlsConfigError(f"{what} {path!r} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate chain and key (PEM paths); client_ca set = mutual TLS."""
    cert: str = ""
    key: str = ""
    client_ca: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsConfigError("--tls-cert and --tls-key go together")
        if self.client_ca and not self.cert:
            raise TlsConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        chain = _read(self.cert, "--tls-cert")
        key = _read(self.key, "--tls-key")
        ca = _read(self.client_ca, "--tls-client-ca") if self.client_ca else None
        return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                           require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTls:
    """How the gateway reaches its upstreams: ca set = TLS (verifying their certificates);
    cert/key = the client certificate presented for mutual TLS."""
    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""          # overrides the name checked against the server certificate

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsConfigError("--upstream-cert and --upstream-key go together")
        if self.cert and not self.ca:
            raise TlsConfigError("--upstream-cert (mutual TLS) needs --upstream-ca")

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--upstream-ca"),
            private_key=_read(self.key, "--upstream-key") if self.key else None,
            certificate_chain=_read(self.cert, "--upstream-cert") if self.cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_server_flags(p: argparse.ArgumentParser) -> None:
    flags.add(p, "--tls-cert", "", str, "TLS certificate chain (PEM) of this server "
                                        "('' = plaintext)")
    flags.add(p, "--tls-key", "", str, "private key (PEM) of --tls-cert")
    flags.add(p, "--tls-client-ca", "", str, "mutual TLS: require client certificates signed by "
                                             "this CA (PEM)")


def add_client_flags(p: argparse.ArgumentParser) -> None:
    flags.add(p, "--upstream-ca", "", str, "CA (PEM) that signed the target's and draft's "
                                           "certificates; '' = plaintext upstream links")
    flags.add(p, "--upstream-cert", "", str, "mutual TLS: client certificate (PEM) for upstreams")
    flags.add(p, "--upstream-key", "", str, "private key (PEM) of --upstream-cert")
    flags.add(p, "--upstream-server-name", "", str, "name expected in the upstreams' "
                                                    "certificates (default: the host dialled)")


def server_from_args(args: argparse.Namespace) -> ServerTls:
    return ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)


def client_from_args(args: argparse.Namespace) -> ClientTls:
    return ClientTls(args.upstream_ca, args.upstream_cert, args.upstream_key,
                     args.upstream_server_name)


def check_readable(*configs: ServerTls | ClientTls) -> None:
    """Reads every file now, so a bad path fails at start-up with a clear message."""
    for c in configs:
        if c.enabled:
            c.credentials()
