"""`dflash demo` (what `make run` runs): starts the local stack on free ports, has a short chat
through the real `openai` client (streamed), prints the answer, tokens/s and the mean
acceptance length, and stops the stack."""
from __future__ import annotations

import argparse
import sys
import time

from dflash.stack import DEFAULT_DRAFTER, DRAFTERS, Stack, StackOptions
from services.common.ports import free_port

DEFAULT_PROMPT = ("Write a Python function that adds two numbers, then write the same function "
                  "again with a docstring.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, choices=DRAFTERS)
    p.add_argument("--model", default="", help="target HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model", default="", help="DFlash drafter directory (--drafter dflash)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--log-dir", default="")


def run(args: argparse.Namespace) -> int:
    opts = StackOptions(http_port=free_port(), port=free_port(), target_port=free_port(),
                        draft_port=free_port(), drafter=args.drafter, model_dir=args.model,
                        draft_model=args.draft_model, log_dir=args.log_dir)
    stack = Stack(opts)
    try:
        stack.start()
        print(f"starting the local stack (drafter: {args.drafter}; logs in {stack.log_dir}) ...",
              flush=True)
        stack.wait_ready()
        print(f"ready\n{stack.endpoints()}\n", flush=True)
        chat(stack.http_url, args.prompt, args.max_tokens)
        return 0
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


def chat(http_url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat through the openai client; prints it and returns its numbers."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{http_url}/v1", api_key="not-needed")
    model = client.models.list().data[0].id
    print(f"user> {prompt}\n\nassistant> ", end="", flush=True)
    t0 = time.perf_counter()
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            usage = chunk.usage
    elapsed = time.perf_counter() - t0
    spec = (usage.model_extra or {}).get("spec_decode", {})
    numbers = {"completion_tokens": usage.completion_tokens, "seconds": elapsed,
               "tokens_per_s": usage.completion_tokens / elapsed,
               "mean_acceptance_length": spec.get("mean_acceptance_length", 1.0),
               "tokens_per_step": (usage.completion_tokens - 1) / max(1, spec.get("verify_steps", 1))}
    print(f"\n\n{numbers['completion_tokens']} tokens in {elapsed:.2f} s = "
          f"{numbers['tokens_per_s']:.1f} tokens/s (prefill included); mean acceptance length "
          f"{numbers['mean_acceptance_length']:.2f} (1 + accepted drafts per drafting step), "
          f"{numbers['tokens_per_step']:.2f} tokens per verify step")
    return numbers
