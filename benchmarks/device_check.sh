#!/usr/bin/env bash
# One lent accelerator session's checks, in order of what is least measured, each part under its
# own time limit and the whole under a budget (a part that would not fit is skipped, and says so):
#   1. fused_logprob.py --compare: the `xla` kernel against the Pallas `gpu` layout (K loop), bf16
#   2. moe_dispatch.py: a Qwen3-30B-A3B layer's ragged_dot / blocked dispatch against a dense MLP
#   3. recipe_scale.py, the Qwen2.5-0.5B GSM8K recipe: train step (packed) and sampler
#   4. recipe_scale.py, the same step unpacked (--no-packing)
#   5. lag_auto.py on the host's CPU cores (JAX_PLATFORMS=cpu): the tuned lag without 2-core
#      contention between the sampler and the train step
# Each part's JSON goes to $OUT/<part>.json, everyone's stderr to $OUT/log.txt.
#
#   bash benchmarks/device_check.sh [BUDGET_S]      # on the device machine, from the repo root
#   bash benchmarks/device_check.sh --quick         # the same parts at smoke sizes (CPU, ~3 min)
set -uo pipefail
cd "$(dirname "$0")/.."
QUICK=0
BUDGET=470
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    *[!0-9]*) echo "jaxrl: device_check.sh takes --quick and/or a budget in seconds, got $a" >&2
              exit 2 ;;
    *) BUDGET=$a ;;
  esac
done
OUT="${OUT:-/tmp/device_check}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}." PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
START=$(date +%s)
LOG="$OUT/log.txt"
: > "$LOG"
{ echo "== $(date -u +%FT%TZ) budget ${BUDGET}s quick=$QUICK"; nvidia-smi -L 2>/dev/null
  "$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'; } >> "$LOG" 2>&1

part() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 30 )); then
    echo "== $name: skipped (${left}s of the budget left)" >> "$LOG"; return
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s): $*" >> "$LOG"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.json" 2>> "$LOG"
  echo "== $name: rc=$? in $(( $(date +%s) - t0 ))s" >> "$LOG"
}

if (( QUICK )); then
  part fused 120 "$PY" benchmarks/fused_logprob.py --compare --quick
  part moe 120 "$PY" benchmarks/moe_dispatch.py --quick
  part recipe_rollout 180 "$PY" benchmarks/recipe_scale.py --quick --steps 1 --rollout
  part recipe_nopack 120 "$PY" benchmarks/recipe_scale.py --quick --steps 1 --no-packing --no-rollout
  part lag_auto 300 env JAX_PLATFORMS=cpu "$PY" benchmarks/lag_auto.py --quick
else
  part fused 80 "$PY" benchmarks/fused_logprob.py --compare --runs 10
  part moe 70 "$PY" benchmarks/moe_dispatch.py --runs 10
  part recipe_rollout 170 "$PY" benchmarks/recipe_scale.py --recipe configs/qwen2_5_0_5b_gsm8k.py \
    --steps 3 --rollout --rollout-calls 2
  part lag_auto 130 env JAX_PLATFORMS=cpu "$PY" benchmarks/lag_auto.py --steps 40
  part recipe_nopack 100 "$PY" benchmarks/recipe_scale.py --recipe configs/qwen2_5_0_5b_gsm8k.py \
    --steps 3 --no-packing --no-rollout
fi
echo "== done in $(( $(date +%s) - START ))s" >> "$LOG"
