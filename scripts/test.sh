#!/usr/bin/env bash
# d2o tests: set-up (packages, model, test data), build, then every test suite.
#   1. Release build with warnings as errors: the model suite (real weights, reference parity
#      against llama.cpp) and the end-to-end suite (the d2o binary driven as a user would, on the
#      real model: generation, evaluation runs, the server and its clients, the set-up script);
#      then lm-evaluation-harness's local-completions model against the server, a stage of its own;
#      then the Python package (built in the same build as the extension d2o_python) under pytest.
#   2. AddressSanitizer + UndefinedBehaviorSanitizer build of the unit suite (synthetic data,
#      random-weight models and writer-made files: every kernel, cache, policy, tokenizer, file
#      format, the scheduler and the server's requests, responses and sessions), run under the
#      sanitizers. The real-model suites run once, in stage 1: under ASan their model runs take
#      several times as long on a 2-core machine, and building the binary and the end-to-end
#      suite with the sanitizers took about a third of this stage's build.
#   3. Fuzz smoke: every libFuzzer target of fuzz/ built with clang (libFuzzer + ASan + UBSan;
#      scripts/setup.sh --fuzz installs clang 14 when it is missing) and run for 8 s from its
#      seeds, one target a core (scripts/fuzz.sh 8; with its build, 4 minutes on 2 AVX2 vCPUs);
#      a crash, leak, timeout or memory blow-up fails the run and leaves its reproducer in
#      fuzz/crashes/. The long runs are for people (fuzz/README.md).
#   scripts/test.sh --tsan: instead, a ThreadSanitizer build of only the tests that run code on
#      several threads (thread pool, scheduler and batched decoding, attention split across
#      threads, micro-batched forward pass, the server's engine thread with clients over HTTP;
#      see tests/CMakeLists.txt), run under TSan.
#   scripts/test.sh --long: instead, the long forms of suites whose short seeded forms run above
#      (for people; about an hour on 2 cores): `pip install .` of a clean copy into a virtual
#      environment, with the Python package's tests run against it; the next-question protocol
#      through `d2o serve`
#      (scripts/next_question.py, 50 trials of every default policy on SmolLM2, and on Gemma 3
#      through /v1/completions); lm-eval's local-completions model on 200 documents per task
#      under the full cache and two budget policies; the server under hostile clients
#      (scripts/hostile_clients.py: 1,000 slow connections for 60 s beside 8 ordinary clients),
#      100 tries of one API key at another's sessions, 16 conversations filling a tmpfs session
#      directory, 32 conversations x 8 turns under a KV cap of 4 full caches with a needle in each
#      document asked for in its last turn, and 100
#      SIGKILLs among session saves (scripts/session_kills.py); reports into
#      build/long/. They measure and print; they fail only on errors (a server that does not
#      answer, a session that was not continued, a request refused that should not be, a file
#      that loads wrongly).
# Extra arguments are passed to ctest (e.g. -R Gguf).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
tsan=0
long=0
if [ "${1:-}" = "--tsan" ]; then
  tsan=1
  shift
elif [ "${1:-}" = "--long" ]; then
  long=1
  shift
fi
# stage NAME: prints the time the previous stage took, so that a CI log shows where time goes.
stage_name="" stage_start=$SECONDS
stage() {
  [ -n "$stage_name" ] && echo "== $stage_name took $((SECONDS - stage_start)) s"
  stage_name=$1 stage_start=$SECONDS
  [ -n "$1" ] && echo "== $1"
  return 0
}
trap 'stage ""' EXIT

stage "set-up"
"$repo/scripts/setup.sh" --test-data

cache=${D2O_CACHE_DIR:-$repo/cache}
export D2O_MODEL=${D2O_MODEL:-$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
export D2O_VOCAB_DIR=${D2O_VOCAB_DIR:-$cache/vocab}
export D2O_TEXT_DIR=${D2O_TEXT_DIR:-$cache/texts}
export D2O_QUANT_DIR=${D2O_QUANT_DIR:-$cache/test-data/quant}
export D2O_MATMUL_DIR=${D2O_MATMUL_DIR:-$cache/test-data/matmul}
export D2O_REFERENCE_DIR=${D2O_REFERENCE_DIR:-$cache/test-data/reference}
jobs=$(nproc 2>/dev/null || echo 2)

if [ "$tsan" = 1 ]; then
  stage "ThreadSanitizer build (thread-pool, scheduler, batched-decode, attention and server tests)"
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DD2O_TSAN=ON -DD2O_WERROR=ON >/dev/null
  cmake --build build-tsan -j"$jobs" --target d2o_tsan_tests
  # halt_on_error: the first race fails the test that ran into it. Suppressions: see
  # scripts/tsan.supp (why each is there).
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$repo/scripts/tsan.supp" \
    ctest --test-dir build-tsan --output-on-failure -j"$jobs" "$@"
  exit 0
fi

if [ "$long" = 1 ]; then
  stage "release build (d2o)"
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DD2O_WERROR=ON -DD2O_UNITY_LIB=ON >/dev/null
  cmake --build build -j"$jobs" --target d2o_cli
  mkdir -p build/long
  stage "next question, SmolLM2 (50 trials, every default policy)"
  scripts/next_question.py --d2o build/d2o -t "$jobs" --trials 50 \
    --json build/long/next_question.json
  stage "next question, Gemma 3 (50 trials, /v1/completions)"
  scripts/next_question.py --d2o build/d2o -t "$jobs" -m gemma3 --completions --trials 50 \
    --json build/long/next_question_gemma3.json
  stage "hostile clients (1,000 slow connections for 60 s, 8 ordinary clients)"
  # No sessions for the ordinary clients: RSS after the load then holds no kept conversation.
  scripts/hostile_clients.py --d2o build/d2o -t "$jobs" --connections 1000 --seconds 60 \
    --no-sessions --json build/long/hostile_clients.json
  stage "two API keys: 100 tries at the other's sessions"
  python3 tests/e2e/serve_keys_test.py build/d2o 100
  stage "a full session directory (16 conversations on a 6 MiB tmpfs)"
  python3 tests/e2e/serve_full_disk_test.py build/d2o 16 6m
  stage "compression under pressure (32 conversations x 8 turns, a cap of 4 full caches, a needle each)"
  # d2o:budget=256 under --compress when-needed; the last turn of every conversation asks for
  # the fact its document carries; then the full cache under the same cap, the reference
  # (docs/results/pressure/README.md).
  python3 tests/e2e/serve_pressure_test.py build/d2o 32 8 1100 --needle \
    --json build/long/serve_pressure.json
  stage "100 SIGKILLs among session saves"
  scripts/session_kills.py --d2o build/d2o -t "$jobs" --kills 100 \
    --json build/long/session_kills.json
  stage "pip install . from a clean copy into a virtual environment"
  # The package as a user installs it: the tracked files copied out, a fresh venv, `pip install`
  # (scikit-build-core and pybind11 from PyPI build the extension over the same CMake build),
  # then pytest against it from outside the source tree.
  rm -rf build/long/pip && mkdir -p build/long/pip/src
  git ls-files -z | xargs -0 tar -cf - | tar -xf - -C build/long/pip/src
  python3 -m venv build/long/pip/venv
  pip_start=$SECONDS
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs build/long/pip/venv/bin/python -m pip install --quiet \
    --disable-pip-version-check build/long/pip/src
  echo "pip install . took $((SECONDS - pip_start)) s"
  (cd build/long/pip && PYTHONPATH="$cache/pylib-pytest" D2O_BIN="$repo/build/d2o" \
    venv/bin/python -m pytest -q -p no:cacheprovider "$repo/tests/python")
  stage "lm-evaluation-harness against d2o serve (200 documents per task, compressing policies)"
  python3 tests/e2e/serve_lm_eval_test.py build/d2o --docs 200 --kv d2o:budget=64 \
    --kv h2o:budget=64 --json build/long/lm_eval.json
  exit 0
fi

stage "release build"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DD2O_WERROR=ON -DD2O_UNITY_TESTS=ON \
  -DD2O_UNITY_LIB=ON -DD2O_PYTHON=ON >/dev/null
# The unit suite runs under the sanitizers (below), not here. The test suites compile in unity
# batches (D2O_UNITY_TESTS: tests/CMakeLists.txt), and so do the libraries and the d2o binary
# (D2O_UNITY_LIB: CMakeLists.txt; the SIMD kernels' files alone). D2O_PYTHON: the Python
# package's extension module over the same library (target d2o_python, into build/python/d2o).
cmake --build build -j"$jobs" --target d2o_cli d2o_model_tests d2o_e2e_tests d2o_python
stage "release tests"
ctest --test-dir build --output-on-failure -j"$jobs" -L "^(model|e2e)$" "$@"
# lm-eval's local-completions model against `d2o serve` (short form: about 40 s on 2 cores; the
# package is installed at set-up), with a budget of its own; its scores are also computed
# through the Python package.
stage "lm-evaluation-harness against d2o serve"
ctest --test-dir build --output-on-failure -L "^lm_eval$" --timeout 240 "$@"
# The Python package as the release build made it (build/python), under pytest (tests/python:
# generation equal to `d2o run`, logits equal to the server's logprobs, errors, 1,000 random
# calls). The full `pip install .` into a virtual environment is in scripts/test.sh --long.
stage "Python package (pytest)"
PYTHONPATH="$repo/build/python:$cache/pylib-pytest" D2O_BIN="$repo/build/d2o" \
  python3 -m pytest -q -p no:cacheprovider tests/python

stage "sanitizer build (ASan + UBSan)"
# -g1 (line tables) rather than RelWithDebInfo's full -g: reports show the same frames and
# file:line, inlined calls included, for less compile time and objects a third the size.
# D2O_SANITIZE compiles at -O1 but for the SIMD kernels (CMakeLists.txt). Only the unit suite is
# built here: the model suite is reference-parity runs and the end-to-end suite drives the d2o
# binary on the real model, both run in the release build above.
# Unity batches for the test suites and the libraries, as in the release build.
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS=-g1 -DD2O_SANITIZE=ON \
  -DD2O_WERROR=ON -DD2O_UNITY_TESTS=ON -DD2O_UNITY_LIB=ON >/dev/null
cmake --build build-asan -j"$jobs" --target d2o_unit_tests
stage "sanitizer tests"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs" -L "^unit$" "$@"

stage "fuzz smoke (libFuzzer + ASan + UBSan, 8 s per target)"
if ! command -v clang++-14 >/dev/null ||
   ! dpkg-query -W -f='${Status}' libclang-rt-14-dev 2>/dev/null | grep -q "install ok installed"; then
  "$repo/scripts/setup.sh" --fuzz
fi
"$repo/scripts/fuzz.sh" 8
