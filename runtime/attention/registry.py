"""Name -> attention backend class. Backends with optional dependencies import lazily."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:              # importing base imports torch; the launcher only needs the names
    from runtime.attention.base import AttentionBackend

BACKENDS: dict[str, str] = {
    "torch": "runtime.attention.torch_backend:TorchAttentionBackend",
    "triton": "runtime.attention.triton_backend:TritonAttentionBackend",
    "flashinfer": "runtime.attention.flashinfer_backend:FlashInferAttentionBackend",
}


def default_backend(device: str) -> str:
    """The backend a tool picks when none is given: torch on the CPU, triton on a GPU."""
    return "torch" if device == "cpu" else "triton"


class BackendUnavailable(RuntimeError):
    pass


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise BackendUnavailable(f"attention backend {name!r} is not available here: {e}. "
                                 f"Install the GPU extras (pip install '.[gpu]') or use "
                                 f"--attention-backend torch") from e


def backends_supporting(feature: str) -> list[str]:
    """Names of the backends importable here whose class sets `feature` (e.g. supports_fp8_kv)."""
    names = []
    for name in BACKENDS:
        try:
            cls = backend_class(name)
        except BackendUnavailable:
            continue
        if getattr(cls, feature, False):
            names.append(name)
    return names
