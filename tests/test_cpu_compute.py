"""CPU compute choices: the fp32 GEMM registry (runtime/layers/linear.py) and which thread
computes in parallel (runtime/threads.py)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from runtime import threads
from runtime.layers import linear as lin
from services.common.engine_loop import EngineLoop, Work
from services.draft.config import DraftConfig
from services.target.config import TargetConfig


@pytest.fixture
def gemm():
    """Restores the process's CPU GEMM after the test."""
    before = lin.cpu_gemm()
    yield lin.set_cpu_gemm
    lin.set_cpu_gemm(before)


def test_auto_is_the_default_where_torch_has_onednn():
    assert "torch" in lin.CPU_GEMMS
    if torch.backends.mkldnn.is_available():
        assert lin.DEFAULT_CPU_GEMM == "auto"


@pytest.mark.parametrize("name", sorted(lin.CPU_GEMMS))
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 70, 1100])
def test_every_gemm_computes_f_linear(gemm, name, rows):
    gemm(name)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g)
    x = torch.randn(rows, 48, generator=g)
    with torch.inference_mode():
        for bias in (None, b):
            got = lin.linear(x, w, bias)
            assert got.shape == (rows, 96)
            torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
        for lead in ((2, 2), (2, 3)):                       # leading batch dimensions
            x3 = torch.randn(*lead, 48, generator=g)
            torch.testing.assert_close(lin.linear(x3, w, b), F.linear(x3, w, b),
                                       rtol=1e-5, atol=1e-4)


def test_onednn_sees_a_bounded_set_of_row_counts():
    """oneDNN keeps memory per distinct shape for the life of the process: any batch's rows are
    padded to one of a few dozen counts (more rows go to MKL)."""
    counts = {lin.onednn_rows(m) for m in range(1, lin.ONEDNN_MAX_ROWS + 1)}
    assert len(counts) <= 32 and max(counts) == lin.ONEDNN_MAX_ROWS
    assert all(lin.onednn_rows(m) >= m for m in range(1, lin.ONEDNN_MAX_ROWS + 1))


def test_gradients_and_other_dtypes_take_f_linear(gemm):
    gemm(lin.DEFAULT_CPU_GEMM)
    layer = lin.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()                   # oneDNN's op has no autograd: must not be used
    assert x.grad is not None and layer.weight.grad is not None
    want = F.linear(x.detach(), layer.weight.detach(), layer.bias.detach())
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        xb, wb = x.detach().bfloat16(), layer.weight.detach().bfloat16()
        assert torch.equal(lin.linear(xb, wb), F.linear(xb, wb))


def test_unknown_gemm_is_refused_with_the_choices(gemm):
    with pytest.raises(ValueError, match="unknown CPU GEMM 'blas'.*torch"):
        gemm("blas")
    with pytest.raises(ValueError, match="cpu gemm 'blas'.*allowed"):
        TargetConfig(model_dir="x", cpu_gemm="blas")
    with pytest.raises(ValueError, match="cpu gemm 'blas'.*allowed"):
        DraftConfig(target_dir="x", cpu_gemm="blas")


def test_service_flag_reaches_both_configs(monkeypatch):
    from services.draft.__main__ import config_from_args as draft_config
    from services.draft.__main__ import parse_args as draft_args
    from services.target.__main__ import config_from_args as target_config
    from services.target.__main__ import parse_args as target_args
    t = target_config(target_args(["--model", "m", "--cpu-gemm", "torch"]))
    assert t.cpu_gemm == "torch"
    monkeypatch.setenv("DFLASH_CPU_GEMM", "torch")
    d = draft_config(draft_args(["--target-model", "t", "--model", "m"]))
    assert d.cpu_gemm == "torch"


def test_draft_dtype_auto_is_bf16_where_torch_computes_it_natively(monkeypatch):
    """--dtype auto: bf16 on CUDA and on a CPU with torch's native bf16 GEMM, else fp32; a named
    dtype is kept; anything else is refused with the choices."""
    import services.draft.config as draft_config
    from services.draft.__main__ import config_from_args, parse_args
    cfg = config_from_args(parse_args(["--target-model", "t", "--model", "m", "--dtype", "auto"]))
    assert cfg.dtype == "auto"
    assert cfg.resolved_dtype() == ("bfloat16" if lin.native_bf16_gemm() else "float32")
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(draft_config, "native_bf16_gemm", lambda native=native: native)
        assert DraftConfig(target_dir="t", dtype="auto").resolved_dtype() == expected
        assert DraftConfig(target_dir="t", dtype="auto", device="cuda").resolved_dtype() == \
            "bfloat16"
        assert DraftConfig(target_dir="t", dtype="float32").resolved_dtype() == "float32"
    with pytest.raises(ValueError, match=r"dtype 'fp8' is not supported; allowed: .*'auto'"):
        DraftConfig(target_dir="t", dtype="fp8")


def test_engine_thread_computes_in_parallel_while_the_caller_is_serial():
    """The engine loop's on_start runs on the engine thread, before its first step: that thread
    gets the process's compute threads whatever the caller's thread uses, even when another
    thread turns serial after the engine started (the services load on helper threads)."""
    seen: dict[str, object] = {}
    caller_before = torch.get_num_threads()

    def step(batch):
        seen["threads"] = torch.get_num_threads()
        seen["thread"] = threading.current_thread().name
        for work, _ in batch:
            work.resolve(None)

    def body():
        threads.serial()
        loop = EngineLoop(step, 8, name="compute-test", on_start=threads.parallel)
        loop.start()
        time.sleep(0.2)                        # on_start has run on the idle engine thread
        helper = threading.Thread(target=threads.serial)
        helper.start()
        helper.join()
        try:
            asyncio.run(loop.submit(Work("verify", "s", None, cost=1)))
        finally:
            loop.stop()
        seen["caller"] = torch.get_num_threads()

    t = threading.Thread(target=body)         # keeps pytest's own thread count untouched
    t.start()
    t.join()
    assert seen["thread"] == "compute-test"
    assert seen["threads"] == threads.COMPUTE_THREADS
    assert seen["caller"] == 1
    assert torch.get_num_threads() == caller_before
