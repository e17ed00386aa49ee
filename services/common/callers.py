"""Who owns a sequence: each caller of the target and the draft has sequences of its own.

A caller is named by what it proves on every call: its client certificate (mutual TLS) and the
secret caller key it sends in the metadata entry `x-dflash-caller` (the gateway draws one at
start and never logs it). The servicers file every sequence under its creator's owner tag
(`key`: "<owner>|<sequence_id>"; '|' is not allowed in an id), so another caller naming the same
id - even one holding the internal token - reaches nothing: a Verify, Propose or Release of it
is NOT_FOUND (released: false), and its Prefill starts a sequence of its own beside it. A caller
that proves nothing (no certificate, no key: grpcurl, a test) shares the anonymous owner "".

The engines know only keys; `external(key)` gives back the id the caller sent, for messages and
for the logs' sequence tag (the same tag in the gateway's logs and the services')."""
from __future__ import annotations

import hashlib
import secrets

import grpc

from services.common import internal_auth

HEADER = "x-dflash-caller"
SEPARATOR = "|"


def new_key() -> str:
    """A caller key (the gateway's, one per process): 128 random bits."""
    return secrets.token_hex(16)


def metadata(caller_key: str) -> tuple[tuple[str, str], ...]:
    """What a client adds to each call (nothing without a key)."""
    return ((HEADER, caller_key),) if caller_key else ()


def owner(context: grpc.aio.ServicerContext) -> str:
    """The caller's owner tag: a digest of its client certificate and its caller key ('' when
    it proves neither). Cheap: one metadata scan and one SHA-256 of under 2 kB per call."""
    key = internal_auth.metadata_value(context.invocation_metadata(), HEADER)
    certs = (context.auth_context() or {}).get("x509_pem_cert") or [b""]
    if not key and not certs[0]:
        return ""
    return hashlib.sha256(certs[0] + b"\0" + key.encode()).hexdigest()[:24]


def key(owner_tag: str, sequence_id: str) -> str:
    """The engines' name of `sequence_id` created by `owner_tag` (a validated id)."""
    return f"{owner_tag}{SEPARATOR}{sequence_id}"


def external(seq_key: str) -> str:
    """The id its caller sent (a key without an owner part is returned as it is: the engines'
    own tests name sequences directly)."""
    return seq_key.partition(SEPARATOR)[2] or seq_key
