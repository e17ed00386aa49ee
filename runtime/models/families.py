"""model_type -> builder of (class, config) for the families beside the dense Llama/Qwen ones:
hybrid (recurrent + attention) and multi-head latent attention models. Builders import their
module lazily, so dense-only processes never load the mamba or MLA code."""
from __future__ import annotations

from collections.abc import Callable


def _bamba(raw: dict) -> tuple[type, object]:
    from runtime.models.bamba import build
    return build(raw)


def _qwen3_5(raw: dict) -> tuple[type, object]:
    from runtime.models.qwen3_5 import build
    return build(raw)


def _qwen3_next(raw: dict) -> tuple[type, object]:
    from runtime.models.qwen3_next import build
    return build(raw)


def _granite_hybrid(raw: dict) -> tuple[type, object]:
    from runtime.models.granite_hybrid import build
    return build(raw)


def _nemotron_h(raw: dict) -> tuple[type, object]:
    from runtime.models.nemotron_h import build
    return build(raw)


def _falcon_h1(raw: dict) -> tuple[type, object]:
    from runtime.models.falcon_h1 import build
    return build(raw)


def _deepseek(raw: dict) -> tuple[type, object]:
    from runtime.models.deepseek import build
    return build(raw)


FAMILIES: dict[str, Callable[[dict], tuple[type, object]]] = {
    "bamba": _bamba,
    "granitemoehybrid": _granite_hybrid,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "qwen3_5": _qwen3_5,
    "qwen3_5_text": _qwen3_5,
    "qwen3_5_moe": _qwen3_5,
    "qwen3_5_moe_text": _qwen3_5,
    "qwen3_next": _qwen3_next,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}


def lookup(model_type: str) -> Callable[[dict], tuple[type, object]] | None:
    return FAMILIES.get(model_type)
