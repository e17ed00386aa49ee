"""`dflash draft-vocab`: writes a drafter's vocabulary (runtime/draft_vocab.py) from the target's
own answers - the training step's cache of generated answers (train/generate.py's JSONL: one
Example per line, `response_ids` counted), as files or inside a .tgz - so the drafter scores
only the tokens the target writes. The target's end-of-sequence ids are always kept. Prints
the coverage of each --check file's answers at a few sizes (held-out answers: what a cut would
cost)."""
from __future__ import annotations

import argparse
import fnmatch
import json
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from runtime.config import ModelConfig
from runtime.draft_vocab import FILE, DraftVocab

SIZES = (4096, 8192, 16384)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--answers", nargs="+", required=True,
                   help="answer JSONL files, or .tgz archives holding them (see --member)")
    p.add_argument("--member", default="*train_*.jsonl",
                   help="which JSONL members of an archive are counted (glob)")
    p.add_argument("--target", required=True, help="the target's HF directory (its EOS ids)")
    p.add_argument("--out", required=True, help="the drafter directory draft_vocab.json goes to")
    p.add_argument("--check", nargs="*", default=[], help="held-out answer files or archives "
                   "(members matching --check-member) whose coverage is printed")
    p.add_argument("--check-member", default="*eval_*.jsonl")


def answers(paths: list[str], member: str) -> Iterator[tuple[str, list[int]]]:
    """(file or archive member name, response ids) of every answer."""
    for path in map(Path, paths):
        if path.name.endswith((".tgz", ".tar.gz")):
            with tarfile.open(path) as tar:
                for m in tar.getmembers():
                    if m.isfile() and fnmatch.fnmatch(Path(m.name).name, member):
                        yield from _lines(m.name, tar.extractfile(m).read().decode().splitlines())
        else:
            yield from _lines(str(path), path.read_text().splitlines())


def _lines(name: str, lines: list[str]) -> Iterator[tuple[str, list[int]]]:
    for line in lines:
        if line.strip():
            yield name, [int(t) for t in json.loads(line)["response_ids"]]


def write(drafter_dir: str | Path, responses: Iterable[list[int]], target_dir: str | Path,
          source: str) -> DraftVocab:
    """Ranks the target's answers (its EOS ids kept first) into the drafter's draft_vocab.json:
    this command, and `dflash train-draft` when it exports a drafter. Answers with fewer distinct
    tokens than a served vocabulary needs (MIN_IDS) are filled up with the lowest ids."""
    target = ModelConfig.from_dir(target_dir)
    vocab = DraftVocab.rank(responses, always=target.eos_token_ids,
                            source=source).filled(target.vocab_size)
    vocab.save(drafter_dir)
    return vocab


def run(args: argparse.Namespace) -> int:
    counted = list(answers(args.answers, args.member))
    if not counted:
        raise SystemExit(f"no answers found in {args.answers} (member {args.member!r})")
    sources = sorted({name for name, _ in counted})
    vocab = write(args.out, (ids for _, ids in counted), args.target,
                  f"response_ids of {len(counted)} answers in {', '.join(sources)}")
    print(f"{Path(args.out) / FILE}: {len(vocab.ids)} ids from {vocab.counted} tokens")
    held_out: dict[str, list[int]] = {}
    for name, ids in answers(args.check, args.check_member):
        held_out.setdefault(name, []).extend(ids)
    for name, tokens in held_out.items():
        sizes = [n for n in SIZES if n < len(vocab.ids)] + [len(vocab.ids)]
        print(f"  {name}: " + ", ".join(f"{n} ids cover {vocab.coverage(tokens, n):.4f}"
                                         for n in sizes))
    return 0
