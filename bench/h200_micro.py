"""python -m bench.h200_micro [--tiny]: GPU measurements for issue 7 that fit one short lease.

Qwen3-8B-shaped target (random bf16 weights: ServiceHooks.random_weights) and a DFlash-shaped
drafter (5 layers, taps 1, 9, 17, 25, 33, block 16), timed in-process with CUDA events:
  copy bandwidth; verify attention (triton vs flashinfer) at context 4096, B = 16, batch 32;
  target forward + LM head per verify step (eager and CUDA graph) at batch 1/8/32, B = 1/16;
  draft propose forward at batch 1/8/32; transformers' static-cache decode at batch 1;
  the bandwidth floor per step and tokens/s implied at forced tau = 6.4 and 3.
Writes JSON incrementally (partial results survive a timeout). --tiny runs a small shape on CPU
(fp32, torch attention backend, perf_counter timing; no CUDA graphs, Triton or FlashInfer) and
exits 1 if a part failed."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from functools import partial
from pathlib import Path

import torch

QWEN3_8B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
            "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}
# Qwen3.5-9B's text model as we take its shape (random weights): 32 layers, every 4th full
# (gated) attention of 16 heads x 256 (4 KV heads), the rest Gated DeltaNet with 16 key heads
# serving 32 value heads of 128; its drafter's layers are a dense Qwen3 layout of that width
QWEN3_5_9B = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
              "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
              "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
              "head_dim": 256, "full_attention_interval": 4,
              "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                              for i in range(32)],
              "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                  "partial_rotary_factor": 0.25},
              "max_position_embeddings": 40960, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2}
QWEN3_5_DRAFT = {**QWEN3_8B, "vocab_size": 248320}
TINY = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2}


class Recorder:
    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")
        print(key, json.dumps(value), flush=True)


def timed(fn, device: str, warmup: int = 2, iters: int = 10) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_timed(fn, reps: int = 20, iters: int = 10) -> float:
    """Median milliseconds of one fn() replayed from a CUDA graph of `reps` calls: the GPU's
    time alone, without the host's launch time (the services replay their forwards so)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return timed(graph.replay, "cuda", warmup=1, iters=iters) / reps


def write_model_dirs(root: Path, target_cfg: dict, taps: list[int],
                     draft_base: dict | None = None) -> tuple[Path, Path]:
    """A target directory of `target_cfg` and a DFlash drafter of 5 layers, block 16, tapping
    `taps` (its layers: draft_base's fields - a dense Qwen3 layout of the target's width for a
    hybrid target - else the target's)."""
    from safetensors.torch import save_file
    tdir, ddir = root / "target", root / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)
    (tdir / "config.json").write_text(json.dumps(target_cfg))
    h = target_cfg["hidden_size"]
    draft_cfg = {**(draft_base or target_cfg), "num_hidden_layers": 5, "block_size": 16,
                 "dflash_config": {"target_layer_ids": taps, "mask_token_id": 0}}
    (ddir / "config.json").write_text(json.dumps(draft_cfg))
    save_file({"fc.weight": torch.zeros(h, len(taps) * h, dtype=torch.bfloat16)},
              str(ddir / "model.safetensors"))
    return tdir, ddir


def copy_tokenizer(tdir: Path) -> None:
    """The gateway needs a tokenizer.json to start; token ids travel as ids (random weights
    produce ids it may not decode: text is irrelevant here). SmolLM2's, where it is found."""
    from runtime.home import models_home
    for candidate in (Path(os.environ.get("DFLASH_BENCH_TOKENIZER", "")),
                      Path(".gpu_tok"),
                      models_home() / "models/smollm2-135m-instruct/float32"):
        if (candidate / "tokenizer.json").is_file():
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (candidate / name).is_file():
                    shutil.copy(candidate / name, tdir / name)
            return
    raise FileNotFoundError("no tokenizer.json: set DFLASH_BENCH_TOKENIZER to a directory with one")


def copy_bandwidth(device: str) -> float:
    """GB/s counting bytes read + written."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), device)
    return 2 * n / (ms / 1e3) / 1e9


def attention(name: str, device: str, bs: int, ctx: int, block: int, shape: dict) -> float:
    """ms per layer: one verify-block attention over a paged context."""
    from runtime.attention.metadata import AttentionMetadata, SeqSlice
    from runtime.attention.registry import backend_class
    from runtime.kv_cache import PagedKVCache, PageTable
    nh, nkv, hd, ps = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"], 16
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pages = bs * (-(-(ctx + block) // ps)) + 2
    cache = PagedKVCache(1, nkv, hd, ps, pages, dtype, device)
    cache.k.normal_()
    cache.v.normal_()
    tables = [PageTable() for _ in range(bs)]
    for t in tables:
        cache.ensure(t, ctx + block)
    meta = AttentionMetadata.build([SeqSlice(t, ctx, block) for t in tables], cache, True, device)
    be = backend_class(name)(cache, nh, nkv, hd, hd ** -0.5)
    be.prepare(meta)
    q = torch.randn(bs * block, nh, hd, dtype=dtype, device=device)
    k = torch.randn(bs * block, nkv, hd, dtype=dtype, device=device)
    return timed(lambda: be.forward(0, q, k, k), device, warmup=3, iters=20)


def mla_attention(name: str, device: str, bs: int, ctx: int, block: int, heads: int,
                  kv_dtype: torch.dtype, lat: int = 512, rope: int = 64):
    """One layer's verify-block MLA attention (absorbed form: the cache write, then attention)
    over a paged latent cache of our own layout, through one of our backends (torch, triton,
    flashinfer) -> the call to time."""
    from runtime.attention.metadata import AttentionMetadata, SeqSlice
    from runtime.attention.registry import backend_class
    from runtime.kv_cache import PagedKVCache, PageTable
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ps = 16
    pages = bs * (-(-(ctx + block) // ps)) + 2
    cache = PagedKVCache(1, 1, lat + rope, ps, pages, kv_dtype, device, latent_value_dim=lat)
    key = torch.randn(cache.k.shape[1], 1, lat + rope, device=device)
    cache.write(0, torch.arange(cache.k.shape[1], device=device), key[..., :lat], key[..., lat:])
    tables = [PageTable() for _ in range(bs)]
    for t in tables:
        cache.ensure(t, ctx + block)
    meta = AttentionMetadata.build([SeqSlice(t, ctx, block) for t in tables], cache, True, device)
    be = backend_class(name)(cache, heads, 1, lat + rope, (128 + rope) ** -0.5)
    be.prepare(meta)
    q = torch.randn(bs * block, heads, lat + rope, dtype=dtype, device=device)
    latent = torch.randn(bs * block, 1, lat, dtype=dtype, device=device)
    k_rope = torch.randn(bs * block, 1, rope, dtype=dtype, device=device)
    return lambda: be.forward(0, q, latent, k_rope)


def flashinfer_mla_attention(bs: int, ctx: int, block: int, heads: int, lat: int = 512,
                             rope: int = 64):
    """FlashInfer's MLA wrapper alone (its own cache layout: latent and rope pages apart), the
    same verify-block attention, bf16 -> the call to time."""
    import flashinfer
    ps, dev, dt = 16, "cuda", torch.bfloat16
    per_seq = -(-(ctx + block) // ps)
    ckv = torch.randn(bs * per_seq, ps, lat, dtype=dt, device=dev)
    kpe = torch.randn(bs * per_seq, ps, rope, dtype=dt, device=dev)
    i32 = {"dtype": torch.int32, "device": dev}
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device=dev))
    wrapper.plan(torch.arange(bs + 1, **i32) * block, torch.arange(bs + 1, **i32) * per_seq,
                 torch.arange(bs * per_seq, **i32), torch.full((bs,), ctx + block, **i32),
                 heads, lat, rope, ps, True, (128 + rope) ** -0.5, dt, dt)
    q_nope = torch.randn(bs * block, heads, lat, dtype=dt, device=dev)
    q_pe = torch.randn(bs * block, heads, rope, dtype=dt, device=dev)
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe)


def mla_rows(device: str, rec: Recorder, tiny: bool) -> list[dict]:
    """Our MLA backends (triton, flashinfer: its MLA wrapper on our pages, torch) and FlashInfer's
    wrapper on its own contiguous layout, by heads, verify block and cache dtype: batch 32 at
    context 4096 (tiny: torch, batch 2 at 64). On a GPU each is timed twice: called from the
    host (`*_ms`, launch time included) and replayed from a CUDA graph (`*_graph_ms`, the GPU's
    time: how the services run it)."""
    rows = []
    bs, ctx = (2, 64) if tiny else (32, 4096)
    names = ("torch",) if tiny else ("triton", "flashinfer", "torch")
    for heads in ((4,) if tiny else (16, 128)):
        for block in (1, 16):
            for kv in (torch.bfloat16, torch.float8_e4m3fn):
                row = {"heads": heads, "block": block, "kv": str(kv).removeprefix("torch."),
                       "batch": bs, "context": ctx}
                for name in names:
                    if name == "flashinfer" and kv != torch.bfloat16:
                        continue                    # our flashinfer backend: no fp8 cache
                    time_mla(row, name, device, partial(mla_attention, name, device, bs,
                                                        ctx, block, heads, kv))
                if not tiny and kv == torch.bfloat16:
                    time_mla(row, "flashinfer_own_layout", device,
                             partial(flashinfer_mla_attention, bs, ctx, block, heads))
                rows.append(row)
                rec.put("mla_attention", rows)
    return rows


def time_mla(row: dict, name: str, device: str, make) -> None:
    """row[name_ms] (and on a GPU row[name_graph_ms]) for the call make() returns, or
    row[name_error]: one failing part does not lose the others."""
    try:
        fn = make()
        row[f"{name}_ms"] = round(timed(fn, device, warmup=3, iters=20), 4)
        if device == "cuda":
            row[f"{name}_graph_ms"] = round(graph_timed(fn), 4)
    except Exception as e:  # noqa: BLE001 - kept in the JSON
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def target_steps(tdir: Path, device: str, rec: Recorder, batches, blocks, ctx: int, backend: str,
                 graphs: bool) -> dict:
    from runtime.attention.metadata import SeqSlice
    from runtime.kv_cache import PageTable
    from services.target.config import TargetConfig
    from services.target.hooks import TargetHooks
    from services.target.worker import TargetWorker
    dtype = "bfloat16" if device == "cuda" else "float32"
    config = TargetConfig(model_dir=str(tdir), device=device, dtype=dtype,
                          attention_backend=backend, max_block_size=16,
                          kv_budget_bytes=(24 << 30) if device == "cuda" else (64 << 20))
    w = TargetWorker.started(config, TargetHooks(random_weights=True))
    out = {}
    for bs in batches:
        tables = [PageTable() for _ in range(bs)]
        for t in tables:
            w.kv_cache.ensure(t, ctx + 16)
        for b in blocks:
            slices = [SeqSlice(t, ctx, b) for t in tables]
            ids = torch.randint(0, 500, (bs * b,))
            pos = torch.arange(ctx, ctx + b).repeat(bs)

            def eager(slices=slices, ids=ids, pos=pos):
                o = w.forward(slices, ids, pos, ())
                return w.logits(o.hidden).argmax(-1)
            row = {"eager_ms": round(timed(eager, device), 3)}
            if graphs and device == "cuda" and backend == "triton":
                try:
                    row["graph_ms"] = round(_graph_step(w, slices, ids, pos, b, ctx, device), 3)
                except Exception as e:  # noqa: BLE001
                    row["graph_error"] = f"{type(e).__name__}: {e}"
            out[f"bs{bs}_B{b}"] = row
            rec.put(f"target_{backend}_bs{bs}_B{b}", row)
        for t in tables:
            w.kv_cache.release(t)
    return out


def _graph_step(w, slices, ids, pos, b, ctx, device) -> float:
    from runtime.cuda_graphs import GraphRunner
    from runtime.models.forward import ForwardBatch
    model, backend = w.model, w.attn_backend

    def fwd(i, p, meta):
        return model(i, p, ForwardBatch(backend, ()))
    runner = GraphRunner(fwd, backend, w.kv_cache, b, ctx + 64, True,
                         buckets=(len(slices),))
    runner.capture()
    ids_d, pos_d = ids.to(device), pos.to(device)

    def step():
        o = runner.run(slices, ids_d, pos_d)
        return w.logits(o.hidden).argmax(-1)
    # exactness of the graph against eager on the same inputs
    eager = w.logits(w.forward(slices, ids, pos, ()).hidden)
    graphed = w.logits(runner.run(slices, ids_d, pos_d).hidden)
    assert (eager - graphed).abs().max().item() < 1e-2 * max(1.0, eager.abs().max().item())
    return timed(step, device)


def draft_steps(tdir: Path, ddir: Path, device: str, rec: Recorder, batches, ctx: int,
                backend: str) -> dict:
    from services.draft.config import DraftConfig
    from services.draft.drafter import ProposeItem, make_drafter
    from services.draft.sequence import DraftSequence
    dtype = "bfloat16" if device == "cuda" else "float32"
    d = make_drafter(DraftConfig(target_dir=str(tdir), model_dir=str(ddir), device=device,
                                 dtype=dtype, attention_backend=backend,
                                 kv_budget_bytes=(8 << 30) if device == "cuda" else (64 << 20)),
                     random_weights=True)
    d.init_backend()
    out = {}
    width = d.facts.feature_width
    for bs in batches:
        seqs = [DraftSequence(f"s{i}") for i in range(bs)]
        feats = torch.randn(ctx, width, dtype=getattr(torch, d.facts.feature_dtype))
        items = [ProposeItem(seq=s, start=0, num_new=ctx, features=feats, token_ids=[0] * ctx,
                             anchor=1, block_size=16) for s in seqs]
        for it in items:
            d.reserve(it)
        d.propose(items)                  # context appended once
        for s in seqs:
            s.context_len = ctx
        blocks = [ProposeItem(seq=s, start=ctx, num_new=0, features=None, token_ids=[], anchor=1,
                              block_size=16) for s in seqs]

        def step(blocks=blocks):
            for it in blocks:
                d.reserve(it)
            return d.propose(blocks)
        out[f"bs{bs}"] = {"propose_ms": round(timed(step, device), 3)}
        rec.put(f"draft_{backend}_bs{bs}", out[f"bs{bs}"])
        for s in seqs:
            d.release(s)
    return out


def transformers_decode(cfg: dict, device: str, ctx: int, new: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    ids = torch.randint(0, 500, (1, ctx), device=device)
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    out = {}
    for impl in ("static", "dynamic"):
        extra = {"cache_implementation": "static"} if impl == "static" else {}
        model.generate(ids, max_new_tokens=4, do_sample=False, **extra)
        torch.cuda.synchronize() if device == "cuda" else None
        t0 = time.perf_counter()
        model.generate(ids, **kw, **extra)
        torch.cuda.synchronize() if device == "cuda" else None
        out[impl] = {"tokens_per_s": round(new / (time.perf_counter() - t0), 1)}
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.tiny import add_tiny_flag, tiny_outputs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tiny_flag(ap)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/h200_micro.json")
    ap.add_argument("--skip", nargs="*", default=[])
    args = ap.parse_args(argv)
    tiny_outputs(args, ap, "h200_micro", ("out",))
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else QWEN3_8B
    taps = [1, 2, 3, 4, 5] if args.tiny else [1, 9, 17, 25, 33]
    rec = Recorder(Path(args.out))
    root = Path(args.out).parent / "h200_micro_models" if args.tiny else Path("/tmp/h200_micro_models")
    tdir, ddir = write_model_dirs(root, shape, taps)
    ctx, batches = (64, (1, 4)) if args.tiny else (1000, (1, 8, 32))
    backend = "torch" if args.tiny else "triton"
    rec.put("device", torch.cuda.get_device_name() if device == "cuda" else "cpu")
    if args.tiny:
        from bench.tiny import NO_CUDA, tiny_fields
        for key, value in tiny_fields({"attn_triton_ms": NO_CUDA + " (attn_torch_ms instead)",
                                       "attn_flashinfer_ms": NO_CUDA, "graph_ms": NO_CUDA,
                                       "cuda_events": "perf_counter timing on the CPU"}).items():
            rec.put(key, value)
    guarded(rec, "copy_GBps", lambda: round(copy_bandwidth(device), 1))
    if not args.tiny:
        guarded(rec, "attn_triton_ms", lambda: round(attention("triton", device, 32, 4096, 16, shape), 4))
    else:
        guarded(rec, "attn_torch_ms", lambda: round(attention("torch", device, 4, 256, 16, shape), 4))
    if "target" not in args.skip:
        guarded(rec, "target", lambda: target_steps(tdir, device, rec, batches, (1, 16), ctx,
                                                    backend, graphs=True))
    if "draft" not in args.skip:
        guarded(rec, "draft", lambda: draft_steps(tdir, ddir, device, rec, batches, ctx, backend))
    if "transformers" not in args.skip:
        guarded(rec, "transformers_bs1",
                lambda: transformers_decode(shape, device, ctx, 8 if args.tiny else 128))
    if "mla" not in args.skip:
        guarded(rec, "mla", lambda: len(mla_rows(device, rec, args.tiny)))
    if not args.tiny and "flashinfer" not in args.skip:
        guarded(rec, "attn_flashinfer_ms",
                lambda: round(attention("flashinfer", device, 32, 4096, 16, shape), 4))
    failed = sorted(k for k in rec.data if k.endswith("_error"))
    if args.tiny and failed:            # a smoke test fails loudly; a GPU run keeps its parts
        raise SystemExit(f"--tiny: parts failed: {failed}")


def guarded(rec: Recorder, key: str, fn) -> None:
    """Record fn()'s value, or its error: one failing part does not lose the others."""
    try:
        rec.put(key, fn())
    except Exception as e:  # noqa: BLE001 - a benchmark part failing is data
        import traceback
        traceback.print_exc()
        rec.put(key + "_error", f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()


def tiny_hybrid(shape: dict) -> dict:
    """A CPU-sized shape of a hybrid one (--tiny): 4 layers, small heads."""
    return {**shape, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "layer_types": shape["layer_types"][:4],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32,
            "max_position_embeddings": 4096}
