#!/usr/bin/env bash
# Issue 7 on a GPU: random-weight checkpoints of real geometries, then `ninfer bench matched`,
# `sweep` and `memory`; every JSON / PNG / log goes to $OUT (default ./e2e-out).
#
#   bash scripts/gpu_validate_e2e.sh                      # quick profile, all stages (~8 min on an H200)
#   bash scripts/gpu_validate_e2e.sh ckpt matched         # stages: ckpt matched sweep memory
#   PROFILE=full MODELS=seed-d256 bash scripts/gpu_validate_e2e.sh matched
#
# Profiles (any variable below can also be set on its own):
#   quick  Qwen3-8B only; matched int8 vs rk4v4-e8 at the issue's 90K prompt / 300 tokens / 3 repeats;
#          sweep under --memory-limit 32GiB at 32K and 64K; memory agreement under 32GiB and the
#          frontier with 2 starts per kv-dtype.
#   full   both models; bf16 joins matched; sweep under 32GiB up to the largest
#          context that fits and on the whole card up to 1M; 20 starts at the frontier. Run it one
#          stage (and one model) per device command: each command must end within 10 minutes.
# Checkpoints are written once under $CKPT_DIR and reused while the machine stays warm.
set -uo pipefail
cd "$(dirname "$0")/.."

PROFILE=${PROFILE:-quick}
OUT=${OUT:-$PWD/e2e-out}
PY=${PY:-python3}
CKPT_DIR=${CKPT_DIR:-/tmp/ninfer-ckpt}
LIMIT_GIB=${LIMIT_GIB:-32}
if [ "$PROFILE" = full ]; then
  : "${MODELS:=qwen3-8b seed-d256}" "${MATCHED_KV:=int8,rk4v4-e8,bf16}"
  : "${SWEEP_CAP:=}" "${CARD_SWEEP:=1}" "${CARD_CAP:=1M}" "${STARTS:=20}" "${SWEEP_BUDGET:=420}"
else
  : "${MODELS:=qwen3-8b}" "${MATCHED_KV:=int8,rk4v4-e8}"
  : "${SWEEP_CAP:=64K}" "${CARD_SWEEP:=0}" "${CARD_CAP:=128K}" "${STARTS:=2}" "${SWEEP_BUDGET:=150}"
fi
: "${KV:=int8,rk4v4-e8}" "${PROMPT:=90000}" "${GEN:=300}" "${REPEATS:=3}" "${SWEEP_GEN:=32}" "${SWEEP_START:=32K}"
# The warm-up is as long as the timed prompt: a shorter one left first-use costs (kernel variants,
# allocator growth) in repeat 0, which then looked like a cache collapse on the later repeats.
: "${WARMUP:=$PROMPT}"
EXTRA=${EXTRA:-}  # engine flags added to every bench, e.g. "--max-concurrency 8"
STAGES=${*:-ckpt matched sweep memory}

mkdir -p "$OUT" "$CKPT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

main() {
echo "== $(date -u) profile=$PROFILE stages=[$STAGES] models=[$MODELS] out=$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>/dev/null || true
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'

rc=0
step() {  # step NAME CMD...: run, time, remember a failure, carry on with the next step
  local name=$1; shift
  local t0=$SECONDS
  echo "== [$name] $*"
  "$@"; local r=$?
  echo "== [$name] exit $r after $((SECONDS - t0)) s"
  [ $r -eq 0 ] || rc=1
}

ckpt() {  # the config is written last, so its presence marks a complete checkpoint
  local m=$1
  [ -f "$CKPT_DIR/$m/config.json" ] && { echo "== [ckpt $m] reusing $CKPT_DIR/$m"; return 0; }
  step "ckpt $m" $PY -m ninfer.tools.random_checkpoint --preset "$m" --out "$CKPT_DIR/$m" --device cuda
}

for stage in $STAGES; do
  for m in $MODELS; do
    dir=$CKPT_DIR/$m
    case $stage in
      ckpt) ckpt "$m" ;;
      matched)
        ckpt "$m"
        step "matched $m" $PY -m ninfer bench matched "$dir" --kv-dtype "$MATCHED_KV" --prompt-tokens "$PROMPT" \
          --gen-tokens "$GEN" --repeats "$REPEATS" --warmup-tokens "$WARMUP" --json "$OUT/matched-$m.json" $EXTRA ;;
      sweep)
        ckpt "$m"
        step "sweep $m ${LIMIT_GIB}GiB" $PY -m ninfer bench sweep "$dir" --kv-dtype "$KV" --memory-limit "$LIMIT_GIB" \
          --contexts auto --auto-start "$SWEEP_START" ${SWEEP_CAP:+--auto-cap "$SWEEP_CAP"} --gen-tokens "$SWEEP_GEN" \
          --time-budget "$SWEEP_BUDGET" --json "$OUT/sweep-${LIMIT_GIB}g-$m.json" --plot "$OUT/sweep-${LIMIT_GIB}g-$m.png" $EXTRA
        if [ "$CARD_SWEEP" = 1 ]; then
          step "sweep $m card" $PY -m ninfer bench sweep "$dir" --kv-dtype "$KV" --contexts auto \
            --auto-start "$SWEEP_START" --auto-cap "$CARD_CAP" --gen-tokens "$SWEEP_GEN" --time-budget "$SWEEP_BUDGET" \
            --json "$OUT/sweep-card-$m.json" --plot "$OUT/sweep-card-$m.png" $EXTRA
        fi ;;
      memory)
        ckpt "$m"
        step "memory $m" $PY -m ninfer bench memory "$dir" --kv-dtype "$KV" --memory-limit "$LIMIT_GIB" \
          --frontier --starts "$STARTS" --json "$OUT/memory-${LIMIT_GIB}g-$m.json" $EXTRA ;;
      *) echo "unknown stage $stage (ckpt matched sweep memory)"; rc=2 ;;
    esac
  done
done
echo "== done $(date -u), exit $rc; files in $OUT:"; ls -la "$OUT"
return $rc
}

main 2>&1 | tee -a "$OUT/e2e.log"
exit "${PIPESTATUS[0]}"
