"""Penalties inside the verify (runtime/penalties.py), through the real target server (tiny
random Llama, fp32): greedy with repetition / presence / frequency penalties equals the reference
loop over transformers' logits token for token, whether the tokens come one per Verify or as
accepted drafts of a chain or a tree (each row counts the drafts before it); bad values are
INVALID_ARGUMENT."""
from __future__ import annotations

import grpc
import pytest
import torch
from support.procs import start_target
from support.target_client import TargetClient, expect_status
from support.tiny_models import TINY_PROMPT as PROMPT
from support.tiny_models import wrong

from dflash.v1 import common_pb2

N = 24
CASES = {
    "repetition": {"repetition_penalty": 1.6},
    "presence-frequency": {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    "negative-presence": {"presence_penalty": -1.5},          # repeats: drafts count twice
    "all": {"repetition_penalty": 0.7, "presence_penalty": -0.5, "frequency_penalty": 1.2},
}


@pytest.fixture(scope="module")
def client(tiny_llama_02_dir, tmp_path_factory):
    proc = start_target(tiny_llama_02_dir, tmp_path_factory.mktemp("logs"), "--page-size", "4",
                        "--max-block-size", "16", "--kv-budget", "8MiB")
    c = TargetClient(proc.address)
    yield c
    c.close()
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def model(tiny_llama_02_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_02_dir)).eval()


def reference(model, penalties: dict, n: int) -> list[int]:
    """Greedy decoding over transformers' logits with vLLM's penalties: repetition over prompt
    and output, then presence and frequency over the output."""
    rep = penalties.get("repetition_penalty", 1.0)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + out])).logits[0, -1].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[PROMPT + out] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        counts = torch.zeros_like(logits)
        for t in out:
            counts[t] += 1
        logits = logits - penalties.get("presence_penalty", 0.0) * (counts > 0) \
            - penalties.get("frequency_penalty", 0.0) * counts
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_penalized_greedy_equals_the_reference_one_step_at_a_time_and_with_drafts(
        client, model, case):
    penalties = CASES[case]
    ref = reference(model, penalties, N)
    assert len(set(ref)) > 3, "the case should not be degenerate"
    sampling = common_pb2.SamplingParams(**penalties)
    assert client.greedy(f"one-{case}", PROMPT, N) != ref        # the penalties matter
    out = [client.prefill(f"one-{case}", PROMPT, sampling).next_token]
    while len(out) < N:
        out.extend(client.verify(f"one-{case}", [out[-1]]).committed_tokens)
    assert out[:N] == ref
    client.release(f"one-{case}")
    # chains of drafts: the reference with a wrong token every fourth position
    seq = f"spec-{case}"
    out = [client.prefill(seq, PROMPT, sampling).next_token]
    while len(out) < N:
        k = len(out)
        drafts = [ref[i] if (i + 1) % 4 else wrong(ref[i]) for i in range(k, min(k + 5, N))]
        out.extend(client.verify(seq, [out[-1]] + drafts).committed_tokens)
    assert out[:N] == ref
    client.release(seq)


def test_a_tree_counts_each_nodes_own_path(client, model):
    """Decoy siblings carry tokens the path has not produced yet: counted in a decoy's row only,
    never in the path's rows."""
    penalties = CASES["presence-frequency"]
    ref = reference(model, penalties, 8)
    sampling = common_pb2.SamplingParams(**penalties)
    anchor = client.prefill("tree", PROMPT, sampling).next_token
    assert anchor == ref[0]
    # nodes: 1 decoy (= ref[2]) and 2 (= ref[1]) under the anchor, 3 (= ref[2]) under 2,
    # 4 (= ref[3]) under 3
    tokens = [ref[2] if ref[2] != ref[1] else wrong(ref[1]), ref[1], ref[2], ref[3]]
    v = client.verify("tree", [anchor] + tokens, [0, 0, 2, 3])
    assert list(v.committed_tokens) == ref[1: 2 + v.accepted] and v.accepted == 3
    client.release("tree")


def test_bad_penalties_are_refused(client):
    bad = grpc.StatusCode.INVALID_ARGUMENT
    for fields, words in (({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
                          ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                          ({"repetition_penalty": 0.0}, "repetition_penalty must be in [0.01, 10]"),
                          ({"repetition_penalty": 1e-30}, "repetition_penalty must be in [0.01, 10]")):
        expect_status(lambda f=fields: client.prefill("bad", PROMPT,
                                                      common_pb2.SamplingParams(**f)),
                      bad, words)
