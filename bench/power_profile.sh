#!/usr/bin/env bash
# bench/power.py at a certification profile's bases on one accelerator (the calibration of the
# tolerance rows of the bases' scale class, judge/tolerances.py): the bases built once (in parallel),
# then one power.py process per JOB, all on DEVICE with the float32 reference there too; each
# process has its own adapter and reference cache and shares the bases read-only; every process
# writes its JSON after each run, so one stopped at LIMIT_S still counts the runs it finished.
#
#   bash bench/power_profile.sh OUT PROFILE DEVICE LIMIT_S NEW_TOKENS VARIATIONS JOB [JOB ...]
#   JOB = DTYPE:FAMILIES:SEED            (FAMILIES comma-separated, bench/power.py's names)
#   e.g. bash bench/power_profile.sh /tmp/pw full cuda 420 48 default,rescale:3,svd,preround,reverse,peft \
#          bfloat16:accuracy,semantics,alllinear,rank:1 bfloat16:mixed,alllinear,rank:2 bfloat16:moe:3
#
# The tables: OUT/null.txt (merged over the jobs, per dtype), OUT/power-*.log (each job's own output).
set -u
OUT=${1:?output directory}; PROFILE=${2:?profile}; DEVICE=${3:?device}; LIMIT=${4:?limit seconds}
NEW_TOKENS=${5:?new tokens}; VARIATIONS=${6:?variations}; shift 6
[ $# -gt 0 ] || { echo "power_profile.sh: no JOB given (DTYPE:FAMILIES:SEED)" >&2; exit 2; }
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
BASE=${POWER_BASE_CACHE:-$(mktemp -d /tmp/lc-power-base-XXXX)}
t0=$(date +%s)
python bench/build_bases.py "$PROFILE" "$BASE" || exit 1
echo "bases ready in $(( $(date +%s) - t0 )) s"
pids=()
for job in "$@"; do
  IFS=: read -r dtype families seed <<< "$job"
  c=$(mktemp -d /tmp/lc-power-XXXX); ln -s "$BASE/models" "$c/models"
  name="$dtype-$seed"
  timeout "$LIMIT" python bench/power.py --profile "$PROFILE" --device "$DEVICE" --reference-device "$DEVICE" \
    --dtypes "$dtype" --families "$families" --variations "$VARIATIONS" --new-tokens "$NEW_TOKENS" \
    --runs 100000 --seed "$seed" --power-runs 0 --faults "" --drops "" --scales "" --cache "$c" \
    --json "$OUT/null-$name.json" > "$OUT/power-$name.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
echo "null runs done in $(( $(date +%s) - t0 )) s"
python bench/power.py --device "$DEVICE" --profile "$PROFILE" --merge "$OUT"/null-*.json > "$OUT/null.txt" 2>&1
cat "$OUT/null.txt"
