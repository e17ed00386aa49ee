"""The offline prompt set (`dflash build-prompts`): reproducible byte for byte, split cleanly,
deduplicated, and the committed data/prompts matches its manifest."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from train import prompts
from train.prompt_templates import load_templates
from train.prompts import SPLITS, PromptRecord, load_prompts, shingles, skeleton

REPO = Path(__file__).resolve().parents[1]
FILES = [f"{s}.jsonl" for s in SPLITS] + ["manifest.json"]


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((prompts.DEFAULT_OUT / "manifest.json").read_text())


@pytest.fixture(scope="module")
def committed() -> dict[str, list[PromptRecord]]:
    return {s: load_prompts(s) for s in SPLITS}


def test_build_is_byte_identical_and_matches_the_committed_set(tmp_path, manifest):
    """Built here and through the CLI in a fresh interpreter with another hash seed."""
    seed, total = manifest["seed"], manifest["total"]
    here, cli = tmp_path / "here", tmp_path / "cli"
    prompts.write(here, prompts.build(seed, total), seed, total)
    env = dict(os.environ, PYTHONHASHSEED="4321")
    subprocess.run([sys.executable, "-m", "dflash.cli", "build-prompts", "--out", str(cli),
                    "--seed", str(seed), "--total", str(total)],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    for name in FILES:
        data = (here / name).read_bytes()
        assert data == (cli / name).read_bytes(), f"{name} differs between two builds"
        assert data == (prompts.DEFAULT_OUT / name).read_bytes(), f"committed {name} is stale"
    for name, info in manifest["files"].items():
        data = (prompts.DEFAULT_OUT / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == info["sha256"] and len(data) == info["bytes"]
    assert manifest["command"] == f"dflash build-prompts --seed {seed} --total {total}"


def test_seed_changes_the_set():
    a, b = prompts.build(0, 1000), prompts.build(1, 1000)
    assert [r.text for r in a["train"]] != [r.text for r in b["train"]]


def test_counts_meet_the_minimums_and_the_manifest(committed, manifest):
    total = sum(len(records) for records in committed.values())
    assert total >= 5000
    assert 0.04 <= len(committed["eval_in"]) / total <= 0.06
    assert 150 <= len(committed["eval_unseen"]) <= 300
    for split, records in committed.items():
        info = manifest["splits"][split]
        assert info["count"] == len(records)
        assert info["categories"] == dict(Counter(r.category for r in records))


def test_categories_per_split(committed):
    train = Counter(r.category for r in committed["train"])
    eval_in = Counter(r.category for r in committed["eval_in"])
    unseen = Counter(r.category for r in committed["eval_unseen"])
    assert set(train) == set(load_templates().trained)
    assert set(eval_in) == set(train), "every trained category is evaluated, nothing else"
    assert set(unseen) == set(load_templates().unseen) and 2 <= len(unseen) <= 3
    assert not set(unseen) & set(train), "eval_unseen categories leaked into train"
    assert min(train.values()) >= 100 and min(eval_in.values()) >= 5
    assert min(unseen.values()) >= 40


def test_records_are_well_formed(committed):
    ids = [r.id for records in committed.values() for r in records]
    assert len(ids) == len(set(ids))
    words = []
    for split, records in committed.items():
        for r in records:
            assert r.split == split and r.text == r.text.strip() and r.text.isascii(), r
            if r.category != "code":     # code may quote f-strings; elsewhere braces are unfilled
                assert not re.search(r"\{[A-Za-z_]+\}", r.text), r
            words.append(len(r.text.split()))
    short_or_long = sum(not 5 <= n <= 60 for n in words)
    assert short_or_long / len(words) < 0.05, "prompts are mostly 5-60 words"


def test_no_duplicates_within_the_set(committed):
    texts = [r.text for records in committed.values() for r in records]
    exact = Counter(prompts.normalise(t) for t in texts)
    assert max(exact.values()) == 1, exact.most_common(3)
    numeric_variants = Counter(skeleton(t) for t in texts)
    assert max(numeric_variants.values()) <= prompts.SKELETON_CAP, numeric_variants.most_common(3)


def _overlaps(a: list[PromptRecord], b: list[PromptRecord]):
    """(text a, text b, trigram Jaccard, trigram containment) for every pair sharing a trigram
    (each pair once when a is b), skipping pairs that differ only in their numbers."""
    grams_a, grams_b = [shingles(r.text) for r in a], [shingles(r.text) for r in b]
    postings: dict[tuple, list[int]] = defaultdict(list)
    for j, g in enumerate(grams_a):
        for gram in g:
            postings[gram].append(j)
    for k, g in enumerate(grams_b):
        shared = Counter(j for gram in g for j in postings.get(gram, ()))
        for j, n in shared.items():
            if (a is b and j >= k) or skeleton(a[j].text) == skeleton(b[k].text):
                continue
            size = len(grams_a[j])
            yield a[j].text, b[k].text, n / (len(g) + size - n), n / min(len(g), size)


def test_no_near_duplicates_across_splits(committed):
    """No eval prompt shares its skeleton (numbers masked) or most of its word trigrams with a
    prompt of another split."""
    for i, split in enumerate(SPLITS):
        for other in SPLITS[i + 1:]:
            masked = {skeleton(r.text) for r in committed[split]}
            assert not masked & {skeleton(r.text) for r in committed[other]}, (split, other)
            for a, b, jaccard, containment in _overlaps(committed[split], committed[other]):
                assert jaccard < prompts.STRICT[0] and containment < prompts.STRICT[1], (a, b)


def test_no_near_duplicates_within_a_split(committed):
    for records in committed.values():
        for a, b, jaccard, containment in _overlaps(records, records):
            assert jaccard < prompts.LOOSE[0] and containment < prompts.LOOSE[1], (a, b)


def test_load_prompts_names_the_allowed_splits(tmp_path):
    with pytest.raises(ValueError, match="train, eval_in, eval_unseen"):
        load_prompts("test")
    with pytest.raises(FileNotFoundError, match="build-prompts"):
        load_prompts("train", root=tmp_path)


def test_cli_rejects_a_total_below_the_minimum(tmp_path, capsys):
    args = argparse.Namespace(out=tmp_path, seed=0, total=10)
    assert prompts.run(args) == 2
    assert "at least 1000" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
