"""A small synchronous client of dflash.v1.Target for tests, and helpers for expected errors."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from dflash.v1 import common_pb2, target_pb2, target_pb2_grpc

TIMEOUT_S = 120.0


class TargetClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        self.stub = target_pb2_grpc.TargetStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def capabilities(self, timeout: float = TIMEOUT_S) -> target_pb2.TargetCapabilities:
        return self.stub.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=timeout)

    def prefill(self, seq: str, ids: list[int], sampling: common_pb2.SamplingParams | None = None,
                capture_layers: tuple[int, ...] = (), feature_dtype: str = "",
                num_generated: int = 0, features_from: int = 0) -> target_pb2.PrefillResponse:
        return self.stub.Prefill(target_pb2.PrefillRequest(
            sequence_id=seq, token_ids=ids, sampling=sampling, capture_layers=capture_layers,
            feature_dtype=feature_dtype, num_generated=num_generated,
            features_from=features_from), timeout=TIMEOUT_S)

    def verify(self, seq: str, ids: list[int], parents: list[int] | None = None
               ) -> target_pb2.VerifyResponse:
        return self.stub.Verify(target_pb2.VerifyRequest(sequence_id=seq, token_ids=ids,
                                                         parents=parents or []),
                                timeout=TIMEOUT_S)

    def release(self, seq: str) -> bool:
        return self.stub.Release(common_pb2.ReleaseRequest(sequence_id=seq),
                                 timeout=TIMEOUT_S).released

    def greedy(self, seq: str, prompt: list[int], n: int, release: bool = True) -> list[int]:
        """n tokens of plain greedy decoding: Prefill, then Verify of the anchor alone."""
        out = [self.prefill(seq, prompt).next_token]
        while len(out) < n:
            out.extend(self.verify(seq, [out[-1]]).committed_tokens)
        if release:
            self.release(seq)
        return out


def greedy_alone(address: str, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation of `prompt` (no gateway, no drafts): n tokens."""
    client = TargetClient(address)
    try:
        return client.greedy("alone", prompt, n)
    finally:
        client.close()


def rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    """Runs fn, which must fail with an RpcError; returns it."""
    try:
        fn()
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call succeeded; an error status was expected")


def expect_status(fn: Callable[[], Any], code: grpc.StatusCode, *words: str) -> str:
    """fn must fail with `code` and a message containing every one of `words`; returns it."""
    err = rpc_error(fn)
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    details = err.details() or ""
    missing = [w for w in words if w not in details]
    assert not missing, f"message {details!r} lacks {missing}"
    return details
