"""`--cpu-gemm auto` measured on the host (runtime/layers/gemm_calibration.py): the choice is a
pure function of the timings, the table covers every row count, `auto` follows it (each choice
gives F.linear's result within fp32 rounding), a failing candidate falls back to the fixed rule,
a measured table is kept per host and shapes and reused, and both services calibrate at start-up
before SERVING (a later start reusing the kept table)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.draft_service import start_draft
from support.procs import start_target

from runtime.layers import linear as lin
from runtime.layers.gemm_calibration import (
    DEFAULT_TABLE,
    ROWS,
    GemmTable,
    cache_key,
    calibrate,
    choose,
    cold_bytes,
    last_level_cache_bytes,
    sample,
    weight_shapes,
)


def test_choose_takes_the_fastest_per_row_count():
    timings = {}
    for r in ROWS:
        timings[(r, "onednn")] = 2.0
        timings[(r, "torch")] = 1.0 if r >= 16 else 3.0
        if r <= 4:
            timings[(r, "weight_left")] = 1.5
    table = choose(timings)
    assert [table.choice[r] for r in ROWS] == ["weight_left"] * 4 + ["onednn", "torch", "torch"]
    timings[(1, "torch")] = 1.4                   # within 10 % of the fixed rule's: kept
    timings[(2, "torch")] = 1.3                   # clearly faster: taken
    assert choose(timings).choice[1] == "weight_left" and choose(timings).choice[2] == "torch"


def test_row_counts_map_to_the_next_measured_one():
    table = GemmTable({r: str(r) for r in ROWS})
    assert [table.for_rows(n) for n in (0, 1, 4, 5, 8, 9, 17, 64, 1000)] == \
        ["1", "1", "4", "8", "8", "16", "64", "64", "64"]


def test_calibration_covers_every_row_count_with_a_valid_candidate(tmp_path):
    params = [torch.randn(96, 64), torch.randn(64, 96), torch.randn(96, 64), torch.ones(64),
              torch.randn(8, 8, dtype=torch.bfloat16)]
    assert weight_shapes(params) == {(96, 64): 2, (64, 96): 1}    # fp32 matrices only
    gemms = {"weight_left": lin._weight_left_2d, "onednn": lin._onednn, "torch": F.linear}
    table = calibrate(params, gemms, tmp_path)
    assert set(table.choice) == set(ROWS)
    assert all(name in gemms and (name != "weight_left" or r <= 4)
               for r, name in table.choice.items())
    assert calibrate([torch.ones(3)], gemms, tmp_path) is DEFAULT_TABLE   # no matrix: fixed rule


def test_a_measured_table_is_kept_and_reused_for_the_same_shapes_only(tmp_path, caplog):
    gemms = {"onednn": lin._onednn, "torch": F.linear}
    caplog.set_level("INFO", logger="dflash.gemm")
    table = calibrate([torch.randn(48, 32)], gemms, tmp_path)
    kept = list(tmp_path.glob("*.json"))
    assert len(kept) == 1 and "cpu gemm calibrated" in caplog.text
    caplog.clear()
    kept[0].write_text('{"choice": {"' + '": "torch", "'.join(map(str, ROWS)) + '": "torch"}}')
    assert calibrate([torch.randn(48, 32)], gemms, tmp_path).choice == dict.fromkeys(ROWS, "torch")
    assert "cpu gemm table reused" in caplog.text and "calibrated" not in caplog.text
    kept[0].write_text("{not json")                     # unreadable: measured again, kept again
    assert set(calibrate([torch.randn(48, 32)], gemms, tmp_path).choice) == set(ROWS)
    assert "cpu gemm calibrated" in caplog.text and '"choice"' in kept[0].read_text()
    other = weight_shapes([torch.randn(32, 48)])          # other shapes, threads: other tables
    assert cache_key(other, gemms) != kept[0].stem
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert cache_key(weight_shapes([torch.randn(48, 32)]), gemms) != kept[0].stem
    finally:
        torch.set_num_threads(threads)
    assert table.choice.keys() == set(ROWS)


def test_a_failing_candidate_keeps_the_fixed_rule(caplog, tmp_path):
    def broken(x, w, b):
        raise RuntimeError("kernel error")
    table = calibrate([torch.randn(32, 32)], {"torch": F.linear, "onednn": broken}, tmp_path)
    assert table is DEFAULT_TABLE
    assert "calibration failed" in caplog.text and "kernel error" in caplog.text
    assert not list(tmp_path.glob("*.json"))                       # nothing kept


def test_a_pass_reads_twice_the_last_level_cache_of_every_shape_in_proportion():
    assert 64 << 20 <= cold_bytes() <= 1 << 30
    assert cold_bytes() >= min(2 * last_level_cache_bytes(), 1 << 30)
    head = torch.empty(1024, 64)                                         # 256 KiB, first
    layers = [torch.empty(n, 64) for _ in range(8) for n in (16, 32)]    # 4 and 8 KiB each
    weights = [head, *layers]
    assert sample(weights, 1 << 30) == weights                           # all: within the limit
    half = sample(weights, 352 << 10 >> 1)                               # half the bytes
    assert half == [head, *layers[:8]]      # the same share of each shape, in the model's order
    assert sample(weights, 1) == [head, *layers[:2]]                     # at least one of each


@pytest.mark.skipif("auto" not in lin.CPU_GEMMS, reason="needs oneDNN")
@pytest.mark.parametrize("name", ["weight_left", "onednn", "onednn_packed", "torch"])
def test_auto_follows_the_table(name):
    w, b = torch.randn(40, 24), torch.randn(40)
    saved = lin._table[0]
    lin.set_cpu_gemm("auto")
    lin.pack_weights([w])            # onednn_packed reads it (the others ignore it)
    try:
        lin._table[0] = GemmTable(dict.fromkeys(ROWS, name))
        for rows in (1, 3, 4, 7, 33):
            x = torch.randn(rows, 24)
            assert torch.allclose(lin.linear(x, w, b), F.linear(x, w, b), atol=1e-5)
        assert lin.calibrate_cpu_gemm([w]) is not None                # auto: measured
        lin.set_cpu_gemm("torch")
        assert lin.calibrate_cpu_gemm([w]) is None                    # fixed: untouched
    finally:
        lin._table[0] = saved
        lin.set_cpu_gemm(lin.DEFAULT_CPU_GEMM)
        lin.unpack_weights([w])


@pytest.mark.skipif("auto" not in lin.CPU_GEMMS, reason="needs oneDNN")
def test_a_reordered_weight_is_not_used_once_the_weight_changed():
    w = torch.randn(40, 24)
    lin.pack_weights([w])
    try:
        x = torch.randn(4, 24)
        assert torch.allclose(lin._onednn_packed_2d(x, w, None), F.linear(x, w), atol=1e-5)
        with torch.no_grad():
            w.mul_(2)                                     # in place: the kept copy is stale
        assert lin._packed(w) is None
        assert torch.allclose(lin._onednn_packed_2d(x, w, None), F.linear(x, w), atol=1e-5)
        lin.pack_weights([w])                             # reordered again
        assert lin._packed(w) is not None
    finally:
        lin.unpack_weights([w])
    assert lin._packed(w) is None and lin._packed(torch.randn(3, 3)) is None


@pytest.mark.skipif("auto" not in lin.CPU_GEMMS, reason="needs oneDNN")
@pytest.mark.parametrize("uses_packed", [True, False])
def test_weights_are_reordered_only_where_the_table_uses_them(tmp_path, monkeypatch, uses_packed):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    weights = [torch.randn(48, 32), torch.randn(32, 48)]
    saved = lin._table[0]
    lin.set_cpu_gemm("auto")
    try:
        lin.calibrate_cpu_gemm(weights)                   # measured (and kept) once
        [kept] = (tmp_path / "cache" / "cpu_gemm").glob("*.json")
        name = "onednn_packed" if uses_packed else "torch"
        kept.write_text('{"choice": {"' + f'": "{name}", "'.join(map(str, ROWS)) + f'": "{name}"}}}}')
        table = lin.calibrate_cpu_gemm(weights)           # the kept table, as a restart reads it
        assert table.choice == dict.fromkeys(ROWS, name)
        assert all((lin._packed(w) is not None) == uses_packed for w in weights)
    finally:
        lin._table[0] = saved
        lin.unpack_weights(weights)


@pytest.mark.slow
def test_both_services_calibrate_before_serving_and_a_restart_reuses_the_table(smollm2_dir,
                                                                              tmp_path):
    env = {"DFLASH_HOME": str(tmp_path / "home")}       # nothing kept yet
    target = start_target(smollm2_dir, tmp_path, env=env)
    draft = start_draft(smollm2_dir, tmp_path, model_dir="models/smollm2-135m-instruct-dflash",
                        env=env)
    restarted = None
    try:
        for proc in (target, draft):
            log = proc.log()
            line = next(x for x in log.splitlines() if "cpu gemm calibrated" in x)
            assert "table=" in line and "1:" in line and "64:" in line
            assert log.index("cpu gemm calibrated") < log.index("warm-up done")
            seconds = float(line.split("seconds=")[1].split()[0])
            assert seconds < 10, line                                  # the goal: <= 2 s
        assert len(list((tmp_path / "home" / "cache" / "cpu_gemm").glob("*.json"))) == 2
        target.stop()
        restarted = start_target(smollm2_dir, tmp_path, env=env)       # the same host and model
        table = next(x for x in target.log().splitlines() if "cpu gemm calibrated" in x)
        reused = next(x for x in restarted.log().splitlines() if "cpu gemm table reused" in x)
        assert table.split("table=")[1].split('"')[1] == reused.split("table=")[1].split('"')[1]
        assert "cpu gemm calibrated" not in restarted.log()
    finally:
        for proc in (draft, target, restarted):
            if proc is not None:
                proc.stop()
