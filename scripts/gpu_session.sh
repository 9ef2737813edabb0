#!/usr/bin/env bash
# One device session for the lead: stages run in order, each under its own time limit, a failed
# stage does not stop the next. Logs and JSON are bundled into $OUT/results.tar.gz so the model
# shards (<= 7 files) and the bundle fit the device's 8 returned files.
#
#   bash scripts/gpu_session.sh probe                 # train the probe model into /tmp/probe (+ $OUT/probe)
#   bash scripts/gpu_session.sh tests needle kernels  # GPU tests, needle grid, store/prefill bench
# Stages read the model from /tmp/probe when an earlier call on the same warm machine trained one,
# else from models/probe.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
RES=/tmp/ninfer-results
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PROBE_ARGS=${PROBE_ARGS:-}
PROBE_TIMEOUT=${PROBE_TIMEOUT:-420}
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

nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,driver_version --format=csv,noheader > "$RES/gpu.txt" 2>&1
cat "$RES/gpu.txt"
for s in "$@"; do
  case $s in
    probe)
      stage probe "$PROBE_TIMEOUT" python3 -m ninfer.probe.train --out /tmp/probe --device cuda $PROBE_ARGS
      if [ -f /tmp/probe/config.json ]; then
        mkdir -p "$OUT/probe"; cp /tmp/probe/* "$OUT/probe/" 2>/dev/null; MODEL=/tmp/probe
        ls /tmp/probe | wc -l
      fi ;;
    tests)
      stage tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_triton_backend.py -k "cuda or graphs" ;;
    needle)
      stage needle 240 python3 -m ninfer bench needle "$MODEL" --contexts "$NEEDLE_CONTEXTS" \
        --kv-dtype bf16,int8,rk4v4,rk4v4-e8 --json "$RES/needle_gpu.json" ;;
    kernels)
      stage kernels 150 python3 scripts/bench_store_prefill.py --out "$RES/store_prefill.json" ;;
    *) echo "unknown stage $s" ;;
  esac
done
tar -czf "$OUT/results.tar.gz" -C "$RES" . && echo "bundle: $(du -h "$OUT/results.tar.gz" | cut -f1)"
