#!/usr/bin/env bash
# d2o demo: set-up (packages, default model), build, then run d2o on the default real model:
# its summary, a generation with the full cache and the same with a D2O-compressed cache.
# Extra arguments replace the demo's own (e.g. scripts/demo.sh run -p "Hello" -n 32).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
"$repo/scripts/setup.sh"
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs" --target d2o_cli
if [ $# -gt 0 ]; then exec build/d2o "$@"; fi
build/d2o inspect --no-tensors
echo
echo "== A chat-formatted generation on the default model, full KV cache:"
build/d2o run --chat -p "Write a short story about a lighthouse keeper who finds a message in a bottle." -n 96
echo
echo "== The same with the D2O-compressed cache (budget of 64 slots per layer and KV head):"
exec build/d2o run --chat -p "Write a short story about a lighthouse keeper who finds a message in a bottle." -n 96 \
  --kv d2o:budget=64 --kv-report
