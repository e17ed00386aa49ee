"""The replicas of one upstream role (target or draft): where they are, and one Upstream each.

--target and --draft take comma-separated entries, each one of

    HOST:PORT          one replica
    dns:NAME:PORT      one replica per address NAME resolves to (A and AAAA records: a
                       Kubernetes headless Service), resolved again every --resolve-interval
    file:PATH          one HOST:PORT per line of PATH ('#' comments), read again every
                       --resolve-interval (a list that a deployment tool rewrites)

Every replica is an Upstream with its own health Watch, liveness probe and capabilities (the
gateway's state decides which are usable: gateway/state.py). A name that does not resolve or a
file that cannot be read keeps the addresses it gave last (logged once per new problem): a DNS
hiccup must not empty the set. A replica that leaves the list is retired: no request is placed on
it, the requests on it move at their next step (gateway/generation.py), and its channel closes
once no request holds it."""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:                        # (upstream.py imports the config, which parses sources)
    from gateway.upstream import Upstream

log = logging.getLogger("dflash.gateway.replicas")

KINDS = ("dns", "file")


@dataclass(frozen=True)
class Source:
    """One entry of --target / --draft."""
    kind: str                            # "static" | "dns" | "file"
    value: str                           # HOST:PORT | NAME:PORT | PATH

    def __str__(self) -> str:
        return self.value if self.kind == "static" else f"{self.kind}:{self.value}"


class ResolveError(Exception):
    """A source gave no addresses now (why, in words)."""


def parse_sources(spec: str, flag: str) -> list[Source]:
    """The entries of a --target / --draft value; ValueError naming the bad one and the forms
    allowed."""
    sources = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        kind, _, rest = entry.partition(":")
        if kind in KINDS:
            rest = rest.removeprefix("//")      # dns:///name:port as gRPC writes it, file:///path
            if kind == "dns":
                rest = rest.removeprefix("/")
            source = Source(kind, rest)
        else:
            source = Source("static", entry)
        if source.kind != "file":
            _split_address(source.value, flag, entry)
        elif not source.value:
            raise ValueError(f"{flag} entry {entry!r}: file: needs a path")
        sources.append(source)
    if not sources:
        raise ValueError(f"{flag} is empty: give HOST:PORT, dns:NAME:PORT or file:PATH "
                         f"(comma-separated for several replicas)")
    return sources


def _split_address(address: str, flag: str, entry: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} entry {entry!r}: expected HOST:PORT, dns:NAME:PORT or "
                         f"file:PATH (a port in 1..65535)")
    return host.strip("[]"), int(port)


async def resolve(source: Source) -> list[str]:
    """The addresses a source names now, in a stable order (ResolveError when it names none)."""
    if source.kind == "static":
        return [source.value]
    if source.kind == "file":
        return _read_list(Path(source.value))
    host, port = _split_address(source.value, "dns", str(source))
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ResolveError(f"{source} does not resolve: {e.strerror}") from None
    addresses = sorted({_join(info[4][0], port) for info in infos})
    if not addresses:
        raise ResolveError(f"{source} resolves to no address")
    return addresses


def _read_list(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ResolveError(f"file:{path} cannot be read: {e.strerror}") from None
    addresses = []
    for n, line in enumerate(lines, 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            _split_address(entry, f"file:{path} line {n}", entry)
        except ValueError as e:
            raise ResolveError(str(e)) from None
        addresses.append(entry)
    return addresses


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ReplicaSet:
    """The upstreams of one role, by address (in the order first seen). `on_change()` is called
    when the set changes, as for a change of one upstream's health."""

    def __init__(self, role: str, spec: str, make: Callable[[str], Upstream], interval_s: float,
                 on_change: Callable[[], None]) -> None:
        self.role = role
        self.sources = parse_sources(spec, f"--{role}")
        self.make, self.interval_s, self.on_change = make, interval_s, on_change
        self.members: dict[str, Upstream] = {}
        self.retired: list[Upstream] = []             # left the list; closed once unheld
        self._last: dict[Source, list[str]] = {}      # each source's last good answer
        self.problems: dict[Source, str] = {}         # each source's current problem
        self._task: asyncio.Task | None = None
        for source in self.sources:                   # fixed addresses are members at once
            if source.kind == "static":
                self._last[source] = [source.value]
                self._add(source.value)

    @property
    def dynamic(self) -> bool:
        return any(s.kind != "static" for s in self.sources)

    def __iter__(self):
        return iter(list(self.members.values()))

    def __len__(self) -> int:
        return len(self.members)

    def describe(self) -> str:
        """The sources as given (for reasons and logs)."""
        return ",".join(str(s) for s in self.sources)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for up in self.members.values():
            up.start()
        if self.dynamic:
            self._task = asyncio.create_task(self._refresh_forever(),
                                             name=f"resolve-{self.role}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for up in [*self.members.values(), *self.retired]:
            await up.close()

    async def refresh(self) -> None:
        """Resolve every source again; add the new addresses, retire the ones gone."""
        wanted: list[str] = []
        for source in self.sources:
            try:
                self._last[source] = await resolve(source)
                if self.problems.pop(source, None):
                    log.info("%s replicas: %s resolves again", self.role, source)
            except ResolveError as e:
                if self.problems.get(source) != str(e):
                    log.warning("%s replicas: %s; keeping its last addresses %s", self.role, e,
                                self._last.get(source, []))
                self.problems[source] = str(e)
            wanted += [a for a in self._last.get(source, []) if a not in wanted]
        changed = False
        for address in wanted:
            if address not in self.members:
                self._add(address).start()
                changed = True
        for address in [a for a in self.members if a not in wanted]:
            self._retire(address)
            changed = True
        await self._close_unheld()
        if changed:
            self.on_change()

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("%s replicas: refresh failed", self.role)
            await asyncio.sleep(self.interval_s)

    def _add(self, address: str) -> Upstream:
        up = self.make(address)
        self.members[address] = up
        if self.dynamic or len(self.sources) > 1:
            log.info("%s replica added: %s", self.role, address)
        return up

    def _retire(self, address: str) -> None:
        up = self.members.pop(address)
        log.info("%s replica removed from the list: %s (its requests move to another)",
                 self.role, address)
        up.retire()
        self.retired.append(up)

    async def _close_unheld(self) -> None:
        for up in [u for u in self.retired if u.placed == 0]:
            self.retired.remove(up)
            await up.close()
