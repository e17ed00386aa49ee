"""`dflash up` keeps its children running: a target, draft or gateway that dies is started again
on the same ports after a backoff (1 s, doubling up to 30 s; back to 1 s once it ran for a
minute), and the gateway's own recovery (docs/reliability.md) finishes the streams in flight
with the same output. A child that refuses its arguments (exit 2: an incompatible model) or dies
5 times within 5 minutes stops the stack instead."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

EXIT_REFUSED = 2                      # services/common/bootstrap.py: start-up refused


class Supervised(Protocol):
    name: str

    def exited(self) -> int | None: ...

    def start(self, append: bool = False) -> None: ...

    def tail(self, lines: int = 20) -> str: ...


@dataclass(frozen=True)
class RestartPolicy:
    initial_s: float = 1.0
    max_s: float = 30.0
    healthy_s: float = 60.0           # a child that ran this long starts over at initial_s
    limit: int = 5                    # restarts within window_s before giving up
    window_s: float = 300.0


@dataclass
class _State:
    backoff_s: float
    started_at: float = field(default_factory=time.monotonic)
    due: float | None = None          # when the pending restart happens
    restarts: list[float] = field(default_factory=list)


class Supervisor:
    def __init__(self, children: Sequence[Supervised], policy: RestartPolicy = RestartPolicy(),
                 say: Callable[[str], None] = print) -> None:
        self.children, self.policy, self.say = children, policy, say
        self.state = {c.name: _State(policy.initial_s) for c in children}

    def check(self) -> str | None:
        """Called every half second: schedules and runs restarts; a reason to stop, or None."""
        now = time.monotonic()
        for child in self.children:
            code = child.exited()
            if code is None:
                continue
            st = self.state[child.name]
            if st.due is None:
                fatal = self._schedule(child, code, st, now)
                if fatal:
                    return fatal
            elif now >= st.due:
                st.due, st.started_at = None, now
                st.restarts.append(now)
                child.start(append=True)
                self.say(f"{child.name} started again (restart {len(st.restarts)})")
        return None

    def _schedule(self, child: Supervised, code: int, st: _State, now: float) -> str | None:
        p = self.policy
        tail = child.tail()
        if code == EXIT_REFUSED:
            return f"{child.name} refused to start (exit {code}); its log ends with:\n{tail}"
        st.restarts = [t for t in st.restarts if now - t < p.window_s]
        if len(st.restarts) >= p.limit:
            return (f"{child.name} exited with {code}, {p.limit} restarts within "
                    f"{p.window_s:.0f} s already; stopping. Its log ends with:\n{tail}")
        if now - st.started_at >= p.healthy_s:
            st.backoff_s = p.initial_s
        st.due = now + st.backoff_s
        self.say(f"{child.name} exited with {code}; starting it again in {st.backoff_s:.1f} s. "
                 f"Its log ends with:\n{tail}")
        st.backoff_s = min(st.backoff_s * 2, p.max_s)
        return None
