"""The target's prefix cache through its gRPC service (tiny Llama, pages of 4 tokens): a later
prompt reuses the pages of an earlier sequence's committed tokens, prompt and generated ones,
and decodes exactly what a target without the cache decodes; features_from bounds the reuse
when the draft needs features; the counters count tokens."""
from __future__ import annotations

import grpc
import pytest
import torch
from support import prom
from support.procs import free_port, start_target
from support.target_client import TargetClient, expect_status

from services.common import tensor_codec

PAGE = 4
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(40)]          # 10 full pages


@pytest.fixture(scope="module")
def targets(tiny_llama_dir, tmp_path_factory):
    """(with the cache, its metrics port), without the cache."""
    port = free_port()
    common = ("--page-size", str(PAGE), "--kv-budget", "2MiB")
    on = start_target(tiny_llama_dir, tmp_path_factory.mktemp("on"), *common,
                      "--metrics-port", str(port))
    off = start_target(tiny_llama_dir, tmp_path_factory.mktemp("off"), *common,
                       "--enable-prefix-caching", "off")
    clients = TargetClient(on.address), TargetClient(off.address)
    yield clients[0], port, clients[1]
    for c in clients:
        c.close()
    assert on.stop() == 0 and off.stop() == 0


def decode(client: TargetClient, seq: str, prompt: list[int], steps: int, **prefill) -> tuple:
    """Greedy: the Prefill's answer and `steps` one-token verifies; (response, tokens)."""
    first = client.prefill(seq, prompt, **prefill)
    tokens = [first.next_token]
    for _ in range(steps):
        tokens += list(client.verify(seq, [tokens[-1]]).committed_tokens)
    return first, tokens


def hits(port: int) -> float:
    return prom.value(port, "dflash_prefix_cache_hits_total", service="target")


def test_capabilities_say_whether_prefixes_are_cached(targets):
    on, _, off = targets
    assert on.capabilities().prefix_caching and not off.capabilities().prefix_caching


def test_a_later_turn_reuses_prompt_and_generated_pages_and_decodes_the_same(targets):
    on, port, off = targets
    before = hits(port)
    first, turn1 = decode(on, "turn1", PROMPT, 8)
    assert first.cached_tokens == 0
    assert on.release("turn1")                 # its pages stay cached: positions 0..47
    turn2 = PROMPT + turn1[:6] + [11, 12, 13]  # 49 tokens; the cached ones cover 0..43
    resp, cached = decode(on, "turn2", turn2, 12)
    ref_resp, ref = decode(off, "turn2", turn2, 12)
    assert (resp.cached_tokens, ref_resp.cached_tokens) == (44, 0)
    assert cached == ref and resp.seq_len == ref_resp.seq_len == len(turn2)
    assert hits(port) - before == 44
    assert on.release("turn2") and off.release("turn2")
    _, again = decode(on, "turn1-again", PROMPT, 8)          # the first prompt once more
    assert again == turn1
    on.release("turn1-again")


def test_features_from_bounds_the_reuse_and_the_rows_answered(targets):
    """A draft that holds positions below features_from gets the features of the rest only,
    and the target reuses cached KV only below it (cached positions compute no features)."""
    on, _, off = targets
    decode(on, "warm", PROMPT, 0)
    on.release("warm")
    layers = (0, 1)
    ref = off.prefill("f", PROMPT, capture_layers=layers, feature_dtype="float32")
    full = tensor_codec.decode(ref.features)
    none = on.prefill("f0", PROMPT, capture_layers=layers, feature_dtype="float32")
    assert none.cached_tokens == 0 and tensor_codec.decode(none.features).shape == full.shape
    part = on.prefill("f22", PROMPT, capture_layers=layers, feature_dtype="float32",
                      features_from=22)
    assert part.cached_tokens == 20                          # 5 pages, below 22
    rows = tensor_codec.decode(part.features)
    assert rows.shape[0] == len(PROMPT) - 22
    torch.testing.assert_close(rows, full[22:], rtol=1e-4, atol=1e-4)
    assert part.next_token == ref.next_token
    for c, seq in ((on, "f0"), (on, "f22"), (off, "f")):
        c.release(seq)
    expect_status(lambda: on.prefill("bad", PROMPT, features_from=len(PROMPT) + 1),
                  grpc.StatusCode.INVALID_ARGUMENT, "features_from 41 is past the prompt's 40")


def test_without_the_cache_nothing_is_reused(targets):
    _, _, off = targets
    decode(off, "x", PROMPT, 2)
    off.release("x")
    first, _ = decode(off, "y", PROMPT, 0)
    assert first.cached_tokens == 0
    off.release("y")


def test_chunked_prefills_answer_exactly_the_rows_from_features_from(tiny_llama_dir):
    """In process, a prompt prefilled in chunks of 16 with features_from in the middle of its
    second chunk, after a first sequence cached its pages: the rows answered are those of a
    whole uncached prefill from features_from on, and the cached pages are below it."""
    from support.inproc_target import loaded_worker, run, started_engine

    from runtime.sampling import SamplingConfig
    from services.target.calls import PrefillCall
    worker = loaded_worker(tiny_llama_dir, prefix_caching=True, token_budget=16,
                           max_block_size=8)
    engine = started_engine(worker)
    prompt = PROMPT + PROMPT[:9]                              # 49 tokens, 4 chunks
    try:
        def prefill(seq: str, features_from: int):
            return run(engine.prefill(PrefillCall(seq, prompt, SamplingConfig(), (0, 1),
                                                  torch.float32, features_from=features_from)))
        whole = prefill("whole", 0)
        assert whole.cached_tokens == 0 and whole.features.shape[0] == len(prompt)
        run(engine.release("whole"))
        part = prefill("part", 22)
        assert part.cached_tokens == 20 and part.next_token == whole.next_token
        torch.testing.assert_close(part.features, whole.features[22:], rtol=1e-4, atol=1e-4)
        none = prefill("none", len(prompt))                  # a rebuild: no rows wanted
        assert none.cached_tokens == 48 and none.features.shape[0] == 0
    finally:
        engine.stop()
