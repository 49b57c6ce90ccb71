#!/usr/bin/env bash
# Regenerates docs/research/results_full.md, the long generated page of every report (the lab
# notebook's tables; docs/results.md is the short hand-written summary a user reads and is not
# written here), and its charts (docs/results/*.svg, *.json, *.md) with the d2o
# evaluation harness: `d2o eval ppl`, `fidelity` (by ratio, and at equal KV bytes across storage
# types), `niah`, `ruler`, `ablate` on the default model
# (SmolLM2-135M-Instruct, fetched by scripts/setup.sh) with every KV policy, then
# `d2o eval summary` for the page. Deterministic: the same model, texts and seed give the same
# numbers (wall times aside).
#
#   scripts/make_results.sh                 the full report (about 5 hours on 2 cores; the page
#                                           gives each report's own wall time)
#   scripts/make_results.sh --quick         a small subset in a few minutes (CI smoke test);
#                                           writes to build/results-quick unless --out is given
#   scripts/make_results.sh --out DIR       reports into DIR, the page into DIR/../results.md
#                                           (without --out: docs/research/results_full.md)
#   scripts/make_results.sh --summary-only  only rebuild the page from the reports already there
#   scripts/make_results.sh --only ppl,ruler  only those reports of the run (names as in
#                                           docs/results/: ppl, fidelity, ablate, niah, ruler,
#                                           ruler_4k, ruler_8k, ruler_8k_more, ruler_8k_rest,
#                                           ruler_bytes, ruler_bytes_10, fidelity_bytes,
#                                           niah_long),
#                                           then the whole page from every report there
#   scripts/make_results.sh --model gemma3  only the Gemma 3 270M runs (about two hours on 2 busy
#                                           cores), into <out>/gemma3; then the whole page, whose
#                                           "Gemma 3 270M" section is built from <out>/gemma3
#   (--model smollm2, the default, runs the SmolLM2 protocols; the page always gets both sections
#   when both folders hold reports.)
#
# Environment: D2O (the d2o binary, default build/d2o), MODEL (a GGUF file, default the setup
# model of the --model chosen), TEXT (the text of ppl/fidelity/ablate, default
# cache/texts/kjv.txt), HAYSTACK (niah and ruler haystack, default the Paul Graham essays, else
# the KJV text), THREADS (default 2), SEED (default 1). Hand-written remarks in
# docs/research/results_notes.md (docs/research/results_gemma3_notes.md for the Gemma 3 section)
# are included in the page.
set -euo pipefail
# The script is one block that bash reads whole before running it: editing this file during a
# long run does not change what the run does.
{

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
quick=0
summary_only=0
only=""
out=""
model=smollm2
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --summary-only) summary_only=1 ;;
    --only) shift; only=${1:?--only needs report names, e.g. ppl,ruler} ;;
    --out) shift; out=${1:?--out needs a folder} ;;
    --model) shift; model=${1:?--model needs smollm2 or gemma3} ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "make_results: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

for name in ${only//,/ }; do
  case "$name" in
    ppl|fidelity|ablate|niah|ruler|ruler_4k|ruler_8k|ruler_8k_more|ruler_8k_rest|ruler_bytes|ruler_bytes_10|fidelity_bytes|niah_long) ;;
    *) echo "make_results: unknown report '$name' in --only (ppl, fidelity, ablate, niah, ruler, ruler_4k, ruler_8k, ruler_8k_more, ruler_8k_rest, ruler_bytes, ruler_bytes_10, fidelity_bytes, niah_long)" >&2
       exit 2 ;;
  esac
done
case "$model" in
  smollm2|gemma3) ;;
  *) echo "make_results: unknown --model '$model' (smollm2 or gemma3)" >&2; exit 2 ;;
esac
if [ "$model" = gemma3 ] && [ $quick -eq 1 ]; then
  echo "make_results: --quick runs the SmolLM2 smoke subset only; drop --model gemma3" >&2
  exit 2
fi

d2o=${D2O:-$repo/build/d2o}
[ -x "$d2o" ] || { echo "make_results: error: no d2o binary at $d2o (build first, or set D2O)" >&2; exit 1; }
threads=${THREADS:-2}
seed=${SEED:-1}
page=""
if [ -z "$out" ]; then
  if [ $quick -eq 1 ]; then
    out=$repo/build/results-quick
  else
    out=$repo/docs/results
    page=$repo/docs/research/results_full.md
  fi
fi
[ -n "$page" ] || page=$(dirname "$out")/results.md
gout=$out/gemma3
mkdir -p "$out"

common=(-t "$threads" --seed "$seed" -o "$out")
[ -n "${MODEL:-}" ] && common+=(-m "$MODEL")
text=()
[ -n "${TEXT:-}" ] && text=(-f "$TEXT")
hay=()
[ -n "${HAYSTACK:-}" ] && hay=(-f "$HAYSTACK")
# The paper's D2O is `d2o:reading=paper` (and its variants, `d2o:reading=paper,KEYS`): the
# reports of docs/results were recorded when it was `d2o`'s default, under the label `d2o`.
all="full;streaming;h2o;snapkv;pyramidkv;roco;cam;keydiff;d2o:reading=paper;d2o:reading=paper,mass=on,merge=sized,layers=uniform,nm=1:1;d2o:reading=paper,mass=on,nm=1:3"
# Per-head budgets (Ada-KV) on the three scorings they apply to: in the full run's ppl, fidelity
# and ruler protocols (not the quick smoke run, nor niah, to keep their time).
ada=";h2o:heads=ada;snapkv:heads=ada;d2o:reading=paper,heads=ada"

run() {
  # --only: an evaluation whose report (its --name, else its protocol) is not listed is skipped.
  if [ -n "$only" ] && [ "$1" = eval ] && [ "$2" != summary ]; then
    local name=$2 prev="" a
    for a in "$@"; do
      [ "$prev" = --name ] && name=$a
      prev=$a
    done
    case ",$only," in
      *",$name,"*) ;;
      *) return 0 ;;
    esac
  fi
  echo "== d2o $*" >&2
  local t0=$SECONDS
  "$d2o" "$@"
  echo "== done in $((SECONDS - t0)) s" >&2
}

if [ $summary_only -eq 0 ] && [ "$model" = gemma3 ]; then
  # Gemma 3 270M: 15 of its 18 layers are sliding-window layers (a ring of 512 slots, never
  # compacted); the policies compress only the 3 global layers, so rho and the capacities below
  # are shares and slot counts of those layers. Policies: the baselines that carry the verdicts,
  # the paper's D2O and the two corrected combinations of the SmolLM2 diagnosis
  # (`mass=on,merge=sized,layers=uniform,nm=1:1` and `mass=on,nm=1:3` on the paper's); RoCo,
  # CaM and KeyDiff too in fidelity, ppl, niah and ruler. The per-head budgets (heads=ada) are
  # left out: with one KV head per layer they are the uniform policy. About two hours on 2 cores
  # shared with other runs (ruler 27 minutes, niah_long 40, fidelity_bytes 22, the others 1-4
  # each). The reports in docs/results/gemma3 were made with the AVX2 kernels (D2O_MAX_ISA=avx2
  # on an AVX-512 machine gives the same figures; the notes say what the AVX-512 kernels change).
  mkdir -p "$gout"
  gemma=(-t "$threads" --seed "$seed" -o "$gout" -m "${MODEL:-gemma3}")
  gpol="full;streaming;h2o;snapkv;pyramidkv;d2o:reading=paper"
  gpol+=";d2o:reading=paper,mass=on,merge=sized,layers=uniform,nm=1:1;d2o:reading=paper,mass=on,nm=1:3"
  gall="full;streaming;h2o;snapkv;pyramidkv;roco;cam;keydiff;d2o:reading=paper"
  gall+=";d2o:reading=paper,mass=on,merge=sized,layers=uniform,nm=1:1;d2o:reading=paper,mass=on,nm=1:3"
  # fidelity: 8 prompts of 2048 tokens (four sliding windows), 64 teacher-forced tokens each.
  run eval fidelity "${gemma[@]}" "${text[@]}" --policies "$gall" --ratios 0.2,0.4 \
    --prompt 2048 --samples 8 --continue 64
  # ppl: token by token through 2048 tokens. Capacity 512 gives the global layers no more slots
  # than a sliding layer holds (the whole cache is then 18 x 512 slots); 1024 is twice the
  # window. A capacity below the window would leave the global layers seeing less than the
  # sliding ones.
  run eval ppl "${gemma[@]}" "${text[@]}" --policies "$gall" --capacities 512,1024 --tokens 2048 \
    --chunk 1
  # ablate: D2O's ablations and the diagnosis groups with the fidelity protocol at rho = 0.2.
  run eval ablate "${gemma[@]}" "${text[@]}" --ratio 0.2 --prompt 2048 --samples 5 --continue 48
  # ruler: RULER-style tasks at 2K tokens (four sliding windows), rho = 0.2 of the global layers,
  # 50 trials per task (300 in all), one shared prefill per trial. vt is left out: the full
  # cache of this base model scored 10% on it in a 28-trial pilot, too little to compare policies.
  run eval ruler "${gemma[@]}" "${hay[@]}" --policies "$gall" --ratio 0.2 --lengths 2048 \
    --trials 50 --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery,cwe,fwe
  # niah: needle and passkey at 4096 tokens, 512 slots in each global layer (12.5%; as many as a
  # sliding layer holds). The base model has no chat template: the prompts are plain text.
  run eval niah "${gemma[@]}" "${hay[@]}" --policies "$gall" --tasks needle,passkey \
    --lengths 4096 --depths 10,50,90 --trials 2 --budget 512
  # niah_long: 16K and 32K contexts (half and all of the trained context: 32752 prompt tokens leave
  # room for the answer within 32768) with a fixed budget of
  # 2048 slots per global layer (12.5% and 6.25%), the paper's fixed-budget setting. One shared
  # prompt pass per trial serves every policy; the prompt passes dominate (about 30 minutes).
  run eval niah "${gemma[@]}" "${hay[@]}" --name niah_long --policies "$gpol" \
    --tasks needle,passkey --lengths 16384,32752 --depths 10,50,90 --trials 2 --budget 2048
  # fidelity_bytes: equal KV bytes, 10% and 20% of the F16 full cache, every policy in F16, Q8_0
  # and rotated Q4_0. The 15 sliding layers hold 512 slots whatever the length, so a 10% share
  # exists only past 23,040 prompt tokens: 4 prompts of 24576, 32 teacher-forced tokens each
  # (about 28 minutes: three prompt passes of 24K tokens per prompt).
  run eval fidelity "${gemma[@]}" "${text[@]}" --name fidelity_bytes --bytes 0.1,0.2 \
    --kv-types f16,q8_0,q4_0r --prompt 24576 --samples 4 --continue 32 \
    --policies "full;h2o;snapkv;streaming;d2o:reading=paper;d2o:reading=paper,mass=on,nm=1:3"
elif [ $summary_only -eq 0 ]; then
  if [ $quick -eq 1 ]; then
    # The smoke subset: every protocol end to end on a small grid.
    # 300 tokens rather than --quick's 600: still past the capacity of 128 for every policy, and
    # this report was two thirds of the subset's time (23 token-by-token runs).
    run eval ppl --quick "${common[@]}" "${text[@]}" --policies "$all" --capacities 128,100000 \
      --tokens 300
    run eval fidelity --quick "${common[@]}" "${text[@]}" --policies "$all;d2o:budget=100000"
    run eval niah --quick "${common[@]}" "${hay[@]}" --policies "full;streaming;h2o;snapkv;pyramidkv;d2o" \
      --lengths 256,384
    run eval ruler --quick "${common[@]}" "${hay[@]}" --policies "full;streaming;h2o;d2o"
    run eval ablate --quick "${common[@]}" "${text[@]}" --samples 1 --continue 8
    run eval fidelity --quick "${common[@]}" "${text[@]}" --name fidelity_bytes --bytes 0.2,0.4 \
      --kv-types f16,q4_0r --policies "full;h2o;d2o:reading=paper"
  else
    # About 5 hours on 2 cores in all (each report's time: the run table of results_full.md).
    # ppl: the PG-19 protocol, token by token through 4096 tokens (half the trained context).
    run eval ppl "${common[@]}" "${text[@]}" --policies "$all$ada" --capacities 256,1024 --tokens 4096 --chunk 1
    # fidelity: 8 prompts of 2048 tokens, 96 teacher-forced tokens each, three ratios.
    run eval fidelity "${common[@]}" "${text[@]}" --policies "$all$ada" --ratios 0.2,0.4,0.8 \
      --prompt 2048 --samples 8 --continue 96
    # ablate: D2O's ablations with the fidelity protocol at rho = 0.2.
    run eval ablate "${common[@]}" "${text[@]}" --ratio 0.2 --prompt 2048 --samples 6 --continue 64
    # niah: the paper's setting is a fixed budget (8192 slots at 50K context); here 512 slots,
    # i.e. 50% of a 1K context down to 6% of the 8K trained context.
    run eval niah "${common[@]}" "${hay[@]}" --policies "$all" --tasks needle,passkey \
      --lengths 1024,2048,4096,8176 --depths 0,33,67,100 --trials 1 --budget 512
    # ruler: RULER-style tasks at 2K tokens, every policy at rho = 0.2, one shared prefill per
    # trial, 50 trials per task (300 in all, enough to resolve about 5 points). 48 trials with
    # these 14 policies took 4.5 minutes on 2 idle cores, so these take about 30. cwe is left
    # out: the full cache of this model scores 2% on it at 2K, too little to compare policies.
    run eval ruler "${common[@]}" "${hay[@]}" --policies "$all$ada" --ratio 0.2 --lengths 2048 \
      --trials 50 --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,fwe
    # ruler_4k: the same tasks at 4K tokens with 50 trials per task (300 in all, enough to resolve
    # about 5 points), the baselines that carry the verdicts, the paper's D2O and the corrected
    # combination with merge=sized. About 45 minutes on 2 cores (a 4K trial with 6 policies takes about 9 s).
    run eval ruler "${common[@]}" "${hay[@]}" --name ruler_4k --ratio 0.2 --lengths 4096 \
      --trials 50 --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,fwe \
      --policies "full;streaming;h2o;snapkv;d2o:reading=paper;d2o:reading=paper,mass=on,merge=sized,layers=uniform,nm=1:1"
    # ruler_8k: 8K tokens (the trained context), one task only (niah_single, 50 trials): an 8K
    # trial takes about 30 s with these policies, so the six tasks would take two and a half hours.
    run eval ruler "${common[@]}" "${hay[@]}" --name ruler_8k --ratio 0.2 --lengths 8192 \
      --trials 50 --tasks niah_single \
      --policies "full;streaming;h2o;snapkv;d2o:reading=paper;d2o:reading=paper,mass=on,merge=sized,layers=uniform,nm=1:1"
    # ruler_8k_more: two more tasks at 8K with the same policies, 50 trials each: niah_multikey
    # and fwe, whose full-cache scores at 4K (38% and 32%) leave room to tell policies apart (vt:
    # 7%). About 50 minutes on 2 cores.
    run eval ruler "${common[@]}" "${hay[@]}" --name ruler_8k_more --ratio 0.2 --lengths 8192 \
      --trials 50 --tasks niah_multikey,fwe \
      --policies "full;streaming;h2o;snapkv;d2o:reading=paper;d2o:reading=paper,mass=on,merge=sized,layers=uniform,nm=1:1"
    # ruler_8k_rest: the other three tasks of the 2K and 4K grids at 8K, so that every task has
    # run at every length: niah_multivalue, niah_multiquery and vt, 50 trials each, the same
    # policies. About 75 minutes on 2 cores. (vt's full-cache score at 4K, 7%, leaves little room.)
    run eval ruler "${common[@]}" "${hay[@]}" --name ruler_8k_rest --ratio 0.2 --lengths 8192 \
      --trials 50 --tasks niah_multivalue,niah_multiquery,vt \
      --policies "full;streaming;h2o;snapkv;d2o:reading=paper;d2o:reading=paper,mass=on,merge=sized,layers=uniform,nm=1:1"
    # Equal KV bytes, RULER (ruler_bytes at 20%, ruler_bytes_10 at 10% of the F16 full cache's
    # bytes): the tasks above with every policy in F16, Q8_0 and rotated Q4_0 storage, each
    # keeping what fits through the answer. About 15 minutes each on 2 cores (AVX2 kernels).
    # `d2o:merge=sized` was the `d2o` default when these two reports were recorded (they label
    # it `d2o`).
    rb=(--policies "full;h2o;snapkv;snapkv:kernel=21;streaming;d2o:merge=sized;d2o:reading=paper" --kv-types f16,q8_0,q4_0r
      --lengths 2048 --trials 8 --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,fwe)
    run eval ruler "${common[@]}" "${hay[@]}" --name ruler_bytes --bytes 0.2 "${rb[@]}"
    run eval ruler "${common[@]}" "${hay[@]}" --name ruler_bytes_10 --bytes 0.1 "${rb[@]}"
    # Equal KV bytes (fidelity_bytes): every policy in F16, Q8_0 and rotated Q4_0 storage, each
    # at the largest budget that fits 10% / 20% of the F16 full cache's key and value bytes; the
    # full caches in those types at their own bytes; H2O also in plain Q4_0. 8 to 16 minutes on
    # 2 busy cores.
    run eval fidelity "${common[@]}" "${text[@]}" --name fidelity_bytes --bytes 0.1,0.2 \
      --kv-types f16,q8_0,q4_0r --prompt 2048 --samples 6 --continue 64 \
      --policies "full;h2o;snapkv;streaming;d2o:merge=sized;d2o:reading=paper;d2o:reading=paper,mass=on,nm=1:3;h2o@q4_0"
  fi
fi

notes=()
[ -f "$repo/docs/research/results_notes.md" ] && [ $quick -eq 0 ] &&
  notes=(--notes "$repo/docs/research/results_notes.md")
# Image links relative to the page: results/ beside it, ../results/ from docs/research/.
mkdir -p "$(dirname "$page")"
imgs=$(realpath --relative-to="$(dirname "$page")" "$out")/
run eval summary --dir "$out" --output "$page" --image-prefix "$imgs" \
  --title "d2o evaluation results" "${notes[@]}"
# The Gemma 3 section: its own summary, every heading one level down, after SmolLM2's.
if [ $quick -eq 0 ] && compgen -G "$gout/*.json" >/dev/null; then
  gnotes=()
  gn=$repo/docs/research/results_gemma3_notes.md
  [ -f "$gn" ] && gnotes=(--notes "$gn")
  gpage=$(mktemp)
  trap 'rm -f "$gpage"' EXIT
  run eval summary --dir "$gout" --output "$gpage" \
    --image-prefix "$imgs$(basename "$gout")/" --title "Gemma 3 270M" "${gnotes[@]}"
  { echo; sed 's/^#/##/' "$gpage"; } >> "$page"
fi
echo "make_results: $page" >&2
exit
}
