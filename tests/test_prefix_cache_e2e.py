"""Prefix caching through the three services (SmolLM2 fp32 + the shipped drafter): multi-turn
chats whose later turns find the earlier turns' pages on the target and the drafter's context
on the draft give the same tokens as a stack without the cache and as transformers - chains,
trees, seeded sampling, and a stack whose caps keep evicting; the usage block reports
`prompt_tokens_details.cached_tokens` through the real `openai` client."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI
from support import prom
from support.draft_service import start_draft
from support.gateway_stack import GreedyReference, start_gateway, wait_until
from support.procs import free_port, start_target

from dflash.v1 import common_pb2, gateway_pb2
from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
N = 24
CONVERSATIONS = [["Name three colours of the rainbow.", "Which of them is warmest?",
                  "Say it again in one word."],
                 ["What is the capital of France?", "And of Italy?", "Which is further south?"]]
MODEL = "smollm2-135m-instruct"
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, in plain words, without "
          "lists unless asked. " * 3)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("prefix_e2e")


class Stack:
    """A target, the shipped drafter and gateways (by name) on them; metrics ports."""

    def __init__(self, model: Path, logs: Path, *flags: str, gateways: dict[str, tuple]):
        self.target_metrics, self.draft_metrics = free_port(), free_port()
        self.target = start_target(model, logs, *flags, "--metrics-port",
                                   str(self.target_metrics))
        self.draft = start_draft(model, logs, *flags, "--metrics-port", str(self.draft_metrics),
                                 model_dir=SHIPPED)
        self.gateways = {name: start_gateway(self.target.address, model, logs, *extra,
                                             draft=self.draft.address)
                         for name, extra in gateways.items()}

    def hits(self, service: str) -> float:
        port = self.target_metrics if service == "target" else self.draft_metrics
        return prom.value(port, "dflash_prefix_cache_hits_total", service=service)

    def stop(self) -> None:
        for p in [*self.gateways.values(), self.draft, self.target]:
            p.stop()


CHAIN = {"chain": ("--block-size", "8")}


def running(model: Path, logs: Path, *flags: str, gateways: dict[str, tuple] = CHAIN):
    """A module fixture's stack (pages of 8 tokens on both services), stopped after."""
    s = Stack(model, logs, "--page-size", "8", *flags, gateways=gateways)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def on(smollm2_dir, logs):
    yield from running(smollm2_dir, logs, gateways={
        **CHAIN, "tree": ("--spec-tree-nodes", "15"), "auto": ()})


@pytest.fixture(scope="module")
def off(smollm2_dir, logs):
    yield from running(smollm2_dir, logs, "--enable-prefix-caching", "off")


@pytest.fixture(scope="module")
def evicting(smollm2_dir, logs):
    """Caps of 3 unreferenced pages on both services: every conversation evicts the last."""
    yield from running(smollm2_dir, logs, "--prefix-cache-max-pages", "3")


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> ChatTokenizer:
    return ChatTokenizer(smollm2_dir)


def turn(gw, tok: ChatTokenizer, messages: list[dict], text: str, **fields
         ) -> tuple[list[int], list[int], gateway_pb2.Usage]:
    """The user's `text` and the model's answer appended to `messages`: (prompt ids, output
    ids, usage)."""
    messages.append({"role": "user", "content": text})
    ids = tok.encode(tok.apply_chat_template(messages))
    output, reply, responses = gw.generate(ids, N, **fields)
    messages.append({"role": "assistant", "content": reply})
    return ids, output, responses[-1].usage


def chat(gw, tok: ChatTokenizer, turns: list[str], system: str = "", **fields
         ) -> list[tuple[list[int], list[int], gateway_pb2.Usage]]:
    """One conversation, turn by turn (each answer goes into the next turn's prompt)."""
    messages = [{"role": "system", "content": system}] if system else []
    return [turn(gw, tok, messages, text, **fields) for text in turns]


def test_later_turns_reuse_both_caches_and_decode_exactly(on, off, tok, smollm2_dir):
    """Exact against the stack without the cache and transformers; and the drafts are as good
    (the draft's cached context is the one it would have computed: acceptance is the same, up
    to a near-tie of fp32 rounding)."""
    reference = GreedyReference(smollm2_dir)
    target0, draft0 = on.hits("target"), on.hits("draft")
    accepted = {"on": 0, "off": 0}
    for turns in CONVERSATIONS:
        cached, plain = chat(on.gateways["chain"], tok, turns), chat(off.gateways["chain"],
                                                                     tok, turns)
        for (ids, out, usage), (ref_ids, ref_out, ref_usage) in zip(cached, plain):
            assert (ids, out) == (ref_ids, ref_out) and ref_usage.cached_tokens == 0
            assert out == reference(ids, N)[: len(out)]
            accepted["on"] += usage.accepted_tokens
            accepted["off"] += ref_usage.accepted_tokens
        assert all(u.cached_tokens >= 8 for _, _, u in cached[1:])     # every later turn hit
    assert on.hits("target") - target0 > 0 and on.hits("draft") - draft0 > 0
    assert off.hits("target") == 0 and off.hits("draft") == 0
    print(accepted); assert accepted["on"] >= 0.9 * accepted["off"] > 0, accepted


@pytest.mark.parametrize("gateway", ["tree", "auto"])
def test_trees_and_auto_speculation_with_the_cache_are_exact(on, off, tok, gateway):
    turns = CONVERSATIONS[0]
    assert [o for _, o, _ in chat(on.gateways[gateway], tok, turns, SYSTEM)] == \
        [o for _, o, _ in chat(off.gateways["chain"], tok, turns, SYSTEM)]


def test_a_shared_system_prompt_is_prefilled_once(on, tok):
    """Two conversations that share only the system prompt: the second's first turn finds it."""
    first = chat(on.gateways["chain"], tok, ["Hello!"], SYSTEM)
    second = chat(on.gateways["chain"], tok, ["Good morning!"], SYSTEM)
    system_tokens = len(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}])))
    assert second[0][2].cached_tokens >= (system_tokens // 8 - 1) * 8 > 0
    assert first[0][1] and second[0][1]


def test_requests_that_draft_nothing_still_leave_their_prefix_on_both_services(on, off, tok):
    """Requests asking for block 1 (as auto's no-drafting steps): the draft takes the prompt's
    context anyway (one Propose of block 1), so a second conversation behind the same system
    prompt hits on the target too - which reuses a cached prefix only as far as the draft holds
    it. Before, neither service hit (a GPU run under auto showed a hit rate of 0)."""
    system = "Reply in one sentence. " + SYSTEM          # a prefix no other test caches
    draft0 = on.hits("draft")
    first = chat(on.gateways["chain"], tok, ["Hello!"], system, block_size=1)
    second = chat(on.gateways["chain"], tok, ["Good morning!"], system, block_size=1)
    system_tokens = len(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": system}])))
    assert second[0][2].cached_tokens >= (system_tokens // 8 - 1) * 8 > 0
    assert on.hits("draft") - draft0 >= (system_tokens // 8 - 1) * 8
    assert first[0][2].accepted_tokens == second[0][2].accepted_tokens == 0    # no drafts
    assert [o for _, o, _ in first + second] == [
        o for _, o, _ in chat(off.gateways["chain"], tok, ["Hello!"], system)
        + chat(off.gateways["chain"], tok, ["Good morning!"], system)]


def test_seeded_sampling_gives_the_same_tokens_with_and_without_the_cache(on, off, tok):
    sampling = common_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    turns = CONVERSATIONS[1]
    assert [o for _, o, _ in chat(on.gateways["chain"], tok, turns, sampling=sampling)] == \
        [o for _, o, _ in chat(off.gateways["chain"], tok, turns, sampling=sampling)]


def test_evictions_never_give_wrong_context(evicting, off, tok):
    """Conversations interleaved turn by turn on caps of 3 pages: what survives is reused, what
    was evicted is recomputed, and every turn equals the stack without the cache."""
    gw, ref = evicting.gateways["chain"], off.gateways["chain"]
    got = [[{"role": "system", "content": SYSTEM}] for _ in CONVERSATIONS]
    want = [[{"role": "system", "content": SYSTEM}] for _ in CONVERSATIONS]
    for t in range(3):
        for c, turns in enumerate(CONVERSATIONS):
            assert turn(gw, tok, got[c], turns[t])[1] == turn(ref, tok, want[c], turns[t])[1]
    assert evicting.hits("target") > 0


def test_openai_usage_reports_cached_tokens(on, tok):
    client = OpenAI(base_url=f"{on.gateways['chain'].http_url}/v1", api_key="unused",
                    max_retries=0, timeout=300)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 8
    assert again.usage.prompt_tokens == first.usage.prompt_tokens


def test_restarted_services_start_with_empty_caches_and_stay_exact(smollm2_dir, logs, off,
                                                                    tok):
    """The caches are soft state: after the target and the draft restart (SIGTERM, then the
    same flags and ports), the next turn finds nothing cached (0 cached tokens) and the one
    after finds its predecessor again; every turn equals the cache-off stack's."""
    from support.reliability import restart
    (logs / "restart").mkdir(exist_ok=True)
    stack = Stack(smollm2_dir, logs / "restart", "--page-size", "8", gateways=CHAIN)
    try:
        gw = stack.gateways["chain"]
        messages: list[dict] = []
        outputs, cached = [], []
        for i, text in enumerate(CONVERSATIONS[0]):
            if i == 1:
                for role in ("target", "draft"):
                    old = getattr(stack, role)
                    assert old.stop() == 0
                    setattr(stack, role, restart(old, logs / f"restarted-{role}").wait_serving())
                wait_until(lambda: gw.readiness()[0] == 200, timeout=120, what="gateway ready")
            _, output, usage = turn(gw, tok, messages, text)
            outputs.append(output)
            cached.append(usage.cached_tokens)
        assert cached[1] == 0 and cached[2] > 0, cached
        assert outputs == [o for _, o, _ in chat(off.gateways["chain"], tok, CONVERSATIONS[0])]
    finally:
        stack.stop()


def test_prompts_within_a_page_skip_the_draft_s_open_sequence(on, off):
    """A prompt of at most one page (8 tokens here) can have no cached prefix: the gateway
    does not ask the draft (one round trip less before the Prefill); a longer one does. The
    output is the cache-off stack's either way."""
    def opens() -> float:
        return prom.value(on.draft_metrics, "dflash_rpc_requests_total", method="OpenSequence",
                          code="OK") or 0.0
    gw = on.gateways["chain"]
    before = opens()
    short, _, _ = gw.generate([1, 2, 3, 4, 5, 6, 7, 8], 6)
    assert opens() == before
    long_prompt = list(range(100, 120))
    longer, _, _ = gw.generate(long_prompt, 6)
    assert opens() == before + 1
    off_gw = off.gateways["chain"]
    assert (short, longer) == (off_gw.generate([1, 2, 3, 4, 5, 6, 7, 8], 6)[0],
                               off_gw.generate(long_prompt, 6)[0])


def test_requests_sharing_a_prefix_at_once_and_the_pools_after(on, off, tok):
    """Six requests behind the same system prompt arrive together (no page of it cached yet
    for some of them, shared pages for others): each equals the stack without the cache; then
    no page is in use on either service while the cache still holds pages."""
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM + f" Case {i // 2}."},
         {"role": "user", "content": q}]))
        for i, q in enumerate(["Hi.", "Hello.", "Good day.", "Hey.", "Greetings.", "Yo."])]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ids: on.gateways["chain"].generate(ids, N)[0], prompts))
    assert got == [off.gateways["chain"].generate(ids, N)[0] for ids in prompts]
    for service, port in (("target", on.target_metrics), ("draft", on.draft_metrics)):
        wait_until(lambda port=port, service=service: prom.value(
            port, "dflash_sequences_active", service=service) == 0, what=f"{service} idle")
        assert prom.value(port, "dflash_kv_cache_usage_ratio", service=service) == 0
        assert prom.value(port, "dflash_prefix_cache_pages", service=service) > 0
