#!/usr/bin/env bash
# What we run on a lent GPU machine (no network there): install carried wheels, then
#   part "bench":  the throughput benchmark (GPU workload), its per-step op counts, and the built-in
#                  engine's time per phase with the fused kernels and without (kernels=torch);
#   part "suites": certify the built-in engine (bfloat16, graphs on) into $OUT/report-graphs,
#                  then graphs off, then every fault of the catalogue against the suites on the GPU;
#                  certify picks its worker count (printed) and each worker its share of the cores;
#   part "time":   bench/certify_time.py: certify's wall time serial and with 8 and 16 workers, warm then cold.
#   The full profile's bar (certified in under 10 minutes warm), over calls on one machine, each
#   within the machine's warm time of the last (the cache lives in /tmp, which survives that; an
#   ignored path of the checkout does not):
#   part "full-cold": the profile's bases, then the cold certification until the deadline; call it
#                  again while the report says "partial": the next call deselects the cases the
#                  earlier calls' reports finished (bench/finished_cases.py; their references are
#                  cached, their engine work is not) and runs the rest; FULL_K=EXPR runs only the
#                  cases pytest's -k EXPR selects (a partial report, which says so); FULL_WORKERS=N
#                  runs N workers instead of certify's choice (an 80 GB card gets one full-profile
#                  worker: FULL_WORKERS=2 there tries two, and the report's device memory line says
#                  what they held);
#   part "full-warm": bench/certify_time.py on that filled cache: the warm wall time, with "computed /
#                  cached" beside it (a warm row computes none);
#   Between sessions: full-cold and full-warm leave the profile's reference cache (and the measured
#   case durations the run order uses) in $OUT as lc-full-refs.tar.xz.aa, .ab, ... (15 MB parts);
#   put them in .refs/ of the checkout (git ignores it) and carry it (carry: [".whl", ".refs"]):
#   the next session's full-cold restores them, so its run computes only the references its
#   changes need (the cache keys are content hashes of model, adapter, request and library versions);
#   without .refs/ it restores the newest set kept with a report (reports/*/lc-full-refs.tar.xz.*:
#   a checkout that starts anew keeps no ignored path);
#   part "exec-batches": bench/exec_mode_batches.py on the full profile's decoder (built by full-cold):
#                  the compile-mode case's batches in each mode, seconds per batch and dynamo graphs;
#   part "compile": the built-in engine's compile mode, fast profile, alone (beside other jobs its
#                  cases took 5x longer and a 400 s limit cut the run);
#   part "detect-new": detection power on the GPU of the faults tests/test_detection_power.py lists
#                  as not yet shown there (NOT_YET_SHOWN_ON_GPU), float32, bfloat16 and float16;
#                  DETECT_FAULTS="f1 f2" and DETECT_DTYPES=bfloat16 narrow it (the whole set, 22 faults
#                  x 3 dtypes, finished 2 runs in 420 s on a cold H100: a call takes a few faults;
#                  15 faults in float32 gave 3 results in 385 s on a warm H100). Verbose: a call cut at
#                  its deadline still names each fault and dtype that finished (-q printed only dots).
# Several parts run one after the other in one call (bash bench/gpu_validation.sh full-cold compile),
# each stopped at DEADLINE seconds after the call began (default 580: a call's limit is 600); a part
# with less than its minimum left is skipped and says so. Keep DEADLINE under the call's limit (less than 600
# where little device time is left): a call cut by that limit returns only what its parts already wrote
# (exec-batches writes its log a line at a time for that).
# Each certification writes its report under $OUT and says what its processes held on the device.
# The carried .whl must hold platformdirs (the image lacks it; README of the device tool, wheels).
# Usage: bash bench/gpu_validation.sh PART [PART ...]
#   PART: bench, suites, detect, time, full-cold, full-warm, exec-batches, compile or detect-new
# The last step of suites/detect runs the overlap fault on purpose, only to print the race report.
set -uo pipefail
parts="bench suites detect time full-cold full-warm exec-batches compile detect-new"
[ $# -gt 0 ] || { echo "gpu_validation.sh: name a part ($parts)" >&2; exit 2; }
for part in "$@"; do
  case " $parts " in
    *" $part "*) ;;
    *) echo "gpu_validation.sh: no part '$part' ($parts)" >&2; exit 2 ;;
  esac
done
deadline=${DEADLINE:-580}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed; using PYTHONPATH"
export PYTHONUNBUFFERED=1  # no OMP_NUM_THREADS: the plugin gives each pytest-xdist worker its share
nvidia-smi -L
# The race detector's report on the overlap fault (the detection test only counts that it fails).
race_report() {
  (python3 -m pytest suites/test_runtime_modes.py --device=cuda --lora-cache "$1" -p no:cacheprovider -q \
    --engine-arg fault=overlap_no_wait -k stream_ordered 2>&1 || true) | grep -m4 -A2 "unsynchronised" | tee -a "$OUT/detection_gpu.log"
}
# Seconds left before the deadline (at least 1: timeout 0 would mean none).
left() { local n=$((deadline - SECONDS)); [ "$n" -gt 1 ] && echo "$n" || echo 1; }
# For a certification: stopped STOP_MARGIN s before the deadline (default 45), since on SIGTERM certify
# stops pytest gracefully and writes the partial report (up to launch.INTERRUPT_GRACE_S, 60 s), and the
# archive of the reports must still be written within the call.
stop_margin=${STOP_MARGIN:-45}
until_stop() { local n=$((deadline - stop_margin - SECONDS)); [ "$n" -gt 1 ] && echo "$n" || echo 1; }
# The full profile's reference cache between sessions (see the header).
restore_refs() {
  local from=.refs
  compgen -G ".refs/lc-full-refs.tar.xz.*" >/dev/null \
    || from=$(ls -d reports/*/ 2>/dev/null | while read -r d; do compgen -G "${d}lc-full-refs.tar.xz.*" >/dev/null && echo "${d%/}"; done | tail -1)
  if [ -n "$from" ] && compgen -G "$from/lc-full-refs.tar.xz.*" >/dev/null && [ ! -d /tmp/lc-full/references ]; then
    mkdir -p /tmp/lc-full && cat "$from"/lc-full-refs.tar.xz.* | tar xJf - -C /tmp/lc-full \
      && echo "references restored from $from: $(find /tmp/lc-full/references -type f | wc -l) entries"
  fi
}
save_refs() {
  rm -f "$OUT"/lc-full-refs.tar.xz.*
  (cd /tmp/lc-full && ls -d references durations 2>/dev/null | xargs -r tar cf - | xz -T0 -6 \
    | split -b 15M - "$OUT/lc-full-refs.tar.xz.") && ls -l "$OUT"/lc-full-refs.tar.xz.* | awk '{print "saved", $5, $NF}'
}
# The least a part needs to be worth starting (seconds).
minimum() { case "$1" in full-cold) echo 240 ;; full-warm) echo 300 ;; exec-batches) echo 150 ;; compile) echo 180 ;; detect-new) echo 120 ;; *) echo 1 ;; esac; }
run_part() {
part=$1
case "$part" in
  bench)
    export OMP_NUM_THREADS=2
    python3 bench/engine_throughput.py --config gpu --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
    python3 bench/engine_throughput.py --config gpu --count-ops --json "$OUT/ops_gpu.json" 2>&1 | grep -E "kernel ops|^ +[0-9]+ +(aten|lora)" | tee -a "$OUT/bench_gpu.log"
    for k in triton torch; do
      python3 bench/profile_decode.py --config gpu --engine-arg kernels=$k 2>&1 | grep -E "^builtin" | tee -a "$OUT/bench_gpu.log"
    done
    ;;
  detect)
    python3 -m pytest tests/test_detection_power.py tests/test_races.py --device=cuda --lora-cache /tmp/lora-cache \
      -p no:cacheprovider -q -rfE -k "graph_stale or overlap_no_wait or races" > "$OUT/detection_gpu.log" 2>&1
    tail -40 "$OUT/detection_gpu.log"
    race_report /tmp/lora-cache
    ;;
  suites)
    cache=/tmp/lora-cache
    start=$SECONDS
    python3 -m lora_conformance.cli certify --device cuda --engine-arg graphs=1 --report "$OUT/report-graphs" \
      -- -p no:cacheprovider --lora-cache "$cache" -q -rfE 2>&1 | tee "$OUT/suites_graphs.log" | tail -40
    echo "certify (cold cache, automatic workers): $((SECONDS - start)) s wall" | tee -a "$OUT/suites_graphs.log"
    python3 -m pytest suites --device=cuda --engine-arg graphs=0 -n 8 -p no:cacheprovider --lora-cache "$cache" -q -rfE \
      2>&1 | tail -25 | tee "$OUT/suites_eager.log"
    python3 -m pytest tests/test_detection_power.py --device=cuda --lora-cache "$cache" -p no:cacheprovider -q -rfE \
      -n 8 2>&1 | tail -25 | tee "$OUT/detection_gpu.log"
    race_report "$cache"
    ;;
  full-cold)
    log="$OUT/full_cold.log"
    restore_refs | tee -a "$log"
    python3 bench/build_bases.py full /tmp/lc-full 2>&1 | grep "^base" | tee -a "$log"
    mkdir -p /tmp/lc-full/runs
    mapfile -t desel < <(python3 bench/finished_cases.py /tmp/lc-full/runs/*/report.json 2>>"$log")
    run=/tmp/lc-full/runs/cold-$(date +%s)
    echo "bases ready at ${SECONDS} s; $(tail -1 "$log"); certifying until $((deadline - stop_margin)) s" | tee -a "$log"
    timeout "$(until_stop)" python3 -m lora_conformance.cli certify --device cuda --profile full --lora-cache /tmp/lc-full \
      --report "$run" ${FULL_WORKERS:+-n "$FULL_WORKERS"} -- -p no:cacheprovider -q -rfE ${FULL_K:+-k "$FULL_K"} "${desel[@]}" >> "$log" 2>&1
    echo "certify rc=$? at ${SECONDS} s" | tee -a "$log"
    grep -E "^(workers|LoRA conformance|reference|device memory|partial)" "$log"
    tar czf "$OUT/full-cold-reports.tgz" -C /tmp/lc-full runs
    save_refs | tee -a "$log"
    ;;
  full-warm)
    mkdir -p /tmp/lc-full/warm  # certify_time's reports (mkdtemp falls back to /tmp where TMPDIR is missing)
    TMPDIR=/tmp/lc-full/warm timeout "$(until_stop)" python3 bench/certify_time.py --device cuda --workers 2 --skip-cold \
      --warm-cache /tmp/lc-full --json "$OUT/full_warm.json" -- --profile=full 2>&1 | tee "$OUT/full_warm.log"
    # the report files only: the directory also holds pytest's temporary adapters (over 16 MB)
    (cd /tmp/lc-full && find warm -name 'report.json' -o -name 'report.md' | tar czf "$OUT/full-warm-report.tgz" -T -)
    save_refs
    ;;
  exec-batches)
    TORCH_LOGS=recompiles timeout "$(left)" python3 bench/exec_mode_batches.py --device cuda --dtype bfloat16 --profile full \
      --cache /tmp/lc-full 2>&1 | grep --line-buffered -v -E "Loading|Writing|warn" | tee "$OUT/exec_batches.log" | tail -40
    ;;
  compile)
    start=$SECONDS
    timeout "$(until_stop)" python3 -m lora_conformance.cli certify --device cuda -n 8 --engine-arg exec_mode=compile \
      --lora-cache /tmp/lc-modes --report "$OUT/report-compile" -- -p no:cacheprovider -q -rfE > "$OUT/compile.log" 2>&1
    echo "certify rc=$? in $((SECONDS - start)) s" | tee -a "$OUT/compile.log"
    grep -E "^(LoRA conformance|reference|device memory|=+ .* in )" "$OUT/compile.log"
    ;;
  detect-new)
    faults=${DETECT_FAULTS:-$(cd tests && python3 -c "from test_detection_power import NOT_YET_SHOWN_ON_GPU as s; print(' '.join(sorted(s)))")}
    faults=$(echo $faults | sed 's/ / or /g')
    LORA_DETECTION_DTYPES=${DETECT_DTYPES:-float32,bfloat16,float16} timeout "$(left)" python3 -m pytest tests/test_detection_power.py \
      --device=cuda --lora-cache /tmp/lc-detect -p no:cacheprovider -v -rfEs -n 4 -k "test_suites_catch_the_fault and ($faults)" \
      > "$OUT/detect_new.log" 2>&1
    echo "detection rc=$? at ${SECONDS} s" | tee -a "$OUT/detect_new.log"
    grep -E "(PASSED|FAILED|ERROR|SKIPPED) |passed|failed" "$OUT/detect_new.log" | tail -40
    ;;
  time)
    python3 bench/certify_time.py --device cuda --engine-arg graphs=1 --workers 1,8,16 --cold-workers 8,16 \
      --json "$OUT/certify_time.json" 2>&1 | tee "$OUT/certify_time.log"
    ;;
esac
}
for part in "$@"; do
  need=$(minimum "$part")
  if [ $((deadline - SECONDS)) -lt "$need" ]; then
    echo "part $part skipped: $((deadline - SECONDS)) s left before the deadline, it needs $need" | tee -a "$OUT/skipped.log"
    continue
  fi
  echo "== part $part at ${SECONDS} s"
  run_part "$part"
done
