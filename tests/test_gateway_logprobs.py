"""Logprobs and penalties through the three services (SmolLM2 fp32 + the shipped DFlash
drafter), with the real `openai` client and gRPC: each delivered token's logprob equals
transformers' log-softmax at its position within fp32 tolerance, and the target-only path's,
whether the token was drafted (a chain or a tree, greedy or sampled) or not; the chat, streaming
and legacy completion shapes; penalized output identical with and without drafts."""
from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI
from support.draft_service import start_draft
from support.gateway_stack import start_gateway
from support.procs import start_target

from dflash.v1 import common_pb2
from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

SHIPPED = "models/smollm2-135m-instruct-dflash"
MODEL = "smollm2-135m-instruct"
QUESTION = "Name three colours of the rainbow."
TOL = 2e-4                      # a verify block and a one-token step round differently in fp32
N = 24


@pytest.fixture(scope="module")
def gateways(smollm2_dir, tmp_path_factory):
    """name -> gateway: "alone" (no draft), "chain" (block 16), "tree" (15 nodes)."""
    logs = tmp_path_factory.mktemp("gateway_logprobs")
    target = start_target(smollm2_dir, logs)
    draft = start_draft(smollm2_dir, logs, model_dir=SHIPPED)
    gws = {"alone": start_gateway(target.address, smollm2_dir, logs),
           "chain": start_gateway(target.address, smollm2_dir, logs, draft=draft.address),
           "tree": start_gateway(target.address, smollm2_dir, logs, "--spec-tree-nodes", "15",
                                 draft=draft.address)}
    yield gws
    for p in (*gws.values(), draft, target):
        p.stop()


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """token ids -> transformers' log-softmax [len(ids), V] (fp32)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir)).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logprobs


def client(gw) -> OpenAI:
    return OpenAI(base_url=f"{gw.http_url}/v1", api_key="unused", max_retries=0, timeout=300)


def prompt_ids(smollm2_dir) -> list[int]:
    tok = ChatTokenizer(smollm2_dir)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                              add_generation_prompt=True))


def ids_of(content, tok: ChatTokenizer) -> list[int]:
    """The token ids behind a chat logprobs content list (from each entry's exact bytes)."""
    return [tok.tokenizer.token_to_id(_piece(bytes(e.bytes))) for e in content]


def _piece(b: bytes) -> str:
    """Bytes -> SmolLM2's byte-level token string."""
    from gateway.logprobs import _byte_decoder
    char_of = {v: k for k, v in _byte_decoder().items()}
    return "".join(char_of[x] for x in b)


def test_chat_logprobs_equal_the_reference_with_and_without_drafts(gateways, reference,
                                                                   smollm2_dir):
    tok = ChatTokenizer(smollm2_dir)
    prompt = prompt_ids(smollm2_dir)
    answers = {}
    for name, gw in gateways.items():
        r = client(gw).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=N,
            temperature=0, logprobs=True, top_logprobs=5)
        content = r.choices[0].logprobs.content
        assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content).strip() \
            == r.choices[0].message.content.strip() or r.choices[0].finish_reason == "stop"
        answers[name] = content
    usage_ids = ids_of(answers["alone"], tok)
    ref = reference(prompt + usage_ids)
    for name, content in answers.items():
        assert [e.token for e in content] == [e.token for e in answers["alone"]], name
        for i, (entry, alone) in enumerate(zip(content, answers["alone"])):
            token = usage_ids[i]
            assert abs(entry.logprob - float(ref[len(prompt) - 1 + i, token])) < 1e-3, (name, i)
            assert abs(entry.logprob - alone.logprob) < TOL, (name, i)
            assert len(entry.top_logprobs) == 5
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
            assert abs(entry.top_logprobs[0].logprob - float(ref[len(prompt) - 1 + i].max())) \
                < 1e-3


def test_sampled_tree_tokens_carry_the_targets_raw_logprobs(gateways, reference, smollm2_dir):
    """T = 0.7 through the tree gateway (sampled trees): every delivered token's logprob is the
    model's raw log-softmax at its position, whichever way the token was committed."""
    tok = ChatTokenizer(smollm2_dir)
    prompt = prompt_ids(smollm2_dir)
    r = client(gateways["tree"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=N,
        temperature=0.7, seed=11, logprobs=True)
    content = r.choices[0].logprobs.content
    ids = ids_of(content, tok)
    ref = reference(prompt + ids)
    for i, entry in enumerate(content):
        assert abs(entry.logprob - float(ref[len(prompt) - 1 + i, ids[i]])) < 1e-3, i
        assert entry.top_logprobs == []
    assert r.usage.completion_tokens == len(content)


def test_streamed_chat_logprobs_match_the_whole_answer(gateways):
    c = client(gateways["chain"])
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
              "max_tokens": N, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = c.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = []
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    # the same tokens; their logprobs to fp32 GEMM rounding: the second request's prefill starts
    # after the first one's cached prefix (other row counts, other last bits)
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, whole)) < 1e-4


def test_legacy_completion_logprobs(gateways):
    r = client(gateways["chain"]).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) >= value - 1e-6
        assert value <= 0


def test_grpc_generate_logprobs_align_with_tokens(gateways, smollm2_dir):
    prompt = prompt_ids(smollm2_dir)
    sampling = common_pb2.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    ids, _, responses = gateways["tree"].generate(prompt, N, sampling=sampling)
    alone, _, ref = gateways["alone"].generate(prompt, N, sampling=sampling)
    assert ids == alone
    got = [lp for r in responses for lp in r.logprobs]
    want = [lp for r in ref for lp in r.logprobs]
    assert len(got) == len(ids) == len(want)
    for g, w, token in zip(got, want, ids):
        assert abs(g.logprob - w.logprob) < TOL and len(g.top_ids) == 3
        assert g.top_ids[0] == token                                 # greedy: the top token


def test_bad_logprobs_requests_are_400(gateways):
    url = f"{gateways['alone'].http_url}/v1"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, words in (({"logprobs": True, "top_logprobs": 21}, "[0, 20]"),
                         ({"top_logprobs": 2}, "top_logprobs needs logprobs")):
        r = httpx.post(f"{url}/chat/completions", json={**chat, **extra}, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "hi", "logprobs": 99},
                   timeout=60)
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]


def test_penalties_under_speculation_equal_the_target_alone(gateways):
    """Penalized greedy output through a chain and a tree equals the target-only path's (the
    target counts the drafts before each row), through the real openai client."""
    outs = {}
    for name, gw in gateways.items():
        r = client(gw).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
            max_tokens=40, temperature=0, presence_penalty=0.6, frequency_penalty=0.4,
            extra_body={"repetition_penalty": 1.2})
        outs[name] = r.choices[0].message.content
    plain = client(gateways["alone"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
        max_tokens=40, temperature=0).choices[0].message.content
    assert outs["chain"] == outs["tree"] == outs["alone"] != plain
