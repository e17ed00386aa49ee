"""`python -m services.draft` as a real process behind real gRPC, with SmolLM2 as the target:
bad input, sequence lifecycle, drafts over real target features, readiness, start-up refusals,
prompt lookup, metrics."""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.dflash_reference import ReferenceDFlash
from support.draft_service import SERVICE, propose_request, start_draft
from support.procs import free_port, health_status, start_target

from dflash.harness import HookFlags
from dflash.make_draft import make_random_drafter
from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from runtime.draft_tree import DraftTree, best_prefixes, parents_problem
from runtime.models.dflash import TargetFingerprint
from services.common import tensor_codec

pytestmark = pytest.mark.slow
H = 576                     # SmolLM2 hidden size; the drafter taps one layer: K*H = 576
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def feats(n: int, seed: int = 0, width: int = H, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def smol_draft(smollm2_dir: Path, tmp_path_factory) -> Path:
    return make_random_drafter(smollm2_dir, tmp_path_factory.mktemp("smol_draft"), num_layers=1,
                               block_size=16, seed=0)


@pytest.fixture(scope="module")
def service(smol_draft, smollm2_dir, tmp_path_factory):
    metrics_port = free_port()
    p = start_draft(smollm2_dir, tmp_path_factory.mktemp("draft_logs"), "--metrics-port",
                    str(metrics_port), "--model-id", "smol-draft", model_dir=smol_draft)
    p.metrics_port = metrics_port
    yield p
    p.stop()


@pytest.fixture(scope="module")
def stub(service):
    with grpc.insecure_channel(service.address) as channel:
        yield draft_pb2_grpc.DraftStub(channel)


def expect_error(call, code: grpc.StatusCode, *needles: str) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    for needle in needles:
        assert needle in e.value.details()
    return e.value.details()


def test_capabilities(stub, smollm2_dir):
    caps = stub.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=10)
    fp = TargetFingerprint.of_target(smollm2_dir)
    assert (caps.drafter_kind, caps.block_size, caps.max_block_size) == ("dflash", 16, 16)
    assert list(caps.target_layer_ids) == [15] and caps.mask_token_id == 16
    assert (caps.hidden_size, caps.feature_dtype, caps.needs_features) == (H, "bfloat16", True)
    assert (caps.target.vocab_size, caps.target.hidden_size, caps.target.num_layers,
            caps.target.tokenizer_hash) == (fp.vocab_size, fp.hidden_size, fp.num_layers,
                                            fp.tokenizer_hash)
    assert caps.protocol_version == 1 and caps.model_id == "smol-draft"
    assert caps.lease_seconds == 120
    # warm-up's Propose cost by its forward's rows (appended + the block of 16): every point
    # timed, and trees (this drafter builds them) on their own curve
    assert [p.tokens for p in caps.propose_cost] == [17, 18, 20, 24, 32]
    assert [p.tokens for p in caps.propose_cost_tree] == [17, 18, 20]
    assert all(0 < p.seconds < 5 for p in (*caps.propose_cost, *caps.propose_cost_tree))


def _truncated() -> draft_pb2.ProposeRequest:
    req = propose_request("bytes", feats(2), 0, 1)
    req.new_features.data = req.new_features.data[:-2]
    return req


def _rows_mismatch() -> draft_pb2.ProposeRequest:
    req = propose_request("rows", feats(4), 0, 1)
    req.positions.append(4)
    return req


def _with_positions(positions: list[int]) -> draft_pb2.ProposeRequest:
    req = propose_request("pos", feats(len(positions)), 0, 1)
    del req.positions[:]
    req.positions.extend(positions)
    return req


BAD = {
    "float32 features": (lambda: propose_request("dt", feats(4, dtype=torch.float32), 0, 1),
                         ["dtype 'float32'", "takes 'bfloat16'"]),
    "width not K*H": (lambda: propose_request("w", feats(4, width=H - 1), 0, 1),
                      ["shape [4, 575]", "expected [4, 576]", "1 target layers [15]"]),
    "rows != positions": (_rows_mismatch, ["shape [4, 576]", "expected [5, 576]"]),
    "positions skip": (lambda: _with_positions([0, 1, 3]),
                       ["skips at index 2: expected 2, got 3"]),
    "positions repeat": (lambda: _with_positions([0, 1, 1]),
                         ["repeats at index 2: expected 2, got 1"]),
    "block over max": (lambda: propose_request("b", feats(2), 0, 1, block_size=17),
                       ["block_size 17 is not allowed: expected 1..16"]),
    "anchor outside vocab": (lambda: propose_request("a", feats(2), 0, 49152),
                             ["anchor 49152 is outside the target vocabulary",
                              "expected an id in [0, 49152)"]),
    "token id outside vocab": (lambda: propose_request("t", feats(2), 0, 1, token_ids=[3, 60000]),
                               ["new_token_ids has ids outside the vocabulary [0, 49152)"]),
    "token ids != positions": (lambda: propose_request("t2", feats(2), 0, 1, token_ids=[3]),
                               ["one id per position: expected 2, got 1"]),
    "bytes != shape": (_truncated, ["bytes do not match shape [2, 576]"]),
    "features missing": (lambda: draft_pb2.ProposeRequest(sequence_id="m", positions=[0, 1, 2],
                                                          anchor=1),
                         ["new_features is missing: 3 positions need a [3, 576] bfloat16 tensor"]),
    "bad sequence id": (lambda: propose_request("no spaces!", feats(1), 0, 1), ["sequence_id"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_invalid_argument_and_others_keep_being_served(case, stub):
    build, needles = BAD[case]
    expect_error(lambda: stub.Propose(build(), timeout=10), INVALID, *needles)
    ok = stub.Propose(propose_request(f"ok-{sorted(BAD).index(case)}", feats(3), 0, 5), timeout=10)
    assert len(ok.draft_tokens) == 15 and ok.context_len == 3


def test_positions_must_continue_the_context(stub):
    p = lambda req: stub.Propose(req, timeout=10)
    assert p(propose_request("cont", feats(6), 0, 11)).context_len == 6
    expect_error(lambda: p(propose_request("cont", feats(3), 3, 11)), INVALID,
                 "expected the first position to be 6 (or 0 to restart), got 3")
    expect_error(lambda: p(propose_request("cont", feats(2), 8, 11)), INVALID,
                 "expected the first position to be 6 (or 0 to restart), got 8")
    assert p(propose_request("cont", feats(2, seed=1), 6, 12)).context_len == 8
    again = p(propose_request("cont", None, 0, 12))             # no new rows: propose again
    assert again.context_len == 8 and len(again.draft_tokens) == 15
    small = p(propose_request("cont", None, 0, 12, block_size=4))
    assert len(small.draft_tokens) == 3 and small.context_len == 8
    # the forward it ran in, alone: no rows appended plus its block of 4 (the gateway's cost
    # model prices Proposes by it)
    assert small.batch_rows == 4 and small.batch_seconds > 0
    assert p(propose_request("cont", feats(3), 0, 12)).context_len == 3   # restart at 0


def test_unknown_and_released_sequences(stub):
    p = lambda req: stub.Propose(req, timeout=10)
    expect_error(lambda: p(propose_request("ghost", feats(2), 5, 1)), NOT_FOUND,
                 "unknown sequence 'ghost'", "from position 0")
    expect_error(lambda: p(propose_request("ghost", None, 0, 1)), NOT_FOUND, "unknown sequence")
    p(propose_request("rel", feats(4), 0, 1))
    release = lambda: stub.Release(common_pb2.ReleaseRequest(sequence_id="rel"), timeout=10)
    assert release().released is True
    assert release().released is False
    expect_error(lambda: p(propose_request("rel", feats(1), 4, 1)), NOT_FOUND, "unknown sequence")
    expect_error(lambda: stub.Release(common_pb2.ReleaseRequest(sequence_id=""), timeout=10),
                 INVALID, "sequence_id")


def test_drafts_over_real_target_features_match_a_from_scratch_forward(
        stub, smol_draft, smollm2_dir, log_dir):
    """Target Prefill -> draft Propose -> target Verify -> draft Propose, checked against the
    independent reference over all features received so far."""
    ref = ReferenceDFlash(smol_draft, smollm2_dir)
    target = start_target(smollm2_dir, log_dir)
    try:
        with grpc.insecure_channel(target.address) as ch:
            tstub = target_pb2_grpc.TargetStub(ch)
            prompt = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198]
            pre = tstub.Prefill(target_pb2.PrefillRequest(
                sequence_id="e2e", token_ids=prompt, capture_layers=[15],
                feature_dtype="bfloat16"), timeout=60)
            context = tensor_codec.decode(pre.features)
            assert tuple(context.shape) == (len(prompt), H)
            d = stub.Propose(draft_pb2.ProposeRequest(
                sequence_id="e2e", new_features=pre.features, positions=range(len(prompt)),
                new_token_ids=prompt, anchor=pre.next_token), timeout=30)
            assert list(d.draft_tokens) == ref.drafts(ref.block_hidden(context, pre.next_token, 16))
            v = tstub.Verify(target_pb2.VerifyRequest(
                sequence_id="e2e", token_ids=[pre.next_token, *d.draft_tokens]), timeout=60)
            new = tensor_codec.decode(v.features)
            assert new.shape[0] == v.accepted + 1
            context = torch.cat([context, new])
            anchor = v.committed_tokens[-1]
            d2 = stub.Propose(draft_pb2.ProposeRequest(
                sequence_id="e2e", new_features=v.features,
                positions=range(len(prompt), len(prompt) + new.shape[0]),
                new_token_ids=[pre.next_token, *d.draft_tokens[: v.accepted]], anchor=anchor),
                timeout=30)
            assert d2.context_len == len(prompt) + v.accepted + 1
            assert list(d2.draft_tokens) == ref.drafts(ref.block_hidden(context, anchor, 16))
    finally:
        target.stop()


def test_tree_propose_is_the_likeliest_prefixes_of_the_reference_block(
        stub, service, smol_draft, smollm2_dir):
    """tree_nodes N: N drafts with parents, each path among the N likeliest prefixes of the
    block's per-position distributions of the from-scratch reference."""
    ref = ReferenceDFlash(smol_draft, smollm2_dir)
    context, n = feats(24, seed=5), 12
    req = propose_request("tree", context, 0, 42)
    req.tree_nodes = n
    d = stub.Propose(req, timeout=30)
    tree = DraftTree(list(d.draft_tokens), list(d.draft_parents))
    assert len(tree.tokens) == n and parents_problem(tree.parents, n) is None
    assert max(tree.depths) <= 15
    logp = torch.log_softmax(ref.block_hidden(context, 42, 16)[1:] @ ref.lm_head.t(), -1)
    score = [0.0]                                       # each node's summed log-probability
    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents), start=1):
        score.append(score[p] + float(logp[tree.depths[i] - 1, t]))
    top = logp.topk(n)
    best = best_prefixes(top.values.tolist(), n)
    nth = min(sum(top.values[i, r].item() for i, r in enumerate(ranks)) for ranks in best)
    assert min(score[1:]) >= nth - 1e-3
    stub.Release(common_pb2.ReleaseRequest(sequence_id="tree"), timeout=10)
    caps = stub.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=10)
    assert caps.max_tree_nodes == 255
    big = propose_request("tree2", feats(4), 0, 42)
    big.tree_nodes = 256
    expect_error(lambda: stub.Propose(big, timeout=10), INVALID, "tree_nodes 256", "up to 255")
    one = propose_request("tree3", feats(4), 0, 42, block_size=1)
    one.tree_nodes = 4
    expect_error(lambda: stub.Propose(one, timeout=10), INVALID, "block_size 1", "at least 2")


def test_metrics(service, stub):
    stub.Propose(propose_request("metrics", feats(20), 0, 1), timeout=10)
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics",
                                  timeout=10).read().decode()
    labels = 'model_name="smol-draft",service="draft"'
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("dflash_") and labels in line}
    assert values[f"dflash_ready{{{labels}}}"] == 1
    assert values[f"dflash_sequences_active{{{labels}}}"] >= 1
    assert values[f"dflash_kv_cache_usage_ratio{{{labels}}}"] > 0
    assert values[f"dflash_forward_tokens_total{{{labels}}}"] >= 20 + 16
    assert any(k.startswith("dflash_rpc_requests_total") and 'method="Propose"' in k
               and 'code="OK"' in k for k in values)


def test_readiness_through_a_health_watch(smol_draft, smollm2_dir, log_dir):
    p = start_draft(smollm2_dir, log_dir, model_dir=smol_draft, wait=False,
                    hooks=HookFlags(warmup_delay_s=3))
    try:
        with grpc.insecure_channel(p.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            stream = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=120)
            seen, refused = [], ""
            for response in stream:
                seen.append(response.status)
                if response.status == health_pb2.HealthCheckResponse.NOT_SERVING and not refused:
                    assert health_status(p.address, "") == health_pb2.HealthCheckResponse.SERVING
                    refused = expect_error(
                        lambda: draft_pb2_grpc.DraftStub(ch).GetCapabilities(
                            common_pb2.GetCapabilitiesRequest(), timeout=10),
                        grpc.StatusCode.UNAVAILABLE, "draft not ready: start-up stage")
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            stream.cancel()
            assert seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING and refused
            assert seen[-1] == health_pb2.HealthCheckResponse.SERVING
            caps = draft_pb2_grpc.DraftStub(ch).GetCapabilities(
                common_pb2.GetCapabilitiesRequest(), timeout=10)
            assert caps.drafter_kind == "dflash"
    finally:
        p.stop()


def _refused(p) -> str:
    """Waits for the process to exit while polling health; it must never be SERVING."""
    deadline = time.monotonic() + 120
    while p.proc.poll() is None and time.monotonic() < deadline:
        assert health_status(p.address, SERVICE, timeout=1) != health_pb2.HealthCheckResponse.SERVING
        time.sleep(0.2)
    code = p.stop()
    assert code == 2, p.log()
    return p.log()


def _edited(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        elif key == "mask_token_id":
            cfg["dflash_config"]["mask_token_id"] = value
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


def test_start_up_refuses_a_drafter_made_for_another_target(tiny_qwen3_dir, smollm2_dir,
                                                           tmp_path, log_dir):
    tiny = make_random_drafter(tiny_qwen3_dir, tmp_path / "tiny", block_size=8)
    log = _refused(start_draft(smollm2_dir, log_dir, model_dir=tiny, wait=False))
    assert "refusing to serve" in log
    for line in ("target vocab_size: the drafter was made for 256, the target has 49152",
                 "target hidden_size: the drafter was made for 64, the target has 576",
                 "target num_layers: the drafter was made for 4, the target has 30",
                 "target tokenizer_hash: the drafter was made for ''"):
        assert line in log


def test_start_up_refuses_a_mask_token_outside_the_vocab(smol_draft, smollm2_dir, tmp_path,
                                                        log_dir):
    bad = _edited(smol_draft, tmp_path / "mask", mask_token_id=49152)
    log = _refused(start_draft(smollm2_dir, log_dir, model_dir=bad, wait=False))
    assert "mask_token_id 49152 is outside the target vocabulary: expected an id in [0, 49152)" in log


def test_start_up_refuses_fc_wider_than_the_targets_features(smol_draft, smollm2_dir, tmp_path,
                                                             log_dir):
    """A z-lab checkpoint (no fingerprint) whose fc takes 2 x 576 while the config taps one
    target layer."""
    from safetensors.torch import load_file, save_file
    bad = _edited(smol_draft, tmp_path / "fc", target_fingerprint=None)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(H, 2 * H)
    save_file(tensors, str(bad / "model.safetensors"))
    log = _refused(start_draft(smollm2_dir, log_dir, model_dir=bad, wait=False))
    assert "fc.weight input width 1152 != K*H_target = 1 x 576 = 576" in log


def test_prompt_lookup_service_from_env(smollm2_dir, log_dir):
    env = {"DFLASH_DRAFTER": "prompt-lookup", "DFLASH_TARGET_MODEL": str(smollm2_dir),
           "DFLASH_BLOCK_SIZE": "6", "DFLASH_LEASE_SECONDS": "1.5"}
    p = start_draft(None, log_dir, env=env)
    try:
        with grpc.insecure_channel(p.address) as ch:
            s = draft_pb2_grpc.DraftStub(ch)
            caps = s.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=10)
            assert (caps.drafter_kind, caps.needs_features, list(caps.target_layer_ids),
                    caps.block_size) == ("prompt-lookup", False, [], 6)
            assert caps.target.vocab_size == 49152 and caps.target.num_layers == 30
            # committed 5 6 7 8 9 5 6, anchor 7: [5, 6, 7] occurred at 0 -> 8 9 5 6 7
            r = s.Propose(propose_request("pl", None, 0, 7, token_ids=[5, 6, 7, 8, 9, 5, 6]),
                          timeout=10)
            assert list(r.draft_tokens) == [8, 9, 5, 6, 7] and r.context_len == 7
            # features are not needed, and ignored when sent
            r = s.Propose(propose_request("pl", feats(1), 7, 40, token_ids=[7]), timeout=10)
            assert list(r.draft_tokens) == []                   # 40 never occurred
            expect_error(lambda: s.Propose(draft_pb2.ProposeRequest(
                sequence_id="pl", positions=[8], anchor=1), timeout=10), INVALID,
                "new_token_ids must have one id per position: expected 1, got 0")
            time.sleep(3.5)                                     # the 1.5 s lease runs out
            expect_error(lambda: s.Propose(propose_request("pl", None, 8, 1, token_ids=[40]),
                                           timeout=10), NOT_FOUND, "lease expired")
    finally:
        p.stop()
