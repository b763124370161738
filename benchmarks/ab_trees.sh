#!/usr/bin/env bash
# A before/after A/B of two source trees on one GPU machine, rounds alternating between the trees:
#   bash benchmarks/ab_trees.sh BEFORE_DIR AFTER_DIR ROUNDS PART [PART ...]
# PART: digest (benchmarks/outputs_digest.py on $DIGEST_SHAPES, default both shapes), latency, prefill, throughput (`wllm bench`,
# no HF). Each tree runs with its own kernel library (DIR/wllm/_lib) and PYTHONPATH=/tmp/site:DIR (the
# dependency wheels device_run.sh installs). AB_ORDER="after before" runs the second tree first in each round. JSON and logs go to $OUT; a table of every number is last.
set -uo pipefail
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); rounds=$3; shift 3
out=${OUT:-/tmp/ab}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for part in "$@"; do
  for round in $(seq 1 "$rounds"); do
    for tree in ${AB_ORDER:-before after}; do
      dir=$before; [ "$tree" = after ] && dir=$after
      env=(env PYTHONPATH="/tmp/site:$dir")
      case $part in
        digest)
          for shape in ${DIGEST_SHAPES:-qwen2.5-0.5b llama-3.1-8b}; do
            (cd "$dir" && "${env[@]}" python3 benchmarks/outputs_digest.py --shape "$shape" --device cuda 2>&1 \
              | grep '^outputs_digest' | sed "s/^/$tree /") | tee -a "$out/digest.txt"
          done ;;
        latency|prefill|throughput)
          (cd "$dir" && "${env[@]}" python3 -m wllm bench "$part" --skip-hf --json "$out/${part}_${tree}_${round}.json" \
            > "$out/${part}_${tree}_${round}.log" 2>&1) || echo "$part $tree round $round failed: $(tail -n 3 "$out/${part}_${tree}_${round}.log")" ;;
      esac
    done
  done
done
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*_*_*.json")):
    part, tree, rnd = f.stem.split("_")
    for r in json.loads(f.read_text())["results"]:
        rows.setdefault((r["bench"], r["shape"], r["metric"]), {}).setdefault(tree, []).append(r["wllm"])
print("\n==== A/B (every round) ====")
for (bench, shape, metric), trees in rows.items():
    print(f"{bench:10s} {shape:14s} {metric:8s} before {trees.get('before')} after {trees.get('after')}")
EOF
[ -f "$out/digest.txt" ] && { echo "==== digests ===="; sort -k3 "$out/digest.txt"; }
