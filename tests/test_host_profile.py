"""bench/host_profile.py's summary of py-spy's collapsed stacks (the sampling itself needs py-spy
and a process to attach to; this checks what is made of its output): frames named file:function,
busy time per second, self and inclusive shares, and the phases' inclusive shares."""
from __future__ import annotations

import pytest

from bench.host_profile import RATE, frame_name, parse, summarize

RAW = """\
_bootstrap (threading.py:1002);run (threading.py:982);_run (services/common/engine_loop.py:160);_step (services/target/engine.py:70);_run (services/target/engine.py:90);_decide (services/target/engine.py:120) 60
_bootstrap (threading.py:1002);run (threading.py:982);_run (services/common/engine_loop.py:160);_step (services/target/engine.py:70);_run (services/target/engine.py:90);forward (services/target/worker.py:200) 30
_run_module_as_main (<frozen runpy>:198);main (services/target/__main__.py:10);verify (services/target/servicer.py:80) 10
not a line
"""


def test_frames_are_named_by_file_and_function():
    assert frame_name("_decide (services/target/engine.py:120)") == "engine.py:_decide"
    assert frame_name("_run_code (<frozen runpy>:88)") == "<frozen runpy>:_run_code"
    assert frame_name("cudaStreamSynchronize") == "cudaStreamSynchronize"
    assert [n for _, n in parse(RAW)] == [60, 30, 10]


def test_summary_shares_and_busy_time():
    s = summarize(RAW, seconds=2.0, phases=("engine.py:_run", "worker.py:forward"))
    assert s["samples"] == 100
    assert s["busy_ms_per_s"] == pytest.approx(1000 * 100 / RATE / 2.0, abs=0.1)
    assert s["self_pct"] == {"engine.py:_decide": 60.0, "worker.py:forward": 30.0,
                             "servicer.py:verify": 10.0}
    assert s["inclusive_pct"]["engine.py:_run"] == 90.0       # both engine stacks
    assert s["threads"] == {"threading.py:_bootstrap": 90.0, "<frozen runpy>:_run_module_as_main": 10.0}
    assert s["phases_pct"] == {"engine.py:_run": 90.0, "worker.py:forward": 30.0}


def test_while_driving_keeps_the_rows_without_py_spy(monkeypatch, tmp_path):
    """Without py-spy the profile is an error entry and nothing is driven (the caller's rows
    stay); with it, the requests run until the recording ends."""
    from bench import host_profile
    monkeypatch.setattr(host_profile, "available", lambda: None)
    ran = []
    result = host_profile.while_driving({"target": 1}, 0.1, tmp_path, lambda i: ran.append(i) or 1)
    assert "py-spy" in result["error"] and ran == []
