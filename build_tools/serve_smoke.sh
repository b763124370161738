#!/usr/bin/env bash
# Starts `wllm serve` on random weights in a real shape (default llama-3.1-8b), waits until it is
# healthy, sends one chat and one streaming completion request, prints what came back and the
# start-up log (KV cache size, CUDA graph capture), then stops it with SIGTERM and checks exit 0.
#   bash build_tools/serve_smoke.sh [shape] [port]
set -uo pipefail
shape=${1:-llama-3.1-8b}
port=${2:-8011}
log=${OUT:-/tmp}/serve_smoke.log
python3 -m wllm serve "$shape" --load-format dummy --port "$port" --log-level info > "$log" 2>&1 &
pid=$!
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 "$pid" 2>/dev/null || { echo "server died"; tail -30 "$log"; exit 1; }
  sleep 1
done
curl -s "http://127.0.0.1:$port/v1/chat/completions" -H "Content-Type: application/json" \
  -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "temperature": 0}'
echo
curl -sN "http://127.0.0.1:$port/v1/completions" -H "Content-Type: application/json" \
  -d '{"prompt": "Once upon", "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}' | tail -3
kill -TERM "$pid"
wait "$pid"
rc=$?
grep -iE "kv cache|graph|ready" "$log" | head -10
echo "serve exit code after SIGTERM: $rc"
exit $rc
