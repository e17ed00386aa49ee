"""OpenAI request bodies (pydantic, unknown fields rejected) and their translation into a
GenerationRequest.

Fields, besides the ones implemented:
- ignored (bookkeeping, no effect on the output): user, metadata, store, service_tier,
  parallel_tool_calls, prompt_cache_key, safety_identifier;
- logprobs (chat: true/false with top_logprobs 0..20; completions: 0..20 top tokens), from the
  target's raw distribution (--logprobs-mode processed: the one tokens are drawn from);
- frequency_penalty / presence_penalty ([-2, 2]) and vLLM's repetition_penalty ([0.01, 10]),
  applied exactly by the target inside every verify;
- structured output (gateway/grammar.py), at most one per request: response_format
  (json_object, json_schema; "text" = none) and vLLM's structured_outputs (json, regex, choice,
  grammar, json_object) and guided_json / guided_regex / guided_choice / guided_grammar;
- accepted only at their neutral value, else 400 "not supported": n, best_of (1), echo (false),
  logit_bias (empty), suffix (null), tools (empty),
  tool_choice ("none"), functions / function_call, audio, prediction, reasoning_effort,
  web_search_options, verbosity (null), modalities (["text"]);
- vLLM's extensions: top_k, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens;
- anything else: 400 (extra="forbid"), as OpenAI does for unrecognized arguments."""
from __future__ import annotations

import json
from typing import Any, Literal

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, model_validator

from gateway.grammar import GrammarSpec
from gateway.prompts import PromptTokenizer
from gateway.request import UINT64, GenerationRequest, RequestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _valid_unicode(self) -> _Strict:
        """JSON may escape a lone surrogate (\\ud800 without its pair): no tokenizer or response
        can carry it, so it is refused here with the field it is in (nested models check their
        own fields)."""
        for name in type(self).model_fields:
            _check_unicode(getattr(self, name), name)
        return self


def _check_unicode(value: Any, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{path} is not valid Unicode: a lone surrogate "
                             f"{value[e.start]!r} at character {e.start} (surrogates "
                             f"\\ud800-\\udfff are only valid in pairs)") from None
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, f"{path} key")
            _check_unicode(item, f"{path}[{key!r}]")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None          # OpenAI's default: 1
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extensions
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def neutral_only(self) -> dict[str, tuple[Any, Any]]:
        """field -> (value, what is allowed) for fields that must keep their neutral value."""
        return {"n": (self.n in (None, 1), "1"), "logit_bias": (not self.logit_bias, "empty")}

    def to_request(self, prompt_ids: list[int]) -> GenerationRequest:
        for name, (ok, allowed) in self.neutral_only().items():
            if not ok:
                raise RequestError(f"{name} is not supported by this server (allowed: {allowed})",
                                   name)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationRequest(
            prompt_ids=tuple(prompt_ids), max_tokens=self.max_new_tokens(),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            seed=None if self.seed is None else self.seed & UINT64, min_tokens=self.min_tokens,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            grammar=self.grammar(), **self.logprob_fields())

    def grammar(self) -> GrammarSpec | None:
        """The one structured-output constraint the request names (None: free text)."""
        given = [(name, spec) for name, spec in (
            ("response_format", _response_format(self.response_format)),
            ("structured_outputs", _structured_outputs(self.structured_outputs)),
            ("guided_json", _json_spec(self.guided_json, "guided_json")),
            ("guided_regex", GrammarSpec("regex", self.guided_regex)
             if self.guided_regex is not None else None),
            ("guided_choice", _choice(self.guided_choice, "guided_choice")),
            ("guided_grammar", GrammarSpec("grammar", self.guided_grammar)
             if self.guided_grammar is not None else None)) if spec is not None]
        if len(given) > 1:
            raise RequestError(f"give one structured-output constraint, got "
                               f"{', '.join(n for n, _ in given)}", given[1][0])
        return given[0][1] if given else None

    def logprob_fields(self) -> dict[str, Any]:
        """GenerationRequest's logprobs and top_logprobs (validated there)."""
        return {}

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16               # OpenAI's default for completions
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def neutral_only(self) -> dict[str, tuple[Any, Any]]:
        return {**super().neutral_only(),
                "best_of": (self.best_of in (None, 1), "1"), "echo": (not self.echo, "false"),
                "suffix": (self.suffix is None, "null")}

    def logprob_fields(self) -> dict[str, Any]:
        if self.logprobs is None:
            return {}
        return {"logprobs": True, "top_logprobs": self.logprobs}

    def prompt_ids(self, tokenizer: PromptTokenizer) -> list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise RequestError(f"one prompt per request is supported, got {len(p)}", "prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise RequestError("the prompt is empty", "prompt")
            return tokenizer.encode(p, add_special_tokens=True)
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    # ignored: bookkeeping only
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def neutral_only(self) -> dict[str, tuple[Any, Any]]:
        return {**super().neutral_only(),
                "tools": (not self.tools, "empty"),
                "tool_choice": (self.tool_choice in (None, "none"), '"none"'),
                "functions": (not self.functions, "empty"),
                "function_call": (self.function_call in (None, "none"), '"none"'),
                "modalities": (self.modalities in (None, ["text"]), '["text"]'),
                "audio": (self.audio is None, "null"),
                "prediction": (self.prediction is None, "null"),
                "reasoning_effort": (self.reasoning_effort is None, "null"),
                "web_search_options": (self.web_search_options is None, "null"),
                "verbosity": (self.verbosity is None, "null")}

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": bool(self.logprobs), "top_logprobs": self.top_logprobs or 0}

    def prompt_ids(self, tokenizer: PromptTokenizer) -> list[int]:
        if not self.messages:
            raise RequestError("messages is empty: give at least one message", "messages")
        messages = []
        for i, m in enumerate(self.messages):
            if m.role not in CHAT_ROLES:
                raise RequestError(f"messages[{i}].role {m.role!r} is not supported; allowed: "
                                   f"{sorted(CHAT_ROLES)}", f"messages[{i}].role")
            messages.append({"role": CHAT_ROLES[m.role], "content": m.text()})
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, TemplateError) as e:
            raise RequestError(f"the chat template refused these messages: {e}",
                               "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)


# -- structured output -----------------------------------------------------------------------------
def _response_format(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI's response_format: text (none), json_object, json_schema {name, schema, strict}."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text" and len(fmt) == 1:
        return None
    if kind == "json_object" and len(fmt) == 1:
        return GrammarSpec("json_object", "")
    if kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        schema = fmt["json_schema"].get("schema", fmt["json_schema"].get("json_schema"))
        if schema is not None:
            return _json_spec(schema, "response_format.json_schema.schema")
    raise RequestError('response_format must be {"type": "text"}, {"type": "json_object"} or '
                       '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                       "response_format")


def _structured_outputs(so: dict[str, Any] | None) -> GrammarSpec | None:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    if so is None:
        return None
    keys = [k for k, v in so.items() if v not in (None, False)]
    known = {"json", "regex", "choice", "grammar", "json_object"}
    if len(keys) != 1 or keys[0] not in known:
        raise RequestError(f"structured_outputs takes exactly one of {sorted(known)}, got "
                           f"{sorted(so)}", "structured_outputs")
    key, value = keys[0], so[keys[0]]
    if key == "json":
        return _json_spec(value, "structured_outputs.json")
    if key == "choice":
        return _choice(value, "structured_outputs.choice")
    if key == "json_object":
        return GrammarSpec("json_object", "")
    if not isinstance(value, str):
        raise RequestError(f"structured_outputs.{key} must be a string", "structured_outputs")
    return GrammarSpec(key, value)


def _json_spec(schema: str | dict[str, Any] | None, param: str) -> GrammarSpec | None:
    """A JSON schema given as an object or as JSON text."""
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{param} must be a JSON schema (an object)", param)
    return GrammarSpec("json_schema", json.dumps(schema))


def _choice(choices: Any, param: str) -> GrammarSpec | None:
    if choices is None:
        return None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c
                                                                for c in choices):
        raise RequestError(f"{param} must be a non-empty list of non-empty strings", param)
    return GrammarSpec("choice", json.dumps(choices))
