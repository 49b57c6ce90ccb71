#!/usr/bin/env bash
# d2o fuzzing: builds the libFuzzer targets of fuzz/ with clang (ASan + UBSan) and runs each for
# SECONDS (default 10), one after the other, on one core.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
# Each target starts from its seed corpus (fuzz/corpus/TARGET, checked in) plus what earlier runs
# found (build-fuzz/corpus/TARGET, not checked in). A crash, a leak, an input that takes over 1 s
# or an allocation beyond the memory bound leaves its reproducer in fuzz/crashes/TARGET/ (ignored
# by git) and makes the script fail; rerun one with build-fuzz/fuzz/TARGET fuzz/crashes/TARGET/FILE.
# Environment: FUZZ_RSS_MB (memory bound per target, default 2048), CXX (default clang++-14).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
seconds=${1:-10}
shift || true
case "$seconds" in ''|*[!0-9]*) echo "fuzz: SECONDS must be a whole number, got '$seconds'" >&2; exit 2 ;; esac
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_gguf fuzz_vocab fuzz_tokenizer fuzz_chat_template fuzz_kv_spec
                                     fuzz_prompt_tokens)
cxx=${CXX:-clang++-14}
command -v "$cxx" >/dev/null || { echo "fuzz: $cxx not found (scripts/setup.sh installs clang)" >&2; exit 1; }
rss_mb=${FUZZ_RSS_MB:-2048}
jobs=$(nproc 2>/dev/null || echo 2)

echo "== fuzz build (clang, libFuzzer + ASan + UBSan)"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DD2O_FUZZ=ON -DD2O_BUILD_TESTS=OFF \
  -DCMAKE_CXX_COMPILER="$cxx" "${launcher[@]}" >/dev/null
cmake --build build-fuzz -j"$jobs" --target "${targets[@]}"

failed=()
for t in "${targets[@]}"; do
  work="build-fuzz/corpus/$t"
  crashes="fuzz/crashes/$t"
  mkdir -p "$work" "$crashes"
  dict=()
  case "$t" in fuzz_gguf|fuzz_vocab) dict=(-dict=fuzz/gguf.dict) ;; esac
  echo "== $t: ${seconds}s"
  # New inputs go to the first corpus folder (the build's), never into the checked-in seeds.
  if ! ASAN_OPTIONS=detect_leaks=1 \
       UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
       "build-fuzz/fuzz/$t" -max_total_time="$seconds" -timeout=1 -rss_limit_mb="$rss_mb" \
       -malloc_limit_mb="$rss_mb" -print_final_stats=1 \
       -artifact_prefix="$crashes/" "${dict[@]}" "$work" "fuzz/corpus/$t" \
       >"build-fuzz/$t.log" 2>&1; then
    failed+=("$t")
    grep -E "^==[0-9]+==ERROR|^SUMMARY|^artifact_prefix|Test unit written|^    #[0-9] " \
      "build-fuzz/$t.log" | head -n 20 || true
    echo "(full log: build-fuzz/$t.log)"
  fi
  grep -E "^stat::number_of_executed_units|^#[0-9]+ +DONE" "build-fuzz/$t.log" | tail -n 2 || true
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (reproducers in fuzz/crashes/)" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${seconds}s each without a finding"
