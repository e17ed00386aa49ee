# On one H200, after `source scripts/h200/env.sh` and scripts/h200/assemble_smollm2.sh: draft
# trees against the chain with the shipped drafter, each phase within one device call.
#   bash scripts/h200/tree_eval.sh check          the Triton tree mask natively, the tree tests
#   bash scripts/h200/tree_eval.sh eval N...      eval-draft on every held-out prompt, T = 0,
#                                                 96 tokens, a tree of N drafts (0 = the chain)
#   bash scripts/h200/tree_eval.sh speed SPEC...  bench.smollm2_gpu with these systems
# Results in $OUT.
set -u
PHASE=$1; shift
case $PHASE in
check)
  python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_attention.py \
    tests/test_draft_tree.py tests/test_target_tree_verify.py 2>&1 | tail -5 ;;
eval)
  for n in "$@"; do
    timeout 400 python3 -m dflash.cli eval-draft --device cuda --dtype bfloat16 --per-split 0 \
      --temperatures 0 --max-new-tokens 96 --concurrency 64 --tree-nodes "$n" \
      --out "$OUT/drafter_eval_tree$n.json" 2>&1 | grep -E "tau|Error|error" | tail -4
  done ;;
speed)
  timeout 560 python3 -m bench.smollm2_gpu --no-transformers --systems "$@" \
    --out "$OUT/smollm2_gpu_trees.json" 2>&1 | grep -vE "Loading|^\s*$" | tail -12 ;;
esac
