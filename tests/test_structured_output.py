"""Structured output through the three services (SmolLM2 fp32 + the shipped DFlash drafter) with
the real `openai` client: every answer to a set of JSON schemas (nested objects, enums, arrays,
numbers) parses and validates with `jsonschema`, identical with and without speculation at T = 0;
regex, choice, Lark grammars and json_object; gRPC Generate; bad schemas and grammars are 400 with
the compiler's message."""
from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import pytest
from openai import OpenAI
from support.draft_service import start_draft
from support.gateway_stack import start_gateway
from support.procs import start_target

from dflash.v1 import common_pb2, gateway_pb2
from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

SHIPPED = "models/smollm2-135m-instruct-dflash"
MODEL = "smollm2-135m-instruct"


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": required or list(properties), "additionalProperties": False}


SHORT = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "person": ("Give the name and home town of a famous scientist as JSON.",
               _obj({"name": SHORT, "address": _obj({"city": SHORT,
                                                     "zip": {"type": "integer"}})})),
    "colour": ("What colour is the sky? Answer as JSON.",
               _obj({"colour": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}})),
    "list": ("List some fruits as JSON.",
             _obj({"items": {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 4}})),
    "numbers": ("When did the first person walk on the moon, and how sure are you? JSON.",
                _obj({"year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                      "score": {"type": "number"}})),
}


@pytest.fixture(scope="module")
def gateways(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("structured")
    target = start_target(smollm2_dir, logs)
    draft = start_draft(smollm2_dir, logs, model_dir=SHIPPED)
    gws = {"alone": start_gateway(target.address, smollm2_dir, logs),
           # fixed sizes: every answer must exercise drafting under the grammar (auto chooses
           # by cost and may not draft in a short answer)
           "chain": start_gateway(target.address, smollm2_dir, logs, "--speculation", "fixed",
                                  draft=draft.address),
           "tree": start_gateway(target.address, smollm2_dir, logs, "--spec-tree-nodes", "15",
                                 draft=draft.address)}
    yield gws
    for p in (*gws.values(), draft, target):
        p.stop()


def client(gw) -> OpenAI:
    return OpenAI(base_url=f"{gw.http_url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(gw, question: str, max_tokens: int = 160, **kwargs):
    return client(gw).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0, **kwargs)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_validate_and_equal_the_target_alone(gateways, name):
    question, schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    answers = {}
    for gw_name, gw in gateways.items():
        r = ask(gw, question, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        answers[gw_name] = r
    for drafted in ("chain", "tree"):
        assert answers[drafted].choices[0].message.content == \
            answers["alone"].choices[0].message.content, drafted
        spec = answers[drafted].usage.model_extra["spec_decode"]
        print(f"{name} {drafted}: tau {spec['mean_acceptance_length']}")
        assert spec["draft_steps"] > 0


def test_streamed_json_equals_the_whole_answer(gateways):
    question, schema = SCHEMAS["colour"]
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    whole = ask(gateways["chain"], question, response_format=fmt).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client(gateways["chain"]).chat.completions
             .create(model=MODEL, messages=[{"role": "user", "content": question}],
                     max_tokens=160, temperature=0, response_format=fmt, stream=True)
             if c.choices]
    assert "".join(parts) == whole


def test_json_object_regex_choice_and_grammar(gateways):
    gw = gateways["chain"]
    r = ask(gw, "Describe a cat as JSON.", max_tokens=200, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = ask(gw, "Give me a phone number.", extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].message.content)
    choices = ["Paris", "London", "Rome"]
    r = ask(gw, "What is the capital of Italy?",
            extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].message.content in choices         # (a 135M model; not always right)
    grammar = 'start: answer "!"\nanswer: "yes" | "no"'
    r = ask(gw, "Is water wet?", extra_body={"guided_grammar": grammar})
    assert r.choices[0].message.content in ("yes!", "no!")
    r = client(gw).completions.create(model=MODEL, prompt="The answer is", max_tokens=8,
                                      temperature=0, extra_body={"guided_choice": ["A", "B"]})
    assert r.choices[0].text in ("A", "B")


def test_grpc_generate_with_a_choice(gateways, smollm2_dir):
    tok = ChatTokenizer(smollm2_dir)
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Pick a colour."}], add_generation_prompt=True))
    structured = gateway_pb2.StructuredOutput(choice=gateway_pb2.Choices(choices=["red", "blue"]))
    _, text, _ = gateways["chain"].generate(
        prompt, 16, sampling=common_pb2.SamplingParams(temperature=0.8, seed=3),
        structured=structured)
    assert text in ("red", "blue")
    with pytest.raises(grpc.RpcError) as e:
        gateways["chain"].generate(prompt, 4, structured=gateway_pb2.StructuredOutput(regex="("))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_constraints_are_400_with_the_reason(gateways):
    url = f"{gateways['chain'].http_url}/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "json_schema"),
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"guided_grammar": "start: ???"}, "grammar"),
        ({"response_format": {"type": "xml"}}, "response_format must be"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured-output constraint"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"guided_choice": []}, "non-empty list"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens cannot be combined"),
    ]
    for extra, words in cases:
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert words in r.json()["error"]["message"], (extra, r.text)
    assert ask(gateways["chain"], "hi", max_tokens=4).choices[0].message.content   # still serving
