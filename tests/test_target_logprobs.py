"""The target's logprobs and token masks, through the real server (tiny random Llama, fp32):
logprobs of committed tokens equal transformers' log-softmax at those positions whether the
token was a draft, the bonus or a one-token step (raw), or the distribution the token was chosen
from (processed); token masks keep every committed token inside the mask, and bad masks are
refused with INVALID_ARGUMENT while the sequence goes on serving."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from support.procs import start_target
from support.target_client import TargetClient, expect_status
from support.tiny_models import TINY_PROMPT as PROMPT
from support.tiny_models import TINY_VOCAB as VOCAB
from support.tiny_models import wrong

from dflash.v1 import common_pb2, target_pb2
from runtime.sampling import SamplingConfig, target_probs
from runtime.token_mask import mask_bytes

TOL = 1e-4


@pytest.fixture(scope="module")
def client(tiny_llama_02_dir, tmp_path_factory):
    proc = start_target(tiny_llama_02_dir, tmp_path_factory.mktemp("logs"), "--page-size", "4",
                        "--max-block-size", "16", "--kv-budget", "8MiB")
    c = TargetClient(proc.address)
    yield c
    c.close()
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_llama_02_dir):
    """ids -> transformers' fp32 logits [len(ids), V] (the reference)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_02_dir)).eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()
    return logits


def mask_of(allowed: set[int]) -> bytes:
    bits = np.zeros(mask_bytes(VOCAB) * 8, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def check_logprobs(lp: common_pb2.TokenLogprobs, token: int, row: torch.Tensor, k: int) -> None:
    """lp: the target's answer for `token`; row: the reference log-probabilities [V]."""
    assert abs(lp.logprob - float(row[token])) < TOL
    top = row.topk(k)
    assert list(lp.top_ids) == top.indices.tolist()
    assert np.allclose(list(lp.top_logprobs), top.values.tolist(), atol=TOL)


def test_raw_logprobs_equal_the_reference_for_drafts_bonus_and_single_steps(client, reference):
    sampling = common_pb2.SamplingParams(logprobs=True, top_logprobs=5)
    pre = client.prefill("lp", PROMPT, sampling)
    greedy = [pre.next_token]
    ref = torch.log_softmax(reference(PROMPT), -1)
    check_logprobs(pre.logprobs, pre.next_token, ref[-1], 5)
    for _ in range(6):                                  # the greedy continuation, for drafts
        greedy.append(int(reference(PROMPT + greedy)[-1].argmax()))
    drafts = [greedy[1], greedy[2], wrong(greedy[3]), greedy[4]]
    v = client.verify("lp", [greedy[0]] + drafts)
    assert (v.accepted, list(v.committed_tokens)) == (2, greedy[1:4])   # 2 drafts + the bonus
    ref = torch.log_softmax(reference(PROMPT + greedy[:3]), -1)
    assert len(v.logprobs) == 3
    for i, (token, lp) in enumerate(zip(v.committed_tokens, v.logprobs)):
        check_logprobs(lp, token, ref[len(PROMPT) + i], 5)
    one = client.verify("lp", [greedy[3]])                               # a one-token step
    check_logprobs(one.logprobs[0], one.committed_tokens[0],
                   torch.log_softmax(reference(PROMPT + greedy[:4]), -1)[-1], 5)
    client.release("lp")


def test_no_logprobs_unless_asked_and_top_logprobs_needs_logprobs(client):
    pre = client.prefill("plain", PROMPT)
    assert not pre.HasField("logprobs")
    assert len(client.verify("plain", [pre.next_token]).logprobs) == 0
    expect_status(lambda: client.prefill("bad", PROMPT, common_pb2.SamplingParams(top_logprobs=3)),
                  grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs needs logprobs")
    expect_status(lambda: client.prefill("bad", PROMPT, common_pb2.SamplingParams(
        logprobs=True, top_logprobs=21)), grpc.StatusCode.INVALID_ARGUMENT, "[0, 20]")
    client.release("plain")


def test_processed_logprobs_are_the_distribution_sampled_from(client, reference):
    """T = 0.5, top-k 4: the processed value is log of the sampled distribution (-inf outside
    the top 4); the raw one is the model's log-softmax."""
    cfg = SamplingConfig(temperature=0.5, top_k=4)
    params = {"temperature": 0.5, "top_k": 4, "seed": 7, "logprobs": True, "top_logprobs": 6}
    processed = client.prefill("p", PROMPT, common_pb2.SamplingParams(
        **params, processed_logprobs=True))
    raw = client.prefill("r", PROMPT, common_pb2.SamplingParams(**params))
    assert processed.next_token == raw.next_token                      # the same seed
    logits = reference(PROMPT)[-1:]
    probs = target_probs(logits, cfg)[0]
    token = processed.next_token
    assert abs(processed.logprobs.logprob - float(torch.log(probs[token]))) < TOL
    assert list(processed.logprobs.top_logprobs)[4:] == [float("-inf")] * 2
    assert abs(raw.logprobs.logprob - float(torch.log_softmax(logits[0], -1)[token])) < TOL
    for seq in ("p", "r"):
        client.release(seq)


def test_raw_logprobs_see_through_min_tokens_processed_do_not(client, reference):
    eos = int(reference(PROMPT)[-1].argmax())              # call the greedy token a stop token
    for processed in (False, True):
        sampling = common_pb2.SamplingParams(min_tokens=2, stop_token_ids=[eos], logprobs=True,
                                             top_logprobs=1, processed_logprobs=processed)
        pre = client.prefill("mt", PROMPT, sampling)
        assert pre.next_token != eos
        top = pre.logprobs.top_ids[0]
        assert (top == eos) == (not processed)
    client.release("mt")


def test_token_masks_confine_every_committed_token(client, reference):
    allowed = {5, 9, 77}
    pre = client.stub.Prefill(target_pb2.PrefillRequest(
        sequence_id="m", token_ids=PROMPT, token_mask=mask_of(allowed)))
    assert pre.next_token in allowed
    anchor = pre.next_token
    ids = [anchor, 5, 9]
    v = client.stub.Verify(target_pb2.VerifyRequest(sequence_id="m", token_ids=ids,
                                                    token_masks=[mask_of(allowed)] * 3))
    assert all(t in allowed for t in v.committed_tokens)
    only = {int(reference(PROMPT + [anchor] + list(v.committed_tokens))[-1].argmin())}
    w = client.stub.Verify(target_pb2.VerifyRequest(
        sequence_id="m", token_ids=[v.committed_tokens[-1]], token_masks=[mask_of(only)]))
    assert list(w.committed_tokens) == list(only)          # even the model's least likely token
    client.release("m")


def test_bad_token_masks_are_refused_and_the_sequence_goes_on(client):
    pre = client.prefill("bm", PROMPT)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    call = client.stub.Verify

    def verify(masks, ids=None, parents=()):
        return call(target_pb2.VerifyRequest(sequence_id="bm", token_ids=ids or [pre.next_token],
                                             token_masks=masks, parents=parents))
    expect_status(lambda: verify([b"\xff" * 4]), bad, "has 4 bytes", f"needs {mask_bytes(VOCAB)}")
    expect_status(lambda: verify([mask_of(set())]), bad, "allows no token")
    expect_status(lambda: verify([mask_of({1})] * 2), bad, "2 masks for a block of 1")
    expect_status(lambda: client.stub.Prefill(target_pb2.PrefillRequest(
        sequence_id="bm2", token_ids=PROMPT, token_mask=b"\x01")), bad, "token mask: a token")
    assert len(verify([]).committed_tokens) == 1                       # still serving
    client.release("bm")


def test_token_masks_confine_a_tree(client, reference):
    """One mask per tree row: the anchor's allows only the second node's token, so the first
    node (the target's own greedy choice) cannot be committed."""
    anchor = client.prefill("mt", PROMPT).next_token
    greedy = int(reference(PROMPT + [anchor])[-1].argmax())
    other = wrong(greedy)
    masks = [mask_of({other})] + [mask_of(set(range(VOCAB)))] * 2
    v = client.stub.Verify(target_pb2.VerifyRequest(
        sequence_id="mt", token_ids=[anchor, greedy, other], parents=[0, 0], token_masks=masks))
    assert (v.accepted, v.committed_tokens[0]) == (1, other)
    client.release("mt")
