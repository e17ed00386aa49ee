"""The engine loop's scheduling contract with a recording step (the loop is the real one; the step
stands for a model forward): work whose caller went away is dropped before it runs, except
detached work (a Release), and works of cost 0 are taken even when the token budget is spent.

Found by the soak test in CI: a Release that waited behind a busy engine for longer than the
gateway's release timeout was cancelled with its RPC and dropped, so the draft kept the sequence
until its lease (120 s) expired."""
from __future__ import annotations

import asyncio
import threading

import pytest
from support.gateway_stack import wait_until

from services.common.engine_loop import EngineLoop, Work
from services.target.config import TargetConfig


class Recorder:
    """A step that records what each iteration ran; the first iteration blocks until `go`."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, str, int]]] = []
        self.entered = threading.Event()
        self.go = threading.Event()

    def __call__(self, batch: list[tuple[Work, int]]) -> None:
        self.entered.set()
        self.go.wait(10)
        self.batches.append([(w.kind, w.seq_id, n) for w, n in batch])
        for w, _ in batch:
            w.resolve(w.kind)

    @property
    def ran(self) -> list[tuple[str, str]]:
        return [(kind, seq) for batch in self.batches for kind, seq, _ in batch]


def run_with_blocked_engine(budget: int, scenario, prompts_apart: bool = False,
                            prompt_sequences: int = 1) -> Recorder:
    """Starts a loop whose first iteration (a verify of "busy") blocks; `scenario(loop)` runs
    meanwhile, then the engine goes on and everything queued is run."""
    step = Recorder()
    loop = EngineLoop(step, token_budget=budget, name="engine-loop-test")
    loop.prompts_apart = lambda: prompts_apart
    loop.prompt_sequences = prompt_sequences

    async def main():
        loop.start()
        busy = asyncio.ensure_future(loop.submit(Work("verify", "busy", None, cost=budget)))
        await asyncio.to_thread(step.entered.wait, 5)
        await scenario(loop)
        step.go.set()
        await busy
        await asyncio.to_thread(wait_until, lambda: not (loop.waiting or loop.running), 5,
                                0.01, "the engine idle")

    try:
        asyncio.run(main())
    finally:
        step.go.set()
        loop.stop()
    return step


def test_a_release_whose_caller_gave_up_still_runs():
    async def scenario(loop: EngineLoop):
        release = asyncio.ensure_future(
            loop.submit(Work("release", "a", None, cost=0, detached=True)))
        propose = asyncio.ensure_future(loop.submit(Work("propose", "b", None, cost=1)))
        await asyncio.sleep(0.05)
        release.cancel()                  # the gateway's release timeout passed
        propose.cancel()                  # the request went away
        await asyncio.gather(release, propose, return_exceptions=True)

    step = run_with_blocked_engine(8, scenario)
    assert ("release", "a") in step.ran
    assert ("propose", "b") not in step.ran     # an ordinary work is dropped


def test_works_of_cost_zero_are_taken_when_the_budget_is_spent():
    async def scenario(loop: EngineLoop):
        for work in (Work("propose", "p", None, cost=4), Work("propose", "q", None, cost=4),
                     Work("release", "r", None, cost=0, detached=True)):
            asyncio.ensure_future(loop.submit(work))
        await asyncio.sleep(0.05)             # all three queued behind the busy iteration

    step = run_with_blocked_engine(4, scenario)
    second = step.batches[1]
    assert ("propose", "p", 4) in second and ("release", "r", 0) in second
    assert ("propose", "q", 4) not in second     # over the budget: next iteration
    assert ("propose", "q") in step.ran


async def queue_prompt_and_verifies(loop: EngineLoop) -> None:
    for work in (Work("verify", "a", None, cost=4),
                 Work("prefill", "p", None, cost=10, splittable=True),
                 Work("verify", "b", None, cost=4),
                 Work("release", "r", None, cost=0, detached=True)):
        asyncio.ensure_future(loop.submit(work))
    await asyncio.sleep(0.05)                 # all queued behind the busy iteration


def test_prompt_chunks_apart_take_turns_with_the_verifies():
    """Where the target captured prefill graphs a batch mixing a prompt chunk with verifies
    would run eagerly: the prompt runs in a forward of its own (with the works of cost 0), the
    verifies in the next - while both wait they alternate, so neither starves."""
    step = run_with_blocked_engine(32, queue_prompt_and_verifies, prompts_apart=True)
    assert step.batches[1:] == [[("release", "r", 0), ("prefill", "p", 10)],
                                [("verify", "a", 4), ("verify", "b", 4)]]


async def two_prompts_and_a_verify(loop: EngineLoop) -> None:
    for work in (Work("prefill", "p", None, cost=10, splittable=True),
                 Work("prefill", "q", None, cost=6, splittable=True),
                 Work("prefill", "s", None, cost=20, splittable=True),
                 Work("verify", "a", None, cost=4)):
        asyncio.ensure_future(loop.submit(work))
    await asyncio.sleep(0.05)


def test_prompts_apart_run_one_sequence_at_a_time():
    """A prefill graph is captured for one sequence's chunk: prompts that wait together run in
    forwards of their own (the verifies between them), not in one eager batch."""
    step = run_with_blocked_engine(32, two_prompts_and_a_verify, prompts_apart=True)
    assert step.batches[1:] == [[("prefill", "p", 10)], [("verify", "a", 4)],
                                [("prefill", "q", 6)], [("prefill", "s", 20)]]


def test_prompts_apart_with_a_prompt_batch_share_their_forward():
    """--prompt-batch 2: two waiting prompts' chunks in one prompts' forward, still apart from
    the verifies; the third waits for the next prompts' turn."""
    step = run_with_blocked_engine(32, two_prompts_and_a_verify, prompts_apart=True,
                                   prompt_sequences=2)
    assert step.batches[1:] == [[("prefill", "p", 10), ("prefill", "q", 6)],
                                [("verify", "a", 4)], [("prefill", "s", 20)]]


def test_prompt_chunks_share_the_batch_unless_apart():
    step = run_with_blocked_engine(32, queue_prompt_and_verifies)
    assert step.batches[1] == [("verify", "a", 4), ("verify", "b", 4), ("release", "r", 0),
                               ("prefill", "p", 10)]


def test_a_prompt_batch_below_one_is_refused():
    with pytest.raises(ValueError, match=r"prompt batch 0: allowed >= 1"):
        TargetConfig(model_dir="m", prompt_batch=0)
