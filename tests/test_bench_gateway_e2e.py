"""bench/gateway_cpu.py's end-to-end bookkeeping: a prompt's time on a system is the median of
its rounds (greedy rounds must agree in length), and transformers' `generate` as a benchmark
system returns exactly what `generate` returns."""
from __future__ import annotations

import pytest
import torch
from support.tiny_models import make_tiny
from transformers import AutoModelForCausalLM

from bench.gateway_cpu import TransformersGenerate, median_run, rounds_text, transformers_run


def test_a_prompts_time_is_the_median_of_its_rounds():
    rounds = [{"tokens": 64, "seconds": 3.0, "ttft_s": 0.2, "verify_steps": 30},
              {"tokens": 64, "seconds": 9.0, "ttft_s": 0.9, "verify_steps": 30},
              {"tokens": 64, "seconds": 2.0, "ttft_s": 0.1, "verify_steps": 30}]
    run = median_run(rounds)
    assert run["seconds"] == 3.0 and run["ttft_s"] == 0.2
    assert run["seconds_rounds"] == [3.0, 9.0, 2.0] and run["verify_steps"] == 30
    assert median_run([{"tokens": 5, "seconds": 1.5}]) == {
        "tokens": 5, "seconds": 1.5, "seconds_rounds": [1.5]}


def test_greedy_rounds_of_different_lengths_are_an_error():
    with pytest.raises(RuntimeError, match="differ in length"):
        median_run([{"tokens": 64, "seconds": 1.0}, {"tokens": 63, "seconds": 1.0}])


def test_the_report_says_how_it_was_timed():
    assert "median of its rounds" in rounds_text({"rounds": 3}) and "3 rounds" in rounds_text(
        {"rounds": 3})
    assert rounds_text({}) == "" and rounds_text({"rounds": 1}) == ""    # older results


def test_transformers_as_a_system_returns_what_generate_returns(tmp_path):
    model_dir = make_tiny(tmp_path / "tiny", "llama")
    prompts = [[1, 5, 9, 13], [2, 4, 6]]
    result = transformers_run(model_dir, prompts, max_tokens=6)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)
                    [0, len(p):].tolist() for p in prompts]
    assert result["output_ids"] == expected
    assert [r["tokens"] for r in result["runs"]] == [len(e) for e in expected]
    system = TransformersGenerate(model_dir)           # a prompt not yet run is generated
    assert system.output_ids(prompts[:1], 6) == expected[:1]


def test_stack_systems_name_their_draft_dtype(tmp_path):
    """--e2e-drafters DRAFTER[:DRAFT_DTYPE]: the label says the dtype, the stack's options carry
    it ("" = the launcher's default), and each system logs into its own folder."""
    from bench.gateway_cpu import stack_system
    label, fp32 = stack_system("dflash:float32", tmp_path)
    assert label == "dflash up --drafter dflash --draft-dtype float32"
    assert fp32.services.opts.draft_dtype == "float32"
    label, default = stack_system("dflash", tmp_path)
    assert label == "dflash up --drafter dflash" and default.services.opts.draft_dtype == ""
    assert fp32.services.opts.log_dir != default.services.opts.log_dir


def test_fewer_than_one_round_is_refused_before_anything_starts(capsys):
    from bench.gateway_cpu import main
    with pytest.raises(SystemExit) as done:
        main(["--e2e-rounds", "0"])
    assert done.value.code == 2
    assert "--e2e-rounds 0: give at least 1 round" in capsys.readouterr().err
