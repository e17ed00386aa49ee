"""A DFlash drafter for a Qwen3.5 target as Qwen publishes it (Qwen3_5ForConditionalGeneration:
the text model under model.language_model.*, its fields under text_config): `dflash make-draft`
reads the text model's shape, the draft service reads the target's embedding and LM head from
there, and the three services' greedy output equals transformers' (the drafter is random, so
this checks exactness and wiring, not acceptance)."""
from __future__ import annotations

import pytest
import torch
from support.draft_service import start_draft
from support.gateway_stack import start_gateway
from support.hybrid import hf_greedy, hf_model, make_tiny_hybrid
from support.procs import start_target

from dflash.make_draft import make_random_drafter
from runtime.models.dflash import TargetFingerprint, TargetHead
from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

N = 24


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_hybrid(tmp_path_factory.mktemp("qwen3_5_mm"), vocab_from=smollm2_dir,
                            active_vocab=(1000, 1016), family="qwen3_5_multimodal")


def test_make_draft_and_the_target_head_read_the_text_model(target_dir, tmp_path):
    fp = TargetFingerprint.of_target(target_dir)
    assert (fp.vocab_size, fp.hidden_size, fp.num_layers) == (49152, 64, 4)
    draft = make_random_drafter(target_dir, tmp_path / "draft", target_layer_ids=[1, 2])
    assert TargetFingerprint.of_target(target_dir).differences(fp) == []
    head = TargetHead.load(target_dir, torch.float32, "cpu")
    hf = hf_model(target_dir)
    assert torch.equal(head.embed_weight, hf.model.language_model.embed_tokens.weight)
    assert torch.equal(head.lm_head_weight, hf.lm_head.weight)
    assert (draft / "config.json").is_file()


def test_dflash_drafting_against_it_through_the_services_equals_transformers(target_dir,
                                                                             tmp_path):
    draft_dir = make_random_drafter(target_dir, tmp_path / "draft", target_layer_ids=[1, 2],
                                    block_size=4)
    prompt = ChatTokenizer(target_dir).encode("The cat sat on the mat. " * 3)
    reference = hf_greedy(hf_model(target_dir), prompt, N)
    logs = tmp_path / "logs"
    logs.mkdir()
    target = start_target(target_dir, logs, "--max-block-size", "4", "--kv-budget", "64MiB",
                          "--state-slots", "4")
    draft = start_draft(target_dir, logs, "--drafter", "dflash", model_dir=draft_dir)
    gateway = start_gateway(target.address, target_dir, logs, draft=draft.address)
    try:
        tokens, _, responses = gateway.generate(prompt, N, block_size=4, ignore_eos=True)
        assert responses[-1].usage.draft_tokens > 0   # the drafter ran on the target's features
        assert tokens == reference
    finally:
        assert gateway.stop() == 0 and draft.stop() == 0 and target.stop() == 0


def test_a_drafter_tapping_a_layer_the_target_lacks_is_refused_before_serving(target_dir,
                                                                              tmp_path):
    """Taps [1, 9] against the 4-layer text model (Gated DeltaNet / attention layers 0-3): the
    draft service exits at start-up naming target_layer_ids and the allowed range, and its
    health never says SERVING."""
    import json
    import time

    from grpc_health.v1 import health_pb2
    from support.draft_service import SERVICE
    from support.procs import health_status
    draft_dir = make_random_drafter(target_dir, tmp_path / "draft", target_layer_ids=[1, 2])
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 9]
    (draft_dir / "config.json").write_text(json.dumps(cfg))
    logs = tmp_path / "logs"
    logs.mkdir()
    draft = start_draft(target_dir, logs, "--drafter", "dflash", model_dir=draft_dir, wait=False)
    deadline = time.monotonic() + 120
    while draft.proc.poll() is None and time.monotonic() < deadline:
        assert (health_status(draft.address, SERVICE, timeout=1)
                != health_pb2.HealthCheckResponse.SERVING)
        time.sleep(0.2)
    assert draft.stop() == 2
    assert "target_layer_ids [1, 9] must be distinct ids in [0, 4)" in draft.log()
