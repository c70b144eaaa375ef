#!/usr/bin/env bash
# bench/power.py split over processes: null runs on cpu (one process per dtype and slice, one thread
# each) and the MoE expert-fault power runs on an accelerator, side by side; then the merged tables.
#
#   [SEED_BASE=N] bash bench/power_parallel.sh OUTDIR [NULL_RUNS_PER_DTYPE] [CPU_PROCS_PER_DTYPE] [POWER_RUNS] [LIMIT_S] [POWER_DEVICE]
# (SEED_BASE, default 100: process k of a dtype draws from seed SEED_BASE + k; another base is a fresh-seed run)
#
# Every process writes its JSON after each run, so a process stopped at LIMIT_S still counts the
# runs it finished. The tables: OUTDIR/null.txt (false alarms per family, check and dtype) and
# OUTDIR/power.txt (detection per fault and dtype).
set -u
OUT=${1:?output directory}
RUNS=${2:-200}
PROCS=${3:-4}
POWER_RUNS=${4:-20}
LIMIT=${5:-480}
POWER_DEVICE=${6:-cuda}
DTYPES="float32 bfloat16 float16"
FAULTS=moe_lora_unweighted,moe_lora_weight_of_next_expert,moe_lora_first_expert_only,moe_expert_mismatch,moe_down_proj_dropped
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
BASE=$(mktemp -d /tmp/lc-power-base-XXXX)
# The base models once, copied to each process's own cache (no two processes write one cache).
python -c "
from pathlib import Path
from lora_conformance.models import resolve_base_model
for k in ('llama', 'moe'):
    resolve_base_model('synthetic:' + k, Path('$BASE') / 'models')
" || exit 1
per=$(( (RUNS + PROCS - 1) / PROCS ))
pids=()
for d in $DTYPES; do
  for k in $(seq 0 $((PROCS - 1))); do
    c=$(mktemp -d /tmp/lc-power-XXXX); cp -r "$BASE/models" "$c/models"
    timeout "$LIMIT" python bench/power.py --device cpu --dtypes "$d" --runs "$per" --start $((k * per)) \
      --seed $(( ${SEED_BASE:-100} + k )) --power-runs 0 --faults "" --drops "" --scales "" --cache "$c" \
      --json "$OUT/null-$d-$k.json" > "$OUT/null-$d-$k.log" 2>&1 &
    pids+=($!)
  done
  if [ "$POWER_RUNS" -gt 0 ]; then
    c=$(mktemp -d /tmp/lc-power-XXXX); cp -r "$BASE/models" "$c/models"
    timeout "$LIMIT" python bench/power.py --device "$POWER_DEVICE" --reference-device "$POWER_DEVICE" \
      --dtypes "$d" --runs 0 --seed 7 \
      --power-runs "$POWER_RUNS" --faults "$FAULTS" --drops "" --scales "" --cache "$c" \
      --json "$OUT/power-$d.json" > "$OUT/power-$d.log" 2>&1 &
    pids+=($!)
  fi
done
wait "${pids[@]}"
python bench/power.py --device cpu --merge "$OUT"/null-*.json > "$OUT/null.txt" 2>&1
ls "$OUT"/power-*.json >/dev/null 2>&1 && python bench/power.py --device "$POWER_DEVICE" --merge "$OUT"/power-*.json > "$OUT/power.txt" 2>&1
cat "$OUT/null.txt" "$OUT/power.txt" 2>/dev/null
