#!/usr/bin/env bash
# The GPU work of a release, in the order a lease should spend its time: the GPU-marked
# tests, then the end-to-end and kernel benchmarks. Run on the GPU machine from the repo
# root with a CUDA build of the op library: bash benchmarks/gpu_suite.sh <part> [out_dir]
#   part: tests [pytest paths and args: tests] | e2e-readers [e2e_bench args] | e2e-fit [MODEL:SPE ...]
#         | kernels | profile [args] | fuzz CASES MINUTES | soak MINUTES | dynamic [dynamic_bench args]
#         | tier [tier_bench args] | readers [reader_scaling args] | link [GiB [row bytes ...]]
#         (E2E_ARGS: more e2e_bench arguments for e2e-fit; FIT_TIMEOUT: seconds per fit run, 240)
# `tests` needs the dev requirements next to TensorFlow (pytest, and tf_keras for test_sok_compat.py).
set -uo pipefail
export PYTHONUNBUFFERED=1   # (each part's lines reach the log as they come, even when a limit cuts it off)
part=$1
out=${2:-out/gpu}
mkdir -p "$out"
quiet() { grep --line-buffered -v -E "^(W|I|E)0000|WARNING: All log|retracing|UserWarning|self\._interrupted" ; }
case $part in
  tests)       # (the whole log written as it goes: a run cut off by a timeout keeps what had passed)
               shift $(( $# < 2 ? $# : 2 ))
               python3 -m pytest -v -m gpu ${*:-tests} -p no:cacheprovider --durations=10 > "$out/gpu_tests.txt" 2>&1
               rc=$?; tail -40 "$out/gpu_tests.txt"; exit $rc ;;
  e2e-readers) shift 2; python3 benchmarks/e2e_bench.py --sections readers embedding "$@" --json "$out/e2e_readers.json" 2>&1 | quiet | tee -a "$out/e2e_readers.txt" ;;
  e2e-fit)     shift 2; runs=${*:+--fit-runs $*}
               python3 benchmarks/e2e_bench.py --sections fit --fit-timeout ${FIT_TIMEOUT:-240} ${E2E_ARGS:-} $runs --json "$out/e2e_fit.json" 2>&1 | quiet | tee -a "$out/e2e_fit.txt" ;;
  kernels)     python3 benchmarks/gpu_bench.py --sections train --json "$out/gpu_train.json" 2>&1 | quiet | tee "$out/gpu_train.txt" ;;
  profile)     shift 2; python3 benchmarks/fit_profile.py "$@" 2>&1 | quiet | tee -a "$out/fit_profile.txt" ;;
  fuzz)        python3 benchmarks/fuzz.py --device gpu --calls "$3" --minutes "$4" --jobs 4 --first-seed 300000 \
                 --json "$out/fuzz_gpu.json" 2>&1 | quiet | tail -30 | tee "$out/fuzz_gpu.txt" ;;
  dynamic)     shift 2; python3 benchmarks/dynamic_bench.py --json "$out/dynamic.json" "$@" 2>&1 | quiet | tee -a "$out/dynamic.txt" ;;
  tier)        shift 2; python3 benchmarks/tier_bench.py --json "$out/tier.json" "$@" 2>&1 | quiet | tee -a "$out/tier.txt" ;;
  readers)     shift 2; python3 benchmarks/reader_scaling.py "$@" 2>&1 | quiet | tee -a "$out/reader_scaling.txt" ;;
  link)        gib=${3:-8}; shift $(( $# < 3 ? $# : 3 ))
               nvcc -O2 -arch=sm_90 -o /tmp/host_link_rows benchmarks/host_link_rows.cu || exit 1
               for bytes in ${*:-512 1024}; do /tmp/host_link_rows "$gib" "$bytes"; done 2>&1 | tee -a "$out/host_link_rows.txt" ;;
  soak)        python3 benchmarks/soak.py --minutes "$3" --out "$out/soak" 2>&1 | quiet | tee "$out/soak.txt" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
