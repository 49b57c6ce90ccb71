#!/usr/bin/env bash
# compare_llama_bench.sh: d2o vs llama.cpp throughput on the same GGUF, threads and depths,
# measured side by side, written to docs/performance.md (and raw JSON).
#
#   LLAMA_BENCH=/path/to/llama-bench LLAMA_LIB=/path/to/its/libs scripts/compare_llama_bench.sh \
#       [-m MODEL] [-t THREADS] [-d DEPTHS] [-p N_PROMPT] [-n N_GEN] [-r REPS] [--kv SPEC]... \
#       [--fa 0,1] [--prefill N] [--llama-extra "ARGS"] [--d2o-extra "ARGS"] [--nice N]
#       [-o docs/performance.md]
#       [--raw DIR] [--d2o build/d2o]
#
# Defaults: the setup step's SmolLM2-135M-Instruct Q4_1, 2 threads, depths 0,2048,4096,8192,
# pp512 and tg128, 3 repetitions, --kv full and --kv d2o:ratio=0.2, flash attention off and on.
# --prefill N (default 8192, 0: skip) also times d2o's prefill of an N-token prompt per policy
# (single runs alternating between the policies, -r times), for the cost of statistics and
# compaction against the full cache. docs/performance_notes.md, if present, is appended.
#
# For every configuration (one test at one depth) the programs run one after another,
# alternating llama.cpp and d2o runs (llama.cpp -fa 0, d2o first policy, llama.cpp -fa 1, d2o
# second policy, ...), so that a change of machine load hits both: compare the ratios of one run,
# never absolute figures across runs. llama.cpp loads the weights into memory (-mmp 0, or -lm
# none in versions with --load-mode) like d2o, and both prefill the depth untimed.
#
# --llama-extra passes further llama-bench options to every llama-bench run (e.g. "--poll 0", so
# its threads sleep instead of spinning when the machine is oversubscribed); --d2o-extra passes
# further options to every `d2o bench` run: the two together compare quantized KV storage, e.g.
# --llama-extra "-ctk q8_0 -ctv q8_0" --d2o-extra "--kv-type q8_0" --fa 1. --nice N runs both
# programs (and the bandwidth probe) under `nice -n N` (negative needs root): on a shared machine
# other jobs then take less of the CPU from both alike.
#
# Nothing here builds or downloads llama.cpp: LLAMA_BENCH must point at an existing llama-bench
# binary and LLAMA_LIB (optional) at the folder holding its shared libraries.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${D2O_MODEL:-$repo/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=2
depths=0,2048,4096,8192
n_prompt=512
n_gen=128
reps=3
fa_list=0,1
kv_specs=()
out=$repo/docs/performance.md
raw=$repo/build/perf-compare
d2o=$repo/build/d2o
prefill_n=8192
llama_extra=""
d2o_extra=""
nice_level=""

die() { echo "compare_llama_bench: error: $*" >&2; exit 1; }
say() { echo "compare_llama_bench: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    -m) model=$2; shift 2 ;;
    -t) threads=$2; shift 2 ;;
    -d) depths=$2; shift 2 ;;
    -p) n_prompt=$2; shift 2 ;;
    -n) n_gen=$2; shift 2 ;;
    -r) reps=$2; shift 2 ;;
    --kv) kv_specs+=("$2"); shift 2 ;;
    --fa) fa_list=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    --raw) raw=$2; shift 2 ;;
    --d2o) d2o=$2; shift 2 ;;
    --prefill) prefill_n=$2; shift 2 ;;
    --llama-extra) llama_extra=$2; shift 2 ;;
    --d2o-extra) d2o_extra=$2; shift 2 ;;
    --nice) nice_level=$2; shift 2 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) die "unknown option '$1' (try --help)" ;;
  esac
done
[ ${#kv_specs[@]} -gt 0 ] || kv_specs=(full d2o:ratio=0.2)

[ -n "${LLAMA_BENCH:-}" ] || die "set LLAMA_BENCH to a built llama-bench binary (e.g. /work/cache/llama-build/bin/llama-bench); this script never builds llama.cpp"
[ -x "$LLAMA_BENCH" ] || die "LLAMA_BENCH='$LLAMA_BENCH' is not an executable file"
[ -x "$d2o" ] || die "d2o binary '$d2o' not found: build it first (cmake --build build) or pass --d2o PATH"
[ -f "$model" ] || die "model '$model' not found: run scripts/setup.sh or pass -m MODEL"
command -v python3 >/dev/null || die "python3 is needed to write the report"
for x in $threads $n_prompt $n_gen $reps $prefill_n; do
  [[ "$x" =~ ^[0-9]+$ ]] || die "'$x' is not a whole number"
done
[ -z "$nice_level" ] || [[ "$nice_level" =~ ^-?[0-9]+$ ]] || die "--nice '$nice_level' is not a whole number"
run_nice=()
[ -z "$nice_level" ] || run_nice=(nice -n "$nice_level")
[[ "$depths" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "-d '$depths' must be a comma-separated list of whole numbers"
[[ "$fa_list" =~ ^[01](,[01])*$ ]] || die "--fa '$fa_list' must be a list of 0 and 1"

lb() { LD_LIBRARY_PATH="${LLAMA_LIB:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "${run_nice[@]}" "$LLAMA_BENCH" "$@"; }
# Weights in process memory: -mmp 0 in older llama-bench, -lm none in versions with --load-mode.
lb_help=$(lb --help 2>&1 || true)
if grep -q -- "--load-mode" <<<"$lb_help"; then no_mmap=(-lm none)
elif grep -q -- "-mmp" <<<"$lb_help"; then no_mmap=(-mmp 0)
else no_mmap=(); say "llama-bench has neither -mmp nor --load-mode: it may read weights through mmap"
fi
grep -q -- "--n-depth" <<<"$lb_help" || die "this llama-bench has no -d/--n-depth option (too old for depth tests)"

mkdir -p "$raw"
rm -f "$raw"/*.json
IFS=, read -r -a depth_arr <<<"$depths"
IFS=, read -r -a fa_arr <<<"$fa_list"
read -r -a llama_extra_arr <<<"$llama_extra"
read -r -a d2o_extra_arr <<<"$d2o_extra"
meta=$raw/meta.txt
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "load_before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  echo "cores: $(nproc)"
  echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2- | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512dq|avx512_vnni|avx512_bf16|avx512vbmi|avx_vnni|amx_tile)$' | tr '\n' ' ')"
  echo "d2o_commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$repo" diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "llama_bench: $LLAMA_BENCH"
  echo "model: $model"
  echo "threads: $threads"
  echo "reps: $reps"
  echo "no_mmap: ${no_mmap[*]:-none}"
  echo "llama_extra: ${llama_extra:-none}"
  echo "d2o_extra: ${d2o_extra:-none}"
  echo "nice: ${nice_level:-0}"
} >"$meta"

# Memory read bandwidth with the same thread count, once before the runs.
"${run_nice[@]}" "$d2o" bench --mem-bw -t "$threads" --json "$raw/membw.json" >/dev/null 2>&1 \
  || say "the memory bandwidth probe failed; the report will use no bandwidth figure"

run_llama() {  # run_llama FA TESTKIND N DEPTH
  local fa=$1 kind=$2 n=$3 d=$4 f
  f=$raw/llama_${kind}${n}_d${d}_fa${fa}.json
  local pn=(-p 0 -n "$n")
  [ "$kind" = pp ] && pn=(-p "$n" -n 0)
  say "llama.cpp -fa $fa: $kind$n @ d$d"
  lb -m "$model" -t "$threads" "${pn[@]}" -d "$d" -r "$reps" -fa "$fa" "${no_mmap[@]}" "${llama_extra_arr[@]}" -o json >"$f" 2>"$f.log" \
    || { say "llama-bench failed (see $f.log)"; rm -f "$f"; }
}
run_d2o() {  # run_d2o SPEC_INDEX TESTKIND N DEPTH
  local i=$1 kind=$2 n=$3 d=$4 f
  f=$raw/d2o_${kind}${n}_d${d}_kv${i}.json
  local pn=(-p 0 -n "$n")
  [ "$kind" = pp ] && pn=(-p "$n" -n 0)
  say "d2o --kv ${kv_specs[$i]}: $kind$n @ d$d"
  "${run_nice[@]}" "$d2o" bench -m "$model" -t "$threads" "${pn[@]}" -d "$d" -r "$reps" --kv "${kv_specs[$i]}" \
    "${d2o_extra_arr[@]}" --json "$f" >"$f.log" 2>&1 || { say "d2o bench failed (see $f.log)"; rm -f "$f"; }
}

tests=()
if [ "$n_prompt" -gt 0 ]; then tests+=("pp $n_prompt"); fi
if [ "$n_gen" -gt 0 ]; then tests+=("tg $n_gen"); fi
[ ${#tests[@]} -gt 0 ] || die "nothing to run (-p 0 and -n 0)"
for d in "${depth_arr[@]}"; do
  for t in "${tests[@]}"; do
    read -r kind n <<<"$t"
    # Alternate: llama.cpp, d2o, llama.cpp, d2o, ... then whatever is left of the longer list.
    nl=${#fa_arr[@]}; nd=${#kv_specs[@]}
    for ((k = 0; k < (nl > nd ? nl : nd); k++)); do
      if [ $k -lt $nl ]; then run_llama "${fa_arr[$k]}" "$kind" "$n" "$d"; fi
      if [ $k -lt $nd ]; then run_d2o "$k" "$kind" "$n" "$d"; fi
    done
  done
done
# Prefill cost per policy: single runs, alternating policies.
if [ "$prefill_n" -gt 0 ]; then
  for ((r = 0; r < reps; r++)); do
    for ((i = 0; i < ${#kv_specs[@]}; i++)); do
      f=$raw/d2o_prefill_kv${i}_${r}.json
      say "d2o --kv ${kv_specs[$i]}: prefill of $prefill_n tokens ($((r + 1))/$reps)"
      "${run_nice[@]}" "$d2o" bench -m "$model" -t "$threads" -p "$prefill_n" -n 0 -d 0 -r 1 --kv "${kv_specs[$i]}" "${d2o_extra_arr[@]}" --json "$f" \
        >"$f.log" 2>&1 || { say "d2o bench failed (see $f.log)"; rm -f "$f"; }
    done
  done
fi
echo "load_after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$meta"
printf '%s\n' "${kv_specs[@]}" >"$raw/kv_specs.txt"

notes=()
if [ -f "$repo/docs/performance_notes.md" ]; then notes=(--notes "$repo/docs/performance_notes.md"); fi
python3 "$repo/scripts/perf_report.py" --raw "$raw" --out "$out" "${notes[@]}" \
  --cmd "scripts/compare_llama_bench.sh -t $threads -d $depths -p $n_prompt -n $n_gen -r $reps$(printf ' --kv %q' "${kv_specs[@]}") --fa $fa_list --prefill $prefill_n${llama_extra:+ --llama-extra \"$llama_extra\"}${d2o_extra:+ --d2o-extra \"$d2o_extra\"}${nice_level:+ --nice $nice_level}"
say "wrote $out (raw results in $raw)"
