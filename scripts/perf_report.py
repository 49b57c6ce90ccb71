#!/usr/bin/env python3
"""Writes docs/performance.md from the raw results of scripts/compare_llama_bench.sh.

Inputs (in --raw): llama_<test>_d<depth>_fa<0|1>.json (llama-bench -o json), d2o_<test>_d<depth>_
kv<i>.json (d2o bench --json), d2o_prefill_kv<i>_<round>.json (the prefill check), membw.json
(d2o bench --mem-bw), meta.txt, kv_specs.txt. Ratios are d2o / llama.cpp at llama.cpp's best
flash-attention setting for that row.
"""
import argparse
import glob
import json
import os
import re
import statistics


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cmd", default="scripts/compare_llama_bench.sh")
    ap.add_argument("--notes", help="Markdown appended after the generated sections")
    ap.add_argument("--preface", help="Markdown inserted after the introduction (e.g. a summary of the run)")
    a = ap.parse_args()

    meta = {}
    with open(os.path.join(a.raw, "meta.txt")) as f:
        for line in f:
            k, _, v = line.partition(":")
            meta[k.strip()] = v.strip()
    with open(os.path.join(a.raw, "kv_specs.txt")) as f:
        specs = [line.strip() for line in f if line.strip()]
    membw = load(os.path.join(a.raw, "membw.json"))
    bw = membw["read_bandwidth_bytes_per_s"] if membw else None

    # llama.cpp: (kind, n, depth) -> {fa: (avg, std)}
    llama = {}
    llama_build = None
    for path in glob.glob(os.path.join(a.raw, "llama_*.json")):
        m = re.search(r"llama_(pp|tg)(\d+)_d(\d+)_fa(\d)\.json$", path)
        data = load(path)
        if not m or not data:
            continue
        kind, n, d, fa = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        for t in data:
            llama_build = t.get("build_commit", llama_build)
            llama.setdefault((kind, n, d), {})[fa] = (t["avg_ts"], t["stddev_ts"])
    # d2o: (kind, n, depth) -> {spec index: result}
    d2o = {}
    d2o_doc = None
    for path in glob.glob(os.path.join(a.raw, "d2o_*_kv*.json")):
        m = re.search(r"d2o_(pp|tg)(\d+)_d(\d+)_kv(\d+)\.json$", path)
        data = load(path)
        if not m or not data:
            continue
        d2o_doc = d2o_doc or data
        kind, n, d, i = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        for r in data["results"]:
            d2o.setdefault((kind, n, d), {})[i] = r

    keys = sorted(set(llama) | set(d2o), key=lambda k: (k[2], k[0] != "pp", k[1]))
    fas = sorted({fa for v in llama.values() for fa in v})
    L = []
    L.append("# Performance: d2o against llama.cpp\n")
    L.append(
        "Throughput of d2o and llama.cpp's `llama-bench` on the same GGUF, threads and context depths, "
        "measured side by side by `scripts/compare_llama_bench.sh` (the two programs alternate per "
        "configuration, so a change of machine load hits both). `pp N`: one forward pass of N prompt "
        "tokens; `tg N`: N decoding steps of one token; `@ dD`: after D tokens of context were prefilled "
        "(untimed). d2o's KV policies apply to the depth prefill as to a prompt (prompt-then-compress): "
        "`d2o:ratio=0.2` keeps 20% of the depth's KV slots, then decodes with a fixed budget. "
        "Figures are tokens/s, mean ± standard deviation over the repetitions; ratios are d2o / "
        "llama.cpp at llama.cpp's better flash-attention setting for that row.\n"
    )
    if a.preface:
        with open(a.preface) as f:
            L.append(f.read().rstrip() + "\n")
    L.append("## Machine and run\n")
    L.append(f"- CPU: {meta.get('cpu', '?')}, {meta.get('cores', '?')} vCPUs; flags: {meta.get('flags', '?')}")
    if bw:
        L.append(f"- Memory read bandwidth measured before the run (`d2o bench --mem-bw -t {meta.get('threads')}`): "
                 f"{bw / 1e9:.1f} GB/s")
    L.append(f"- Date: {meta.get('date', '?')}; load average (1, 5, 15 min) before: {meta.get('load_before', '?')}, "
             f"after: {meta.get('load_after', '?')}. The machine is shared: absolute figures vary with the load, "
             "ratios from one interleaved run are what counts.")
    L.append(f"- d2o commit {meta.get('d2o_commit', '?')}; llama.cpp build {llama_build or '?'} "
             f"(`{os.path.basename(meta.get('llama_bench', 'llama-bench'))}`, weights loaded with `{meta.get('no_mmap', '?')}`"
             + (f", extra options `{meta['llama_extra']}`" if meta.get("llama_extra", "none") != "none" else "") + ")")
    if meta.get("nice", "0") != "0":
        L.append(f"- Both programs ran under `nice -n {meta['nice']}` (other jobs on the machine took less CPU from "
                 "both alike).")
    L.append(f"- Model: `{os.path.basename(meta.get('model', '?'))}`; {meta.get('threads', '?')} threads; "
             f"{meta.get('reps', '?')} repetitions per figure; F16 KV cache in both.\n")

    # Main table.
    head = ["test"] + [f"llama.cpp fa={fa}" for fa in fas]
    for i, s in enumerate(specs):
        head += [f"d2o `{s}`", "ratio"]
    head += ["d2o KV MiB"]
    L.append("## Throughput\n")
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    ratios = {}
    for key in keys:
        kind, n, d = key
        name = f"{kind}{n}" + (f" @ d{d}" if d else "")
        row = [name]
        lv = llama.get(key, {})
        for fa in fas:
            row.append(f"{fmt(lv[fa][0])} ± {fmt(lv[fa][1])}" if fa in lv else "-")
        best = max((v[0] for v in lv.values()), default=None)
        kvs = []
        for i, s in enumerate(specs):
            r = d2o.get(key, {}).get(i)
            if r is None:
                row += ["-", "-"]
                continue
            ratio = r["avg_ts"] / best if best else None
            ratios[(key, i)] = ratio
            row += [f"{fmt(r['avg_ts'])} ± {fmt(r['stddev_ts'])}", fmt(ratio)]
            kvs.append(f"{r['kv_bytes_used'] / 2**20:.1f}")
        row.append(" / ".join(kvs) if kvs else "-")
        L.append("| " + " | ".join(row) + " |")
    L.append("")
    L.append("`d2o KV MiB`: K and V bytes holding slots after the test, per policy in column order (a full "
             "cache of the same tokens is the first figure).\n")

    # Acceptance figures.
    def ratio_of(kind, n, d, i):
        return ratios.get(((kind, n, d), i))

    L.append("## Targets\n")
    L.append("| target | figure | met |")
    L.append("|---|---:|:---:|")
    pp = sorted({k[1] for k in keys if k[0] == "pp"})
    tg = sorted({k[1] for k in keys if k[0] == "tg"})
    depths = sorted({k[2] for k in keys})
    full_i = specs.index("full") if "full" in specs else None
    comp_i = next((i for i, s in enumerate(specs) if s != "full"), None)
    if full_i is not None and pp and 0 in depths:
        x = ratio_of("pp", pp[-1], 0, full_i)
        L.append(f"| pp{pp[-1]} at depth 0, d2o / llama.cpp >= 0.8 | {fmt(x)} | {'yes' if x and x >= 0.8 else 'no'} |")
    if full_i is not None and tg and 0 in depths:
        x = ratio_of("tg", tg[-1], 0, full_i)
        L.append(f"| tg{tg[-1]} at depth 0, d2o / llama.cpp >= 0.9 | {fmt(x)} | {'yes' if x and x >= 0.9 else 'no'} |")
    dmax = depths[-1] if depths else None
    if full_i is not None and tg and dmax:
        x = ratio_of("tg", tg[-1], dmax, full_i)
        L.append(f"| tg{tg[-1]} at depth {dmax}, full cache, d2o / llama.cpp >= 1.0 | {fmt(x)} | "
                 f"{'yes' if x and x >= 1.0 else 'no'} |")
    if comp_i is not None and tg and dmax:
        x = ratio_of("tg", tg[-1], dmax, comp_i)
        L.append(f"| tg{tg[-1]} at depth {dmax}, d2o `{specs[comp_i]}` / llama.cpp full cache >= 2.5 | {fmt(x)} | "
                 f"{'yes' if x and x >= 2.5 else 'no'} |")
    # Prefill cost of the compressing policy against the full cache (alternating single runs).
    pre = {}
    for path in glob.glob(os.path.join(a.raw, "d2o_prefill_kv*_*.json")):
        m = re.search(r"d2o_prefill_kv(\d+)_(\d+)\.json$", path)
        data = load(path)
        if m and data:
            for r in data["results"]:
                pre.setdefault(int(m.group(1)), []).append(r["samples_s"][0])
    prefill_note = None
    if full_i in pre and comp_i in pre:
        tf, tc = statistics.mean(pre[full_i]), statistics.mean(pre[comp_i])
        n_pre = d2o_prefill_n(a.raw)
        x = tc / tf
        L.append(f"| prefill of {n_pre} tokens, `{specs[comp_i]}` (statistics and compaction included) / full "
                 f"cache <= 1.10 | {fmt(x, 3)} | {'yes' if x <= 1.10 else 'no'} |")
        prefill_note = (f"Prefill check: `d2o bench -p {n_pre} -n 0 -r 1`, alternating the policies "
                        f"{len(pre[full_i])} times each: full cache {tf:.2f} s, `{specs[comp_i]}` {tc:.2f} s "
                        f"(mean). ")
    L.append("")
    if prefill_note:
        L.append(prefill_note + "\n")

    # Bytes per decoded token.
    if d2o_doc:
        wbytes = d2o_doc["model_bytes"]
        per_tok = d2o_doc["kv_bytes_per_token"]
        L.append("## Bytes moved per decoded token\n")
        L.append(
            "A decoding step reads every weight once (the tied output matrix included) and the whole KV "
            "cache once. Weights: " + f"{wbytes / 1e6:.1f} MB. KV: {per_tok} bytes per cached token (F16, all "
            "layers), read over the average context of the tg run (depth + n/2) for a full cache, or the "
            "slots d2o's policy keeps. `GB/s` is bytes per token times tokens/s; `% bw` compares it with "
            "the measured read bandwidth" + (f" ({bw / 1e9:.1f} GB/s)" if bw else "") + ". Weights that stay in "
            "the caches between tokens (L2 + L3 hold a good part of a 92 MB model) can push this above 100%.\n")
        head = ["test", "program", "t/s", "weights MB", "KV MB", "MB/token", "GB/s", "% bw"]
        L.append("| " + " | ".join(head) + " |")
        L.append("|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|")
        for key in keys:
            kind, n, d = key
            if kind != "tg":
                continue
            name = f"tg{n}" + (f" @ d{d}" if d else "")
            ctx = d + n / 2
            rows = []
            lv = llama.get(key, {})
            if lv:
                fa, (ts, _) = max(lv.items(), key=lambda kv: kv[1][0])
                rows.append((f"llama.cpp fa={fa}", ts, per_tok * ctx))
            for i, s in enumerate(specs):
                r = d2o.get(key, {}).get(i)
                if r is None:
                    continue
                kv = per_tok * ctx if s == "full" else r["kv_bytes_used"]
                rows.append((f"d2o `{s}`", r["avg_ts"], kv))
            for prog, ts, kv in rows:
                tot = wbytes + kv
                gbs = tot * ts / 1e9
                L.append(f"| {name} | {prog} | {ts:.1f} | {wbytes / 1e6:.1f} | {kv / 1e6:.1f} | {tot / 1e6:.1f} | "
                         f"{gbs:.1f} | {fmt(100 * gbs * 1e9 / bw, 0) if bw else '-'} |")
        L.append("")

    # Where d2o's decoding time goes (engine timers, summed over the repetitions).
    split_rows = []
    for key in keys:
        kind, n, d = key
        if kind != "tg":
            continue
        for i, s in enumerate(specs):
            r = d2o.get(key, {}).get(i)
            if r is None or "engine_s" not in r:
                continue
            tokens = n * len(r["samples_s"])
            e = r["engine_s"]
            ms = {k: 1e3 * e.get(k, 0.0) / tokens for k in ("matmul", "attention", "policy", "other")}
            wall = 1e3 * sum(r["samples_s"]) / tokens
            split_rows.append(f"| tg{n}" + (f" @ d{d}" if d else "") + f" | `{s}` | {wall:.2f} | {ms['matmul']:.2f} | "
                              f"{ms['attention']:.2f} | {ms['policy']:.2f} | {ms['other']:.2f} |")
    if split_rows:
        L.append("## Where d2o's decoding time goes\n")
        L.append("Milliseconds per decoded token from the engine's own timers (mean over the repetitions): "
                 "`matmul` = all weight matrix products (the output layer included), `attention` = the "
                 "attention kernel (with the statistics a policy asks for), `policy` = the policy's "
                 "bookkeeping and compaction, `other` = norms, RoPE, activations, copies.\n")
        L.append("| test | kv | ms/token | matmul | attention | policy | other |")
        L.append("|---|---|---:|---:|---:|---:|---:|")
        L.extend(split_rows)
        L.append("")

    L.append("## How to reproduce\n")
    L.append("```sh")
    L.append("cmake -S . -B build -DD2O_WERROR=ON && cmake --build build -j2")
    L.append("LLAMA_BENCH=/path/to/llama-bench LLAMA_LIB=/path/to/llama.cpp/libs \\")
    L.append(f"  {a.cmd}")
    L.append("```")
    L.append("The script never builds or downloads llama.cpp. Raw JSON of every run is kept in `build/perf-compare/`. "
             "For one program alone: `build/d2o bench -p 512 -n 128 -d 0,8192 --kv full --kv d2o:ratio=0.2 -r 3 -t 2` "
             "and `llama-bench -m MODEL -p 512 -n 128 -d 0,8192 -fa 0,1 -t 2 -lm none` (`-mmp 0` in older versions).\n")
    if a.notes:
        with open(a.notes) as f:
            L.append(f.read().rstrip() + "\n")
    with open(a.out, "w") as f:
        f.write("\n".join(L))


def d2o_prefill_n(raw):
    for path in glob.glob(os.path.join(raw, "d2o_prefill_kv*_*.json")):
        data = load(path)
        if data and data["results"]:
            return data["results"][0]["n"]
    return "?"


if __name__ == "__main__":
    main()
