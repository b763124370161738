#!/usr/bin/env bash
# Runs on the lent GPU machine (device tool), from the repository root:
#   carry: ["wllm/_lib", ".whl", "build/legtest"]   (prebuilt library, dependency wheels, leg-test library)
#   command: bash build_tools/device_run.sh [pytest args...] [-- bench1 bench2 ...]
# Built here first with: WLLM_CUDA_ARCHS=9.0 pip install -e . (or the full build), and
# build_tools/fetch_device_wheels.sh. Installs the wheels into /tmp/site (no index there), runs
# `wllm doctor`, `pytest -m cuda` and the named benchmarks (benchmarks/<name>.py), and prints a
# short summary table last. Full logs go to $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-/tmp/wllm-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$root
else
  export PYTHONPATH=$root
fi
export PYTHONUNBUFFERED=1
[ -f build/legtest/libwllm_kernels.so ] && export WLLM_TEST_LEG_LIBRARY=$root/build/legtest/libwllm_kernels.so
# The tree arrives without .git: `git rev-parse --short HEAD > build/legtest/commit.txt` here names it.
[ -f build/legtest/commit.txt ] && export WLLM_COMMIT=$(cat build/legtest/commit.txt)

pytest_args=()
benches=()
seen_sep=0
for a in "$@"; do
  if [ "$a" = "--" ]; then seen_sep=1; continue; fi
  if [ $seen_sep = 1 ]; then benches+=("$a"); else pytest_args+=("$a"); fi
done

summary=()
python3 -m wllm doctor 2>&1 | tee "$out/doctor.txt"
summary+=("doctor: exit ${PIPESTATUS[0]}")
python3 -m pytest -m cuda -p no:cacheprovider "${pytest_args[@]}" 2>&1 | tee "$out/pytest_cuda.txt"
rc=${PIPESTATUS[0]}
summary+=("pytest -m cuda: exit $rc, $(tail -n 1 "$out/pytest_cuda.txt")")
for b in "${benches[@]}"; do
  timeout "${BENCH_TIMEOUT:-900}" python3 "benchmarks/$b.py" 2>&1 | tee "$out/bench_$b.txt"
  summary+=("bench $b: exit ${PIPESTATUS[0]}")
done
echo
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
exit $rc
