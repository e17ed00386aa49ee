"""A drafter's vocabulary (runtime/draft_vocab.py): the ranking, its file, how the draft service
resolves --draft-vocab, the restricted LM head, drafts that come only from it, and the
`dflash draft-vocab` command."""
from __future__ import annotations

import asyncio
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from dflash.cli import main as dflash_main
from dflash.make_draft import make_random_drafter
from runtime.draft_vocab import FILE, FULL, SHIPPED, DraftVocab, resolve
from runtime.models.dflash import TargetHead
from services.draft.config import DraftConfig
from services.draft.dflash_drafter import DFlashDrafter
from services.draft.drafter import DrafterRefused
from services.draft.engine import DraftEngine, ProposeCall


def test_rank_puts_always_first_then_by_count_then_id():
    vocab = DraftVocab.rank([[5, 7, 7, 9], [9, 7, 3]], always=[2], source="s")
    assert vocab.ids == (2, 7, 9, 3, 5) and vocab.counted == 7
    assert vocab.top(2) == (2, 7)
    assert vocab.coverage([7, 9, 3, 11]) == 0.75
    assert vocab.coverage([7, 9, 3, 11], n=2) == 0.25


def test_a_short_ranking_is_filled_with_the_lowest_ids_it_lacks():
    vocab = DraftVocab.rank([[9, 9, 3]], always=[2])
    filled = vocab.filled(vocab_size=100)
    assert filled.ids[:3] == (2, 9, 3) and len(filled.ids) == 64 and len(set(filled.ids)) == 64
    assert filled.ids[3:6] == (0, 1, 4)
    assert vocab.filled(vocab_size=5).ids == (2, 9, 3, 0, 1)       # never past the vocabulary
    assert filled.filled(vocab_size=100) is filled


def test_file_round_trip_and_unreadable_files(tmp_path):
    assert DraftVocab.load(tmp_path) is None
    vocab = DraftVocab.rank([[4, 4, 1]], source="answers")
    vocab.save(tmp_path)
    assert DraftVocab.load(tmp_path) == vocab
    (tmp_path / FILE).write_text(json.dumps({"ids": [1, 1]}))
    with pytest.raises(ValueError, match="distinct"):
        DraftVocab.load(tmp_path)
    (tmp_path / FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        DraftVocab.load(tmp_path)


def test_resolve(tmp_path):
    assert resolve(tmp_path, SHIPPED, 100) is None          # nothing shipped: every token
    assert resolve(tmp_path, FULL, 100) is None
    with pytest.raises(ValueError, match="ships no draft_vocab.json"):
        resolve(tmp_path, 10, 100)
    ranked = tuple(range(199, 99, -1))                      # 100 ids, 199 first
    DraftVocab(ranked).save(tmp_path)
    assert resolve(tmp_path, SHIPPED, 300) == ranked
    assert resolve(tmp_path, 70, 300) == ranked[:70]
    assert resolve(tmp_path, FULL, 300) is None
    with pytest.raises(ValueError, match="too small: at least 64"):
        resolve(tmp_path, 10, 300)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        resolve(tmp_path, SHIPPED, 150)
    DraftVocab(tuple(range(99, -1, -1))).save(tmp_path)
    assert resolve(tmp_path, SHIPPED, 100) is None          # nothing cut: the plain head


def test_restricted_head_scores_only_its_tokens():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 8, generator=g)
    full = TargetHead(weight, weight)
    ids = tuple(range(63, -1, -3))                          # every third id, in another order
    head = full.restricted(ids)
    hidden = torch.randn(32, 8, generator=g)
    logits = full.logits(hidden)
    assert head.logits(hidden).shape == (32, len(ids))
    masked = torch.full_like(logits, float("-inf"))
    masked[:, list(ids)] = logits[:, list(ids)]
    assert torch.equal(head.greedy(hidden), masked.argmax(-1))
    inside = torch.isin(full.greedy(hidden), torch.tensor(ids))
    assert inside.any() and not inside.all()               # both cases are exercised
    assert torch.equal(head.greedy(hidden)[inside], full.greedy(hidden)[inside])
    assert full.restricted(None) is full


@pytest.fixture(scope="module")
def tiny_draft(tiny_qwen3_dir: Path, tmp_path_factory) -> Path:
    return make_random_drafter(tiny_qwen3_dir, tmp_path_factory.mktemp("draft"), num_layers=1,
                               block_size=8, seed=2)


def _drafts(draft: Path, target: Path, vocab: int, tree_nodes: int = 0, **device
            ) -> list[list[int]]:
    """The drafts of a few Proposes through an in-process engine (device: DraftConfig's
    device, attention_backend, cuda_graphs)."""
    cfg = DraftConfig(target_dir=str(target), model_dir=str(draft), page_size=4, draft_vocab=vocab,
                      **device)
    drafter = DFlashDrafter(cfg)
    drafter.init_backend()
    drafter.capture_cuda_graphs()
    engine = DraftEngine(drafter, cfg)
    engine.start()
    gen = torch.Generator().manual_seed(1)
    try:
        async def go():
            return [(await engine.propose(ProposeCall(
                f"s{i}", 0, n, torch.randn(n, 64, generator=gen).to(torch.bfloat16), [],
                int(torch.randint(0, 256, (1,), generator=gen)), 8, tree_nodes))).draft_tokens
                for i, n in enumerate([3, 9, 17, 5])]
        return asyncio.run(go())
    finally:
        engine.stop()


def test_drafts_come_only_from_the_vocabulary(tiny_draft, tiny_qwen3_dir, tmp_path):
    draft = Path(shutil.copytree(tiny_draft, tmp_path / "draft"))
    ids = tuple(range(0, 256, 2))
    DraftVocab(ids).save(draft)
    full = _drafts(draft, tiny_qwen3_dir, FULL)
    shipped = _drafts(draft, tiny_qwen3_dir, SHIPPED)
    pairs = [(a, b) for f, s in zip(full, shipped) for a, b in zip(f, s)]
    assert all(b in ids for _, b in pairs)
    assert any(a not in ids for a, _ in pairs)             # the cut changed some drafts ...
    assert all(a == b for a, b in pairs if a in ids)       # ... and only those
    trees = _drafts(draft, tiny_qwen3_dir, SHIPPED, tree_nodes=12)
    assert all(t in ids for tree in trees for t in tree) and all(len(t) == 12 for t in trees)


def test_a_size_without_a_shipped_vocabulary_is_refused(tiny_draft, tiny_qwen3_dir):
    with pytest.raises(DrafterRefused, match="ships no draft_vocab.json"):
        DFlashDrafter(DraftConfig(target_dir=str(tiny_qwen3_dir), model_dir=str(tiny_draft),
                                  draft_vocab=100))
    with pytest.raises(ValueError, match="draft_vocab must be"):
        DraftConfig(target_dir=str(tiny_qwen3_dir), model_dir=str(tiny_draft), draft_vocab=-2)


def test_the_command_counts_answers_in_files_and_archives(tiny_qwen3_dir, tmp_path, capsys):
    def answers(name: str, responses: list[list[int]]) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt_id": str(i), "response_ids": r}) + "\n"
                                for i, r in enumerate(responses)))
        return path
    train = answers("train_t0.0.jsonl", [[5, 6, 6], [6, 7]])
    held_out = answers("eval_in_t0.0.jsonl", [[6, 200]])
    archive = tmp_path / "answers.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(train, arcname="work/train_t0.0.jsonl")
        tar.add(held_out, arcname="work/eval_in_t0.0.jsonl")
    eos = json.loads((tiny_qwen3_dir / "config.json").read_text())["eos_token_id"]
    for source in (train, archive):
        out = tmp_path / f"out-{source.suffix}"
        out.mkdir()
        assert dflash_main(["draft-vocab", "--answers", str(source), "--target",
                            str(tiny_qwen3_dir), "--out", str(out), "--check", str(archive)]) == 0
        vocab = DraftVocab.load(out)
        # ranked, then filled up with the lowest ids to the 64 a server needs
        assert vocab.ids[:4] == (eos, 6, 5, 7) and vocab.counted == 5 and len(vocab.ids) == 64
        assert "eval_in_t0.0.jsonl: 64 ids cover 0.5000" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graph_replayed_drafts_map_to_the_vocabulary_as_eager_ones(tiny_draft, tiny_qwen3_dir,
                                                                    tmp_path):
    """On CUDA the block forward and its restricted head run from captured graphs: the same
    drafts as eager, all from the vocabulary."""
    draft = Path(shutil.copytree(tiny_draft, tmp_path / "draft"))
    ids = tuple(range(1, 256, 2))
    DraftVocab(ids).save(draft)
    for tree_nodes in (0, 12):
        runs = [_drafts(draft, tiny_qwen3_dir, SHIPPED, tree_nodes, device="cuda",
                        dtype="float32", attention_backend="triton", cuda_graphs=graphs)
                for graphs in (False, True)]
        assert runs[0] == runs[1]
        assert all(t in ids for d in runs[1] for t in d)
