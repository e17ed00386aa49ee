"""The templates and slot values of the offline prompt set, read from data/prompt-templates/
(prompts.py builds the set from them; follow_ups.py draws second turns).

Files: index.json ({"categories": [...] in build order, "trained": [...], "unseen": [...],
"follow_ups": {category or "*": [requests]}}), vocabulary.json (named value lists shared by
families), and one <category>.json per category: {"weight": share of its split, "families":
[...]}. A family is {"templates": [...], "slots": {name: [values]}, "group": the slot whose value
is the family's subject and is held out whole for eval_in, or "template" (each template is its
own group), "per_group": at most this many prompts per subject and split, "weight": share within
the category}. A slot key "a|b|c" fills the names a, b and c together from one value [x, y, z]
(a name and its pronouns, an equation and its coefficients). Values: strings, numbers,
{"range": [start, stop, step]}, or "@NAME" for a list of vocabulary.json. In a template, {slot}
is replaced by a value (values may hold further {slot}s), {Slot} by the value capitalised, and
braces naming no slot (code) are kept."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "data" / "prompt-templates"


@dataclass(frozen=True)
class PromptTemplates:
    categories: dict[str, dict[str, Any]]   # category -> {"weight", "families"} (keys as in prompts.Family)
    trained: tuple[str, ...]                # fill train and eval_in
    unseen: tuple[str, ...]                 # only eval_unseen
    follow_ups: dict[str, list[str]]        # second-turn requests by category ("*": any)


@cache
def load_templates(root: Path = TEMPLATES_DIR) -> PromptTemplates:
    index = _read(root / "index.json")
    vocabulary = _read(root / "vocabulary.json")
    categories = {name: _category(_read(root / f"{name}.json"), vocabulary)
                  for name in index["categories"]}
    return PromptTemplates(categories, tuple(index["trained"]), tuple(index["unseen"]),
                           index["follow_ups"])


def _read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _category(spec: dict, vocabulary: dict[str, list]) -> dict[str, Any]:
    return {"weight": spec["weight"],
            "families": [_family(f, vocabulary) for f in spec["families"]]}


def _family(spec: dict, vocabulary: dict[str, list]) -> dict[str, Any]:
    """Slot keys "a|b" -> ("a", "b"); "@NAME" -> the vocabulary list; [x, y] values -> tuples."""
    family = dict(spec)
    family["templates"] = _values(spec["templates"], vocabulary)
    if "slots" in spec:
        family["slots"] = {(tuple(key.split("|")) if "|" in key else key): _values(v, vocabulary)
                           for key, v in spec["slots"].items()}
    return family


def _values(spec: Any, vocabulary: dict[str, list]) -> list | range:
    if isinstance(spec, str) and spec.startswith("@"):
        spec = vocabulary[spec[1:]]
    if isinstance(spec, dict):
        return range(*spec["range"])
    return [tuple(v) if isinstance(v, list) else v for v in spec]
