"""--speculation auto through the three services (SmolLM2 fp32 + the shipped DFlash drafter):
the target measures its verify cost at warm-up and reports it; the gateway's choice every step
never changes the output (greedy: token for token the fixed sizes' and the target's alone, also
with requests at once); the choices are exported; a calibration that fails leaves the target
serving with no curve and the gateway on fixed speculation, with a warning."""
from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.draft_service import start_draft
from support.gateway_stack import chat_prompts, generate_concurrently, start_gateway
from support.procs import start_target

from dflash.harness import HookFlags
from dflash.v1 import common_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

SHIPPED = "models/smollm2-135m-instruct-dflash"
TEXTS = ["Write a short poem about the sea.",
         "Repeat this sentence word for word: the early bird catches the worm.",
         "List the first ten prime numbers, separated by commas."]


def capabilities(address: str):
    with grpc.insecure_channel(address) as ch:
        return target_pb2_grpc.TargetStub(ch).GetCapabilities(
            common_pb2.GetCapabilitiesRequest(), timeout=10)


def samples(http_port: int, name: str) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


@pytest.fixture(scope="module")
def services(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("adaptive")
    # a budget that reaches the trees while the other processes start beside it
    target = start_target(smollm2_dir, logs, "--cost-calibration-s", "5")
    draft = start_draft(smollm2_dir, logs, model_dir=SHIPPED)
    gws = {"alone": start_gateway(target.address, smollm2_dir, logs),
           "auto": start_gateway(target.address, smollm2_dir, logs, draft=draft.address),
           "chain": start_gateway(target.address, smollm2_dir, logs, "--speculation", "4",
                                  draft=draft.address),
           "tree": start_gateway(target.address, smollm2_dir, logs, "--speculation", "fixed",
                                 "--spec-tree-nodes", "15", draft=draft.address)}
    yield target, gws
    for p in (*gws.values(), draft, target):
        p.stop()


def test_the_target_reports_its_verify_cost(services):
    target, _ = services
    caps = capabilities(target.address)
    curve = [(p.tokens, p.seconds) for p in caps.verify_cost]
    assert len(curve) >= 3, curve
    assert [t for t, _ in curve] == sorted(t for t, _ in curve) and curve[0][0] == 1
    assert all(s > 0 for _, s in curve)
    trees = [(p.tokens, p.seconds) for p in caps.verify_cost_tree]
    assert trees and trees[0][0] == 8 and all(s > 0 for _, s in trees), trees   # a tree of 7
    assert "verify cost calibrated" in target.log()


def test_auto_output_equals_fixed_sizes_and_the_target_alone(services, smollm2_dir):
    _, gws = services
    prompts = chat_prompts(smollm2_dir, TEXTS)
    outputs = {name: [gw.generate(p, 40)[0] for p in prompts] for name, gw in gws.items()}
    for name in ("auto", "chain", "tree"):
        assert outputs[name] == outputs["alone"], name
    together = generate_concurrently(gws["auto"], prompts, 40)
    assert together == outputs["alone"]


def test_auto_exports_its_choices_and_cost_model(services, smollm2_dir):
    _, gws = services
    gw = gws["auto"]
    gw.generate(chat_prompts(smollm2_dir, TEXTS[:1])[0], 24)
    chosen = samples(gw.http_port, "dflash_spec_verify_tokens_chosen_count")
    assert sum(chosen.values()) >= 1, chosen
    cost = {dict(k)["component"]: v for k, v in
            samples(gw.http_port, "dflash_spec_cost_seconds").items()}
    assert cost["verify_1"] > 0 and cost["overhead"] >= 0, cost
    fixed = samples(gws["chain"].http_port, "dflash_spec_verify_tokens_chosen_count")
    assert sum(fixed.values()) == 0                # fixed sizes choose nothing


def test_a_failed_calibration_starts_anyway_and_the_gateway_uses_fixed_sizes(smollm2_dir,
                                                                             tmp_path):
    target = start_target(smollm2_dir, tmp_path, hooks=HookFlags(fail_cost_calibration=True))
    draft = start_draft(smollm2_dir, tmp_path, model_dir=SHIPPED)
    gw = start_gateway(target.address, smollm2_dir, tmp_path, draft=draft.address)
    try:
        caps = capabilities(target.address)
        assert list(caps.verify_cost) == [] and list(caps.verify_cost_tree) == []
        assert "verify cost calibration failed" in target.log()
        prompt = chat_prompts(smollm2_dir, TEXTS[:1])[0]
        ids, _, responses = gw.generate(prompt, 24)
        assert len(ids) == 24 and sum(r.accepted for r in responses) > 0   # still speculating
        assert "reports no verify cost curve" in gw.log()
        chosen = samples(gw.http_port, "dflash_spec_verify_tokens_chosen_count")
        assert sum(chosen.values()) == 0
    finally:
        for p in (gw, draft, target):
            p.stop()


def test_cost_calibration_can_be_turned_off(smollm2_dir, tmp_path):
    target = start_target(smollm2_dir, tmp_path, "--cost-calibration-s", "0")
    try:
        assert list(capabilities(target.address).verify_cost) == []
        assert "verify cost calibrated" not in target.log()
    finally:
        target.stop()
