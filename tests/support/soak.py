"""The soak's load: `workers` concurrent clients, each looping until the deadline over a mix of
streamed and whole requests (HTTP and gRPC), random cancellations (a client that stops reading
and hangs up, a client-side timeout), and bad requests of known kinds. Every outcome is counted;
an answer that is neither the expected success nor the expected refusal is a violation."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import httpx

from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

_TEXT = ("the cat dog sat on mat log red blue one two three paint robot sea shore light plant "
         "once upon a time there was fox jumps over lazy again and")
WORDS = tuple(_TEXT.split())


@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)     # (kind, outcome) -> n
    violations: list[str] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)   # HTTP status / gRPC code -> n
    tokens: int = 0
    mismatches: list[str] = field(default_factory=list)  # greedy output differing from reference

    def add(self, kind: str, outcome: str) -> None:
        self.counts[(kind, outcome)] += 1

    def status(self, code) -> None:
        self.statuses[str(code)] += 1
        if isinstance(code, int) and code >= 500:
            self.violations.append(f"HTTP {code}")

    def total(self, outcome: str | None = None) -> int:
        return sum(n for (_, o), n in self.counts.items() if outcome is None or o == outcome)


@dataclass
class Target:
    http_url: str
    grpc_address: str
    model: str
    reference: dict[str, list[int]]      # greedy prompt text -> token ids (max REF_TOKENS)


REF_TOKENS = 24


class Load:
    def __init__(self, target: Target, seed: int = 1234) -> None:
        self.t = target
        self.out = Outcomes()
        self.rng = random.Random(seed)

    async def run(self, workers: int, seconds: float) -> Outcomes:
        deadline = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=workers * 2, max_keepalive_connections=workers)
        async with httpx.AsyncClient(base_url=self.t.http_url, timeout=120, limits=limits) as http, \
                grpc.aio.insecure_channel(self.t.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            await asyncio.gather(*(self._worker(http, stub, channel, deadline, i)
                                   for i in range(workers)))
        return self.out

    async def _worker(self, http, stub, channel, deadline: float, i: int) -> None:
        rng = random.Random(self.rng.random() + i)
        actions: list[tuple[float, Callable[..., Awaitable[None]]]] = [
            (0.30, self._http_stream), (0.25, self._grpc_stream), (0.12, self._http_whole),
            (0.08, self._greedy_check), (0.05, self._http_timeout), (0.20, self._bad)]
        weights = [w for w, _ in actions]
        while time.monotonic() < deadline:
            action = rng.choices([a for _, a in actions], weights)[0]
            try:
                await action(rng, http, stub, channel)
            except Exception as e:  # noqa: BLE001 - any client-side surprise is a violation
                self.out.violations.append(f"{action.__name__}: {type(e).__name__}: {e}"[:300])

    # -- good requests ------------------------------------------------------------------------
    def _prompt(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))

    def _sampling(self, rng: random.Random) -> dict:
        if rng.random() < 0.5:
            return {"temperature": 0}
        return {"temperature": rng.choice([0.5, 0.8, 1.0]), "top_p": rng.choice([0.9, 1.0]),
                "seed": rng.randint(0, 2**31)}

    def _body(self, rng: random.Random, stream: bool) -> tuple[str, dict]:
        body = {"model": self.t.model, "max_tokens": rng.randint(4, 48), "stream": stream,
                **self._sampling(rng)}
        if rng.random() < 0.5:
            return "/v1/chat/completions", {**body, "messages": [
                {"role": "user", "content": self._prompt(rng)}]}
        return "/v1/completions", {**body, "prompt": self._prompt(rng)}

    async def _http_stream(self, rng, http, stub, channel) -> None:
        path, body = self._body(rng, stream=True)
        cancel_after = rng.randint(1, 6) if rng.random() < 0.3 else None
        async with http.stream("POST", path, json=body) as r:
            self.out.status(r.status_code)
            if r.status_code != 200:
                self.out.violations.append(f"stream {r.status_code}: {(await r.aread())[:200]}")
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if '"error"' in line:
                    self.out.violations.append(f"error in stream: {line[:200]}")
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    self.out.add("http_stream", "cancelled")
                    return                      # leaving the block closes the connection
        self.out.add("http_stream", "completed")

    async def _grpc_stream(self, rng, http, stub, channel) -> None:
        s = self._sampling(rng)
        sampling = common_pb2.SamplingParams(temperature=s["temperature"])
        if "seed" in s:
            sampling.top_p, sampling.seed = s["top_p"], s["seed"]
        call = stub.Generate(gateway_pb2.GenerateRequest(
            text=self._prompt(rng), max_tokens=rng.randint(4, 48), sampling=sampling),
            timeout=120)
        cancel_after = rng.randint(1, 6) if rng.random() < 0.3 else None
        n = 0
        try:
            async for msg in call:
                n += 1
                self.out.tokens += len(msg.token_ids)
                if cancel_after is not None and n >= cancel_after:
                    call.cancel()
                    self.out.add("grpc_stream", "cancelled")
                    return
        except grpc.aio.AioRpcError as e:
            self.out.status(e.code().name)
            self.out.violations.append(f"grpc stream {e.code().name}: {e.details()}"[:300])
            return
        self.out.status("OK")
        self.out.add("grpc_stream", "completed")

    async def _http_whole(self, rng, http, stub, channel) -> None:
        path, body = self._body(rng, stream=False)
        r = await http.post(path, json=body)
        self.out.status(r.status_code)
        if r.status_code != 200:
            self.out.violations.append(f"whole {r.status_code}: {r.text[:200]}")
            return
        self.out.tokens += r.json()["usage"]["completion_tokens"]
        self.out.add("http_whole", "completed")

    async def _http_timeout(self, rng, http, stub, channel) -> None:
        """A client that gives up after a short time (the gateway must cancel and release)."""
        path, body = self._body(rng, stream=rng.random() < 0.5)
        try:
            r = await http.post(path, json=body, timeout=rng.uniform(0.02, 0.3))
            self.out.status(r.status_code)
            self.out.add("http_timeout", "completed before the timeout")
        except httpx.TimeoutException:
            self.out.add("http_timeout", "cancelled")

    async def _greedy_check(self, rng, http, stub, channel) -> None:
        """Greedy output under load equals the reference taken before the soak."""
        prompt = rng.choice(sorted(self.t.reference))
        resp = [m async for m in stub.Generate(gateway_pb2.GenerateRequest(
            text=prompt, max_tokens=REF_TOKENS, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0)), timeout=120)]
        tokens = [t for m in resp for t in m.token_ids]
        self.out.status("OK")
        if tokens != self.t.reference[prompt]:
            self.out.mismatches.append(prompt)
        self.out.add("greedy_check", "identical" if tokens == self.t.reference[prompt]
                     else "DIFFERENT")

    # -- bad requests ---------------------------------------------------------------------------
    async def _bad(self, rng, http, stub, channel) -> None:
        kind, expected = rng.choice(BAD_KINDS)
        got = await getattr(self, f"_bad_{kind}")(rng, http, stub, channel)
        self.out.status(got)
        if got != expected:
            self.out.violations.append(f"bad request {kind}: expected {expected}, got {got}")
        self.out.add(f"bad:{kind}", "refused" if got == expected else f"got {got}")

    async def _post_raw(self, http, path: str, content: bytes) -> int:
        r = await http.post(path, content=content, headers={"content-type": "application/json"})
        if r.status_code != 200:
            json.loads(r.content)["error"]["message"]          # OpenAI's error shape
        return r.status_code

    async def _bad_json(self, rng, http, stub, channel) -> int:
        return await self._post_raw(http, "/v1/completions", b'{"model": "m", "prompt": ')

    async def _bad_field(self, rng, http, stub, channel) -> int:
        body = {"model": self.t.model, "prompt": "hi", "frobnicate": 1}
        return (await http.post("/v1/completions", json=body)).status_code

    async def _bad_max_tokens(self, rng, http, stub, channel) -> int:
        body = {"model": self.t.model, "prompt": "hi", "max_tokens": 10**7}
        return (await http.post("/v1/completions", json=body)).status_code

    async def _bad_temperature(self, rng, http, stub, channel) -> int:
        body = {"model": self.t.model, "messages": [{"role": "user", "content": "hi"}],
                "temperature": -1}
        return (await http.post("/v1/chat/completions", json=body)).status_code

    async def _bad_token_ids(self, rng, http, stub, channel) -> int:
        body = {"model": self.t.model, "prompt": [1, 2, 10**7]}
        return (await http.post("/v1/completions", json=body)).status_code

    async def _bad_model(self, rng, http, stub, channel) -> int:
        body = {"model": "no-such-model", "prompt": "hi"}
        return (await http.post("/v1/completions", json=body)).status_code

    async def _bad_role(self, rng, http, stub, channel) -> int:
        body = {"model": self.t.model, "messages": [{"role": "wizard", "content": "hi"}]}
        return (await http.post("/v1/chat/completions", json=body)).status_code

    async def _bad_too_large(self, rng, http, stub, channel) -> int:
        big = json.dumps({"model": self.t.model, "prompt": "a" * (1 << 20)}).encode()
        return await self._post_raw(http, "/v1/completions", big)

    async def _bad_grpc_empty(self, rng, http, stub, channel) -> str:
        return await _grpc_code(stub.Generate(gateway_pb2.GenerateRequest(text=""), timeout=30))

    async def _bad_grpc_top_p(self, rng, http, stub, channel) -> str:
        return await _grpc_code(stub.Generate(gateway_pb2.GenerateRequest(
            text="hi", sampling=common_pb2.SamplingParams(top_p=2.0)), timeout=30))

    async def _bad_grpc_bytes(self, rng, http, stub, channel) -> str:
        call = channel.unary_stream("/dflash.v1.Gateway/Generate",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        # field 1 claiming at least 2**28 bytes: never a valid message, whatever follows
        junk = b"\x0a\xff\xff\xff\xff" + rng.randbytes(rng.randint(0, 64))
        return await _grpc_code(call(junk, timeout=30))


BAD_KINDS = [("json", 400), ("field", 400), ("max_tokens", 400), ("temperature", 400),
             ("token_ids", 400), ("model", 404), ("role", 400), ("too_large", 413),
             ("grpc_empty", "INVALID_ARGUMENT"), ("grpc_top_p", "INVALID_ARGUMENT"),
             ("grpc_bytes", "INVALID_ARGUMENT")]


async def _grpc_code(call) -> str:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"
