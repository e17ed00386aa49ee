"""Which threads of a model process compute in parallel on the CPU.

torch's CPU kernels parallelise with OpenMP (libgomp). Every OS thread that opens a parallel
region with more than one thread gets its own pool of worker threads, kept for that thread's
life. Once the pools' threads outnumber the cores, libgomp stops letting idle workers spin
(its throttled spin count), and each parallel region waits for futex wake-ups. On the 2-core
CPU machine a SmolLM2 forward on the engine thread took 31.6 ms instead of 20.9 ms after the
main thread had computed with 2 threads once (bench/results/cpu_gemm.json, "threads").

So a model process computes in parallel on its engine thread only:
  serial()    first thing on the main thread, and on every helper thread that runs torch
              (weights are loaded in asyncio.to_thread);
  parallel()  on the engine thread: the process's compute threads, torch's default at import
              (OMP_NUM_THREADS, else the cores)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

COMPUTE_THREADS = torch.get_num_threads()

T = TypeVar("T")


def _set(threads: int) -> None:
    # torch sets a thread's OpenMP thread count lazily, at its first parallel op, from the value
    # the last set_num_threads of ANY thread left behind: take that first-use step now, so that
    # another thread's later serial() cannot undo this thread's choice.
    torch.get_num_threads()
    torch.set_num_threads(threads)


def serial() -> None:
    """The calling thread computes with one intra-op thread (opens no OpenMP pool)."""
    _set(1)


def parallel(threads: int = 0) -> None:
    """The calling thread (the engine's) computes with `threads` (0 = COMPUTE_THREADS)."""
    _set(threads or COMPUTE_THREADS)


def serially(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a helper thread that must not keep an OpenMP pool (asyncio.to_thread)."""
    serial()
    return fn(*args)
