#!/usr/bin/env bash
# Downloads (here, where PyPI is reachable) the cp312 manylinux wheels that the GPU machine lacks
# into the git-ignored .whl/ folder, which the device tool then carries (carry: [".whl", "wllm/_lib"]).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/.whl"
plats=()
for n in 17 24 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
grep -v '^#' "$root/build_tools/device_requirements.txt" | grep -v '^$' | while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" --platform manylinux2014_x86_64 --platform any -d "$root/.whl" "$req"
done
du -sh "$root/.whl"
