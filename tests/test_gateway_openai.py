"""The OpenAI-compatible HTTP API through the real `openai` client (and raw HTTP for what a
client library would not send), on target + prompt-lookup draft + gateway processes."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from support.draft_service import start_draft
from support.gateway_stack import GreedyReference, start_gateway, wait_until
from support.procs import free_port, start_target

from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France? Answer in one sentence."
STORY = "Once upon a time, in a small village by the sea,"
EMOJI_PROMPT = "Smiley: 🙂\nThumbs up: 👍\nSmiley: 🙂\nThumbs up:"     # continues with " 👍": 3 tokens


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway_openai")


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> ChatTokenizer:
    return ChatTokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def reference(smollm2_dir) -> GreedyReference:
    return GreedyReference(smollm2_dir)


@pytest.fixture(scope="module")
def stack(smollm2_dir, logs):
    """(target, draft, gateway); target and draft expose /metrics."""
    target = start_target(smollm2_dir, logs, "--metrics-port", str(tm := free_port()))
    draft = start_draft(smollm2_dir, logs, "--drafter", "prompt-lookup",
                        "--metrics-port", str(dm := free_port()))
    target.metrics_port, draft.metrics_port = tm, dm
    gw = start_gateway(target.address, smollm2_dir, logs, draft=draft.address)
    yield target, draft, gw
    for p in (gw, draft, target):
        p.stop()


@pytest.fixture(scope="module")
def gw(stack):
    return stack[2]


@pytest.fixture(scope="module")
def client(gw) -> OpenAI:
    return OpenAI(base_url=f"{gw.http_url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat_ids(tok, content: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]))


def expected_text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != 2], skip_special_tokens=True).rstrip("\ufffd")


def finish_of(ids: list[int], n: int) -> str:
    return "stop" if ids and ids[-1] == 2 else "length"


# -- chat and completions, streamed and not -----------------------------------------------------
def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_matches_reference_and_counts_usage(client, tok, reference):
    ids = chat_ids(tok, QUESTION)
    ref = reference(ids, 40)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=40, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(tok, ref)
    assert r.choices[0].finish_reason == finish_of(ref, 40)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref))
    assert r.usage.total_tokens == len(ids) + len(ref)


def test_chat_streamed_equals_non_streamed(client, tok, reference):
    ids = chat_ids(tok, STORY)
    ref = reference(ids, 48)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": STORY}], max_tokens=48, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body, usage = chunks[:-1], chunks[-1]
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in body)
    assert usage.choices == [] and usage.usage.completion_tokens == len(ref)
    assert usage.usage.prompt_tokens == len(ids)
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected_text(tok, ref)
    assert body[-1].choices[0].finish_reason == finish_of(ref, 48)
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    spec = usage.usage.model_extra["spec_decode"]
    assert spec["verify_steps"] >= 1 and spec["mean_acceptance_length"] >= 1.0


def test_completions_streamed_and_not(client, tok, reference):
    ids = tok.encode(STORY, add_special_tokens=True)
    ref = reference(ids, 32)
    whole = client.completions.create(model=MODEL, prompt=STORY, max_tokens=32, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == expected_text(tok, ref)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(ref))
    chunks = list(client.completions.create(model=MODEL, prompt=STORY, max_tokens=32,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=32, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text


def test_default_completion_length_is_16(client):
    r = client.completions.create(model=MODEL, prompt=STORY, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_seeded_sampling_repeats(client):
    def once(seed):
        return client.completions.create(model=MODEL, prompt=STORY, max_tokens=24, temperature=0.9,
                                         top_p=0.95, seed=seed,
                                         extra_body={"top_k": 50}).choices[0].text
    a, b, c = once(7), once(7), once(8)
    assert a == b and a != c


def test_min_tokens_and_ignore_eos(client, tok, reference):
    ids = chat_ids(tok, QUESTION)
    natural = len(reference(ids, 40))
    assert natural < 30                                  # the answer ends with EOS early
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=40, temperature=0,
                                       extra_body={"min_tokens": natural + 5})
    assert r.usage.completion_tokens >= natural + 5
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=natural + 6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == natural + 6 and r.choices[0].finish_reason == "length"


# -- stop strings and UTF-8 -------------------------------------------------------------------------
def spanning_stop(tok, ids: list[int]) -> tuple[str, int]:
    """A stop string that starts inside one output token and ends inside the next; and how
    many tokens are delivered when it stops (up to the token that completes it)."""
    for k in range(4, len(ids) - 1):
        left, right = tok.decode([ids[k]]), tok.decode([ids[k + 1]])
        if len(left) >= 3 and len(right) >= 3 and "\ufffd" not in left + right:
            stop = left[-2:] + right[:2]
            text = tok.decode(ids)
            if text.find(stop) == len(tok.decode(ids[:k + 1])) - 2:
                return stop, k + 2
    raise AssertionError("no token pair for a spanning stop string")


def test_stop_string_spanning_tokens(client, tok, reference, gw):
    ids = tok.encode(STORY, add_special_tokens=True)
    ref = reference(ids, 40)
    stop, n_tokens = spanning_stop(tok, ref)
    full = tok.decode(ref)
    want = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=40, temperature=0,
                                  stop=[stop, "never-matches"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == n_tokens
    streamed = list(client.completions.create(model=MODEL, prompt=STORY, max_tokens=40,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    tokens, text, responses = gw.generate(ids, 40, stop=[stop])
    assert (tokens, text, responses[-1].finish_reason) == (ref[:n_tokens], want, "stop")


def test_utf8_split_across_tokens_is_never_broken(client, tok, reference, gw):
    ids = tok.encode(EMOJI_PROMPT, add_special_tokens=True)
    ref = reference(ids, 16)
    assert sum("\ufffd" in tok.decode([t]) for t in ref) >= 3   # characters really are split
    chunks = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=EMOJI_PROMPT, max_tokens=16, temperature=0, stream=True)]
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == expected_text(tok, ref) and "👍" in "".join(chunks)
    _, _, responses = gw.generate(ids, 16)
    assert not any("\ufffd" in r.text for r in responses)
    assert "".join(r.text for r in responses) == expected_text(tok, ref)


# -- bad input: OpenAI-shaped 4xx, never 500 -------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": MODEL, "prompt": "hi"}
BAD = [
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {**COMP, "prompt": ""}, 400, "prompt"),
    ("completions", {**COMP, "prompt": []}, 400, "prompt"),
    ("completions", {**COMP, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {**COMP, "prompt": [1, 49152]}, 400, "prompt"),
    ("completions", {**COMP, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**COMP, "max_tokens": -5}, 400, "max_tokens"),
    ("completions", {**COMP, "max_tokens": 10_000}, 400, "max_tokens"),
    ("completions", {**COMP, "temperature": -1}, 400, "temperature"),
    ("completions", {**COMP, "temperature": 1e300}, 400, "temperature"),
    ("completions", {**COMP, "temperature": 0.5, "top_k": 2**31}, 400, "top_k"),
    ("completions", {**COMP, "top_p": 1e-46}, 400, "top_p"),
    ("completions", {**COMP, "top_p": 0}, 400, "top_p"),
    ("completions", {**COMP, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**COMP, "n": 2}, 400, "n"),
    ("completions", {**COMP, "echo": True}, 400, "echo"),
    ("completions", {**COMP, "logprobs": 21}, 400, "top_logprobs"),
    ("completions", {**COMP, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {**COMP, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {**COMP, "not_a_field": 1}, 400, "not_a_field"),
    ("completions", {**COMP, "stop": [""]}, 400, "stop"),
    ("completions", {**COMP, "min_tokens": 20, "max_tokens": 10}, 400, "min_tokens"),
    ("completions", {**COMP, "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {**COMP, "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"model": MODEL}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ("chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400, "role"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    ("chat/completions", {**CHAT, "temperature": -0.1}, 400, "temperature"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat/completions", {**CHAT, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools"),
    ("chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("chat/completions", {**CHAT, "stream": True, "top_p": -1}, 400, "top_p"),
    ("chat/completions", {**CHAT, "stream_options": {"include_usage": True, "x": 1}}, 400,
     "stream_options"),
    ("chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD)])
def test_bad_input_gets_openai_error(gw, path, body, status, param):
    r = httpx.post(f"{gw.http_url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert param in (err["param"] or "") + err["message"], err
    if status == 404:
        assert err["code"] == "model_not_found"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'{"model": '])
def test_malformed_json_is_400(gw, raw):
    r = httpx.post(f"{gw.http_url}/v1/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


LONE_SURROGATES = [
    ("completions", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % MODEL.encode(),
     "prompt"),
    ("completions", b'{"model": "a\\udc00b", "prompt": "hi", "max_tokens": 2}', "model"),
    ("completions", b'{"model": "%s", "prompt": "hi", "stop": ["\\ud83d"]}' % MODEL.encode(),
     "stop[0]"),
    ("chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "x\\ud800"}]}'
     % MODEL.encode(), "content"),
]


@pytest.mark.parametrize("path,raw,field", LONE_SURROGATES)
def test_invalid_unicode_is_400_and_the_connection_serves_on(gw, client, path, raw, field):
    """JSON can escape a lone surrogate; it was a 500 (and a reset connection) in the
    tokenizer or the response. Now a 400 naming the field, and the next request works."""
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{gw.http_url}/v1/{path}", content=raw,
                      headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "not valid Unicode" in err["message"] and field in err["message"], err
        ok = http.post(f"{gw.http_url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_near_zero_temperature_is_greedy(client, tok, reference):
    """T = 1e-40 was accepted and made NaN on the target, ending every stream batched with it:
    below 1e-5 the gateway serves greedy, as the target does."""
    ids = tok.encode(STORY, add_special_tokens=True)
    want = expected_text(tok, reference(ids, 24))
    for t in (1e-40, 1e-6):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=t)
        assert r.choices[0].text == want


def test_unknown_route_and_method(gw):
    assert httpx.get(f"{gw.http_url}/v1/nothing").status_code == 404
    r = httpx.get(f"{gw.http_url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_raises_typed_errors(client):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=-2)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_health_readiness_metrics(gw, client):
    assert httpx.get(f"{gw.http_url}/health").json() == {"status": "ok"}
    r = httpx.get(f"{gw.http_url}/readiness")
    assert r.status_code == 200 and r.json()["ready"] is True
    assert "speculative" in r.json()["reason"]
    client.completions.create(model=MODEL, prompt="Count: one two three", max_tokens=8,
                              temperature=0)
    text = httpx.get(f"{gw.http_url}/metrics").text
    for name in ("dflash_time_to_first_token_seconds_bucket", "dflash_inter_token_latency_seconds",
                 "dflash_e2e_request_latency_seconds",
                 f'dflash_step_seconds_count{{model_name="{MODEL}",stage="verify"}}',
                 'stage="gateway"', 'stage="draft"', "dflash_spec_drafts_total",
                 f'dflash_ready{{model_name="{MODEL}",service="gateway"}} 1.0',
                 "dflash_requests_running"):
        assert name in text, name


# -- cancellation releases the sequences on both services ---------------------------------------
def sequences(port: int) -> float:
    from support.prom import scrape
    samples = scrape(port).get("dflash_sequences_active", [])
    return sum(v for _, v in samples)


def kv_usage(port: int) -> float:
    from support.prom import scrape
    return sum(v for _, v in scrape(port).get("dflash_kv_cache_usage_ratio", []))


def assert_released(stack) -> None:
    target, draft, _ = stack
    wait_until(lambda: sequences(target.metrics_port) == 0 and sequences(draft.metrics_port) == 0,
               timeout=20, what="sequences released on target and draft")
    assert kv_usage(target.metrics_port) == 0


LONG = {"model": MODEL, "prompt": STORY, "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_http_stream_disconnect_releases(stack):
    target, draft, gw = stack
    with httpx.Client(timeout=60) as c, \
            c.stream("POST", f"{gw.http_url}/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()          # kept open: leaving a for loop would close it
        got = 0
        while got < 4:
            got += next(lines).startswith("data:")
        wait_until(lambda: sequences(target.metrics_port) == 1
                   and sequences(draft.metrics_port) == 1, timeout=20,
                   what="the stream's sequence held on target and draft")
    assert_released(stack)


def aborted(gw) -> float:
    from support.prom import scrape
    return sum(v for lb, v in scrape(gw.http_port).get("dflash_request_success_total", [])
               if lb["finished_reason"] == "abort")


def test_http_non_streamed_disconnect_releases(stack):
    gw = stack[2]
    before = aborted(gw)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.http_url}/v1/completions", json=LONG, timeout=httpx.Timeout(5, read=2.5))
    assert_released(stack)
    assert aborted(gw) == before + 1            # it was running, and was cut short


def test_grpc_cancel_releases(stack, tok):
    from dflash.v1 import common_pb2, gateway_pb2
    target, _, gw = stack
    call = gw.stub.Generate(gateway_pb2.GenerateRequest(
        text=STORY, max_tokens=400, ignore_eos=True, sampling=common_pb2.SamplingParams()))
    for _ in range(3):
        next(call)
    assert sequences(target.metrics_port) == 1
    call.cancel()
    assert_released(stack)
