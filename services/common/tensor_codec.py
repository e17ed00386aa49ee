"""TensorData <-> torch.Tensor: raw little-endian bytes + dtype + shape (never floats in lists)."""
from __future__ import annotations

import warnings

import torch

from dflash.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.wire_dtypes import ITEM_BYTES

WIRE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ITEM_BYTES}
assert all(WIRE_DTYPES[n].itemsize == b for n, b in ITEM_BYTES.items())
# numpy has no bfloat16: move raw bits through a same-width integer view.
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def wire_dtype(name: str) -> torch.dtype:
    if name not in WIRE_DTYPES:
        raise InvalidArgument(f"tensor dtype {name!r} is not supported; allowed: {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def encode(t: torch.Tensor) -> common_pb2.TensorData:
    t = t.detach().contiguous().cpu()
    name = {v: k for k, v in WIRE_DTYPES.items()}[t.dtype]
    data = t.view(_BITS[t.dtype]).numpy().tobytes()
    return common_pb2.TensorData(data=data, dtype=name, shape=list(t.shape))


def decode(msg: common_pb2.TensorData, what: str = "tensor") -> torch.Tensor:
    """Validates dtype and byte count; returns a CPU tensor of msg.shape that views the message's
    bytes (no copy; never write to it - the consumer copies it once, to its device)."""
    dtype = wire_dtype(msg.dtype)
    numel = 1
    for d in msg.shape:
        numel *= d
    expected = numel * dtype.itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(f"{what}: {len(msg.data)} bytes do not match shape {list(msg.shape)} "
                              f"of {msg.dtype} ({expected} bytes expected)")
    if numel == 0:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    with warnings.catch_warnings():      # a view of the message's bytes, not a copy: read only
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(msg.data, dtype=_BITS[dtype])
    return raw.view(dtype).reshape(tuple(msg.shape))
