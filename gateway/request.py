"""A generation request as the loop sees it (both APIs build one), and its validation against
the target's limits. Errors say what was wrong and what is allowed."""
from __future__ import annotations

import math
import struct
import uuid
from dataclasses import dataclass, replace

from dflash.v1 import common_pb2
from gateway.grammar import GrammarSpec
from runtime.prefix_cache import prompt_keys
from runtime.sampling_limits import (
    GREEDY_BELOW,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
)
from services.common.errors import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
UINT64 = (1 << 64) - 1


class RequestError(InvalidArgument):
    """Bad input; `param` names the offending field (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    max_prompt_tokens: int = 0           # the server's limits (--max-prompt-tokens, 0 = none)
    max_new_tokens: int = 0              # (--max-tokens-limit, 0 = none)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None        # None: up to the context limit
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 / -1 = off
    seed: int | None = None
    min_tokens: int = 0                  # EOS and stop_token_ids suppressed (on the target) until then
    stop: tuple[str, ...] = ()           # stop strings; their text is not returned
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    block_size: int = 0                  # 0 = the gateway's default
    skip_special_tokens: bool = True
    logprobs: bool = False               # each delivered token's log-probability (the target's) ...
    top_logprobs: int = 0                # ... and the top ones at its position (0..20)
    processed_logprobs: bool = False     # False: the raw distribution (runtime/logprobs.py)
    presence_penalty: float = 0.0        # applied on the target, exactly (runtime/penalties.py)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    grammar: GrammarSpec | None = None   # structured output (compiled by the service)
    request_id: str = ""

    @property
    def greedy(self) -> bool:
        """Below GREEDY_BELOW (the target's SamplingConfig.greedy rule, the same constant)."""
        return self.temperature < GREEDY_BELOW

    def prefix_keys(self, page_size: int) -> list[bytes]:
        """The prefix-cache keys a target or draft with pages of `page_size` looks the prompt
        up by (runtime/prefix_cache.py): the hook for placing a request on
        the replica that holds its longest prefix, once the gateway has several (the scale-out
        issue); one replica today."""
        return prompt_keys(list(self.prompt_ids), page_size)

    def sampling_pb(self, seed_offset: int = 0) -> common_pb2.SamplingParams:
        """seed_offset > 0 on a rebuild, so a sampled stream does not replay its random draws."""
        msg = common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                        min_tokens=self.min_tokens,
                                        stop_token_ids=list(self.stop_token_ids),
                                        logprobs=self.logprobs, top_logprobs=self.top_logprobs,
                                        processed_logprobs=self.processed_logprobs,
                                        presence_penalty=self.presence_penalty,
                                        frequency_penalty=self.frequency_penalty)
        if self.repetition_penalty != 1.0:
            msg.repetition_penalty = self.repetition_penalty
        if self.top_p != 1.0:
            msg.top_p = self.top_p
        if self.seed is not None:
            msg.seed = (self.seed + seed_offset * 0x9E3779B97F4A7C15) & UINT64
        return msg


def validate(req: GenerationRequest, limits: Limits) -> GenerationRequest:
    """Checks every field; returns the request with max_tokens resolved and a request id."""
    n = len(req.prompt_ids)
    if n == 0:
        raise RequestError("the prompt is empty: give at least one token", "prompt")
    bad = [t for t in req.prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {limits.vocab_size})", "prompt")
    if limits.max_prompt_tokens and n > limits.max_prompt_tokens:
        raise RequestError(f"the prompt has {n} tokens; this server accepts at most "
                           f"{limits.max_prompt_tokens}", "prompt")
    room = limits.max_context - n
    if room < 1:
        raise RequestError(f"the prompt has {n} tokens; this model's context holds "
                           f"{limits.max_context}, leaving none to generate", "prompt")
    max_tokens = _max_tokens(req.max_tokens, room, n, limits)
    _sampling(req, limits, max_tokens)
    _stops(req, limits)
    if req.block_size < 0:
        raise RequestError(f"block_size must be >= 0 (0 = default), got {req.block_size}",
                           "block_size")
    return replace(req, max_tokens=max_tokens, request_id=req.request_id or uuid.uuid4().hex)


def _max_tokens(value: int | None, room: int, n: int, limits: Limits) -> int:
    cap = limits.max_new_tokens
    if value is None:
        return min(room, cap) if cap else room
    if value < 1:
        raise RequestError(f"max_tokens must be >= 1, got {value}", "max_tokens")
    if cap and value > cap:
        raise RequestError(f"max_tokens {value} is too large: this server generates at most "
                           f"{cap} tokens per request", "max_tokens")
    max_context = limits.max_context
    if value > room:
        raise RequestError(f"max_tokens {value} is too large: this model's context holds "
                           f"{max_context} tokens and the prompt uses {n}, so at most {room} "
                           f"can be generated", "max_tokens")
    return value


def _sampling(req: GenerationRequest, limits: Limits, max_tokens: int) -> None:
    if not 0 <= req.temperature <= MAX_TEMPERATURE:                     # NaN fails too
        raise RequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy; "
                           f"below {GREEDY_BELOW:g} is greedy too), got {req.temperature}",
                           "temperature")
    if not (math.isfinite(req.top_p) and 0 < _float32(req.top_p) <= 1):
        raise RequestError(f"top_p must be in (0, 1] (and not below float32's smallest "
                           f"positive value), got {req.top_p}", "top_p")
    if not -1 <= req.top_k <= MAX_TOP_K:
        raise RequestError(f"top_k must be -1 or 0 (off) or in [1, {MAX_TOP_K}], got "
                           f"{req.top_k}", "top_k")
    if req.seed is not None and not 0 <= req.seed <= UINT64:
        raise RequestError(f"seed must be in [0, 2**64), got {req.seed}", "seed")
    if not 0 <= req.min_tokens <= max_tokens:
        raise RequestError(f"min_tokens must be in [0, max_tokens={max_tokens}], got "
                           f"{req.min_tokens}", "min_tokens")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                           f"{req.top_logprobs}", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs set", "top_logprobs")
    _penalties(req)
    if req.grammar is not None and (req.ignore_eos or req.min_tokens):
        name = "ignore_eos" if req.ignore_eos else "min_tokens"
        raise RequestError(f"{name} cannot be combined with structured output: the grammar "
                           f"decides where the output ends (with EOS)", name)


def _penalties(req: GenerationRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise RequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), "
                               f"got {value}", name)
    if not (math.isfinite(req.repetition_penalty) and MIN_REPETITION_PENALTY
            <= _float32(req.repetition_penalty) <= MAX_REPETITION_PENALTY):
        raise RequestError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                           f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {req.repetition_penalty}",
                           "repetition_penalty")


def _float32(x: float) -> float:
    """x as the wire's float fields carry it (0 for values below float32's smallest)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _stops(req: GenerationRequest, limits: Limits) -> None:
    if len(req.stop) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}", "stop")
    for s in req.stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise RequestError(f"stop strings must have 1..{MAX_STOP_CHARS} characters, got "
                               f"{s[:40]!r} ({len(s)})", "stop")
    bad = [t for t in req.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                           f"[0, {limits.vocab_size})", "stop_token_ids")
