"""Every benchmark's --tiny mode, as a subprocess: it starts, measures through its real path
(engines, services, gRPC, the local stack) on the CPU, and writes its JSON (and its doc section
where it has one) where it is told - so that no refactor breaks a benchmark unnoticed.

The benchmarks run with OMP_NUM_THREADS=1 (and --threads 1 where they take it): a smoke test
checks the paths, not the speed, and on a 2-core machine three model processes (or a test run
beside them) with two OpenMP threads each oversubscribe the cores, which makes libgomp's parallel
regions several times slower. `bench.run_cpu --tiny` is not run here: it only runs the CPU
benchmarks below once more (about 4-5 minutes); its command lines are checked instead."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def positive(*values) -> None:
    for v in values:
        assert isinstance(v, (int, float)) and v > 0, values


def no_errors(d: dict) -> None:
    assert not [k for k in d if k.endswith("_error")], {k: v for k, v in d.items()
                                                        if k.endswith("_error")}


# -- what each benchmark measures --------------------------------------------------------------
def anchor_positions(d: dict) -> None:
    for split in ("eval_in", "eval_unseen"):
        s = d["splits"][split]
        assert s["sequences"] == 2
        for name in ("uniform", "loop", "one_hop", "two_hops"):
            assert s["anchors"][name]["tau"] >= 1.0
        positive(s["anchors"]["uniform"]["anchors"], s["anchors"]["loop"]["anchors"])
        assert s["loop_by_offset"] and s["first_position_by_target_confidence"]["loop"]


def cpu_gemm(d: dict) -> None:
    assert set(d["gemm"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    for by_rows in d["gemm"].values():
        assert set(by_rows) == {"1", "4"}
        positive(*(g["us"] for row in by_rows.values() for g in row.values()))
    assert {"torch", "auto"} <= set(d["forward"])
    positive(*(ms for row in d["forward"].values() for ms in row.values()))
    assert len(d["threads"]) == 2
    positive(*(ms for row in d["threads"].values() for ms in row.values()))


def draft_cpu(d: dict) -> None:
    assert {(r["block"], r["batch"]) for r in d["propose"]} == {(4, 1), (4, 2), (16, 1), (16, 2)}
    positive(*(r["median_ms"] for r in d["propose"]), d["append"][0]["us_per_token"])
    positive(d["grpc"][0]["median_ms"])


def drafter_cpu(d: dict) -> None:
    assert [(r["drafter"], r["block_size"]) for r in d["rows"]] == [("none", 0), ("dflash", 4)]
    for r in d["rows"]:
        positive(r["tokens_per_s"], r["step_ms"], r["verify_handler_ms"])
        assert r["identical_to_autoregressive"] and r["tau"] >= 1.0
    positive(*(r["propose_handler_ms"] for r in d["rows"][1:]))


def gateway_cpu(d: dict) -> None:
    assert [(r["drafter"], r["concurrency"]) for r in d["overhead"]] == [("dflash", 1),
                                                                         ("dflash", 2)]
    positive(*(r["propose_handler_ms"] for r in d["overhead"][:1]))
    positive(*(r["tokens_per_s"] for r in d["overhead"]), *(r["step_ms"] for r in d["overhead"]))
    systems = d["end_to_end"]["systems"]
    assert {"dflash up --drafter dflash", "transformers generate",
            "transformers prompt lookup (10)"} <= set(systems)
    for s in systems.values():
        positive(s["tokens_per_s"]["all"])
        assert s["identical_to_transformers_greedy"]
    tables = d["end_to_end"]["gemm_tables"]     # --cpu-gemm auto: each model process's choice
    assert any(k.endswith("target.log") for k in tables), tables
    assert all(v.startswith("1:") for v in tables.values()), tables


def gpu_layer_ops(d: dict) -> None:
    assert d["ok"] and len(d["ops"]) == 8 and all(r["ok"] for r in d["ops"])
    assert {r["op"] for r in d["ops"]} == {"add_rms_norm", "qk_norm", "rotary", "silu_and_mul"}


def gpu_profile(d: dict) -> None:
    positive(d["steps"], d["total_ms"], d["draft_ms"], d["verify_ms"])
    assert d["tokens_generated"] == d["tokens"] and d["top_self_cpu_us"]


def gpu_side_by_side(d: dict) -> None:
    no_errors(d)
    rows = d["rows"]
    configs = {(r["config"], r.get("wire"), r.get("forced_tau")) for r in rows}
    assert configs == {("AR service", "unary", None), ("spec services", "unary", 6.4),
                       ("spec services", "stream", 6.4), ("in-process", None, 6.4),
                       ("transformers-static", None, None), ("transformers-dynamic", None, None)}
    positive(*(r["tokens_per_s"] for r in rows))
    spec = [r for r in rows if r["config"] == "spec services"]
    positive(*(r["propose_handler_ms"] for r in spec), *(r["verify_handler_ms"] for r in spec))
    check = d["inproc_tau6.4_draft_graph_check"]
    assert check["drafts"] > 0 and check["agree"] == check["drafts"]
    positive(d["inproc_tau6.4_ttft"]["ttft_ms"], d["floor"]["copy_GBps"])
    for part in ("services_ar", "services_tau6.4"):
        assert d[part]["health"]["target"][-1][1] == "SERVING"
        positive(*(t["ttft_ms"] for t in d[part]["ttft"].values()))


def h200_micro(d: dict) -> None:
    no_errors(d)
    positive(d["copy_GBps"], d["attn_torch_ms"])
    positive(*(r["eager_ms"] for r in d["target"].values()))
    positive(*(r["propose_ms"] for r in d["draft"].values()))
    positive(*(r["tokens_per_s"] for r in d["transformers_bs1"].values()))


def hybrid_cpu(d: dict) -> None:
    assert len(d["verify"]) == 8 and {r["model"] for r in d["verify"]} == {"hybrid", "dense"}
    positive(*(r["median_ms"] for r in d["verify"]), *(r["tokens_per_s"] for r in d["verify"]))
    positive(d["models"]["hybrid"]["state_bytes_per_sequence_live"])


def scan_kernels_gpu(d: dict) -> None:
    kinds = {(r["family"], r["kind"]) for r in d["rows"]}
    for family in ("delta", "ssd"):
        assert {(family, "prefill"), (family, "decode"),
                (family, "verify (every position's state)")} <= kinds
    positive(*(r["ms"] for r in d["rows"]))
    assert all(r["out_rel_err"] == 0.0 for r in d["rows"] if "out_rel_err" in r)   # the reference


def invariant_gemm_gpu(d: dict) -> None:
    results = d["models"]["tiny"]["results"]
    assert all(all(r["invariant"].values()) for r in results.values())   # the property itself
    for r in results.values():
        positive(*(t["ms"] for row in r["rows"].values() for t in row["tiles"].values()))
        assert all(t["max_abs_diff_vs_cublas"] < 1e-3 for row in r["rows"].values()
                   for t in row["tiles"].values())
    positive(*(row["shipped_ms"] for row in d["models"]["tiny"]["forward_gemm_ms"].values()))


def hybrid_gpu(d: dict) -> None:
    rows = d["rows"]
    assert len(rows) == 8 and len({r["model"] for r in rows}) == 2
    positive(*(r["median_ms"] for r in rows))
    assert all(v > 0 for v in d["state_pool_bytes"].values()) and d["state_pool_bytes"]


def side_by_side_hybrid(d: dict) -> None:
    no_errors(d)
    configs = {(r["config"], r.get("wire")) for r in d["rows"]}
    assert configs == {("AR service", "unary"), ("spec services", "unary"),
                       ("spec services", "stream")}
    positive(*(r["tokens_per_s"] for r in d["rows"]))
    assert d["services_tau6.4"]["health"]["target"][-1][1] == "SERVING"


def simulated_tau(d: dict) -> None:
    for split in ("eval_in", "eval_unseen"):
        s = d["splits"][split]
        assert s["sequences"] == 2 and s["tau"] >= 1.0 and s["tau_by_block"]["4"] >= 1.0


def smollm2_gpu(d: dict) -> None:
    systems = d["systems"]
    assert len(systems) == 4 and d["prompts"] == 2
    for name, s in systems.items():
        positive(s["summary"]["all"]["tokens_per_s"])
        if name.startswith("dflash up"):        # fp32 on the CPU: the same tokens
            assert s["identical_to_transformers"] == s["identical_to_our_ar"] == 2


def adaptive_cpu(d: dict) -> None:
    assert d["levels"] == [1, 2]
    configs = {r["config"] for r in d["rows"]}
    assert configs == {"autoregressive", "chain 4", "tree 7", "auto"}
    positive(*(r["tokens_per_s"] for r in d["rows"]))
    assert [s["concurrency"] for s in d["summary"]] == [1, 2]
    for s in d["summary"]:                  # auto's choices, scraped from its gateway's metrics
        assert sum(v["steps"] for v in s["auto_chosen"].values()) > 0


def adaptive_shape(d: dict) -> None:
    """--shape qwen3-8b: chains only (the forced acceptance is a chain's), the profile recorded."""
    assert d["shape"] == "qwen3-8b" and d["force_profile"]
    assert {r["config"] for r in d["rows"]} == {"autoregressive", "chain 4", "auto"}
    positive(*(r["tokens_per_s"] for r in d["rows"]))


def prefix_cache(d: dict) -> None:
    """Cache on and off: both workloads measured, the later turns found the earlier ones, the
    outputs equal."""
    for name in ("on", "off"):
        positive(d[name]["multi_turn"]["tokens_per_s"], d[name]["shared_system"]["ttft_rest_ms"])
    assert d["on"]["multi_turn"]["hit_rate"]["target"] > 0
    assert d["on"]["multi_turn"]["hit_rate"]["draft"] > 0
    assert not d["off"]["multi_turn"]["hit_rate"]["target"]
    assert d["summary"]["identical_outputs"] is True
    for name in ("on", "off"):          # where the time went: the services' own histograms
        b = d[name]["multi_turn"]["breakdown"]
        assert b["target.Prefill"]["n"] == 4 and b["target.Prefill"]["ms"] > 0
        assert b["target.forward"]["ms"] > 0 and b["ttft"]["n"] == 4


def prefix_cache_shape(d: dict) -> None:
    """The random-weight shape, conversations continued in token ids behind their own long
    openings: the later turns hit on both services (outputs are not compared: forced)."""
    assert d["shape"] == "qwen3-8b" and d["history_tokens"] > 0 and d["force_profile"]
    assert d["prompt_batch"] == 2                  # passed to the target (on the CPU: no graphs)
    positive(d["on"]["multi_turn"]["ttft_later_ms"], d["off"]["multi_turn"]["ttft_later_ms"])
    assert min(d["on"]["multi_turn"]["hit_rate"].values()) > 0
    assert not d["off"]["multi_turn"]["hit_rate"]["target"]


def spec_load_cpu(d: dict) -> None:
    assert len(d["configs"]) == 2 and d["levels"] == [1, 2]
    for rows in d["configs"].values():
        assert [r["concurrency"] for r in rows] == [1, 2]
        positive(*(r["tokens_per_s"] for r in rows))


def grammar_cpu(d: dict) -> None:
    lib = d["libraries"]["llguidance"]
    assert lib["available"] and lib["import"]["loads"] == []          # the gateway stays torch-free
    assert set(lib["compile_ms"]) >= {"json_schema", "json_object", "regex", "choice", "grammar"}
    positive(lib["tokenizer_ms"], *lib["compile_ms"].values())
    for row in lib["documents"].values():
        assert row["document_walks_through"] and row["only_eos_when_complete"]
        assert row["rollback_all_gives_the_first_mask"]
        positive(row["mask_us"]["median"], row["plan_15_us"]["median"],
                 row["gateway_plan_15_us"]["median"])
    assert lib["special_tokens_allowed_in_a_string"] == []


def structured_cpu(d: dict) -> None:
    g = d["grammar"]
    assert set(g["specs"]) == {"json_schema", "json_object", "regex", "choice", "grammar"}
    positive(g["mask_us"], g["plan_15_drafts_us"], *(s["compile_ms"] for s in g["specs"].values()))
    assert [(r["prompt"], r["schema"]) for r in d["speculation"]] == [("colour", False),
                                                                      ("colour", True)]
    positive(*(r["tau"] for r in d["speculation"]), *(r["seconds"] for r in d["speculation"]))


def target_cpu(d: dict) -> None:
    assert [r["block"] for r in d["verify"]] == [1, 4, 8, 16]
    positive(*(r["median_ms"] for r in d["verify"]), *(r["step_median_ms"] for r in d["verify"]))
    positive(*(r["transformers"]["median_ms"] for r in d["verify"]))
    positive(*(r["tokens_per_s"] for r in d["prefill"]), *(r["median_ms"] for r in d["grpc"]))
    # the engine ran the GEMMs the service would: measured on this host per row count
    assert [part.split(":")[0] for part in d["cpu_gemm"].split()] == ["1", "2", "3", "4", "8",
                                                                     "16", "64"]


def gemm_table_ab(d: dict) -> None:
    assert set(d["tables"]) == {"measured", "other"}
    assert {(r["table"], r["shape"], r["q"]) for r in d["rows"]} == {
        (t, s, q) for t in ("measured", "other") for s in ("one sequence", "batch") for q in (1, 4)}
    positive(*(r["step_median_ms"] for r in d["rows"]))


def kv_fp8(d: dict) -> None:
    assert d["bytes_per_token"]["fp8_e4m3"] * 2 == d["bytes_per_token"]["auto"]
    assert len(d["rows"]) == d["prompts"] == 1
    assert 0.0 <= d["summary"]["mean_agreement"] <= 1.0


def tp_cpu(d: dict) -> None:
    assert [r["ranks"] for r in d["rows"]] == [1, 3] and d["identical_outputs"]
    positive(*(r["decode_tokens_per_s"] for r in d["rows"]), *(r["verify16_ms"] for r in d["rows"]))


def replicas_cpu(d: dict) -> None:
    configs = {(r["config"], r["mode"]) for r in d["rows"]}
    assert configs >= {(c, m) for c in ("1 replica (shared cores)", "2 replicas (shared cores)")
                       for m in ("autoregressive", "speculative")}
    assert d["identical_outputs"] and len(d["summary"]) == len(configs) // 2
    positive(*(r["tokens_per_s"] for r in d["rows"]), *(s["speedup"] for s in d["summary"]))


def train_step(d: dict) -> None:
    positive(d["seconds_per_step"], *d["train_seconds_of_runs"])


def tree_acceptance(d: dict) -> None:
    for split in ("eval_in", "eval_unseen"):
        trees = d["splits"][split]["trees"]
        assert set(trees) == {"0/15", "7/15", "3/3"}
        assert all(t["tau"] >= 1.0 and t["anchors"] > 0 for t in trees.values())


def wire_cpu(d: dict) -> None:
    assert len(d["wire_alone"]) == 12                     # 2 methods x 2 levels x 3 wires
    positive(*(r["mean_us"] for r in d["wire_alone"]), *(r["calls_per_s"] for r in d["wire_alone"]))
    e = d["end_to_end"]
    assert e["identical"] and [r["wire"] for r in e["rows"]] == ["unary", "stream", "socket"]
    positive(*(r["tokens_per_s"] for r in e["rows"]), *(r["step_ms"] for r in e["rows"]))


@dataclass(frozen=True)
class Bench:
    module: str
    check: Callable[[dict], None]
    section: str = ""                   # its docs/benchmarks.md heading: it takes --doc
    out_is_dir: str = ""                # --out is a folder; the JSON is this file in it
    extra: tuple[str, ...] = ()

    def argv(self, tmp: Path) -> list[str]:
        out = tmp / "out" if self.out_is_dir else tmp / "x.json"
        doc = ["--doc", str(tmp / "doc.md")] if self.section else []
        return [sys.executable, "-m", f"bench.{self.module}", "--tiny", "--out", str(out), *doc,
                *self.extra]

    def json_path(self, tmp: Path) -> Path:
        return tmp / "out" / self.out_is_dir if self.out_is_dir else tmp / "x.json"


BENCHES = [
    Bench("adaptive_cpu", adaptive_cpu, "## Adaptive speculation (CPU)"),
    Bench("adaptive_cpu", adaptive_shape,
          "## Adaptive speculation (GPU, Qwen3-8B shape, forced acceptance profile)",
          extra=("--shape", "qwen3-8b")),
    Bench("anchor_positions", anchor_positions),
    Bench("cpu_gemm", cpu_gemm, "## CPU compute: GEMM and threads"),
    Bench("draft_cpu", draft_cpu),
    Bench("drafter_cpu", drafter_cpu),
    Bench("gateway_cpu", gateway_cpu, "## Gateway / end to end (CPU)"),
    Bench("gemm_table_ab", gemm_table_ab),
    Bench("gpu_layer_ops", gpu_layer_ops),
    Bench("grammar_cpu", grammar_cpu),
    Bench("gpu_profile", gpu_profile, out_is_dir="gpu_profile.json"),
    Bench("gpu_side_by_side", gpu_side_by_side, out_is_dir="gpu_side_by_side.json"),
    Bench("h200_micro", h200_micro),
    Bench("gpu_side_by_side", side_by_side_hybrid, out_is_dir="gpu_side_by_side.json",
          extra=("--shape", "qwen3.5-9b", "--parts", "ar", "services")),
    Bench("hybrid_cpu", hybrid_cpu, extra=("--threads", "1")),        # as OMP_NUM_THREADS
    Bench("hybrid_gpu", hybrid_gpu),
    Bench("invariant_gemm_gpu", invariant_gemm_gpu),
    Bench("kv_fp8", kv_fp8, "## fp8 KV cache (CPU)"),
    Bench("prefix_cache", prefix_cache, "## Prefix caching (CPU)"),
    Bench("prefix_cache", prefix_cache_shape, "## Prefix caching (GPU, Qwen3-8B shape)",
          extra=("--shape", "qwen3-8b", "--history-tokens", "40", "--prompt-batch", "2")),
    Bench("scan_kernels_gpu", scan_kernels_gpu),
    Bench("simulated_tau", simulated_tau),
    Bench("smollm2_gpu", smollm2_gpu),
    Bench("replicas_cpu", replicas_cpu, "## Gateway replicas (CPU)"),
    Bench("spec_load_cpu", spec_load_cpu, "## Speculation under load (CPU)"),
    Bench("structured_cpu", structured_cpu),
    Bench("target_cpu", target_cpu, "## Target service (CPU)", extra=("--threads", "1")),
    Bench("tp_cpu", tp_cpu, "## Tensor-parallel target (CPU)"),
    Bench("train_step", train_step),
    Bench("tree_acceptance", tree_acceptance),
    Bench("wire_cpu", wire_cpu, "## Per-step wire: unary, stream and socket (CPU)"),
]


def run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, (f"{' '.join(argv[2:])} exited {done.returncode}; stderr "
                                  f"ends:\n{done.stderr[-4000:]}\nstdout ends:\n"
                                  f"{done.stdout[-1500:]}")
    return done


def test_every_benchmark_module_has_a_smoke_test():
    tools = {"__init__", "report", "tiny", "run_cpu", "gpu_report", "plot_drafters",
             "render_dashboard", "grafana_dashboard", "local_prometheus", "host_profile",
             "plot_runs"}
    modules = {p.stem for p in (REPO / "bench").glob("*.py")} - tools
    assert modules == {b.module for b in BENCHES}


@pytest.mark.slow
@pytest.mark.parametrize("bench", BENCHES, ids=lambda b: " ".join((b.module, *b.extra)))
def test_benchmark_tiny_mode_measures_and_writes_its_json(bench, smollm2_dir, tmp_path):
    run(bench.argv(tmp_path))
    data = json.loads(bench.json_path(tmp_path).read_text())
    assert data["tiny"] is True
    bench.check(data)
    if bench.section:
        doc = (tmp_path / "doc.md").read_text()
        assert doc.startswith("# Benchmarks\n") and bench.section in doc


@pytest.mark.slow
def test_gpu_report_renders_the_committed_results(tmp_path):
    """The GPU section and its plot from bench/results/ (no GPU needed), into temp files."""
    run([sys.executable, "-m", "bench.gpu_report", "--doc", str(tmp_path / "doc.md"),
         "--out", str(tmp_path / "plot.png")], timeout=120)
    doc = (tmp_path / "doc.md").read_text()
    assert "## GPU: one NVIDIA H200 (issue 7)" in doc and "Goals of issue 7" in doc
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_plot_runs_draws_the_committed_ab_runs(tmp_path):
    """bench.plot_runs from session 26's committed A/B runs (no GPU needed)."""
    d = REPO / "bench/results/gpu/session26"
    run([sys.executable, "-m", "bench.plot_runs", "--out", str(tmp_path / "ab.png"),
         f"before={d / 'dma_ab_before.json'}", f"after={d / 'dma_ab_dma2.json'}"], timeout=120)
    assert (tmp_path / "ab.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_plot_drafters_draws_the_training_curves(tmp_path):
    run([sys.executable, "-m", "bench.plot_drafters", "--out", str(tmp_path / "curves.png")],
        timeout=120)
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_run_cpu_tiny_runs_each_benchmark_tiny_into_its_folder(tmp_path):
    from bench.run_cpu import BENCHES as RUN_CPU
    from bench.run_cpu import tiny_argv
    commands = [tiny_argv(b, tmp_path) for b in RUN_CPU]
    assert len(commands) == len(RUN_CPU)
    for cmd in commands:
        outs = [cmd[i + 1] for i, a in enumerate(cmd) if a in ("--out", "--doc")]
        assert outs and all(Path(o).parent == tmp_path for o in outs), cmd
        assert "--tiny" in cmd or cmd[:2] == ["dflash.cli", "eval-draft"], cmd
    assert {c[0] for c in commands if "--doc" in c} == {
        "bench.cpu_gemm", "bench.target_cpu", "bench.gateway_cpu", "bench.wire_cpu",
        "bench.adaptive_cpu", "bench.prefix_cache"}


def test_tiny_never_writes_the_committed_results_or_the_doc(tmp_path):
    """--tiny sends default outputs, and any path into bench/results/ or docs/, to a temporary
    folder; paths the caller chose elsewhere stay."""
    from bench.report import add_output_flags
    from bench.tiny import add_tiny_flag, tiny_outputs
    p = argparse.ArgumentParser()
    add_output_flags(p, "x")
    add_tiny_flag(p)
    args = p.parse_args(["--tiny"])
    tiny_outputs(args, p, "x")
    for path in (args.out, args.doc):
        assert not Path(path).resolve().is_relative_to(REPO), path
    args = p.parse_args(["--tiny", "--out", str(REPO / "bench/results/y.json"),
                         "--doc", str(tmp_path / "doc.md")])
    tiny_outputs(args, p, "x")
    assert not Path(args.out).resolve().is_relative_to(REPO) and args.doc == str(tmp_path / "doc.md")
    args = p.parse_args([])                     # not --tiny: untouched
    tiny_outputs(args, p, "x")
    assert (args.out, args.doc) == ("bench/results/x.json", "docs/benchmarks.md")
