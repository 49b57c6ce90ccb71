#!/usr/bin/env bash
# d2o demo: set-up (packages, default model), build, then run d2o on the default real model.
# Extra arguments replace the demo's own (e.g. scripts/demo.sh run -p "Hello" -n 32).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
"$repo/scripts/setup.sh"
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs" --target d2o_cli
if [ $# -gt 0 ]; then exec build/d2o "$@"; fi
exec build/d2o inspect --no-tensors
