#!/usr/bin/env bash
# d2o tests: set-up (packages, model, test data), build, then every test suite.
#   1. Release build with warnings as errors: unit, model (real weights) and end-to-end tests.
#   2. AddressSanitizer + UndefinedBehaviorSanitizer build: the same suites except the long
#      reference-parity runs and the four whole-pipeline evaluation runs (make_results --quick,
#      eval ppl/niah --quick, the same-seed rerun): same code paths as the release run and as the
#      shorter eval tests that do run, but 3-10 minutes each under ASan on a 2-core machine;
#      and the server driven by the `openai` package (the same binary's requests and responses
#      are unit-tested under ASan; the model run takes minutes there).
# Extra arguments are passed to ctest (e.g. -R Gguf).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
"$repo/scripts/setup.sh" --test-data

cache=${D2O_CACHE_DIR:-$repo/cache}
export D2O_MODEL=${D2O_MODEL:-$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
export D2O_VOCAB_DIR=${D2O_VOCAB_DIR:-$cache/vocab}
export D2O_TEXT_DIR=${D2O_TEXT_DIR:-$cache/texts}
export D2O_QUANT_DIR=${D2O_QUANT_DIR:-$cache/test-data/quant}
export D2O_MATMUL_DIR=${D2O_MATMUL_DIR:-$cache/test-data/matmul}
export D2O_REFERENCE_DIR=${D2O_REFERENCE_DIR:-$cache/test-data/reference}
jobs=$(nproc 2>/dev/null || echo 2)

echo "== release build"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DD2O_WERROR=ON >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs" "$@"

echo "== sanitizer build (ASan + UBSan)"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DD2O_SANITIZE=ON -DD2O_WERROR=ON >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs" \
  -E "Parity|ServeOpenAi|MakeResults\.QuickRuns|CliEval\.(PplQuickRuns|NiahQuickRuns|RulerQuickRuns|SameSeedSameNumbers)" "$@"
