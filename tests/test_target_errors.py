"""Bad input through a real target server: each case answers the right gRPC status with a message
saying what was wrong and what is allowed, and a good request on another sequence still works.

Malformed TensorData is not applicable here: no target request carries a tensor (features only
flow out of the target); tensor_codec.decode is exercised where the draft service accepts them."""
from __future__ import annotations

import itertools

import grpc
import pytest
from support import prom
from support.procs import free_port, start_target
from support.target_client import TargetClient, expect_status

from dflash.v1 import common_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT
MAX_CONTEXT, MAX_BLOCK, PAGE = 48, 8, 4
KV_PAGES = 19                          # 80 KiB / 4 KiB per page (tiny Llama, fp32), minus page 0
_ids = itertools.count()


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, metrics_port):
    proc = start_target(tiny_llama_dir, tmp_path_factory.mktemp("logs"),
                        "--max-context", str(MAX_CONTEXT), "--max-block-size", str(MAX_BLOCK),
                        "--page-size", str(PAGE), "--kv-budget", "80KiB",
                        "--max-message-mib", "1", "--metrics-port", str(metrics_port))
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    c = TargetClient(server.address)
    assert c.capabilities().kv_pages_total == KV_PAGES
    yield c
    c.close()


@pytest.fixture
def still_serves(client):
    """After the test's bad requests, a good one on a fresh sequence works."""
    yield
    seq = f"good{next(_ids)}"
    first = client.prefill(seq, [1, 2, 3]).next_token
    assert len(client.verify(seq, [first, 5]).committed_tokens) >= 1
    assert client.release(seq)


def sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


# case -> (Prefill arguments over a good default, words the message must contain)
BAD_PREFILLS = {
    "token outside vocab": ({"ids": [1, 256, 7]}, ["outside the vocabulary [0, 256)", "[256]"]),
    "empty prompt": ({"ids": []}, ["token_ids is empty", "at least one token"]),
    "prompt past max context": ({"ids": [5] * MAX_CONTEXT},
                                [f"prompt of {MAX_CONTEXT} tokens", f"max context is {MAX_CONTEXT}"]),
    "negative temperature": ({"sampling": sampling(temperature=-0.5)},
                             ["temperature must be in [0, 10000]", "-0.5"]),
    "nan temperature": ({"sampling": sampling(temperature=float("nan"))},
                        ["temperature must be in [0, 10000]", "nan"]),
    "temperature past float32": ({"sampling": sampling(temperature=1e300)},
                                 ["temperature must be in [0, 10000]", "inf"]),
    "top_p zero": ({"sampling": sampling(temperature=1, top_p=0.0)}, ["top_p must be in (0, 1]"]),
    "top_p above one": ({"sampling": sampling(temperature=1, top_p=1.5)},
                        ["top_p must be in (0, 1]", "1.5"]),
    "top_k below -1": ({"sampling": sampling(temperature=1, top_k=-2)},
                       ["top_k must be 0 or -1 (off) or >= 1", "-2"]),
    "stop token outside vocab": ({"sampling": sampling(stop_token_ids=[999])},
                                 ["stop_token_ids [999]", "[0, 256)"]),
    "capture layer past the last": ({"capture_layers": (0, 4)},
                                    ["capture_layers [0, 4]", "[0, 4)"]),
    "capture layer twice": ({"capture_layers": (1, 1)}, ["distinct", "[0, 4)"]),
    "feature dtype": ({"capture_layers": (1,), "feature_dtype": "int8"},
                      ["'int8'", "allowed", "bfloat16", "float32"]),
    "num_generated past prompt": ({"num_generated": 4}, ["num_generated 4", "3 tokens"]),
    "empty sequence id": ({"seq": ""}, ["sequence_id", "1-128 characters"]),
    "bad sequence id": ({"seq": "a b/c"}, ["sequence_id 'a b/c'", "[A-Za-z0-9._:-]"]),
}


@pytest.mark.parametrize("case", list(BAD_PREFILLS))
def test_bad_prefill(client, still_serves, case):
    kw, words = BAD_PREFILLS[case]
    kw = {"seq": f"bad{next(_ids)}", "ids": [1, 2, 3], **kw}
    expect_status(lambda: client.prefill(kw.pop("seq"), kw.pop("ids"), **kw), INVALID, *words)


def test_near_zero_temperature_is_greedy_and_harms_no_neighbour(client, still_serves):
    """T = 1e-40 (finite, accepted) divided logits to inf and sampling to NaN, failing every
    sequence in the batch: below 1e-5 a sequence is greedy now (min_tokens too)."""
    def generate(temperature: float) -> list[int]:
        seq = f"tiny{next(_ids)}"
        out = [client.prefill(seq, [1, 2, 3], sampling(temperature=temperature,
                                                        min_tokens=4)).next_token]
        while len(out) < 8:
            out += client.verify(seq, [out[-1], 5, 6]).committed_tokens
        assert client.release(seq)
        return out[:8]

    greedy = generate(0.0)
    for t in (1e-40, 1e-45, 1e-6):
        assert generate(t) == greedy


def test_bad_verify_blocks(client, still_serves):
    client.prefill("v", [1, 2, 3, 4])
    expect_status(lambda: client.verify("v", [7, 300]), INVALID,
                  "outside the vocabulary [0, 256)", "[300]")
    expect_status(lambda: client.verify("v", []), INVALID, "0 tokens", f"allowed 1..{MAX_BLOCK}")
    expect_status(lambda: client.verify("v", [7] * (MAX_BLOCK + 1)), INVALID,
                  f"{MAX_BLOCK + 1} tokens", f"allowed 1..{MAX_BLOCK}",
                  f"up to {MAX_BLOCK - 1} drafts")
    assert client.verify("v", [7] * MAX_BLOCK).seq_len >= 5       # the sequence is unharmed
    assert client.release("v")


def test_verify_past_max_context(client, still_serves):
    n = MAX_CONTEXT - 4
    client.prefill("long", [5] * n)
    expect_status(lambda: client.verify("long", [7] * 6), INVALID,
                  f"verify of 6 tokens at position {n}", f"max context {MAX_CONTEXT}",
                  "at most 4 fit")
    v = client.verify("long", [7, 8, 9, 10])                      # 4 still fit
    assert v.seq_len == n + v.accepted + 1
    assert client.release("long")


def test_unknown_and_released_sequences(client, still_serves):
    expect_status(lambda: client.verify("never-seen", [1]), grpc.StatusCode.NOT_FOUND,
                  "unknown sequence 'never-seen'", "Prefill it again")
    client.prefill("gone", [1, 2, 3])
    assert client.release("gone") is True
    expect_status(lambda: client.verify("gone", [1]), grpc.StatusCode.NOT_FOUND,
                  "unknown sequence 'gone'", "released")
    assert client.release("gone") is False                        # Release is idempotent
    expect_status(lambda: client.verify("", [1]), INVALID, "sequence_id", "1-128 characters")


def test_oversized_message(client, still_serves):
    """More than --max-message-mib (1 MiB): ~1.2 MB of token ids."""
    expect_status(lambda: client.prefill("huge", [200] * 600_000),
                  grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max", str(1 << 20))


def test_kv_full_then_released(client, still_serves, metrics_port):
    usage = lambda: prom.value(metrics_port, "dflash_kv_cache_usage_ratio")
    assert usage() == 0
    client.prefill("a", [5] * 40)                                 # 10 of 19 pages
    expect_status(lambda: client.prefill("b", [6] * 40), grpc.StatusCode.RESOURCE_EXHAUSTED,
                  "KV cache full", "10 more pages needed", "9 free", f"of {KV_PAGES}")
    expect_status(lambda: client.verify("b", [1]), grpc.StatusCode.NOT_FOUND, "'b'")  # no half-built b
    short = client.prefill("c", [7] * 36)                         # 9 pages: the pool is full now
    assert usage() == 1.0
    expect_status(lambda: client.verify("a", [1, 2, 3, 4]), grpc.StatusCode.RESOURCE_EXHAUSTED,
                  "KV cache full", "1 more pages needed", "0 free")
    assert client.release("c") and short.seq_len == 36
    v = client.verify("a", [1, 2, 3, 4])                          # the sequence survived
    assert v.seq_len == 40 + v.accepted + 1
    assert client.release("a")
    client.prefill("b", [6] * 40)                                 # room again
    assert client.release("b")
    assert usage() == 0
