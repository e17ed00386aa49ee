"""Property-based fuzzing support (hypothesis): arbitrary protobuf messages built from their
descriptors, field-level and byte-level mutations of valid messages, arbitrary JSON, and a
tally of the answers.

Every strategy is bounded (sizes, depth) so that one example is one quick RPC."""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

F = FieldDescriptor

# fixed budget: derandomized (the same examples on every run), no per-example deadline
def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


_INTERNAL_ERROR = re.compile(r"^\S+ ERROR \S+ internal error", re.MULTILINE)


def internal_errors(log: str) -> list[str]:
    """The internal-error records in a service's log (an ERROR line the error mappers write).
    Fuzzed text a log line echoes cannot match: values are quoted on one line (logs.py), and the
    fuzzer does draw the literal "internal error" (hypothesis uses the source's constants)."""
    return _INTERNAL_ERROR.findall(log)


# -- protobuf ---------------------------------------------------------------------------------
_INT_RANGES = {
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1),
    F.TYPE_SFIXED32: (-2**31, 2**31 - 1), F.TYPE_INT64: (-2**63, 2**63 - 1),
    F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(lo: int, hi: int, hints: tuple[int, ...]) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, hi, 0, 1, 2, 3, -1, 7, 8, 15, 16, 255, 256, 1000, 1015,
                                1016, 2047, 2048, 49151, 49152, *hints) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(0, min(hi, 2100)).filter(
        lambda v: v >= lo), st.integers(lo, hi))


def scalar(fd: FieldDescriptor, hints: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    if fd.name in hints:
        return hints[fd.name]
    t = fd.type
    if t in _INT_RANGES:
        return _integers(*_INT_RANGES[t], ())
    if t == F.TYPE_FLOAT:
        return st.floats(width=32)
    if t == F.TYPE_DOUBLE:
        return st.floats()
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.text(max_size=40)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=600)
    if t == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in fd.enum_type.values]),
                         st.integers(-2**31, 2**31 - 1))
    raise TypeError(f"no strategy for field {fd.full_name} of type {t}")


def _is_repeated(fd: FieldDescriptor) -> bool:
    return fd.is_repeated


def message(descriptor: Descriptor, cls: type[Message], hints: dict | None = None,
            depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of this type: each field set or not, any value of its type (hints: field
    name -> strategy, for values that reach deeper code, e.g. known sequence ids)."""
    hints = hints or {}

    @st.composite
    def build(draw) -> Message:
        msg = cls()                     # fields of one oneof: the last one set wins
        for fd in descriptor.fields:
            if draw(st.booleans()):
                _set_field(draw, msg, fd, hints, depth)
        return msg
    return build()


def _set_field(draw, msg: Message, fd: FieldDescriptor, hints: dict, depth: int) -> None:
    if fd.type == F.TYPE_MESSAGE:
        if depth >= 3:
            return
        if _is_repeated(fd):
            sub_cls = type(getattr(msg, fd.name).add())
            del getattr(msg, fd.name)[:]
            for m in draw(st.lists(message(fd.message_type, sub_cls, hints, depth + 1),
                                   max_size=3)):
                getattr(msg, fd.name).add().CopyFrom(m)
        else:
            sub_cls = type(getattr(msg, fd.name))
            getattr(msg, fd.name).CopyFrom(draw(message(fd.message_type, sub_cls, hints,
                                                        depth + 1)))
        return
    value = scalar(fd, hints)
    if _is_repeated(fd):
        getattr(msg, fd.name).extend(draw(st.lists(value, max_size=40)))
    else:
        setattr(msg, fd.name, draw(value))


def field_mutation(valid: Message, hints: dict | None = None) -> st.SearchStrategy[Message]:
    """A valid message with one to three fields replaced by arbitrary values (or cleared)."""
    hints = hints or {}
    fields = list(valid.DESCRIPTOR.fields)
    if not fields:                        # nothing to replace (GetCapabilitiesRequest)
        return st.just(valid)

    @st.composite
    def mutate(draw) -> Message:
        msg = type(valid)()
        msg.CopyFrom(valid)
        for fd in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
            msg.ClearField(fd.name)
            if draw(st.booleans()):
                _set_field(draw, msg, fd, hints, 1)
        return msg
    return mutate()


def byte_mutation(valid: bytes) -> st.SearchStrategy[bytes]:
    """The wire bytes of a valid message, damaged: bytes flipped, inserted, deleted, truncated,
    duplicated, or a field with an out-of-range length prefix appended."""
    @st.composite
    def mutate(draw) -> bytes:
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "dup", "bogus"]))
            at = draw(st.integers(0, len(data)))
            if kind == "flip" and data:
                data[min(at, len(data) - 1)] ^= draw(st.integers(1, 255))
            elif kind == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=8))
            elif kind == "delete":
                del data[at:at + draw(st.integers(1, 8))]
            elif kind == "truncate":
                del data[at:]
            elif kind == "dup":
                data[at:at] = data[max(0, at - 8):at]
            else:                         # a length-delimited field claiming more than is there
                tag = draw(st.integers(1, 20)) << 3 | 2
                data += bytes([tag]) + _varint(draw(st.integers(0, 2**32))) + b"\x00" * 3
        return bytes(data)
    return mutate()


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


# -- calls and tallies -------------------------------------------------------------------------
# What a handler may answer; UNKNOWN and INTERNAL (unhandled exceptions) never.
DEFINED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.OUT_OF_RANGE}


@dataclass
class Tally:
    """Answers by (method, code) and inputs tried."""
    codes: Counter = field(default_factory=Counter)

    def record(self, method: str, code) -> None:
        self.codes[(method, getattr(code, "name", str(code)))] += 1

    @property
    def total(self) -> int:
        return sum(self.codes.values())

    def summary(self) -> str:
        by_code = Counter()
        for (_, code), n in self.codes.items():
            by_code[code] += n
        return " ".join(f"{c}:{n}" for c, n in sorted(by_code.items()))


def call_raw(channel: grpc.Channel, path: str, data: bytes, streaming: bool = False,
             metadata: tuple = (), timeout: float = 30) -> grpc.StatusCode:
    """Sends raw request bytes to a method; returns the status it ends with."""
    ident: Callable[[bytes], bytes] = lambda b: b
    try:
        if streaming:
            for _ in channel.unary_stream(path, request_serializer=ident,
                                          response_deserializer=ident)(
                    data, timeout=timeout, metadata=metadata):
                pass
        else:
            channel.unary_unary(path, request_serializer=ident, response_deserializer=ident)(
                data, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# -- JSON ------------------------------------------------------------------------------------------
JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                        st.integers(-2**70, 2**70), st.text(max_size=30))
JSON = st.recursive(JSON_LEAVES, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=12), kids, max_size=4)),
    max_leaves=12)


def dumps(value) -> bytes:
    """JSON as Python writes it (NaN and Infinity included: the server must refuse them)."""
    return json.dumps(value, allow_nan=True).encode()
