"""Checks on request fields shared by the services; each raises InvalidArgument saying what
was wrong and what is allowed."""
from __future__ import annotations

import re
from collections.abc import Sequence

from dflash.v1 import common_pb2
from runtime.sampling import SamplingConfig
from services.common.errors import InvalidArgument

_SEQ_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def sequence_id(value: str) -> str:
    if not _SEQ_ID.match(value):
        raise InvalidArgument(f"sequence_id {value[:140]!r} is invalid: use 1-128 characters "
                              f"from [A-Za-z0-9._:-]")
    return value


def token_ids(ids: Sequence[int], vocab_size: int, what: str = "token_ids") -> list[int]:
    ids = list(ids)
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise InvalidArgument(f"{what} has ids outside the vocabulary [0, {vocab_size}): "
                              f"{bad[:5]}{' ...' if len(bad) > 5 else ''}")
    return ids


def sampling(msg: common_pb2.SamplingParams, vocab_size: int) -> SamplingConfig:
    cfg = SamplingConfig(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        top_k=0 if msg.top_k in (0, -1) else int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        min_tokens=int(msg.min_tokens),
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=msg.logprobs, top_logprobs=int(msg.top_logprobs),
        processed_logprobs=msg.processed_logprobs,
        presence_penalty=float(msg.presence_penalty), frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.HasField("repetition_penalty")
        else 1.0,
    )
    try:
        cfg.validate(vocab_size)
    except ValueError as e:
        raise InvalidArgument(f"sampling: {e}") from None
    return cfg
