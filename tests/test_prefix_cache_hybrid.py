"""Prefix caching on a hybrid (Mamba2 + attention) target: a cached prefix's KV pages come with
the recurrent state at its end (runtime/state_checkpoints.py), kept where a prompt's last full
page ends and at every page boundary a verify commits past; a later prompt's output equals
transformers' greedy decoding with speculative verifies of partial accepts, and without the
restored state it would not. No checkpoint: a miss, never a wrong state."""
from __future__ import annotations

import pytest
from support.hybrid import hf_greedy, hf_model, make_tiny_hybrid, speculate
from support.procs import start_target
from support.target_client import TargetClient

SMALL = ("--page-size", "4", "--kv-budget", "16MiB", "--max-block-size", "8")
PROMPT = [1, 17, 42, 99, 7, 3, 250, 18, 64, 5, 77, 120, 9, 31, 200, 11, 88, 6, 143, 29, 51, 2]
N = 30


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp("tiny_bamba"))


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    model = hf_model(hybrid_dir)
    return lambda prompt, n=N: hf_greedy(model, prompt, n)


@pytest.fixture(scope="module")
def client(hybrid_dir, tmp_path_factory):
    proc = start_target(hybrid_dir, tmp_path_factory.mktemp("logs"), *SMALL)
    c = TargetClient(proc.address)
    yield c
    c.close()
    assert proc.stop() == 0


def test_a_later_turn_restores_the_state_where_its_cached_prefix_ends(client, reference):
    assert client.capabilities().prefix_caching
    first = reference(PROMPT)
    out, partial = speculate(client, "turn1", PROMPT, first, N)   # released at its end
    assert out == first and partial >= 3
    turn2 = PROMPT + out[:17] + [4, 6, 8]                  # 42 tokens
    same = next(i for i, (a, b) in enumerate(zip(turn2, PROMPT + out)) if a != b)
    resp = client.prefill("turn2", turn2)
    # the full pages turn 1 committed that turn 2 starts with, and a checkpoint at their end
    # (36 unless out[17] happens to be 3: a verify's boundary, found in its verify slot or at
    # its last committed row), well past the first prompt
    assert resp.cached_tokens == min(same, len(turn2) - 1) // 4 * 4 >= 36
    client.release("turn2")
    expected = reference(turn2)
    got, partial = speculate(client, "turn2", turn2, expected, N)
    assert got == expected and partial >= 3


def test_a_prompts_last_full_page_is_kept_by_its_prefill(client, reference):
    prompt = [5, 9] + PROMPT[:21]                          # 23 tokens: its chunk is cut at 20
    assert client.prefill("p", prompt).cached_tokens == 0
    client.release("p")
    longer = prompt + [60, 61]
    assert client.prefill("q", longer).cached_tokens == 20
    client.release("q")
    expected = reference(longer)
    assert speculate(client, "q", longer, expected, N)[0] == expected


def test_without_the_restored_state_the_output_is_wrong(hybrid_dir, reference, monkeypatch):
    """In process: the pages of the cached prefix with the sequence's fresh (zero) recurrent
    state instead of the checkpoint's - the output differs from transformers."""
    from support.inproc_target import loaded_worker, run, started_engine

    from runtime.sampling import SamplingConfig
    from runtime.state_checkpoints import StateCheckpoints
    from services.target.calls import PrefillCall

    def greedy(engine, seq: str, prompt: list[int], n: int) -> tuple[int, list[int]]:
        first = run(engine.prefill(PrefillCall(seq, prompt, SamplingConfig(), (), None)))
        out = [first.next_token]
        while len(out) < n:
            out += run(engine.verify(seq, [out[-1]])).committed
        run(engine.release(seq))
        return first.cached_tokens, out

    monkeypatch.setattr(StateCheckpoints, "restore", lambda self, key, slot: None)
    worker = loaded_worker(hybrid_dir, prefix_caching=True, max_block_size=8,
                           kv_budget_bytes=16 << 20)
    engine = started_engine(worker)
    try:
        assert greedy(engine, "a", PROMPT, 4) == (0, reference(PROMPT, 4))
        cached, out = greedy(engine, "b", PROMPT + [70], 12)
        assert cached == 20 and out != reference(PROMPT + [70], 12)
    finally:
        engine.stop()


def test_no_checkpoints_no_prefix_caching(hybrid_dir, tmp_path):
    proc = start_target(hybrid_dir, tmp_path, *SMALL, "--prefix-state-checkpoints", "0")
    c = TargetClient(proc.address)
    try:
        assert not c.capabilities().prefix_caching
        c.greedy("a", PROMPT, 4)
        assert c.prefill("b", PROMPT).cached_tokens == 0
        c.release("b")
        assert "prefix caching is off for this hybrid model" in proc.log()
    finally:
        c.close()
        assert proc.stop() == 0


def test_checkpoints_fit_in_a_quarter_of_the_budget_beside_the_state_pool(hybrid_dir):
    """A budget sized for the state pool and its pages still starts: fewer checkpoints (none
    when not even one fits: then no prefix caching for it), never a refusal."""
    from runtime.state_pool import MambaStatePool
    from services.target.config import TargetConfig
    from services.target.worker import TargetWorker

    def worker(budget: int) -> TargetWorker:
        w = TargetWorker(TargetConfig(model_dir=str(hybrid_dir), page_size=4, max_block_size=8,
                                      kv_budget_bytes=budget, state_slots=2,
                                      prefix_caching=True))
        w.alloc_memory_pools()
        return w
    pool = worker(16 << 20).state_pool
    assert isinstance(pool, MambaStatePool)
    per_state = pool.bytes_per_state
    assert pool.nbytes == per_state * (pool.num_slots + pool.num_verify_slots * 8)
    roomy = worker(16 << 20)
    assert roomy.state_checkpoints.capacity == 16 and roomy.prefix_caching
    tight = worker(pool.nbytes + 12 * per_state)
    assert tight.state_checkpoints.capacity == 3 and tight.prefix_caching
    none = worker(pool.nbytes + 3 * per_state)
    assert none.state_checkpoints is None and not none.prefix_caching
