"""Property-based fuzzing (hypothesis) of every RPC handler of the target and the draft services,
through real servers: arbitrary messages of each request type, valid messages with fields
replaced by arbitrary values, and valid messages' wire bytes damaged. Property: every answer is
a defined status (OK, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, FAILED_PRECONDITION,
OUT_OF_RANGE) - never UNKNOWN or INTERNAL - and the service keeps serving.

The budget is fixed (fuzz_settings: derandomized, no deadline): EXAMPLES per method and kind."""
from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.draft_service import start_draft
from support.fuzz import (
    DEFINED,
    Tally,
    byte_mutation,
    call_raw,
    field_mutation,
    fuzz_settings,
    internal_errors,
    message,
)
from support.procs import health_status, start_target
from support.reliability import BLOCK, TARGET_FLAGS, tiny_hybrid

from dflash.make_draft import make_random_drafter
from dflash.v1 import common_pb2, draft_pb2, target_pb2
from services.common import tensor_codec

pytestmark = pytest.mark.slow

EXAMPLES = 100                        # per (method, kind)
KINDS = ("arbitrary", "mutated-fields", "mutated-bytes")
LIVE = "fz-live"                     # a sequence that exists when each example runs
SEQ_IDS = st.one_of(st.just(LIVE), st.just(LIVE + "x"), st.text(max_size=140))
HINTS = {"sequence_id": SEQ_IDS}
SERVING = 1
TALLY = Tally()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_services")


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_dir):
    return tiny_hybrid(tmp_path_factory, smollm2_dir)


@pytest.fixture(scope="module")
def target(model, logs):
    p = start_target(model, logs, *TARGET_FLAGS, "--drain-grace", "1")   # fuzzed sequences stay
    yield p
    assert p.stop() == 0


@pytest.fixture(scope="module")
def drafts(model, logs, tmp_path_factory):
    dflash = make_random_drafter(model, tmp_path_factory.mktemp("dflash"), block_size=BLOCK)
    procs = {"dflash": start_draft(model, logs, "--drain-grace", "1", model_dir=dflash),
             "prompt-lookup": start_draft(model, logs, "--drafter", "prompt-lookup",
                                          "--block-size", str(BLOCK), "--drain-grace", "1")}
    yield procs
    for p in procs.values():
        assert p.stop() == 0


@pytest.fixture(scope="module", autouse=True)
def summary():
    t0 = time.monotonic()
    yield
    print(f"\nRELIABILITY fuzz_services inputs={TALLY.total} seconds="
          f"{time.monotonic() - t0:.0f} answers={TALLY.summary()}")


def fuzz(channel: grpc.Channel, path: str, strategy, setup=lambda: None) -> None:
    """Runs the fixed budget of examples of `strategy` (messages or raw bytes) against path."""
    method = path.rsplit("/", 1)[-1]

    @fuzz_settings(EXAMPLES)
    @given(strategy)
    def run(x):
        setup()
        data = x if isinstance(x, bytes) else x.SerializeToString()
        code = call_raw(channel, path, data)
        TALLY.record(method, code)
        assert code in DEFINED, f"{method} answered {code.name} to {x!r:.300}"

    run()


def strategy(kind: str, cls, valid) -> st.SearchStrategy:
    if kind == "arbitrary":
        return message(cls.DESCRIPTOR, cls, HINTS)
    if kind == "mutated-fields":
        return field_mutation(valid, HINTS)
    return byte_mutation(valid.SerializeToString())


def assert_serving(p, service: str) -> None:
    assert p.proc.poll() is None, f"{service} died:\n{p.log()[-3000:]}"
    assert health_status(p.address, service) == SERVING
    assert not internal_errors(p.log()), p.log()[-3000:]


# -- target --------------------------------------------------------------------------------------
PREFILL = target_pb2.PrefillRequest(
    sequence_id=LIVE, token_ids=list(range(1000, 1012)),
    sampling=common_pb2.SamplingParams(temperature=0.7, top_k=5, seed=3),
    capture_layers=[0, 2], feature_dtype="bfloat16")
TARGET_VALID = {
    "GetCapabilities": common_pb2.GetCapabilitiesRequest(),
    "Prefill": PREFILL,
    "Verify": target_pb2.VerifyRequest(sequence_id=LIVE, token_ids=[1003, 1004, 1005]),
    "Release": common_pb2.ReleaseRequest(sequence_id=LIVE),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", list(TARGET_VALID))
def test_fuzz_target(target, method, kind):
    valid = TARGET_VALID[method]
    with grpc.insecure_channel(target.address) as ch:
        prefill = ch.unary_unary("/dflash.v1.Target/Prefill",
                                 request_serializer=target_pb2.PrefillRequest.SerializeToString,
                                 response_deserializer=target_pb2.PrefillResponse.FromString)
        prefill(PREFILL, timeout=30)
        assert call_raw(ch, f"/dflash.v1.Target/{method}", valid.SerializeToString()) == \
            grpc.StatusCode.OK                                  # the seed itself is valid
        fuzz(ch, f"/dflash.v1.Target/{method}", strategy(kind, type(valid), valid),
             setup=lambda: prefill(PREFILL, timeout=30))
    assert_serving(target, "dflash.v1.Target")


# -- draft ---------------------------------------------------------------------------------------
def propose_seed(caps: draft_pb2.DraftCapabilities) -> draft_pb2.ProposeRequest:
    """A valid Propose starting LIVE from position 0 with 6 positions."""
    import torch
    n = 6
    req = draft_pb2.ProposeRequest(sequence_id=LIVE, positions=list(range(n)),
                                   new_token_ids=list(range(1000, 1000 + n)), anchor=1007,
                                   block_size=BLOCK)
    if caps.needs_features:
        width = len(caps.target_layer_ids) * caps.hidden_size
        feats = torch.randn(n, width).to(getattr(torch, caps.feature_dtype))
        req.new_features.CopyFrom(tensor_codec.encode(feats))
    return req


def draft_caps(ch: grpc.Channel) -> draft_pb2.DraftCapabilities:
    return ch.unary_unary("/dflash.v1.Draft/GetCapabilities",
                          request_serializer=common_pb2.GetCapabilitiesRequest.SerializeToString,
                          response_deserializer=draft_pb2.DraftCapabilities.FromString)(
        common_pb2.GetCapabilitiesRequest(), timeout=10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["GetCapabilities", "Propose", "Release"])
@pytest.mark.parametrize("drafter", ["dflash", "prompt-lookup"])
def test_fuzz_draft(drafts, drafter, method, kind):
    p = drafts[drafter]
    with grpc.insecure_channel(p.address) as ch:
        seed = propose_seed(draft_caps(ch))
        valid = {"GetCapabilities": common_pb2.GetCapabilitiesRequest(), "Propose": seed,
                 "Release": common_pb2.ReleaseRequest(sequence_id=LIVE)}[method]
        propose = ch.unary_unary("/dflash.v1.Draft/Propose",
                                 request_serializer=draft_pb2.ProposeRequest.SerializeToString,
                                 response_deserializer=draft_pb2.ProposeResponse.FromString)
        propose(seed, timeout=30)
        assert call_raw(ch, f"/dflash.v1.Draft/{method}", valid.SerializeToString()) == \
            grpc.StatusCode.OK
        fuzz(ch, f"/dflash.v1.Draft/{method}", strategy(kind, type(valid), valid),
             setup=lambda: propose(seed, timeout=30))
    assert_serving(p, "dflash.v1.Draft")
