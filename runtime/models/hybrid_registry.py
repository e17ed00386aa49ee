"""model_type -> builder of (class, config) for hybrid (recurrent + attention) families.
Empty until a hybrid family registers itself here."""
from __future__ import annotations

from collections.abc import Callable

HYBRID_FAMILIES: dict[str, Callable[[dict], tuple[type, object]]] = {}


def lookup(model_type: str) -> Callable[[dict], tuple[type, object]] | None:
    return HYBRID_FAMILIES.get(model_type)
