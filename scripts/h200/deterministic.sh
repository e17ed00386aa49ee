# On one GPU, after `source scripts/h200/env.sh` (and scripts/h200/assemble_smollm2.sh for the
# `exact` phase): issue 38's checks of --deterministic (docs/deterministic.md), each phase within
# one device call (10 minutes). Results in $OUT.
#   bash scripts/h200/deterministic.sh check   the batch-invariance and attention tests natively
#                                              (bf16, CUDA graphs, the GEMM's tiles across row
#                                              counts), then bench.invariant_gemm_gpu (~6 min)
#   bash scripts/h200/deterministic.sh cost    bench.gpu_side_by_side, Qwen3-8B shape, forced
#                                              tau 6.4, c = 1, 32, 32: the default mode, then
#                                              --deterministic, on the same machine (~4 min)
#   bash scripts/h200/deterministic.sh exact   bench.smollm2_gpu: SmolLM2 + the shipped drafter,
#                                              every held-out prompt against the autoregressive
#                                              path, alone and at c = 8 and 32 (~6 min)
set -u
PHASE=$1
case $PHASE in
check)
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_batch_invariance.py \
    tests/test_triton_attention.py 2>&1 | tail -5
  timeout 330 python3 -m bench.invariant_gemm_gpu --out "$OUT/invariant_gemm.json" 2>&1 \
    | grep -E '"family_agrees"|"shipped_invariant"|errors|Error' | cut -c1-400 | tail -14 ;;
cost)
  for mode in default deterministic; do
    flag=""; [ "$mode" = deterministic ] && flag=--deterministic
    timeout 280 python3 -m bench.gpu_side_by_side --parts services --taus 6.4 --wires stream \
      --levels 1 32 32 --ttft-lens 1000 $flag --out "/tmp/sbs_$mode" 2>&1 | tail -3
    cp "/tmp/sbs_$mode/gpu_side_by_side.json" "$OUT/side_by_side_$mode.json"
  done ;;
exact)
  timeout 560 python3 -m bench.smollm2_gpu --per-split 16 --max-tokens 256 --no-transformers \
    --systems "none,deterministic" "dflash,deterministic,tree=15,speculation=fixed" \
    "dflash,deterministic,speculation=fixed" "dflash,deterministic" none dflash \
    --concurrency 8 32 --out "$OUT/smollm2_det.json" 2>&1 | grep -vE "Loading|^\s*$" | tail -12 ;;
*)
  echo "usage: deterministic.sh check|cost|exact" >&2; exit 2 ;;
esac
