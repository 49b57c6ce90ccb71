#!/usr/bin/env python3
"""Both question settings side by side, from reports `d2o eval` wrote into one folder.

  scripts/question_settings.py DIR [--ref d2o]

reads DIR/ruler_before.json and DIR/ruler_after.json (`d2o eval ruler --question before|after`,
the same policies, seed and lengths), and, when present, DIR/fidelity.json and
DIR/fidelity_turn.json (`d2o eval fidelity` without and with `--continue-turn`), and prints
Markdown tables: per policy its RULER-style score in each setting (mean ± standard error over
trials, and its share of the full cache's score), its fidelity KL in each, and the paired
difference to the reference policy (--ref, default d2o) with a verdict: W (the reference is
better beyond two standard errors), L (worse) or T (a tie). Differences are paired by trial
(RULER) or by text window (fidelity), within one setting.
"""
import argparse
import json
import math
import os
import sys


def mean_se(xs):
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def verdict(diff, se, higher_is_better):
    """W: the reference is better beyond 2 SE; L: worse; T: neither."""
    if not (se > 0):
        return "T" if diff == 0 else ("W" if (diff > 0) == higher_is_better else "L")
    if abs(diff) <= 2 * se:
        return "T"
    return "W" if (diff > 0) == higher_is_better else "L"


def load(path):
    with open(path) as f:
        return json.load(f)


def ruler_scores(report):
    """{label: [score per trial]} in trial order."""
    labels = [p["label"] for p in report["policies"]]
    out = {l: [] for l in labels}
    for t in report["trials"]:
        for l, s in zip(labels, t["scores"]):
            out[l].append(s)
    return labels, out


def fidelity_kl(report):
    """{row label: [KL per window]} for the cases of one column."""
    return {c["row"]: c["per_sample"]["kl"] for c in report["cases"]}


def paired(ref, other, higher_is_better):
    d = [a - b for a, b in zip(ref, other)]
    m, se = mean_se(d)
    return m, se, verdict(m, se, higher_is_better)


def fmt(m, se, scale=1.0, digits=1):
    if math.isnan(se):
        return f"{m * scale:.{digits}f}"
    return f"{m * scale:.{digits}f} ± {se * scale:.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--ref", default="d2o", help="the policy the others are compared with")
    a = ap.parse_args()
    before_p = os.path.join(a.dir, "ruler_before.json")
    after_p = os.path.join(a.dir, "ruler_after.json")
    if not (os.path.exists(before_p) and os.path.exists(after_p)):
        sys.exit(f"question_settings: {a.dir} needs ruler_before.json and ruler_after.json")
    rb, ra = load(before_p), load(after_p)
    lb, sb = ruler_scores(rb)
    la, sa = ruler_scores(ra)
    if lb != la or len(sb[lb[0]]) != len(sa[la[0]]):
        sys.exit("question_settings: the two RULER reports have different policies or trials")
    if a.ref not in sb or "full" not in sb:
        sys.exit(f"question_settings: the reports need the full cache and '{a.ref}'")
    fb = sb["full"]
    fa = sa["full"]
    print(f"RULER-style score, % (`{rb['params']['compression']}`, lengths "
          f"{rb['params']['lengths']}, {len(fb)} trials; {rb['meta']['model']['name']}, "
          f"{rb['meta']['kernels']} kernels). Share = of the full cache's score in that setting; "
          f"vs {a.ref} = {a.ref} minus the policy, paired by trial, points.\n")
    print(f"| policy | before | share | vs {a.ref} | after | share | vs {a.ref} |")
    print("|---|---:|---:|---|---:|---:|---|")
    full_b, full_a = mean_se(fb)[0], mean_se(fa)[0]
    for l in lb:
        mb, seb = mean_se(sb[l])
        ma, sea = mean_se(sa[l])
        cells = [l, fmt(mb, seb, 100), f"{100 * mb / full_b:.0f}%" if full_b > 0 else "-"]
        for scores, ref in ((sb, sb[a.ref]), (sa, sa[a.ref])):
            if l == a.ref:
                cells.append("")
            else:
                d, se, v = paired(ref, scores[l], True)
                cells.append(f"{v} {fmt(d, se, 100)}")
            if scores is sb:
                cells += [fmt(ma, sea, 100), f"{100 * ma / full_a:.0f}%" if full_a > 0 else "-"]
        print("| " + " | ".join(cells) + " |")
    fid_p = os.path.join(a.dir, "fidelity.json")
    turn_p = os.path.join(a.dir, "fidelity_turn.json")
    if os.path.exists(fid_p) and os.path.exists(turn_p):
        kb, kt = fidelity_kl(load(fid_p)), fidelity_kl(load(turn_p))
        if a.ref in kb and a.ref in kt:
            fp = load(fid_p)["params"]
            print(f"\nFidelity, KL(full ‖ policy) in nats per token ({len(kb[a.ref])} windows of "
                  f"{fp['prompt_len']} + {fp['n_continue']} tokens): the continuation goes on "
                  f"the text (plain), or begins with a new user turn (turn). vs {a.ref} = the "
                  f"policy minus {a.ref}, paired by window (W: {a.ref} lower).\n")
            print(f"| policy | plain | vs {a.ref} | turn | vs {a.ref} |")
            print("|---|---:|---|---:|---|")
            for l in kb:
                if l not in kt:
                    continue
                cells = [l]
                for k in (kb, kt):
                    m, se = mean_se(k[l])
                    cells.append(fmt(m, se, 1, 4))
                    if l == a.ref:
                        cells.append("")
                    else:
                        d, se2, v = paired(k[l], k[a.ref], True)
                        cells.append(f"{v} {fmt(d, se2, 1, 4)}")
                print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
