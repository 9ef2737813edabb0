#!/usr/bin/env bash
# One device session for the lead: stages run in order, each under its own time limit, a failed
# stage does not stop the next. Logs and JSON are bundled into $OUT/results.tar.gz so the model
# shards (<= 7 files) and the bundle fit the device's 8 returned files.
#
#   bash scripts/gpu_session.sh probe tests           # probe variants training in the background
#                                                     # while the GPU tests run; best one -> $OUT/probe
#   bash scripts/gpu_session.sh needle kernels        # needle grid, store/prefill bench
#   bash scripts/gpu_session.sh store                 # CUDA store: GPU bit-exact tests, its variants
#                                                     # (register caps), both backends
# `probe` trains the PROBE_VARIANTS (";"-separated train.py argument sets, one process each,
# sharing the GPU) in the background; the next stage that needs the model, or the end of the
# script, waits for them and ships the best by `ninfer.tools.probe.pick`. Stages read the model from
# /tmp/probe when an earlier call on the same warm machine trained one, else from models/probe.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
RES=/tmp/ninfer-results
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PROBE_ARGS=${PROBE_ARGS:---minutes 6 --eval-minutes 1.2}
PROBE_VARIANTS=${PROBE_VARIANTS:---seed 0;--seed 1 --lr 2e-3;--seed 2 --shape full;--seed 3 --min-len 256 --batch-tokens 6144}
PROBE_TIMEOUT=${PROBE_TIMEOUT:-520}
PROBE_PIDS=()
NEEDLE_CONTEXTS=${NEEDLE_CONTEXTS:-4k,16k,64k}
MODEL=/tmp/probe
[ -f "$MODEL/config.json" ] || MODEL=$PWD/models/probe

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== [$name] start $(date -u +%T) (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "== [$name] rc=$rc in $((SECONDS - t0))s"
  tail -n 25 "$RES/$name.log"
}

probe_wait() {  # wait for the background trainings, then ship the best one
  [ ${#PROBE_PIDS[@]} -gt 0 ] || return 0
  wait "${PROBE_PIDS[@]}"; PROBE_PIDS=()
  for d in /tmp/probe-runs/*/; do tail -n 12 "$d/train.log" | sed "s|^|$(basename "$d"): |"; done
  python3 -m ninfer.tools.probe.pick --out /tmp/probe --report "$RES/probe_pick.json" /tmp/probe-runs/*/ \
    > "$RES/probe_pick.log" 2>&1; cat "$RES/probe_pick.log"
  for d in /tmp/probe-runs/*/; do cp "$d/train.log" "$RES/train-$(basename "$d").log"; done
  if [ -f /tmp/probe/config.json ]; then
    mkdir -p "$OUT/probe"; cp /tmp/probe/* "$OUT/probe/"; MODEL=/tmp/probe
  fi
}

nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,driver_version --format=csv,noheader > "$RES/gpu.txt" 2>&1
cat "$RES/gpu.txt"
for s in "$@"; do
  case $s in
    probe)
      rm -rf /tmp/probe-runs; i=0
      IFS=';' read -ra VARIANTS <<< "$PROBE_VARIANTS"
      for v in "${VARIANTS[@]}"; do
        d=/tmp/probe-runs/v$i; mkdir -p "$d"; echo "$v" > "$d/args.txt"
        # shellcheck disable=SC2086
        timeout -k 10 "$PROBE_TIMEOUT" python3 -m ninfer.tools.probe.train --out "$d/probe" --device cuda \
          $PROBE_ARGS $v > "$d/train.log" 2>&1 &
        PROBE_PIDS+=($!); i=$((i + 1))
      done
      echo "== [probe] ${#PROBE_PIDS[@]} variants training in the background: $PROBE_VARIANTS" ;;
    tests)
      stage tests 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_triton_backend.py -k "cuda or graphs" ;;
    needle)
      probe_wait
      stage needle "${NEEDLE_TIMEOUT:-420}" python3 -m ninfer bench needle "$MODEL" --contexts "$NEEDLE_CONTEXTS" \
        --kv-dtype bf16,int8,rk4v4,rk4v4-e8 --json "$RES/needle_gpu.json" ;;
    kernels)
      stage kernels 150 python3 scripts/bench_store_prefill.py --out "$RES/store_prefill.json" ;;
    store)
      stage store-tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_store_cuda.py
      stage store-variants 120 python3 scripts/store_rows_regcap.py
      stage store-bench 150 python3 scripts/bench_store_prefill.py --store-only --out "$RES/store_cuda.json" ;;
    *) echo "unknown stage $s" ;;
  esac
done
probe_wait
tar -czf "$OUT/results.tar.gz" -C "$RES" . && echo "bundle: $(du -h "$OUT/results.tar.gz" | cut -f1)"
