"""Verify: greedy acceptance (all, none, some drafts right), KV state after a partial accept,
continuous batching of concurrent sequences, lossless rejection sampling, top-k / top-p /
min_tokens, and the features of prefill and verify. A tiny random Llama (fp32) whose weights
are large enough that its greedy path does not just repeat one token; the real server where the
wire matters, the engine in-process where the inside must be looked at."""
from __future__ import annotations

import asyncio
import json
import math
import shutil
import threading

import pytest
import torch
from support import prom
from support.inproc_target import (
    assert_same_continuation,
    batch_logits,
    greedy_then_prefill,
    loaded_worker,
    run,
    started_engine,
)
from support.procs import free_port, start_target
from support.target_client import TargetClient
from support.tiny_models import TINY_PROMPT as PROMPT
from support.tiny_models import TINY_VOCAB as VOCAB
from support.tiny_models import wrong

from dflash.v1 import common_pb2
from runtime.acceptance import rejection_accept
from runtime.kv_cache import PageTable
from runtime.sampling import SamplingConfig, target_probs
from services.common.engine_loop import Work
from services.common.tensor_codec import decode
from services.target.engine import PrefillCall, TargetEngine, VerifyCall

PROMPTS_8 = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
             for n in (5, 17, 33, 64, 90, 11, 45, 120)]     # 90 and 120 > token budget: chunked
SAMPLE_T, SAMPLE_K = 1.0, 8            # p(top) ~0.7 at the sampling context: peaked, not one-hot


@pytest.fixture(scope="module")
def model_dir(tiny_llama_02_dir):
    return tiny_llama_02_dir


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, metrics_port):
    proc = start_target(model_dir, tmp_path_factory.mktemp("logs"), "--page-size", "4",
                        "--token-budget", "64", "--max-block-size", "16", "--kv-budget", "8MiB",
                        "--metrics-port", str(metrics_port))
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    c = TargetClient(server.address)
    yield c
    c.close()


@pytest.fixture(scope="module")
def greedy_ref(client) -> list[int]:
    """The model's own greedy continuation of PROMPT, one token per Verify."""
    return client.greedy("greedy-ref", PROMPT, 16)


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# -- greedy acceptance ---------------------------------------------------------------------

def test_all_drafts_right(client, greedy_ref):
    g = greedy_ref
    assert client.prefill("all", PROMPT).next_token == g[0]
    v = client.verify("all", g[0:8])                         # anchor + 7 right drafts
    assert (v.accepted, list(v.committed_tokens), v.seq_len) == (7, g[1:9], len(PROMPT) + 8)
    v = client.verify("all", g[8:11])
    assert (v.accepted, list(v.committed_tokens)) == (2, g[9:12])
    assert client.release("all")


def test_no_draft_right(client, greedy_ref):
    g = greedy_ref
    client.prefill("none", PROMPT)
    v = client.verify("none", [g[0], wrong(g[1]), g[2], g[3]])
    assert (v.accepted, list(v.committed_tokens), v.seq_len) == (0, [g[1]], len(PROMPT) + 1)
    assert list(client.verify("none", [g[1]]).committed_tokens) == [g[2]]
    client.release("none")


def test_some_drafts_right_and_rejected_kv_never_leaks(client, greedy_ref):
    g = greedy_ref
    client.prefill("some", PROMPT)
    v = client.verify("some", [g[0], g[1], g[2], g[3], wrong(g[4]), g[5], g[6], g[7]])
    assert (v.accepted, list(v.committed_tokens), v.seq_len) == (3, g[1:5], len(PROMPT) + 4)
    # decoding on from the accepted prefix gives the greedy continuation: positions 4..7 of
    # the rejected block are overwritten, not attended
    out = list(v.committed_tokens)
    while len(out) < 12:
        out.extend(client.verify("some", [out[-1]]).committed_tokens)
    assert out == g[1:13]
    client.release("some")


def test_anchor_only_verify_is_plain_greedy_decoding(client, model_dir):
    ref = hf_model(model_dir)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(16):                  # full recomputation, argmax: plain greedy
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    assert client.greedy("plain", PROMPT, 16) == ids[len(PROMPT):]


def test_kv_after_partial_accept_equals_one_by_one(model_dir):
    worker = loaded_worker(model_dir, page_size=4)
    engine = started_engine(worker)
    try:
        g = greedy_then_prefill(engine, PROMPT, 7, ("block", "steps"))
        v = run(engine.verify("block", [g[0], g[1], g[2], g[3], wrong(g[4]), g[5], g[6]]))
        assert (v.accepted, v.committed) == (3, g[1:5])
        for k in range(4):
            assert run(engine.verify("steps", [g[k]])).committed == [g[k + 1]]
        assert_same_continuation(worker, engine.seqs["block"], engine.seqs["steps"],
                                 len(PROMPT) + 4, g[4], g[5])
    finally:
        engine.stop()


def test_calls_of_one_sequence_in_flight_together_run_in_order(model_dir):
    """Engine iterations driven by hand (the engine loop's contract: work a step leaves
    unfinished is offered again next iteration). A Verify that arrives while its Prefill is
    between chunks, and a second Verify of the same sequence, wait instead of writing the same
    KV positions. (No prefix caching: the second prompt would find the first one's pages and
    run in one chunk.)"""
    worker = loaded_worker(model_dir, token_budget=64, prefix_caching=False)
    engine = TargetEngine(worker)                          # its thread is not started
    loop = asyncio.new_event_loop()
    prompt = PROMPTS_8[7]                                  # 120 tokens: two prefill chunks

    def work(kind, seq, payload, cost):
        return Work(kind, seq, payload, cost, splittable=kind == "prefill", loop=loop,
                    future=loop.create_future())

    def step(*batch):
        engine._step(list(batch))
        loop.run_until_complete(asyncio.sleep(0))          # deliver the results
        return [w.future.result() if w.future.done() else None for w, _ in batch]

    try:
        ref = work("prefill", "ref", PrefillCall("ref", prompt, SamplingConfig(), (), torch.float32), 120)
        g = [step((ref, 120))[0].next_token]
        for _ in range(3):
            g += step((work("verify", "ref", VerifyCall([g[-1]]), 1), 1))[0].committed
        p = work("prefill", "dup", PrefillCall("dup", prompt, SamplingConfig(), (), torch.float32), 120)
        v1, v2 = work("verify", "dup", VerifyCall([g[0]]), 1), work("verify", "dup", VerifyCall([g[1]]), 1)
        assert step((p, 64)) == [None]                     # first chunk
        assert step((v1, 1), (v2, 1), (p, 56))[:2] == [None, None]   # both wait for the prefill
        assert p.future.result().next_token == g[0]
        r1, r2 = step((v1, 1), (v2, 1))                   # one forward per sequence per step
        assert (r1.committed, r2) == ([g[1]], None)
        (r2,) = step((v2, 1))
        assert (r2.committed, r2.seq_len) == ([g[2]], len(prompt) + 2)
        # A Release behind a Verify of its sequence in one iteration waits for that forward
        # (found by the soak test: releasing first freed the pages the Verify was about to use,
        # and the forward failed with INTERNAL).
        v3, rel = work("verify", "dup", VerifyCall([g[2]]), 1), work("release", "dup", None, 0)
        r3, gone = step((v3, 1), (rel, 0))
        assert (r3.committed, gone) == ([g[3]], None)
        assert step((rel, 0)) == [True] and "dup" not in engine.seqs
    finally:
        loop.close()


def test_eight_concurrent_sequences_batched_equal_one_at_a_time(client, metrics_port):
    n_tokens = 16
    alone = [client.greedy(f"alone{i}", p, n_tokens) for i, p in enumerate(PROMPTS_8)]
    forwards_before = prom.value(metrics_port, "dflash_forward_seconds_count")
    barrier = threading.Barrier(len(PROMPTS_8))
    results: dict[int, list[int]] = {}
    verifies: dict[int, int] = {}
    errors: list[Exception] = []

    def one(i: int) -> None:
        try:
            barrier.wait()
            seq, ref = f"conc{i}", alone[i]
            out = [client.prefill(seq, PROMPTS_8[i]).next_token]
            step = 0
            while len(out) < n_tokens:      # blocks of 1..6 from the known answer, one wrong
                size = 1 + (i + step) % 6
                block = [out[-1]] + ref[len(out): len(out) + size - 1]
                bad = (i + step) % 3        # which draft is corrupted (past the end: none)
                if 1 <= bad < len(block):
                    block[bad] = wrong(block[bad])
                v = client.verify(seq, block)
                assert v.accepted == (bad - 1 if 1 <= bad < len(block) else len(block) - 1)
                out.extend(v.committed_tokens)
                step += 1
            results[i], verifies[i] = out[:n_tokens], step
            client.release(seq)
        except Exception as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS_8))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [results[i] for i in range(len(PROMPTS_8))] == alone
    forwards = prom.value(metrics_port, "dflash_forward_seconds_count") - forwards_before
    # run alone, each prefill chunk and each verify would be a forward of its own
    alone_forwards = sum(math.ceil(len(p) / 64) for p in PROMPTS_8) + sum(verifies.values())
    assert forwards < alone_forwards, "concurrent work was not batched into shared forwards"


# -- sampling -------------------------------------------------------------------------------

def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's test of observed counts [V] against probabilities [V]; bins with a small
    expectation are merged into one. Returns the p-value."""
    expected = probs.double() * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def block_probs(model_dir):
    """Target probabilities at PROMPT + [anchor] and at the position after a draft token."""
    worker = loaded_worker(model_dir)
    cfg = SamplingConfig(temperature=SAMPLE_T, top_k=SAMPLE_K)
    anchor = 33
    p0 = target_probs(batch_logits(worker, [(PageTable(), 0, PROMPT + [anchor])])[0][-1:], cfg)[0]
    ranked = p0.argsort(descending=True).tolist()
    out = {}
    for name, draft in (("likely", ranked[0]), ("unlikely", ranked[2])):
        logits = batch_logits(worker, [(PageTable(), 0, PROMPT + [anchor, draft])])[0][-2:]
        out[name] = (anchor, draft, target_probs(logits, cfg))
    return out


@pytest.mark.parametrize("which", ["likely", "unlikely"])
def test_rejection_sampling_preserves_the_target_distribution(block_probs, which):
    _, draft, probs = block_probs[which]                   # probs [2, V]: rows at anchor, draft
    assert 0.02 < probs[0, draft] < 0.8, "the draft should be neither certain nor impossible"
    gen = torch.Generator().manual_seed(1234)
    n = 20_000
    first = torch.zeros(VOCAB, dtype=torch.long)
    second = torch.zeros(VOCAB, dtype=torch.long)
    naive = torch.zeros(VOCAB, dtype=torch.long)
    for _ in range(n):
        acc = rejection_accept([draft], probs, gen)
        first[acc.tokens[0]] += 1
        if acc.accepted:
            second[acc.tokens[1]] += 1
        # a plausible wrong rule (bonus from p itself, not the residual) as a power check
        rejected = torch.rand((), generator=gen) >= probs[0, draft]
        naive[int(torch.multinomial(probs[0], 1, generator=gen)) if rejected else draft] += 1
    assert chi_square_p(first, probs[0]) > 1e-3
    assert chi_square_p(second, probs[1]) > 1e-3         # after an accept: the next position's p
    assert chi_square_p(naive, probs[0]) < 1e-3            # the test can tell a wrong rule apart
    assert abs(second.sum() / n - probs[0, draft]) < 0.02


def test_sampling_through_grpc(client, block_probs):
    """Verify draws through the server (one seed per draw) follow the target distribution,
    and a seed makes a draw reproducible."""
    anchor, draft, probs = block_probs["likely"]
    sampling = lambda seed: common_pb2.SamplingParams(temperature=SAMPLE_T, top_k=SAMPLE_K,
                                                      seed=seed)
    firsts = []
    for seed in range(300):
        client.prefill("draw", PROMPT, sampling(seed))
        firsts.append(client.verify("draw", [anchor, draft]).committed_tokens[0])
    second = int(probs[0].argsort(descending=True)[1])
    bins = lambda t: 0 if t == draft else 1 if t == second else 2
    counts = torch.bincount(torch.tensor([bins(t) for t in firsts]), minlength=3)
    p = torch.stack([probs[0, draft], probs[0, second], 1 - probs[0, draft] - probs[0, second]])
    assert chi_square_p(counts, p, min_expected=0) > 1e-3
    again = []
    for _ in range(2):
        client.prefill("draw", PROMPT, sampling(7))
        again.append(list(client.verify("draw", [anchor, draft, 5, 6]).committed_tokens))
    assert again[0] == again[1]
    client.release("draw")


def test_top_k_and_top_p(block_probs, client, greedy_ref):
    _, _, probs = block_probs["likely"]
    assert int((probs[0] > 0).sum()) == SAMPLE_K                   # top-k keeps k tokens
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    full = torch.softmax(logits, -1)[0]
    kept = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))[0]
    # p = 0.56, 0.21, 0.13, ...: the smallest prefix reaching 0.8 has 3 tokens (0.90)
    assert torch.allclose(kept, torch.cat([full[:3] / full[:3].sum(), torch.zeros(2)]))
    # on the server, top_k=1 or a tiny top_p turn sampling into greedy decoding
    g = greedy_ref
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        for seed in (1, 2):
            s = common_pb2.SamplingParams(temperature=1.0, seed=seed, **params)
            assert client.prefill("topk", PROMPT, s).next_token == g[0]
            v = client.verify("topk", g[0:6])           # p(draft) = 1: every draft accepted
            assert (v.accepted, list(v.committed_tokens)) == (5, g[1:7])
    client.release("topk")


def test_min_tokens_suppresses_stop_tokens_through_grpc(client, greedy_ref):
    g = greedy_ref
    assert g[0] != g[1]
    stop = lambda min_tokens: common_pb2.SamplingParams(min_tokens=min_tokens,
                                                        stop_token_ids=[g[1]])
    for min_tokens, allowed in ((0, True), (1, True), (2, False), (5, False)):
        client.prefill("mt", PROMPT, stop(min_tokens))     # output 0: g[0], not a stop token
        v = client.verify("mt", [g[0], g[1]])              # row 0 predicts output 1
        assert (v.committed_tokens[0] == g[1]) == allowed, min_tokens
    # a rebuild: num_generated says how many prompt tokens were outputs already
    rebuilt = PROMPT + [g[0]]
    for num_generated, min_tokens, allowed in ((1, 1, True), (0, 1, False), (1, 2, False)):
        r = client.prefill("mt", rebuilt, stop(min_tokens), num_generated=num_generated)
        assert (r.next_token == g[1]) == allowed
    client.release("mt")


def test_min_tokens_suppresses_the_models_eos(model_dir, tmp_path):
    """The model's own eos id (config.json) is suppressed until min_tokens outputs exist."""
    base = loaded_worker(model_dir)
    logits = batch_logits(base, [(PageTable(), 0, PROMPT)])[0][-1]
    top, runner_up = logits.argsort(descending=True)[:2].tolist()
    model = tmp_path / "eos_is_greedy"
    shutil.copytree(model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = top                              # the greedy first token is eos now
    (model / "config.json").write_text(json.dumps(cfg))
    engine = started_engine(loaded_worker(model))
    try:
        for min_tokens, expected in ((0, top), (1, runner_up), (3, runner_up)):
            call = PrefillCall(f"eos{min_tokens}", PROMPT, SamplingConfig(min_tokens=min_tokens),
                               (), torch.float32)
            assert run(engine.prefill(call)).next_token == expected
    finally:
        engine.stop()


# -- features -------------------------------------------------------------------------------

def hf_hidden(model_dir, ids: list[int], layers: list[int]) -> torch.Tensor:
    """transformers' hidden_states[i + 1] for each layer i, concatenated: [len(ids), K*H]."""
    with torch.no_grad():
        hs = hf_model(model_dir)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layers], dim=-1)


def test_prefill_and_verify_features_equal_hidden_states(client, model_dir, greedy_ref):
    prompt = PROMPTS_8[7]                          # 120 tokens: prefilled in two chunks
    layers = [2, 0, 3]                             # any order; 3 is the last layer
    g = client.greedy("feat-ref", prompt, 6)
    ref = hf_hidden(model_dir, prompt + g[:5], layers)
    r = client.prefill("feat", prompt, capture_layers=layers)
    bf16 = decode(r.features)
    assert r.features.dtype == "bfloat16" and bf16.shape == (len(prompt), 3 * 64)
    torch.testing.assert_close(bf16.float(), ref[:len(prompt)], rtol=2 ** -7, atol=1e-5)
    r32 = client.prefill("feat", prompt, capture_layers=layers, feature_dtype="float32")
    f32 = decode(r32.features)
    assert f32.dtype == torch.float32
    # fp32 rounding, relative to the scale of the residual stream (|h| up to ~10 here)
    assert (f32 - ref[:len(prompt)]).abs().max() <= 1e-5 * ref.abs().max()
    v = client.verify("feat", [g[0], g[1], g[2], wrong(g[3])])
    assert v.accepted == 2
    feats = decode(v.features)                     # block positions 0..a: anchor + accepted
    n = len(prompt)
    assert feats.shape == (3, 3 * 64)
    torch.testing.assert_close(feats.float(), ref[n: n + 3], rtol=2 ** -7, atol=1e-5)
    no_features = client.prefill("feat", prompt)
    assert not no_features.HasField("features")
    client.release("feat")
