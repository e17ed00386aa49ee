"""The draft's prefix cache through its gRPC service (the shipped drafter in fp32, pages of 4,
over SmolLM2's real features of a chat prompt): OpenSequence finds the context an earlier
sequence committed for the same tokens, and a Propose that continues from there drafts exactly
what the earlier sequence drafted from the whole context; bad input is refused and the service
goes on."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from support import prom
from support.draft_service import propose_request, start_draft
from support.procs import free_port, start_target
from support.target_client import TargetClient

from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from runtime.models.dflash import DFlashConfig
from runtime.tokenizer import ChatTokenizer
from services.common import tensor_codec

pytestmark = pytest.mark.slow
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"


@pytest.fixture(scope="module")
def prompt(smollm2_dir: Path, tmp_path_factory) -> tuple[list[int], torch.Tensor, int]:
    """A chat prompt's tokens (all but the last), the target's features of them for the
    shipped drafter, and the last token (the anchor)."""
    tok = ChatTokenizer(smollm2_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content":
                                               "Count from one to twenty, in words."}]))
    target = start_target(smollm2_dir, tmp_path_factory.mktemp("target"))
    try:
        client = TargetClient(target.address)
        layers = tuple(DFlashConfig.from_dir(SHIPPED).target_layer_ids)
        resp = client.prefill("p", ids, capture_layers=layers, feature_dtype="bfloat16")
        client.close()
    finally:
        target.stop()
    features = tensor_codec.decode(resp.features)
    return ids[:-1], features[:-1], ids[-1]


@pytest.fixture(scope="module")
def service(smollm2_dir: Path, tmp_path_factory):
    port = free_port()
    p = start_draft(smollm2_dir, tmp_path_factory.mktemp("logs"), "--page-size", "4",
                    "--dtype", "float32", "--metrics-port", str(port), model_dir=SHIPPED)
    p.metrics_port = port
    yield p
    p.stop()


@pytest.fixture(scope="module")
def stub(service):
    with grpc.insecure_channel(service.address) as channel:
        yield draft_pb2_grpc.DraftStub(channel)


def open_seq(stub, seq: str, tokens: list[int]) -> int:
    return stub.OpenSequence(draft_pb2.OpenSequenceRequest(sequence_id=seq, token_ids=tokens),
                             timeout=30).cached_tokens


def propose(stub, seq: str, features: torch.Tensor, start: int, tokens: list[int],
            anchor: int) -> list[int]:
    return list(stub.Propose(propose_request(seq, features, start, anchor, token_ids=tokens),
                             timeout=30).draft_tokens)


def release(stub, seq: str) -> None:
    stub.Release(common_pb2.ReleaseRequest(sequence_id=seq), timeout=30)


def test_capabilities_offer_it(stub):
    assert stub.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=30).prefix_caching


def test_a_cached_prefix_gives_the_drafts_of_the_whole_context(stub, service, prompt):
    tokens, f, anchor = prompt
    full = len(tokens) // 4 * 4                # positions in full pages
    assert open_seq(stub, "first", tokens) == 0
    whole = propose(stub, "first", f, 0, tokens, anchor)
    assert len(whole) == 15 and len(set(whole)) > 3           # a real continuation
    release(stub, "first")                     # its full pages stay cached
    hits = prom.value(service.metrics_port, "dflash_prefix_cache_hits_total", service="draft")
    held = open_seq(stub, "second", tokens + [anchor])
    assert held == full
    assert propose(stub, "second", f[held:], held, tokens[held:], anchor) == whole
    assert prom.value(service.metrics_port, "dflash_prefix_cache_hits_total",
                      service="draft") - hits == full
    # another beginning finds nothing; once a live sequence committed it, others share it
    other = [tokens[0] + 1] + tokens[1:]
    assert open_seq(stub, "third", other) == 0
    drafts = propose(stub, "third", f, 0, other, anchor)
    assert open_seq(stub, "fourth", other + [anchor]) == full
    assert propose(stub, "fourth", f[full:], full, other[full:], anchor) == drafts
    for seq in ("second", "third", "fourth"):
        release(stub, seq)


def test_context_without_token_ids_is_not_cached(stub, prompt):
    _, f, anchor = prompt
    tokens = [7] * 12
    stub.Propose(propose_request("anon", f[:12], 0, anchor), timeout=30)    # no token ids
    release(stub, "anon")
    assert open_seq(stub, "named", tokens + [1]) == 0
    release(stub, "named")


@pytest.mark.parametrize("tokens, needle", [([10 ** 6], "token"), ([1] * 100_000, "max context")])
def test_bad_open_requests_are_refused_and_the_service_goes_on(stub, tokens, needle):
    with pytest.raises(grpc.RpcError) as e:
        open_seq(stub, "bad", tokens)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    assert open_seq(stub, "ok", [7] * 5) == 0
    release(stub, "ok")
