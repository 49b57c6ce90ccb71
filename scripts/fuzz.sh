#!/usr/bin/env bash
# d2o fuzzing: builds the libFuzzer targets of fuzz/ with clang (ASan + UBSan) and runs each for
# SECONDS (default 10), as many at a time as there are cores.
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
                                     fuzz_prompt_tokens fuzz_serve_request fuzz_session_file)
cxx=${CXX:-clang++-14}
command -v "$cxx" >/dev/null || { echo "fuzz: $cxx not found (scripts/setup.sh --fuzz installs it)" >&2; exit 1; }
rss_mb=${FUZZ_RSS_MB:-2048}
jobs=$(nproc 2>/dev/null || echo 2)

echo "== fuzz build (clang, libFuzzer + ASan + UBSan)"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DD2O_FUZZ=ON -DD2O_BUILD_TESTS=OFF \
  -DCMAKE_CXX_COMPILER="$cxx" "${launcher[@]}" >/dev/null
cmake --build build-fuzz -j"$jobs" --target "${targets[@]}"

# run_target TARGET SECONDS: 0 when the run ends without a finding.
run_target() {
  local t=$1 secs=$2 dict=()
  case "$t" in
    fuzz_gguf|fuzz_vocab) dict=(-dict=fuzz/gguf.dict) ;;
    fuzz_serve_request) dict=(-dict=fuzz/json.dict) ;;
  esac
  # New inputs go to the first corpus folder (the build's), never into the checked-in seeds.
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "build-fuzz/fuzz/$t" -max_total_time="$secs" -timeout=1 -rss_limit_mb="$rss_mb" \
    -malloc_limit_mb="$rss_mb" -print_final_stats=1 -artifact_prefix="fuzz/crashes/$t/" \
    "${dict[@]}" "build-fuzz/corpus/$t" "fuzz/corpus/$t" >>"build-fuzz/$t.log" 2>&1
}

# fuzz_one TARGET: runs TARGET for SECONDS; prints what it found and returns 1 on a finding.
fuzz_one() {
  local t=$1 end before new found=0
  mkdir -p "build-fuzz/corpus/$t" "fuzz/crashes/$t"
  : >"build-fuzz/$t.log"
  end=$((SECONDS + seconds))
  while :; do
    before=$(ls "fuzz/crashes/$t" | wc -l)
    if run_target "$t" $((end - SECONDS > 1 ? end - SECONDS : 1)); then break; fi
    # The per-input limit is wall-clock time: on a loaded machine a fast input can be stalled
    # past it. A timeout counts only if its input is slow again when replayed alone.
    new=$(ls -t "fuzz/crashes/$t" | head -n $(( $(ls "fuzz/crashes/$t" | wc -l) - before )))
    if [ -n "$new" ] && [ "$(echo "$new" | grep -vc '^timeout-')" = 0 ] &&
       "build-fuzz/fuzz/$t" -timeout=1 -runs=3 $(printf "fuzz/crashes/$t/%s " $new) \
         >>"build-fuzz/$t.log" 2>&1; then
      for f in $new; do mv "fuzz/crashes/$t/$f" "fuzz/crashes/$t/stalled-$f"; done
      echo "   a timeout did not reproduce when replayed (machine load); kept as fuzz/crashes/$t/stalled-*"
      [ $SECONDS -lt $((end - 1)) ] && continue
      break
    fi
    grep -E "^==[0-9]+==ERROR|^SUMMARY|^artifact_prefix|Test unit written|^    #[0-9] " \
      "build-fuzz/$t.log" | head -n 20 || true
    echo "(full log: build-fuzz/$t.log)"
    found=1
    break
  done
  grep -E "^#[0-9]+[[:space:]]+DONE" "build-fuzz/$t.log" | tail -n 1 || true
  return $found
}

# The targets run $jobs at a time (one a core: each is single-threaded), each printing its lines
# when it ends.
failed=()
i=0
while [ $i -lt ${#targets[@]} ]; do
  lane=("${targets[@]:i:jobs}")
  pids=()
  for t in "${lane[@]}"; do
    fuzz_one "$t" >"build-fuzz/$t.out" 2>&1 &
    pids+=($!)
  done
  for k in "${!lane[@]}"; do
    t=${lane[$k]}
    status=0
    wait "${pids[$k]}" || status=$?
    echo "== $t: ${seconds}s"
    cat "build-fuzz/$t.out"
    [ $status -eq 0 ] || failed+=("$t")
  done
  i=$((i + jobs))
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (reproducers in fuzz/crashes/)" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${seconds}s each without a finding"
