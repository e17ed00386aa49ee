# On one H200, after `source scripts/h200/env.sh` and scripts/h200/assemble_smollm2.sh: an A/B of
# train-draft flags on a short recipe, two or three runs at once on the one GPU (each with its
# own feature cache), sharing one set of answers. Work files in out/ (kept while the machine is
# warm).
#   bash scripts/h200/train_pair.sh start STEPS "FLAGS_A" "FLAGS_B" ["FLAGS_C"]   answers, then
#                                                                                the runs (bg)
#   bash scripts/h200/train_pair.sh watch [SECONDS]   follow; when all are done, results to $OUT
#                                                    (call again for models that did not fit)
set -u
PHASE=$1; shift
T=${TARGET:-${DFLASH_HOME:-/root/dflash-home}/models/smollm2-135m-instruct/bfloat16}
W=out/work
mkdir -p "$W" "$OUT"
export DFLASH_TORCH_LAYER_OPS=1
COMMON=(--target "$T" --work "$W" --device cuda --mask-token-id 16 --sampled-temperature 0.7
        --concurrency 1024 --max-new-tokens 384 --samples-per-prompt ${SAMPLES:-2}
        --follow-ups ${FOLLOW_UPS:-0} --layers 3 --taps 5 --lr 1e-3 --batch-sequences 32
        --blocks-per-sequence 32 --eval-sequences 128 --cache-features)
case $PHASE in
start)
  STEPS=$1
  [ -f "$W/train_t0.0.jsonl" ] || tar xzf data/train-answers/smollm2-answers-greedy.tgz -C out
  python3 -m dflash.cli train-draft "${COMMON[@]}" --out out/unused --generate-only 2>&1 \
    | grep -E "tokens in|Error|error"
  shift
  for v in a b c; do
    [ $# -gt 0 ] || break
    FLAGS=$1; shift
    echo "$FLAGS" > out/flags_$v
    setsid nohup python3 -m dflash.cli train-draft "${COMMON[@]}" --out out/drafter_$v \
      --steps "$STEPS" --eval-every $(( STEPS / 3 )) $FLAGS > out/train_$v.log 2>&1 < /dev/null &
  done
  sleep 60
  for v in $(ls out/flags_? | sed 's/.*_//'); do tr '\r' '\n' < out/train_$v.log | grep -vE "^\[#*\.*\]" | tail -2
    tr '\r' '\n' < out/train_$v.log | grep -E "^\[#*\.*\]" | tail -1; done ;;
watch)
  end=$(( $(date +%s) + ${1:-540} ))
  while pgrep -f "train-draft" > /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  runs=$(ls out/flags_? | sed 's/.*_//')
  for v in $runs; do
    echo "== $v: $(cat out/flags_$v)"
    tr '\r' '\n' < out/train_$v.log | grep -vE "^\[#*\.*\]" | grep -E "tau|stopped|Error|error" | tail -6
    tr '\r' '\n' < out/train_$v.log | grep -E "^\[#*\.*\]" | tail -1
  done
  # a call returns at most 8 files of at most 16 MiB, 64 MiB together: the runs' JSON and cards
  # in one archive, each model in 15 MiB parts, the smaller model first, a model only while the
  # total stays within 60 MiB; the models left out come back on the next watch
  done_runs=$(for v in $runs; do
    [ -f out/drafter_$v/training.json ] && echo drafter_$v; done)
  [ -n "$done_runs" ] || exit 0
  (cd out && tar czf "$OUT/results.tgz" flags_? train_?.log \
    $(for d in $done_runs; do echo "$d/config.json $d/training.json $d/eval.json $d/README.md"; done))
  total=0
  for d in $(for r in $done_runs; do [ -f out/$r.returned ] ||
               echo "$(stat -c %s out/$r/model.safetensors) $r"; done | sort -n | cut -d' ' -f2); do
    total=$(( total + $(stat -c %s out/$d/model.safetensors) ))
    [ "$total" -le $(( 60 * 1024 * 1024 )) ] || { echo "$d: weights left out (size): watch again"; break; }
    split -b 15M out/$d/model.safetensors "$OUT/$d.safetensors.part."
    touch out/$d.returned
  done ;;
esac
