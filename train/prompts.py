"""The offline prompt set for training and evaluating drafters: `dflash build-prompts`.

Prompts are filled from the templates and slot lists in data/prompt-templates/ (train/prompt_templates.py) by one seeded RNG, so a
seed gives byte-identical files. Three splits:
  train        trained categories, minus the held-out groups
  eval_in      the held-out groups of the trained categories (~5%)
  eval_unseen  categories that never appear in train (150-300 prompts)
A *group* is what a family holds out as a whole (a topic, a function spec, a source text, or the
template itself for numeric problems), so an eval_in prompt never shares its subject with a train
prompt. Every accepted prompt also passes one near-duplicate index over all splits.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from train.prompt_templates import load_templates

SPLITS = ("train", "eval_in", "eval_unseen")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "prompts"
DEFAULT_SEED = 0
DEFAULT_TOTAL = 6000
MIN_TOTAL = 1000
EVAL_IN_SHARE = 0.05         # of the total
UNSEEN_SHARE = 0.04          # of the total, clamped to UNSEEN_RANGE
UNSEEN_RANGE = (150, 300)
HOLD_OUT_SHARE = 0.07        # of each trained family's groups
# Near-duplicates, on word trigrams of the skeleton: Jaccard (shared / union) or containment
# (shared / the smaller set) at or above these. STRICT holds across splits and on one subject
# (group); LOOSE between two subjects of one split (the same template on another topic).
STRICT = (0.6, 0.75)
LOOSE = (0.8, 0.9)
EVAL_PER_GROUP = 2           # eval_in prompts per held-out group, when sizing the hold-out
MAX_HOLD_OUT_SHARE = 0.2     # of a family's groups held out up front (more if eval_in runs dry)
SKELETON_CAP = 2             # prompts that differ only in their numbers, at most, all in one split
MAX_MISSES = 400             # consecutive rejections before a family counts as exhausted

_SLOT = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TOKEN = re.compile(r"[a-z0-9]+|[+\-*/=%^]")
_NUMBER_WORDS = frozenset(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                           "nine", "ten", "eleven", "twelve", "fifteen", "twenty", "thirty",
                           "fifty", "hundred", "thousand", "million"])


class PromptSetError(ValueError):
    """The requested prompt set cannot be built (e.g. --total beyond what the sources supply)."""


@dataclass(frozen=True)
class PromptRecord:
    id: str
    category: str
    split: str
    text: str


# ---- normalised text and near-duplicates ------------------------------------------------------

def normalise(text: str) -> str:
    """Lower-case words and arithmetic symbols, single-spaced; punctuation and case dropped."""
    return " ".join(_TOKEN.findall(unicodedata.normalize("NFKC", text).lower()))


def skeleton(text: str) -> str:
    """normalise() with every number (digits or a number word) replaced by 0."""
    return " ".join("0" if w.isdigit() or w in _NUMBER_WORDS else w
                    for w in normalise(text).split())


def shingles(text: str) -> frozenset[tuple[str, ...]]:
    """Word trigrams of the skeleton (the whole skeleton when it has fewer than 3 words)."""
    words = skeleton(text).split()
    if len(words) < 3:
        return frozenset([tuple(words)])
    return frozenset(tuple(words[i:i + 3]) for i in range(len(words) - 2))


@dataclass(frozen=True)
class _Entry:
    split: str
    group: str
    skeleton: str
    size: int                 # number of shingles


class DedupIndex:
    """Accepts a prompt unless it near-duplicates an accepted one: the same normalised text; the
    same skeleton in another split, or more than SKELETON_CAP prompts on one skeleton; trigram
    similarity at STRICT across splits or on one subject (group; "" is none), else at LOOSE."""

    def __init__(self) -> None:
        self._skeletons: dict[str, tuple[str, int]] = {}       # skeleton -> (split, count)
        self._postings: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self._entries: list[_Entry] = []
        self._exact: set[str] = set()
        self._per_group: Counter[tuple[str, str]] = Counter()

    def add(self, text: str, split: str, group: str = "", per_group: int = 0) -> bool:
        """Adds `text` unless it is a near-duplicate, or `group` already has `per_group` (> 0)
        prompts in `split`; True when added."""
        key, exact = skeleton(text), normalise(text)
        owner, count = self._skeletons.get(key, (split, 0))
        if exact in self._exact or owner != split or count >= SKELETON_CAP:
            return False
        if group and per_group and self._per_group[split, group] >= per_group:
            return False
        grams = shingles(text)
        entry = _Entry(split, group, key, len(grams))
        if self._near(grams, entry):
            return False
        self._exact.add(exact)
        self._per_group[split, group] += 1
        self._skeletons[key] = (split, count + 1)
        for gram in grams:
            self._postings[gram].append(len(self._entries))
        self._entries.append(entry)
        return True

    def _near(self, grams: frozenset, new: _Entry) -> bool:
        shared: Counter[int] = Counter()
        for gram in grams:
            shared.update(self._postings.get(gram, ()))
        for i, n in shared.items():
            old = self._entries[i]
            if old.skeleton == new.skeleton:
                continue                     # numeric variants: SKELETON_CAP decides
            strict = old.split != new.split or (new.group != "" and old.group == new.group)
            jaccard_limit, containment_limit = STRICT if strict else LOOSE
            if (n / (new.size + old.size - n) >= jaccard_limit
                    or n / min(new.size, old.size) >= containment_limit):
                return True
        return False


# ---- families: templates x slots --------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """One entry of a category in data/prompt-templates/. `slots` maps a slot name, or a tuple of names
    filled together from tuple values, to its values; `group` names the held-out slot, or is
    "template" when each template is its own group; `per_group` caps the prompts of one group in
    one split (0: no cap)."""
    templates: tuple[str, ...]
    slots: dict[Any, list]
    group: str
    weight: float
    per_group: int

    @staticmethod
    def of(spec: dict) -> Family:
        return Family(tuple(spec["templates"]), spec.get("slots", {}),
                      spec.get("group", "template"), float(spec.get("weight", 1.0)),
                      int(spec.get("per_group", 0)))

    def group_values(self) -> dict[str, Any]:
        """group key -> value, in source order, unique."""
        if self.group == "template":
            values = list(self.templates)
        else:
            values = self.slots[self._slot_key(self.group)]
        return {_group_key(v): v for v in values}

    def _slot_key(self, name: str) -> Any:
        for key in self.slots:
            if key == name or (isinstance(key, tuple) and name in key):
                return key
        raise KeyError(name)

    def draw(self, group_value: Any, rng: random.Random) -> str:
        if self.group == "template":
            return self._fill(group_value, {}, rng)
        values = _assign(self._slot_key(self.group), group_value)
        return self._fill(rng.choice(self.templates), values, rng)

    def _fill(self, template: str, values: dict[str, Any], rng: random.Random) -> str:
        """Fills {slot}s left to right; a value may hold further {slot}s. {Slot} is the value
        capitalised; braces that name no slot (code) stay as they are."""
        text = template
        for _ in range(4):
            names = [self._base(n) for n in _SLOT.findall(text) if self._base(n)]
            if not names:
                return text
            for name in names:
                if name not in values:
                    key = self._slot_key(name)
                    values.update(_assign(key, rng.choice(self.slots[key])))
            text = _SLOT.sub(lambda m: self._render(m.group(1), values), text)
        raise PromptSetError(f"slots nest too deeply in template {template!r}")

    def _base(self, name: str) -> str:
        """The slot a placeholder names (itself, or lower-cased for {Slot}); "" for none."""
        for candidate in (name, name.lower()):
            if any(k == candidate or (isinstance(k, tuple) and candidate in k) for k in self.slots):
                return candidate
        return ""

    def _render(self, name: str, values: dict[str, Any]) -> str:
        base = self._base(name)
        if not base:
            return "{" + name + "}"
        text = str(values[base])
        return text if base == name else text[:1].upper() + text[1:]


def _group_key(value: Any) -> str:
    return " | ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _assign(key: Any, value: Any) -> dict[str, Any]:
    return dict(zip(key, value)) if isinstance(key, tuple) else {key: value}


def _stream(family: Family, groups: list[str],
            rng: random.Random) -> Iterator[tuple[str, str]]:
    """Endless (subject, draft) pairs, round-robin over the groups (reshuffled each round). The
    subject is the group key, or "" where each template is a group (drafts differ in subject)."""
    values = family.group_values()
    order = list(groups)
    while order:
        rng.shuffle(order)
        for key in order:
            yield ("" if family.group == "template" else key), family.draw(values[key], rng)


# ---- quotas and splits ------------------------------------------------------------------------

def apportion(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of `total` in proportion to `weights` (ties: first wins)."""
    raw = [total * w / sum(weights) for w in weights]
    out = [int(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out


def split_sizes(total: int) -> dict[str, int]:
    unseen = min(max(round(total * UNSEEN_SHARE), UNSEEN_RANGE[0]), UNSEEN_RANGE[1])
    eval_in = round(total * EVAL_IN_SHARE)
    return {"train": total - unseen - eval_in, "eval_in": eval_in, "eval_unseen": unseen}


def _families(names: tuple[str, ...]) -> dict[str, list[Family]]:
    return {c: [Family.of(s) for s in load_templates().categories[c]["families"]] for c in names}


def _weights(names: tuple[str, ...]) -> list[float]:
    return [float(load_templates().categories[c]["weight"]) for c in names]


class HoldOut:
    """The group keys kept out of train for eval_in, in a seeded order per trained family: the
    larger of HOLD_OUT_SHARE of its groups and enough for EVAL_PER_GROUP prompts each, at most
    MAX_HOLD_OUT_SHARE, at least one, never all; widen() holds out more when eval_in runs dry."""

    def __init__(self, families: dict[str, list[Family]], eval_quota: dict[str, int],
                 rng: random.Random) -> None:
        self.keys: set[str] = set()
        self._order: dict[tuple[str, int], list[str]] = {}    # (category, family) -> group keys
        self._count: dict[tuple[str, int], int] = {}
        for category, fams in families.items():
            quotas = apportion(eval_quota[category], [f.weight for f in fams])
            for i, (fam, quota) in enumerate(zip(fams, quotas)):
                order = list(fam.group_values())
                rng.shuffle(order)
                n = max(round(len(order) * HOLD_OUT_SHARE), -(-quota // EVAL_PER_GROUP))
                n = max(1, min(n, int(len(order) * MAX_HOLD_OUT_SHARE)))
                self._order[category, i] = order
                self._count[category, i] = min(n, len(order) - 1)
                self.keys.update(order[: self._count[category, i]])

    def widen(self, category: str) -> bool:
        """One more group held out per family of `category`, never a family's last; False: none."""
        grew = False
        for (cat, i), order in self._order.items():
            n = self._count[cat, i]
            if cat == category and n < len(order) - 1:
                self.keys.add(order[n])
                self._count[cat, i] = n + 1
                grew = True
        return grew


def _take(stream: Iterator[tuple[str, str]], n: int, split: str, index: DedupIndex,
          per_group: int = 0) -> tuple[list[str], bool]:
    """Up to n accepted drafts; True when the stream ran dry (MAX_MISSES rejections in a row)."""
    out: list[str] = []
    misses = 0
    while len(out) < n and misses < MAX_MISSES:
        group, text = next(stream, ("", ""))
        if not text:
            return out, True
        if index.add(text, split, group, per_group):
            out.append(text)
            misses = 0
        else:
            misses += 1
    return out, misses >= MAX_MISSES


def _fill_category(fams: list[Family], groups: list[list[str]], quota: int, split: str,
                   rng: random.Random, index: DedupIndex) -> list[str]:
    """Up to `quota` prompts spread over the families by weight; a dry family's share goes to the
    rest. Fewer only when every family ran dry."""
    streams = [_stream(f, g, rng) for f, g in zip(fams, groups)]
    live = [bool(g) for g in groups]
    texts: list[str] = []
    while len(texts) < quota and any(live):
        wants = apportion(quota - len(texts), [f.weight * ok for f, ok in zip(fams, live)])
        for i, stream in enumerate(streams):
            if live[i] and wants[i] > 0:
                got, dry = _take(stream, wants[i], split, index, fams[i].per_group)
                texts += got
                live[i] = not dry
    return texts


def _eval_in(category: str, fams: list[Family], quota: int, hold: HoldOut, rng: random.Random,
             index: DedupIndex) -> list[str]:
    """eval_in prompts from the held-out groups, holding out more while they run dry."""
    texts: list[str] = []
    while True:
        groups = [[k for k in f.group_values() if k in hold.keys] for f in fams]
        texts += _fill_category(fams, groups, quota - len(texts), "eval_in", rng, index)
        if len(texts) == quota or not hold.widen(category):
            return texts


def _shortage(category: str, split: str, got: int, quota: int) -> PromptSetError:
    return PromptSetError(f"category {category!r} supplies only {got} of the {quota} {split} "
                          f"prompts asked for; lower --total")


def build(seed: int = DEFAULT_SEED, total: int = DEFAULT_TOTAL) -> dict[str, list[PromptRecord]]:
    """The prompt set for (seed, total): split -> records, categories in source order. Built in
    the order eval_unseen, eval_in, train, all through one DedupIndex."""
    if total < MIN_TOTAL:
        raise PromptSetError(f"--total must be at least {MIN_TOTAL}, got {total}")
    rng = random.Random(seed)
    trained, unseen = load_templates().trained, load_templates().unseen
    fams = _families(trained + unseen)
    sizes = split_sizes(total)
    eval_quota = dict(zip(trained, apportion(sizes["eval_in"], _weights(trained))))
    hold = HoldOut({c: fams[c] for c in trained}, eval_quota, rng)
    index = DedupIndex()
    out: dict[str, list[PromptRecord]] = {}
    for split, names in (("eval_unseen", unseen), ("eval_in", trained), ("train", trained)):
        records: list[PromptRecord] = []
        for category, quota in zip(names, apportion(sizes[split], _weights(names))):
            if split == "eval_in":
                texts = _eval_in(category, fams[category], quota, hold, rng, index)
            else:                                  # train: all but held out; eval_unseen: all
                groups = [[k for k in f.group_values() if split != "train" or k not in hold.keys]
                          for f in fams[category]]
                texts = _fill_category(fams[category], groups, quota, split, rng, index)
            if len(texts) < quota:
                raise _shortage(category, split, len(texts), quota)
            records += [PromptRecord(f"{split}-{category}-{i:04d}", category, split, t)
                        for i, t in enumerate(texts)]
        out[split] = records
    return {s: out[s] for s in SPLITS}


# ---- files ------------------------------------------------------------------------------------

def write(out_dir: Path, prompt_set: dict[str, list[PromptRecord]], seed: int, total: int) -> dict:
    """Writes {split}.jsonl and manifest.json into out_dir; returns the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "command": f"dflash build-prompts --seed {seed} --total {total}",
        "seed": seed, "total": total, "splits": {}, "files": {}}
    for split, records in prompt_set.items():
        data = records_jsonl(records).encode()
        (out_dir / f"{split}.jsonl").write_bytes(data)
        counts = Counter(r.category for r in records)
        manifest["splits"][split] = {"count": len(records), "categories": dict(counts)}
        manifest["files"][f"{split}.jsonl"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                               "bytes": len(data)}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_prompts(split: str, root: Path | None = None) -> list[PromptRecord]:
    """The records of one split from `root` (default: the repository's data/prompts)."""
    if split not in SPLITS:
        raise ValueError(f"unknown prompt split {split!r}; splits are {', '.join(SPLITS)}")
    path = (root or DEFAULT_OUT) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; build it with `dflash build-prompts`")
    return read_records(path)


def read_records(path: Path) -> list[PromptRecord]:
    with path.open(encoding="utf-8") as f:
        return [PromptRecord(**json.loads(line)) for line in f if line.strip()]


def records_jsonl(records: list[PromptRecord]) -> str:
    """One JSON object a line, in order (the split files' format)."""
    return "".join(json.dumps(asdict(r), ensure_ascii=False) + "\n" for r in records)


# ---- `dflash build-prompts` -------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default: {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"RNG seed; a seed gives identical files (default: {DEFAULT_SEED})")
    parser.add_argument("--total", type=int, default=DEFAULT_TOTAL,
                        help=f"prompts over all splits, at least {MIN_TOTAL} "
                             f"(default: {DEFAULT_TOTAL})")


def run(args: argparse.Namespace) -> int:
    """Builds and writes the set; prints counts per split and category. Bad --total: exit 2."""
    try:
        manifest = write(args.out, build(args.seed, args.total), args.seed, args.total)
    except PromptSetError as e:
        print(f"dflash build-prompts: {e}", file=sys.stderr)
        return 2
    for split, info in manifest["splits"].items():
        cats = ", ".join(f"{c} {n}" for c, n in info["categories"].items())
        print(f"{split}: {info['count']} ({cats})")
    print(f"wrote {args.out}")
    return 0
