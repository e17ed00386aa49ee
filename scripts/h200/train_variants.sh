# On a 2-GPU H200 host, from the repository root, after `source scripts/h200/env.sh`,
# scripts/h200/assemble_smollm2.sh and the answers in out/work: two recipe variants of the
# shipped drafter trained side by side, one per GPU (the shipped recipe plus each variant's
# flags), then simulated tau of both and of the shipped drafter.
#   STOP=480 bash scripts/h200/train_variants.sh train   (again to resume: checkpoints in out/)
#   bash scripts/h200/train_variants.sh eval   (EVAL_LENGTHS="96 0": answer tokens simulated; 0 = whole)
# Variants: VAR_A / VAR_B (extra train-draft flags). STOP_A / STOP_B: each one's pause (default
# STOP; a variant that first generates more answers needs a shorter first segment).
# EVAL_SHIPPED=1: eval also simulates the shipped drafter.
set -u
PHASE=$1
T=${TARGET:-$DFLASH_HOME/models/smollm2-135m-instruct/bfloat16}
VAR_A=${VAR_A:---anchor-window 128}
VAR_B=${VAR_B:---anchor-window 128 --gamma 3}
mkdir -p "$OUT"
export DFLASH_TORCH_LAYER_OPS=1

train_one() {   # NAME GPU STOP FLAGS...
  local name=$1 gpu=$2 stop=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu python3 -m dflash.cli train-draft --target "$T" --work out/work \
    --device cuda --mask-token-id 16 --sampled-temperature 0.7 --concurrency 1024 \
    --max-new-tokens 384 --out "out/drafter_$name" --samples-per-prompt 6 --layers 3 --taps 5 \
    --lr 1e-3 --steps "${STEPS:-20000}" --batch-sequences 32 --blocks-per-sequence 32 \
    --eval-sequences 128 --eval-every 4000 --stop-after "$stop" --cache-features \
    --checkpoint "out/checkpoint_$name.pt" "$@" 2>&1 | tr '\r' '\n' \
    | grep -vE "^\[#*\.+\]" >> "out/train_$name.log"
  if [ -f "out/drafter_$name/training.json" ]; then
    mkdir -p "$OUT/drafter_$name"
    cp "out/drafter_$name"/*.json "out/drafter_$name/README.md" "$OUT/drafter_$name/"
    split -b 12M "out/drafter_$name/model.safetensors" "$OUT/drafter_$name/model.safetensors.part."
  fi
}

eval_one() {    # NAME GPU DRAFTER
  for n in ${EVAL_LENGTHS:-96 0}; do
    CUDA_VISIBLE_DEVICES=$2 python3 -m bench.simulated_tau --work out/work --device cuda \
      --draft-model "$3" --per-split 128 --max-new-tokens $n \
      --out "$OUT/simulated_$1_$n.json" 2>&1 | tail -1 | sed "s/^/$1 max_new_tokens=$n /"
  done
}

case $PHASE in
train)
  # shellcheck disable=SC2086
  train_one A 0 "${STOP_A:-${STOP:-0}}" $VAR_A &
  # shellcheck disable=SC2086
  train_one B 1 "${STOP_B:-${STOP:-0}}" $VAR_B &
  wait
  tail -n 8 out/train_A.log out/train_B.log ;;
eval)
  eval_one A 0 out/drafter_A &
  eval_one B 1 out/drafter_B &
  wait
  [ -z "${EVAL_SHIPPED:-}" ] || eval_one shipped 0 models/smollm2-135m-instruct-dflash ;;
esac
