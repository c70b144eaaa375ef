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
#   part "full-cold": the profile's bases, then the cold certification until LIMIT seconds (default
#                  520) have passed since the call began; call it again while the report says
#                  "partial" (the second call finds what the first computed);
#   part "full-warm": bench/certify_time.py on that filled cache: the warm wall time, with "computed /
#                  cached" beside it (a warm row computes none);
#   part "compile": the built-in engine's compile mode, fast profile, alone (beside other jobs its
#                  cases took 5x longer and a 400 s limit cut the run).
# Each certification writes its report under $OUT and says what its processes held on the device.
# The carried .whl must hold platformdirs (the image lacks it; README of the device tool, wheels).
# Usage: bash bench/gpu_validation.sh bench|suites|detect|time|full-cold|full-warm|compile
# The last step of suites/detect runs the overlap fault on purpose, only to print the race report.
set -uo pipefail
part=${1:?bench, suites, detect, time, full-cold, full-warm or compile}
case "$part" in
  bench|suites|detect|time|full-cold|full-warm|compile) ;;
  *) echo "gpu_validation.sh: no part '$part' (bench, suites, detect, time, full-cold, full-warm or compile)" >&2; exit 2 ;;
esac
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
    limit=${LIMIT:-520}
    python3 bench/build_bases.py full /tmp/lc-full 2>&1 | grep "^base" | tee "$OUT/full_cold.log"
    left=$((limit - SECONDS))
    echo "bases ready at ${SECONDS} s; certifying for at most ${left} s" | tee -a "$OUT/full_cold.log"
    timeout "$left" python3 -m lora_conformance.cli certify --device cuda --profile full --lora-cache /tmp/lc-full \
      --report "$OUT/report-full-cold" -- -p no:cacheprovider -q -rfE >> "$OUT/full_cold.log" 2>&1
    echo "certify rc=$? at ${SECONDS} s" | tee -a "$OUT/full_cold.log"
    grep -E "^(workers|LoRA conformance|reference|device memory|partial)" "$OUT/full_cold.log"
    ;;
  full-warm)
    python3 bench/certify_time.py --device cuda --workers 2 --skip-cold --warm-cache /tmp/lc-full \
      --json "$OUT/full_warm.json" -- --profile=full 2>&1 | tee "$OUT/full_warm.log"
    ;;
  compile)
    start=$SECONDS
    python3 -m lora_conformance.cli certify --device cuda -n 8 --engine-arg exec_mode=compile --lora-cache /tmp/lc-modes \
      --report "$OUT/report-compile" -- -p no:cacheprovider -q -rfE > "$OUT/compile.log" 2>&1
    echo "certify rc=$? in $((SECONDS - start)) s" | tee -a "$OUT/compile.log"
    grep -E "^(LoRA conformance|reference|device memory|=+ .* in )" "$OUT/compile.log"
    ;;
  time)
    python3 bench/certify_time.py --device cuda --engine-arg graphs=1 --workers 1,8,16 --cold-workers 8,16 \
      --json "$OUT/certify_time.json" 2>&1 | tee "$OUT/certify_time.log"
    ;;
esac
