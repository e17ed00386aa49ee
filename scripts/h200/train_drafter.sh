# On the H200, from the repository root, after `source scripts/h200/env.sh` and
# scripts/h200/assemble_smollm2.sh: the phases of training the shipped SmolLM2 drafter, each
# within one device call (10 min). Work files stay in out/ (ignored, kept while the machine is
# warm); results go to $OUT.
#   bash scripts/h200/train_drafter.sh gen   [SAMPLES]             answers (+ step-time probe)
#   bash scripts/h200/train_drafter.sh train STEPS [SAMPLES] [EXTRA...]  train + held-out tau
#   bash scripts/h200/train_drafter.sh eval                           e2e bench (eval-draft: EVAL=1)
#   bash scripts/h200/train_drafter.sh bg STEPS [SAMPLES] [EXTRA...]  `train` in the background
#   bash scripts/h200/train_drafter.sh watch [SECONDS]  follow it; when done, its results to $OUT
#                                       (and the first 96 tokens' simulated tau, unless SIMULATE=0)
# bg: the run outlives the call (setsid) while calls follow each other within the machine's
# warm time; it keeps its feature cache, which a resumed --stop-after run has to rebuild.
# train: STOP=SECONDS pauses the run after that long (checkpoint in out/work); the same command
# in the next call resumes it. CACHE=1 keeps every sequence's features in device memory.
set -u
PHASE=$1; shift
T=${TARGET:-$DFLASH_HOME/models/smollm2-135m-instruct/bfloat16}
DEVICE=${DEVICE:-cuda}
W=out/work
mkdir -p "$W" "$OUT"
for f in data/train-answers/self_prompts_*.jsonl.gz; do    # --self-prompts N: the requests kept
  [ -f "$f" ] && [ ! -f "$W/$(basename "$f" .gz)" ] && gunzip -c "$f" > "$W/$(basename "$f" .gz)"
done
# gen/train run the target eagerly (no CUDA graphs), where torch ops launch faster than the fused
# Triton kernels; the served stacks of `eval` keep the fused kernels (they replay graphs).
[ "$PHASE" = eval ] || export DFLASH_TORCH_LAYER_OPS=1
COMMON=(--target "$T" --work "$W" --device "$DEVICE" --mask-token-id 16 --sampled-temperature 0.7
        --concurrency 1024 --max-new-tokens 384 ${EXTRA:-})   # EXTRA: e.g. a CPU dry run's limits
case $PHASE in
gen)   # the sets in parallel processes (train-draft's default on a GPU): about 3 minutes
  SAMPLES=${1:-6}
  [ -f "$W/train_t0.0.jsonl" ] || tar xzf data/train-answers/smollm2-answers-greedy.tgz -C out
  python3 -m dflash.cli train-draft "${COMMON[@]}" --out out/unused --samples-per-prompt "$SAMPLES" \
    --generate-only 2>&1 | grep -E "tokens in|answer sets|Error|error"
  ls -la "$W"; tar czf "$OUT/answers.tgz" -C out work
  [ -n "${PROBE:-}" ] || exit 0
  for ops in 1 0; do
    DFLASH_TORCH_LAYER_OPS=$ops python3 -m bench.train_step --target "$T" --work "$W" --device "$DEVICE" --steps ${PROBE_STEPS:-20} \
      --batch-sequences ${PROBE_BATCH:-32} --blocks-per-sequence 32 2>/dev/null | sed "s/^/torch_ops=$ops /"
  done
  for i in 1 2; do
    python3 -m bench.train_step --target "$T" --work "$W" --device "$DEVICE" --steps ${PROBE_STEPS:-20} --batch-sequences ${PROBE_BATCH:-32} \
      --blocks-per-sequence 32 2>/dev/null | sed "s/^/parallel$i /" &
  done
  wait ;;
bg)
  mkdir -p out/result; rm -f out/train_raw.log
  OUT=$PWD/out/result setsid nohup bash scripts/h200/train_drafter.sh train "$@" \
    > out/bg.log 2>&1 < /dev/null &
  sleep 5; cat out/bg.log ;;
watch)
  end=$(( $(date +%s) + ${1:-540} ))
  while pgrep -f "train_drafter.sh train" > /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  tr '\r' '\n' < out/train_raw.log | grep -vE "^\[#*\.*\]" | tail -6
  tr '\r' '\n' < out/train_raw.log | grep -E "^\[#*\.*\]" | tail -1
  if ! pgrep -f "train_drafter.sh train" > /dev/null; then
    cat out/bg.log; cp -r out/result/. "$OUT/"; echo "finished: results in \$OUT"
    [ -f out/drafter/model.safetensors ] && [ "${SIMULATE:-1}" = 1 ] && timeout 240 python3 -m bench.simulated_tau \
      --work "$W" --device "$DEVICE" --draft-model out/drafter --per-split 128 \
      --max-new-tokens 96 --out "$OUT/drafter_simulated_96.json" 2>&1 | tail -3
  fi ;;
train)
  STEPS=$1; SAMPLES=${2:-6}; shift; shift || true
  python3 -m dflash.cli train-draft "${COMMON[@]}" --out out/drafter --samples-per-prompt "$SAMPLES" \
    --layers 3 --taps 5 --lr 1e-3 --steps "$STEPS" --batch-sequences 32 \
    --blocks-per-sequence 32 --eval-sequences 128 --eval-every ${EVAL_EVERY:-1000} \
    --stop-after "${STOP:-0}" ${CACHE:+--cache-features} "$@" 2>&1 | tee out/train_raw.log | tr '\r' '\n' \
    | grep -vE "^\[#*\.+\]" | tail -25
  if [ -f out/drafter/training.json ]; then       # finished (a paused run exports nothing)
    mkdir -p "$OUT/drafter"
    cp out/drafter/*.json out/drafter/README.md "$OUT/drafter/"
    split -b 12M out/drafter/model.safetensors "$OUT/drafter/model.safetensors.part."   # <= 16 MiB
  fi ;;
eval)
  cp out/drafter/* models/smollm2-135m-instruct-dflash/
  [ -n "${EVAL:-}" ] && timeout 250 python3 -m dflash.cli eval-draft --target "$T" --device cuda --dtype bfloat16 \
    --per-split 32 --max-new-tokens 128 --concurrency 16 --out "$OUT/drafter_eval_h200.json" \
    2>&1 | tail -30
  timeout 280 python3 -m bench.smollm2_gpu --per-split 8 --max-tokens 128 ${BENCH_FLAGS:-} \
    --out "$OUT/smollm2_gpu.json" 2>&1 | tail -12 ;;
esac
