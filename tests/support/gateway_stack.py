"""Gateway test support: start `python -m gateway`, talk to it over gRPC, and transformers'
greedy reference on the same token ids."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from support.procs import ServiceProcess, free_port

SERVICE = "dflash.v1.Gateway"


class GatewayProcess(ServiceProcess):
    """A gateway child with its gRPC address and HTTP base URL."""

    def __init__(self, args: list[str], port: int, http_port: int, log_dir: Path) -> None:
        super().__init__("gateway", args, SERVICE, port, log_dir)
        self.http_port = http_port
        self.http_url = f"http://127.0.0.1:{http_port}"
        self._channel: grpc.Channel | None = None

    @property
    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return gateway_pb2_grpc.GatewayStub(self._channel)

    def readiness(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.http_url}/readiness", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, timeout: float = 300,
                 **fields) -> tuple[list[int], str, list[gateway_pb2.GenerateResponse]]:
        """Greedy by default; returns (token ids, text, all responses)."""
        sampling = fields.pop("sampling", common_pb2.SamplingParams(temperature=0.0))
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=list(prompt_ids)),
                                          max_tokens=max_tokens, sampling=sampling, **fields)
        responses = list(self.stub.Generate(req, timeout=timeout))
        ids = [t for r in responses for t in r.token_ids]
        return ids, "".join(r.text for r in responses), responses

    def stop(self, timeout: float = 15.0) -> int | None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        return super().stop(timeout)


def start_gateway(target: str, tokenizer_dir: str | Path, log_dir: Path, *extra: str,
                  draft: str = "", wait: bool = True) -> GatewayProcess:
    port, http_port = free_port(), free_port()
    args = ["--target", target, "--draft", draft, "--tokenizer", str(tokenizer_dir),
            "--port", str(port), "--http-port", str(http_port), "--host", "127.0.0.1",
            "--backoff-max", "1", *extra]
    p = GatewayProcess(args, port, http_port, log_dir)
    p.start()
    return p.wait_serving(timeout=120) if wait else p


def generate_concurrently(gw: GatewayProcess, prompts: Sequence[Sequence[int]], n: int
                          ) -> list[list[int]]:
    """Every prompt as its own greedy request, all at once (a thread each); their token ids."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: gw.generate(ids, n)[0], prompts))


def chat_prompts(model_dir: str | Path, texts: Sequence[str]) -> list[list[int]]:
    """Each text as one user message through the model's chat template, as token ids."""
    from runtime.tokenizer import ChatTokenizer
    tok = ChatTokenizer(model_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout} s")


class GreedyReference:
    """transformers' greedy `generate` (fp32) on token ids, stopping at EOS like the gateway;
    results cached per (prompt, n)."""

    def __init__(self, model_dir: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                          dtype=torch.float32).eval()
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        key = (tuple(prompt_ids), n)
        if key not in self.cache:
            with self.torch.no_grad():
                out = self.model.generate(self.torch.tensor([list(prompt_ids)]), max_new_tokens=n,
                                          do_sample=False)
            self.cache[key] = out[0, len(prompt_ids):].tolist()
        return self.cache[key]


def lookup_partial_accepts(prompt: Sequence[int], tokens: Sequence[int], accepted: Sequence[int],
                           usage, block: int, n: int) -> int:
    """Verify steps that accepted some of their drafts and rejected others, for a stream of n
    greedy tokens drafted by prompt lookup with blocks of `block` (event 0: the prefill's
    token). Each step's drafts are recomputed with the drafter's own rule over the committed
    tokens and their totals checked against the gateway's usage, so the count is the real one."""
    from services.draft.prompt_lookup import propose_ngram
    produced, drafted, partial = 1, 0, 0
    for a in accepted[1:]:
        d = len(propose_ngram(list(prompt) + list(tokens[:produced]),
                              min(block, n - produced) - 1, max_ngram=4, min_ngram=1))
        drafted += d
        partial += 0 < a < d
        produced += a + 1
    assert (drafted, sum(accepted)) == (usage.draft_tokens, usage.accepted_tokens)
    return partial
