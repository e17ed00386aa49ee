"""`dflash train-draft` end to end on a tiny target (CPU): the target answers real prompts
(greedy and sampled, generated in waves) and a follow-up turn after its own answers, a drafter is
trained for a few steps on the target's greedy-chain labels plus its soft labels (the loss goes
down), exported in z-lab's format with a model card, and the
draft service serves it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.draft_service import start_draft
from support.tiny_models import make_tiny

from runtime.draft_vocab import DraftVocab
from runtime.models.dflash import DFlashConfig
from runtime.weights import read_tensors

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_chat_target(smollm2_dir, tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template. Its greedy
    answers collapse into a repeated token: a pattern a drafter can learn in a few dozen steps
    (the initializer range gives the tied LM head enough logit scale to get confident)."""
    out = make_tiny(tmp_path_factory.mktemp("tiny_chat"), "llama", vocab_size=49152,
                    hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                    tie_word_embeddings=True, eos_token_id=2, initializer_range=0.05)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_dir) / name, out / name)
    return out


@pytest.mark.slow
def test_tiny_training_run_reduces_loss_and_exports_a_servable_drafter(tiny_chat_target, tmp_path):
    out = tmp_path / "drafter"
    cmd = [sys.executable, "-m", "dflash.cli", "train-draft", "--target", str(tiny_chat_target),
           "--out", str(out), "--work", str(tmp_path / "work"), "--device", "cpu",
           "--dtype", "float32", "--mask-token-id", "16", "--layers", "1", "--target-layer-ids", "1", "5",
           "--block-size", "8", "--steps", "60", "--batch-sequences", "4",
           "--blocks-per-sequence", "8", "--lr", "3e-2", "--max-new-tokens", "24",
           "--limit-prompts", "12", "--limit-eval", "3", "--eval-sequences", "3",
           "--concurrency", "16", "--seed", "1", "--sampled-temperature", "0.7",
           "--samples-per-prompt", "2", "--follow-ups", "2", "--soft-labels", "0.5",
           "--reach-weight", "0.5", "--init-from-target", "--loop-hops", "2", "--layer-passes", "2"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "training.json").read_text())
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) >= 3
    assert losses[-1] < losses[0] - 1.0, losses          # it learns (ln V = 10.8 at the start)
    assert (out / "README.md").is_file() and summary["eval"]["eval_in"]["sequences"] == 3
    # one greedy and two sampled answers per prompt, and a greedy and a sampled answer to a
    # follow-up turn, each set cached once in --work
    assert summary["answers_by_temperature"] == {"0.0": 24, "0.7": 36}
    assert summary["num_train_prompts"] == 12 and summary["num_second_turns"] == 24
    assert "(24 of them to a second turn, " in (out / "README.md").read_text()
    assert summary["config"]["greedy_labels"] and summary["config"]["soft_label_weight"] == 0.5
    assert summary["config"]["reach_weight"] == 0.5 and summary["config"]["init_from_target"]
    assert "layers started from the target's last ones" in (out / "README.md").read_text()
    assert summary["config"]["loop_hops"] == 2
    assert "moved 2 steps along the drafter's own speculative loop" in (out / "README.md").read_text()
    assert "x (0.5 + 0.5 x the drafter's probability of reaching k)" in (out / "README.md").read_text()
    assert {p.name for p in (tmp_path / "work").glob("train*.jsonl")} == {
        "train_t0.0.jsonl", "train_t0.7.jsonl", "train_t0.7_s1.jsonl",
        "train-followup_t0.0.jsonl", "train-followup_t0.7_s1.jsonl"}
    cfg = DFlashConfig.from_dir(out)
    assert cfg.block_size == 8 and cfg.mask_token_id == 16 and cfg.target_layer_ids == (1, 5)
    # the drafter's vocabulary: the tokens of the greedy training answers, EOS first (this tiny
    # target writes few distinct tokens: the ranking is filled up to the 64 a server needs)
    vocab = DraftVocab.load(out)
    greedy = [json.loads(line)["response_ids"]
              for line in (tmp_path / "work" / "train_t0.0.jsonl").read_text().splitlines()]
    seen = {t for r in greedy for t in r} | {vocab.ids[0]}
    assert set(vocab.ids[: len(seen)]) == seen and len(vocab.ids) == max(64, len(seen))
    assert summary["draft_vocab"] == len(vocab.ids)
    assert f"draft vocabulary: {len(vocab.ids)} token ids" in (out / "README.md").read_text()
    # --layer-passes 2: one set of layer weights, run twice
    assert cfg.layer_passes == 2 and "runs through them 2 times" in (out / "README.md").read_text()
    assert not any(name.startswith("layers.1.") for name in read_tensors(str(out), None))
    draft = start_draft(tiny_chat_target, tmp_path, model_dir=out)
    try:
        assert draft.proc.poll() is None
    finally:
        draft.stop()


def test_train_draft_refuses_layer_ids_outside_the_target_before_generating(tiny_chat_target,
                                                                            tmp_path):
    cmd = [sys.executable, "-m", "dflash.cli", "train-draft", "--target", str(tiny_chat_target),
           "--out", str(tmp_path / "drafter"), "--device", "cpu", "--mask-token-id", "16",
           "--target-layer-ids", "1", "6"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "target_layer_ids [1, 6] must be distinct ids in [0, 6)" in done.stderr
    assert not (tmp_path / "work").exists()          # refused before any answer was generated


def _generate(target: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash.cli", "train-draft", "--target", str(target),
           "--out", str(work.parent / "unused"), "--work", str(work), "--device", "cpu",
           "--dtype", "float32", "--mask-token-id", "16", "--target-layer-ids", "1", "5",
           "--max-new-tokens", "12",
           "--limit-prompts", "6", "--limit-eval", "2", "--concurrency", "4", "--seed", "3",
           "--samples-per-prompt", "2", "--follow-ups", "2", "--generate-only", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.slow
def test_sets_made_in_parallel_or_one_at_a_time_equal_those_of_one_process(tiny_chat_target,
                                                                          tmp_path):
    """Answer sets made by spawned processes (--generation-processes, the GPU default) or by
    one process per set (--only-set) equal the seeded sets that one process makes in turn."""
    whole, split, parallel = tmp_path / "whole", tmp_path / "split", tmp_path / "parallel"
    done = _generate(tiny_chat_target, whole)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "answer sets, " not in done.stderr             # one process on the CPU by default
    done = _generate(tiny_chat_target, parallel, "--generation-processes", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generating 3 answer sets, 3 processes at a time: follow-ups 0 1" in done.stderr
    done = _generate(tiny_chat_target, split, "--only-set", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {p.name for p in split.glob("train*.jsonl")} == {"train_t0.0.jsonl",
                                                          "train_t0.7_s1.jsonl"}
    for name in ("0", "follow-ups"):
        done = _generate(tiny_chat_target, split, "--only-set", name)
        assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.name for p in whole.glob("*.jsonl"))
    assert len(names) == 7, names
    for other in (split, parallel):
        assert names == sorted(p.name for p in other.glob("*.jsonl")), other
        for name in names:
            assert (other / name).read_text() == (whole / name).read_text(), (other, name)


@pytest.mark.parametrize("flags, message", [
    (("--only-set", "2"), ("--only-set '2': give 'follow-ups' or a sampled set's index, 0 to 1 "
                           "(--samples-per-prompt 2)")),
    (("--only-set", "followups"),
     "--only-set 'followups': give 'follow-ups' or a sampled set's index"),
    (("--generation-processes", "-2"),
     "--generation-processes -2: give a count of processes (1 = one set after another)"),
    (("--self-prompts", "-1"), "--self-prompts -1 --self-prompt-tokens 96: give a count >= 0"),
    (("--intermediate-size", "-8"), "--intermediate-size -8: give the drafter's FFN width (> 0)"),
    (("--reach-weight", "1.5"), "--reach-weight 1.5: give a value in [0, 1] (0 = off)"),
    (("--layer-passes", "0"), "--layer-passes 0: give a count of passes >= 1 (1 = off)"),
    (("--loop-hops", "-1"), "--loop-hops -1: give a count of hops >= 0 (0 = off)"),
    (("--init-from-target", "--init-from", "other"),
     "--init-from-target and --init-from: give one starting point"),
    (("--init-from-target", "--intermediate-size", "24"),
     "--init-from-target copies the target's FFN"),
])
def test_bad_set_options_are_refused_before_generating(tiny_chat_target, tmp_path, flags,
                                                       message):
    done = _generate(tiny_chat_target, tmp_path / "work", *flags)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr
    assert not (tmp_path / "work").exists()
