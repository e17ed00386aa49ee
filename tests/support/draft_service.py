"""Draft-service helpers for tests: start `python -m services.draft`, build Propose requests."""
from __future__ import annotations

from pathlib import Path

import torch

from dflash.harness import NO_HOOK_FLAGS, HookFlags
from dflash.v1 import draft_pb2
from services.common import tensor_codec
from support.procs import ServiceProcess, free_port, service_command

SERVICE = "dflash.v1.Draft"


def start_draft(target_dir: str | Path | None, log_dir: Path, *extra: str,
                model_dir: str | Path | None = None, wait: bool = True,
                env: dict[str, str] | None = None, hooks: HookFlags = NO_HOOK_FLAGS,
                prefix: list[str] | None = None) -> ServiceProcess:
    """target_dir / model_dir None: not passed as flags (e.g. given through DFLASH_* env);
    prefix: a command the draft runs under."""
    port = free_port()
    args = ["--port", str(port), "--host", "127.0.0.1", *extra]
    if target_dir is not None:
        args = ["--target-model", str(target_dir), *args]
    if model_dir is not None:
        args = ["--model", str(model_dir), *args]
    module, args = service_command("draft", args, hooks)
    p = ServiceProcess(module, args, SERVICE, port, log_dir, env, prefix).start()
    return p.wait_serving() if wait else p


def propose_request(seq_id: str, features: torch.Tensor | None, start: int, anchor: int,
                    block_size: int = 0, token_ids: list[int] | None = None
                    ) -> draft_pb2.ProposeRequest:
    n = 0 if features is None else features.shape[0]
    if features is None and token_ids is not None:
        n = len(token_ids)
    return draft_pb2.ProposeRequest(
        sequence_id=seq_id, positions=list(range(start, start + n)),
        new_features=tensor_codec.encode(features) if features is not None else None,
        new_token_ids=token_ids or [], anchor=anchor, block_size=block_size)
