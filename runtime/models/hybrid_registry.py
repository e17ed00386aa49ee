"""model_type -> builder of (class, config) for hybrid (recurrent + attention) families.
Builders import their module lazily, so dense-only processes never load the mamba code."""
from __future__ import annotations

from collections.abc import Callable


def _bamba(raw: dict) -> tuple[type, object]:
    from runtime.models.bamba import build
    return build(raw)


HYBRID_FAMILIES: dict[str, Callable[[dict], tuple[type, object]]] = {
    "bamba": _bamba,
}


def lookup(model_type: str) -> Callable[[dict], tuple[type, object]] | None:
    return HYBRID_FAMILIES.get(model_type)
