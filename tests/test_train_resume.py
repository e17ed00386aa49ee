"""Checkpointed training (`dflash train-draft --stop-after`): a run cut into segments that each
stop early, save the checkpoint and are resumed, ends bit-identical to the same run done in one
go (weights, losses); a checkpoint of another run is refused, not mixed in."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from support.tiny_models import make_tiny

from runtime.weights import read_tensors
from train.config import TrainConfig
from train.generate import Example
from train.trainer import train


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny_resume"), "llama", num_hidden_layers=4)


def _examples(vocab: int, n: int = 12) -> list[Example]:
    rng = random.Random(3)
    return [Example(f"p{i}", "chat", [rng.randrange(vocab) for _ in range(6)],
                    [rng.randrange(vocab) for _ in range(rng.randrange(8, 20))], 0.0)
            for i in range(n)]


def _cfg(target, out, **kw) -> TrainConfig:
    return TrainConfig(target_dir=str(target), out_dir=str(out), num_layers=1, block_size=4,
                       target_layer_ids=(1, 2), mask_token_id=3, steps=5, batch_sequences=3,
                       blocks_per_sequence=4, lr=1e-2, warmup_steps=2, max_len=64,
                       device="cpu", feature_backend="torch", **kw)


def test_segmented_run_equals_one_run(tiny_target, tmp_path):
    from runtime.config import read_config_json
    examples = _examples(int(read_config_json(str(tiny_target))["vocab_size"]))
    whole = train(_cfg(tiny_target, tmp_path / "whole"), examples, [])
    assert whole.finished
    ck = tmp_path / "ck.pt"
    cfg = _cfg(tiny_target, tmp_path / "parts", checkpoint=str(ck), stop_after_seconds=1e-9)
    segments = []
    while True:
        res = train(cfg, examples, [])
        segments.append(res.state.step)
        if res.finished:
            break
        assert ck.is_file()
    assert segments == [1, 2, 3, 4, 5]                   # one step per segment, then done
    assert not ck.exists()                               # removed once the run is finished
    assert [h["loss"] for h in res.summary["history"]] == \
        [h["loss"] for h in whole.summary["history"]]
    a = read_tensors(str(whole.out), None)
    b = read_tensors(str(res.out), None)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cached_features_train_the_same_run(tiny_target, tmp_path):
    """Features computed once (--cache-features) instead of per batch: the same batches and
    labels, so the same losses up to the float noise of batching the target differently."""
    from runtime.config import read_config_json
    examples = _examples(int(read_config_json(str(tiny_target))["vocab_size"]))
    plain = train(_cfg(tiny_target, tmp_path / "plain"), examples, [])
    cached = train(_cfg(tiny_target, tmp_path / "cached", cache_features=True), examples, [])
    a = [h["loss"] for h in plain.summary["history"]]
    b = [h["loss"] for h in cached.summary["history"]]
    assert len(a) == len(b) == 2 and a == pytest.approx(b, rel=2e-2)


def test_checkpoint_of_another_run_is_refused(tiny_target, tmp_path):
    from runtime.config import read_config_json
    examples = _examples(int(read_config_json(str(tiny_target))["vocab_size"]))
    ck = tmp_path / "ck.pt"
    first = train(_cfg(tiny_target, tmp_path / "a", checkpoint=str(ck), stop_after_seconds=1e-9),
                  examples, [])
    assert not first.finished and ck.is_file()
    other = replace(_cfg(tiny_target, tmp_path / "a", checkpoint=str(ck)), lr=2e-2)
    with pytest.raises(ValueError, match=r"another run \(lr: 0.01 there, 0.02 here\)"):
        train(other, examples, [])
    with pytest.raises(ValueError, match="training answers: 12 there, 11 here"):
        train(_cfg(tiny_target, tmp_path / "a", checkpoint=str(ck)), examples[:11], [])
    # caching features is a speed switch, not part of the recipe: a segment may change it
    done = train(_cfg(tiny_target, tmp_path / "a", checkpoint=str(ck), cache_features=True),
                 examples, [])
    assert done.finished and not ck.exists()


def test_init_from_starts_where_a_trained_drafter_ended(tiny_target, tmp_path):
    from runtime.config import read_config_json
    examples = _examples(int(read_config_json(str(tiny_target))["vocab_size"]))
    first = train(_cfg(tiny_target, tmp_path / "first"), examples, [])
    # lr 0: the optimizer changes nothing, so the export is exactly the weights it started from
    again = train(replace(_cfg(tiny_target, tmp_path / "again"), init_from=str(first.out),
                          lr=0.0, steps=1), examples, [])
    a, b = read_tensors(str(first.out), None), read_tensors(str(again.out), None)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for other in ({"num_layers": 2}, {"intermediate_size": 40}, {"layer_passes": 2}):
        with pytest.raises(ValueError, match=r"layers, FFN width, taps, block size, mask id"):
            train(replace(_cfg(tiny_target, tmp_path / "x"), init_from=str(first.out), **other),
                  examples, [])


def test_intermediate_size_shapes_the_exported_drafter(tiny_target, tmp_path):
    """--intermediate-size N: the export's FFN is N wide (config and weights) and it loads as a
    drafter; 0 keeps the target's width."""
    from runtime.config import read_config_json
    from runtime.models.dflash import load_dflash
    raw = read_config_json(str(tiny_target))
    examples = _examples(int(raw["vocab_size"]))
    wide = int(raw["intermediate_size"]) + 24
    for width, expected in ((wide, wide), (0, int(raw["intermediate_size"]))):
        out = train(replace(_cfg(tiny_target, tmp_path / f"w{width}"), steps=1,
                            intermediate_size=width), examples, []).out
        assert read_config_json(str(out))["intermediate_size"] == expected
        gates = [v for k, v in read_tensors(str(out), None).items() if k.endswith("gate_proj.weight")]
        assert gates and all(g.shape[0] == expected for g in gates)
        load_dflash(str(out), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("window", [0, 5, 1000])
def test_anchors_stay_in_the_answer_window(window):
    """Anchors lie in [prompt_len, len-2]; --anchor-window N keeps them in the answer's first N
    tokens (all of a short answer when N exceeds it)."""
    from train.trainer import Batcher
    cfg = TrainConfig(target_dir="", out_dir="", device="cpu", blocks_per_sequence=4,
                      anchor_window=window, max_len=64)
    batch = [Example("a", "c", [1] * 7, list(range(40)), 0.0),     # a long answer
             Example("b", "c", [1] * 3, [5, 6, 7], 0.0),            # short: draws with replacement
             Example("c", "c", [1] * 50, list(range(40)), 0.0)]     # cut at max_len
    batcher = Batcher(batch, cfg, random.Random(0))
    seen: set[tuple[int, int]] = set()
    for _ in range(50):
        anchors = batcher.anchors(batch, "cpu")
        assert anchors.shape == (3, 4)
        for row, (p, n) in zip(anchors.tolist(), [(7, 47), (3, 6), (50, 64)]):
            hi = min(n - 2, p + window - 1) if window else n - 2
            assert all(p <= a <= hi for a in row), (row, p, hi)
            seen.update((p, a) for a in row)
    assert max(a for p, a in seen if p == 7) == (min(46 - 1, 7 + window - 1) if window else 45)


def test_default_taps_that_collide_are_refused_with_a_hint(tiny_target, tmp_path):
    """DFlash's spreading rule gives [1, 1] for 2 taps of a 4-layer target: such a drafter could
    not be served (the draft service refuses repeated taps), so training refuses it up front."""
    with pytest.raises(ValueError, match=r"\[1, 1\] must be distinct.*pass --target-layer-ids"):
        train(replace(_cfg(tiny_target, tmp_path / "x"), target_layer_ids=(), num_taps=2),
              _examples(8), [])
