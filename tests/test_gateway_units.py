"""Gateway pieces without processes: stop strings, compatibility checks, request validation."""
from __future__ import annotations

import random

import pytest

from dflash.v1 import common_pb2, draft_pb2, target_pb2
from gateway import compat
from gateway.feed import DraftFeed
from gateway.request import GenerationRequest, Limits, RequestError, validate
from gateway.state import Speculation
from gateway.stop import StopMatcher


# -- stop strings ---------------------------------------------------------------------------------
def feed_all(stops, pieces, check=True):
    m = StopMatcher(stops)
    out, stopped = [], False
    for p in pieces:
        r = m.add(p, check)
        out.append(r.text)
        if r.stopped:
            stopped = True
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped, out


def test_stop_string_split_over_pieces_is_cut_and_not_returned():
    text, stopped, pieces = feed_all(["END"], ["Hello E", "N", "D and more"])
    assert (text, stopped) == ("Hello ", True)
    assert pieces[0] == "Hello "          # "E" is held back: it may begin the stop


def test_held_text_released_when_it_is_not_a_stop():
    text, stopped, pieces = feed_all(["END"], ["Hello E", "Nx", " world"])
    assert (text, stopped) == ("Hello ENx world", False)
    assert pieces == ["Hello ", "ENx", " world", ""]


def test_partial_stop_at_the_end_is_flushed():
    assert feed_all(["END"], ["abc EN"]) == ("abc EN", False, ["abc ", "EN"])


def test_earliest_of_several_stops_wins():
    assert feed_all(["xyz", "b c"], ["a b", " c xyz"])[:2] == ("a ", True)


def test_stops_unchecked_below_min_tokens():
    assert feed_all(["END"], ["aEND"], check=False)[:2] == ("aEND", False)


def test_stop_matcher_random_splits_agree_with_str_find():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 30)))
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        got, stopped, _ = feed_all([stop], pieces)
        i = text.find(stop)
        assert (got, stopped) == ((text[:i], True) if i >= 0 else (text, False)), (text, stop, pieces)


# -- compatibility -----------------------------------------------------------------------------------
def target_caps(**kw) -> target_pb2.TargetCapabilities:
    base = {"protocol_version": 1, "model_id": "t", "vocab_size": 1000, "num_layers": 12, "hidden_size": 64,
                "max_block_size": 16, "tokenizer_hash": "aa", "feature_dtypes": ["bfloat16", "float32"],
                "max_context": 512, "eos_token_ids": [2]}
    return target_pb2.TargetCapabilities(**{**base, **kw})


def draft_caps(**kw) -> draft_pb2.DraftCapabilities:
    fp = common_pb2.ModelFingerprint(vocab_size=1000, hidden_size=64, num_layers=12,
                                     tokenizer_hash="aa")
    base = {"protocol_version": 1, "drafter_kind": "dflash", "block_size": 8, "target_layer_ids": [1, 5, 9],
                "mask_token_id": 999, "hidden_size": 64, "feature_dtype": "bfloat16", "target": fp,
                "max_block_size": 8, "needs_features": True}
    return draft_pb2.DraftCapabilities(**{**base, **kw})


def test_compatible_pair():
    d = compat.check_pair(target_caps(), draft_caps(), 0)
    assert d.ok and d.block_size == 8 and d.max_block_size == 8


def test_block_size_clamped_to_target_max_with_a_note():
    d = compat.check_pair(target_caps(max_block_size=4), draft_caps(max_block_size=16,
                                                                    block_size=16), 0)
    assert d.ok and d.block_size == 4 and "clamped" in d.notes[0]


def test_tree_size_is_what_both_sides_allow():
    both = compat.check_pair(target_caps(max_tree_nodes=255), draft_caps(max_tree_nodes=100), 0, 63)
    assert both.ok and both.tree_nodes == 63 and not both.notes
    small = compat.check_pair(target_caps(max_tree_nodes=31), draft_caps(max_tree_nodes=100), 0, 63)
    assert small.tree_nodes == 31 and "clamped to 31" in small.notes[0]
    chains = compat.check_pair(target_caps(max_tree_nodes=255), draft_caps(), 0, 63)
    assert chains.ok and chains.tree_nodes == 0 and "draft max_tree_nodes 0" in chains.notes[0]
    assert compat.check_pair(target_caps(), draft_caps(), 0).tree_nodes == 0


@pytest.mark.parametrize("target_kw,draft_kw,words", [
    ({"vocab_size": 2000}, {}, ["vocabulary", "1000", "2000"]),
    ({"hidden_size": 128, "vocab_size": 1000}, {"target": common_pb2.ModelFingerprint()},
     ["hidden size", "64", "128"]),
    ({"num_layers": 8}, {"target": common_pb2.ModelFingerprint()}, ["layers", "[9]", "[0, 8)"]),
    ({}, {"mask_token_id": 1000}, ["mask token id 1000"]),
    ({}, {"protocol_version": 2}, ["protocol version 2"]),
    ({"tokenizer_hash": "bb"}, {}, ["tokenizer"]),
    ({"feature_dtypes": ["float32"]}, {}, ["bfloat16"]),
])
def test_incompatible_pairs_are_refused_with_a_reason(target_kw, draft_kw, words):
    d = compat.check_pair(target_caps(**target_kw), draft_caps(**draft_kw), 0)
    assert not d.ok
    text = " ".join(d.problems)
    assert all(w in text for w in words), text


def test_hybrid_target_without_commit_is_refused():
    problems = compat.check_target(target_caps(hybrid=True, mamba_verify_commit=False,
                                               attention_backend="torch"), "")
    assert problems and "mamba_verify_commit=false" in problems[0]
    assert compat.check_target(target_caps(hybrid=True, mamba_verify_commit=True), "") == []


def test_gateway_tokenizer_must_be_the_targets():
    assert "tokenizer" in compat.check_target(target_caps(), "cc")[0]
    assert compat.check_target(target_caps(), "aa") == []
    assert compat.check_target(target_caps(tokenizer_hash=""), "cc") == []   # unknown: no check


# -- request validation ----------------------------------------------------------------------------
LIMITS = Limits(vocab_size=100, max_context=50)


@pytest.mark.parametrize("kw,param,words", [
    ({"prompt_ids": ()}, "prompt", "empty"),
    ({"prompt_ids": (1, 100)}, "prompt", "vocabulary"),
    ({"prompt_ids": tuple(range(50))}, "prompt", "none to generate"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": 48}, "max_tokens", "at most 47"),
    ({"temperature": -0.5}, "temperature", "in [0, 10000]"),
    ({"temperature": float("nan")}, "temperature", "in [0, 10000]"),
    ({"temperature": 1e300}, "temperature", "in [0, 10000]"),
    ({"temperature": 0.5, "top_k": 2**31}, "top_k", "[1, 2147483647]"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "top_k"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens", "max_tokens=5"),
    ({"stop": ("",)}, "stop", "1.."),
    ({"stop_token_ids": (100,)}, "stop_token_ids", "vocabulary"),
    ({"seed": -1}, "seed", "2**64"),
])
def test_bad_requests_name_the_field(kw, param, words):
    req = GenerationRequest(**{"prompt_ids": (1, 2, 3), **kw})
    with pytest.raises(RequestError) as e:
        validate(req, LIMITS)
    assert e.value.param == param and words in str(e.value)


def test_max_tokens_defaults_to_the_room_in_the_context():
    req = validate(GenerationRequest(prompt_ids=(1, 2, 3)), LIMITS)
    assert req.max_tokens == 47 and req.request_id


def test_seed_offset_changes_the_seed_only_on_rebuilds():
    req = GenerationRequest(prompt_ids=(1,), temperature=0.7, seed=5)
    assert req.sampling_pb().seed == 5 and req.sampling_pb(1).seed != 5
    assert not GenerationRequest(prompt_ids=(1,)).sampling_pb().HasField("seed")


# -- feed -----------------------------------------------------------------------------------------------
def _inline(data: bytes, dtype: str, shape: list[int]) -> common_pb2.FeatureChunk:
    return common_pb2.FeatureChunk(inline=common_pb2.TensorData(data=data, dtype=dtype, shape=shape))


def test_feed_keeps_inline_and_plane_chunks_of_consecutive_positions_in_order():
    f = DraftFeed()
    f.append(_inline(b"\x01\x02" * 2, "bfloat16", [1, 2]), [7])
    ref = common_pb2.FeatureRef(plane="p", publication=3, offset=64, rows=2, width=2,
                                dtype="bfloat16")
    f.append(common_pb2.FeatureChunk(ref=ref), [8, 9])
    assert [c.WhichOneof("where") for c in f.chunks] == ["inline", "ref"]
    assert f.positions == [0, 1, 2] and f.token_ids == [7, 8, 9]
    assert f.nbytes == 4                      # what the gateway holds: the inline bytes
    with pytest.raises(ValueError, match="format changed"):
        f.append(_inline(b"\x00" * 4, "float32", [1, 1]), [1])
    with pytest.raises(ValueError, match="2 feature rows for 1 positions"):
        f.append(_inline(b"\x03\x04" * 4, "bfloat16", [2, 2]), [1])
    f.sent()                                  # the draft took them: the next rows continue
    f.append(None, [10, 11])
    assert f.positions == [3, 4] and f.chunks == [] and f.nbytes == 0
    f.reset()                                 # a rebuild: everything again from position 0
    f.append(None, [1, 2, 3])
    assert f.positions == [0, 1, 2]


# -- step shape -----------------------------------------------------------------------------------
def test_speculation_sizes_each_step_within_every_limit():
    spec = Speculation(draft=None, block_size=8, max_block_size=16, generation=1, tree_nodes=63)
    assert spec.block_for(0, remaining=100, room=100) == 8          # the default block
    assert spec.block_for(32, remaining=100, room=100) == 16        # the pair's max
    assert spec.block_for(0, remaining=3, room=100) == 3            # tokens still allowed
    assert spec.block_for(0, remaining=100, room=2) == 2            # room in the context
    assert spec.block_for(0, remaining=0, room=0) == 1              # always the anchor
    assert spec.tree_for(room=100) == 63                            # greedy and sampled alike
    assert spec.tree_for(room=10) == 10
    assert Speculation(None, 8, 16, 1).tree_for(room=100) == 0
