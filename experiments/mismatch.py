"""
Third study: training-inference mismatch, the paper's own setting. The sampler computes mu at a lower precision than
the trainer computes pi (float32): a bf16 copy of the policy, or a simulated FP8 engine (`--rollout_dtype float8`:
linear weights rounded to float8 e4m3 per output channel after every sync, linear inputs per token). On the embedded
addition task on a CPU. Everything below was written, and committed, before the pilot or the grid ran.

The grid (python experiments/mismatch.py; resumable: finished runs are skipped; --replot redraws from mismatch.json):
  precision  float32 (mismatch ~1e-7: the control), bfloat16, float8 (the sampler's dtype; the trainer is float32)
  method     dppo_tv      DPPO, binary TV, delta 0.15
             dppo_kl      DPPO, binary KL, delta 0.05
             ratio_clip   PPO/GRPO Clip-Higher, eps 0.2 / 0.28, anchored to mu as sampled
             pg_is        the DPPO loss with delta = inf: importance-weighted policy gradient, no trust region
             pg_tis       pg_is with the weight capped at C = 3 (the paper's PG-TIS, which it identifies with CISPO)
             minirl       ratio_clip anchored to a trainer-recomputed old policy (the paper's MiniRL)
             dppo_tv_old  dppo_tv anchored to a trainer-recomputed old policy
  seeds      0-11, paired: seed s starts from warm start s % 6 (600 supervised steps, model seeds 0-5) with RL seed s,
             the same for every method and precision
  fixed      40 RL steps of 16 prompts x 8 completions, 4 mini-batch updates per rollout (the paper's setting),
             temperature 1, 1,000 held-out prompts evaluated every 5 steps; lr LR below, chosen by the pilot.
The pilot (--pilot, recorded in mismatch_pilot.md): ratio_clip with a float32 sampler, seeds 0 and 1, lr 1e-4, 2e-4,
4e-4, 8e-4. Its rule: LR = the largest pilot lr at which float32 ratio clip ends at or above its own start (final
accuracy >= step-0 accuracy) on both pilot seeds; 1e-4 if none does. The pilot also times the runs: if 252 runs
at its mean time per run (times 1.15 for bf16, float8 and the recomputed anchors) exceed 75 minutes, the grid is
trimmed before it runs by dropping dppo_kl first, then seeds 10-11.
The pilot ran before the grid (mismatch_pilot.md): float32 ratio clip from warm starts at 0.340 / 0.360 ended at
lr 1e-4: 0.952 / 0.966; 2e-4: 0.899 / 0.900; 4e-4: 0.447 / 0.426 (both collapsed on the way, at steps 35 and 15, yet
ended above their start); 8e-4: 0.007 / 0.000. The rule gives LR = 4e-4. Its projected grid time was 54 minutes
(runs slowed by other work on the machine while it ran; 7 s a run alone): no trimming.

Decision rules, fixed before any result of the pilot or the grid existed:
  Outcomes. Primary: final held-out accuracy F = the mean of the last 3 evaluations (steps 30, 35, 40). Secondary:
    the collapse step, the first evaluation at which accuracy is 20 points or more below the best the run reached
    before (the standard error of one evaluation near 0.5 is 0.016, so a 20-point fall is not evaluation noise).
  Paired differences. For methods A and B at one precision, d_s = F(A, s) - F(B, s) for s = 0..11; the 95 %
    interval is mean(d) +- 2.201 sd(d) / sqrt(12) (Student t, 11 degrees of freedom).
  Named comparisons, each reported at each precision whatever the outcome (12 intervals):
    (1) DPPO-TV - ratio clip;  (2) DPPO-TV - PG-IS;  (3) DPPO-TV - DPPO-TV on a recomputed anchor;
    (4) ratio clip - MiniRL (the same rule, rollout anchor vs recomputed anchor).
  Verdicts. "better": the interval's lower end > 0; "worse": its upper end < 0; "no difference": the whole interval
    lies inside [-0.02, +0.02] (within 2 points of accuracy); otherwise "undecided". No correction for the 12
    comparisons: with no effect anywhere, about 0.6 of them would be called better or worse by chance.
  The paper's predictions, tested as stated:
    (P1) "mismatch grows over training without a trust region and stays low with DPPO" (its Fig. 3): per run, the
         growth g = mean first-mini-batch |pi - mu| over steps 31-40 minus over steps 1-10. Holds at a precision if
         g's interval for pg_is and for pg_tis lies above 0 and the paired interval of g(pg_is) - g(dppo_tv) lies
         above 0. Judged at bfloat16 and float8 (at float32 the mismatch is rounding: reported only).
    (P2) "ratio clipping's masked tokens are mostly low-probability ones (mu < 0.15), DPPO's are not", on the same
         mini-batches: in every dppo_tv and ratio_clip run both rules' masks are computed on each mini-batch (the
         run's own and the other's counterfactual one). Per seed, pooled over the run's steps token-weighted: the
         share of ratio clipping's masked tokens with mu < 0.15, and DPPO-TV's. Holds if the ratio's share has an
         interval above 0.5 and the paired interval of (ratio's share - DPPO-TV's) lies above 0; judged at each
         precision, from the dppo_tv runs (their counterfactual ratio mask) and, separately, the ratio_clip runs.
    (P3) "a recomputed anchor lets the mismatch through": the trust region on a recomputed anchor cannot see
         |pi_old - mu|; holds at a precision if the paired interval of g(dppo_tv_old) - g(dppo_tv) lies above 0 and
         comparison (3) is "better". Reported with the mean |pi_old - mu| the recomputed anchor hides.
Re-measured with mini-batches of whole groups (--groups; written, and committed, before it ran). The grid above ran
when update_policy shuffled rows into its mini-batches; it now shuffles whole groups (a prompt's G completions
together, so that the update runs each prompt's forward once), which changes which rows share an optimiser step.
The headline cells are run again with the code as it is now, everything else as above (LR 4e-4 from the pilot, not
re-piloted): methods dppo_tv, ratio_clip, pg_is; all three precisions; seeds 0-11 from warm starts made again
(600 steps, seeds 0-5); 108 runs in runs/mismatch_groups. Reported in mismatch_groups.md, whichever way they fall:
per cell the mean final accuracy then and now, and comparisons (1) and (2) at each precision, then and now, with
the verdict rule above. The question: does any verdict of (1) or (2) change with whole-group mini-batches?
When it ran (added before it ran), the code also differed from the grid's in ways that change numbers only at
float32 rounding: each prompt's forward runs once in the update (the sampler already did so), and the RL
optimiser is the fused AdamW; and the warm starts are made on whatever processor runs it. Any of these can move
single runs (RL amplifies rounding), so a changed verdict is not attributed to whole groups alone.
Outputs in --out (default: this folder): mismatch.md (every table), mismatch.png (first-mini-batch |pi - mu| and
held-out accuracy over steps, per precision and method: mean over seeds), mismatch.json (one summary per run).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dppo  # noqa: E402
from samplers import make_sampler  # noqa: E402
from stability import config_kw, run_once  # noqa: E402  the first study's resumable run

METHODS = {
    "dppo_tv": dict(loss="dppo", divergence="binary_tv"),
    "dppo_kl": dict(loss="dppo", divergence="binary_kl"),
    "ratio_clip": dict(loss="ratio_clip"),
    "pg_is": dict(loss="dppo", divergence="binary_tv", delta_low=math.inf, delta_high=math.inf),
    "pg_tis": dict(loss="dppo", divergence="binary_tv", delta_low=math.inf, delta_high=math.inf, ratio_cap=3.0),
    "minirl": dict(loss="ratio_clip", anchor="recomputed"),
    "dppo_tv_old": dict(loss="dppo", divergence="binary_tv", anchor="recomputed"),
}
# One colour per method, the same in every figure of the project: blue DPPO-TV, orange ratio clipping.
NAMES = {"dppo_tv": ("DPPO-TV (δ 0.15)", "tab:blue"), "dppo_kl": ("DPPO-KL (δ 0.05)", "tab:green"),
         "ratio_clip": ("ratio clip (ε 0.2 / 0.28)", "tab:orange"), "pg_is": ("PG-IS: no trust region", "tab:red"),
         "pg_tis": ("PG-TIS / CISPO: weight capped at 3", "tab:purple"),
         "minirl": ("MiniRL: ratio clip, recomputed anchor", "tab:pink"),
         "dppo_tv_old": ("DPPO-TV, recomputed anchor", "tab:brown")}
PRECISIONS = ["float32", "bfloat16", "float8"]
LR = 4e-4  # from the pilot by the docstring's rule (mismatch_pilot.md), committed before the grid runs
FULL = dict(methods=list(METHODS), precisions=PRECISIONS, seeds=list(range(12)), warm_starts=6, steps=40,
            eval_every=5, prompts_per_step=16, group_size=8, eval_size=1000, warm_start_steps=600, depth=4)
GROUPS = dict(FULL, methods=["dppo_tv", "ratio_clip", "pg_is"])  # --groups: the headline cells again
PILOT = dict(FULL, methods=["ratio_clip"], precisions=["float32"], seeds=[0, 1], lrs=[1e-4, 2e-4, 4e-4, 8e-4])
QUICK = dict(methods=list(METHODS), precisions=PRECISIONS, seeds=[0, 1], warm_starts=2, steps=1, eval_every=1,
             prompts_per_step=4, group_size=4, eval_size=20, warm_start_steps=20, depth=2, lrs=[1e-4])
# Student t quantiles 0.975 by degrees of freedom (12 paired seeds: 11, t = 2.201); from any t table
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201}
COLLAPSE_DROP, LOW_MU = 0.20, 0.15
ACC_TOL = 1e-9  # accuracies are multiples of 1/eval_size: a drop of exactly 0.20 may subtract to 0.1999999...
COMPARISONS = [("dppo_tv", "ratio_clip"), ("dppo_tv", "pg_is"), ("dppo_tv", "dppo_tv_old"), ("ratio_clip", "minirl")]


def run_grid(out: str, grid: dict, lrs: list, name: str = "mismatch") -> list[dict]:
    """Every run of the grid (those already finished are read back); one summary per run."""
    runs_dir = os.path.join(out, "runs", name)
    warm = [dppo.warm_start_dir(os.path.join(runs_dir, f"warm{w}"), warm_start_steps=grid["warm_start_steps"], seed=w)
            for w in range(grid["warm_starts"])]
    jobs = [(m, p, lr, s) for lr in lrs for p in grid["precisions"] for m in grid["methods"] for s in grid["seeds"]]
    summaries = []
    for n, (method, precision, lr, seed) in enumerate(jobs, 1):
        run_dir = os.path.join(runs_dir, f"{method}-{precision}-lr{lr:g}-seed{seed}")
        cfg = dppo.Config(model=warm[seed % len(warm)], out_dir=run_dir, seed=seed, lr=lr, quiet=True,
                          num_minibatches=grid["depth"], steps=grid["steps"],
                          eval_every=grid["eval_every"], save_every=grid["steps"],
                          prompts_per_step=grid["prompts_per_step"], group_size=grid["group_size"],
                          eval_size=grid["eval_size"], **config_kw(METHODS[method]))
        s = run_once(run_dir, cfg, summarise, make_sampler(precision, anchor=METHODS[method].get("anchor", "rollout")),
                     method=method, precision=precision, lr=lr,
                     seed=seed, warm_start=seed % len(warm))
        summaries.append(s)
        fell = f" collapsed at step {s['collapse_step']}" if s["collapse_step"] else ""
        print(f"[{n}/{len(jobs)}] {os.path.basename(run_dir)}: {s['acc'][0][1]:.3f} -> {s['final']:.3f}{fell} "
              f"({s['seconds']:.0f} s)", flush=True)
    return summaries


def _pooled(rows: list[dict], key: str, weight: str):
    """sum(row[key] * row[weight]) / sum(row[weight]) over rows that have key; None when the weights sum to 0."""
    rows = [r for r in rows if key in r]
    total = sum(r[weight] for r in rows)
    if total == 0:
        return None
    return sum(r[key] * r[weight] for r in rows) / total


def collapse_step(acc: list) -> int | None:
    """The first evaluation step at which accuracy is COLLAPSE_DROP or more below the best before it (ACC_TOL: the
    comparison forgives float rounding, so 0.417 -> 0.217 is a drop of 0.20); None if there is none."""
    best = -1.0
    for step, a in acc:
        if best - a >= COLLAPSE_DROP - ACC_TOL:
            return step
        best = max(best, a)
    return None


def summarise(rows: list[dict]) -> dict:
    """One run's metrics.jsonl rows -> its accuracy curve, final accuracy, collapse step, mismatch curve and growth,
    and its own and the other rule's masked shares with mu < 0.15 (token-weighted over its steps)."""
    acc = [(r["step"], r["acc"]) for r in rows if "acc" in r]
    collapse = collapse_step(acc)
    steps = [r for r in rows if "reward" in r]
    mismatch = [(r["step"], r["mismatch_dp_mean"]) for r in steps]
    early = [m for step, m in mismatch if step <= 10]
    late = [m for step, m in mismatch if step > len(mismatch) - 10]
    own_low_mu = _pooled(steps, "masked_low_mu", "tokens_masked")
    rival_low_mu = _pooled(steps, "rival_masked_low_mu", "tokens_rival")
    return dict(acc=acc, final=sum(a for _, a in acc[-3:]) / len(acc[-3:]), collapse_step=collapse,
                mismatch=mismatch, growth=sum(late) / len(late) - sum(early) / len(early),
                anchor_dp=_pooled(steps, "anchor_dp_mean", "tokens"),
                masked=_pooled(steps, "masked_frac", "tokens"),
                own_low_mu=own_low_mu, rival_low_mu=rival_low_mu,
                tokens_masked=sum(r["tokens_masked"] for r in steps),
                tokens_rival=sum(r.get("tokens_rival", 0) for r in steps))


def _cells(summaries, **match) -> list[dict]:
    """The summaries whose fields equal match, sorted by seed."""
    return sorted((s for s in summaries if all(s[k] == v for k, v in match.items())), key=lambda s: s["seed"])


def interval(d: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % Student-t interval of paired differences d (n <= 12; n - 1 degrees of freedom)."""
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return mean, mean, mean
    half = T_975[n - 1] * statistics.stdev(d) / math.sqrt(n)
    return mean, mean - half, mean + half


def p_value(d: list[float]) -> float:
    """Two-sided p-value of the paired t test of mean(d) = 0 (n - 1 degrees of freedom): 1 - 2 * the integral of the
    Student t density from 0 to |t|, by Simpson's rule on 4,000 intervals (error far below 1e-6)."""
    n = len(d)
    sd = statistics.stdev(d)
    if sd == 0:
        return 0.0 if sum(d) else 1.0
    t, nu = abs(sum(d) / n) / (sd / math.sqrt(n)), n - 1
    const = math.exp(math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2)) / math.sqrt(nu * math.pi)

    def density(x):
        return const * (1 + x * x / nu) ** (-(nu + 1) / 2)
    steps = 4000
    h = t / steps
    area = density(0) + density(t) + sum((4 if k % 2 else 2) * density(k * h) for k in range(1, steps))
    return max(0.0, 1 - 2 * area * h / 3)


def holm(pvals: list[float]) -> list[float]:
    """Holm-adjusted p-values, in the input's order: the i-th smallest times (m - i + 1), kept non-decreasing, at most
    1. A comparison survives the correction at level 0.05 when its adjusted p-value is below 0.05."""
    m = len(pvals)
    order = sorted(range(m), key=lambda i: pvals[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvals[i]))
        adjusted[i] = running
    return adjusted


def verdict(lo: float, hi: float) -> str:
    """The docstring's verdict for a 95 % interval [lo, hi] of paired accuracy differences."""
    if lo > 0:
        return "better"
    if hi < 0:
        return "worse"
    if -0.02 <= lo and hi <= 0.02:
        return "no difference"
    return "undecided"


def paired(summaries, precision, a, b, key="final") -> list[float]:
    """Per seed, key of method a minus key of method b at one precision (only seeds both have)."""
    xa = {s["seed"]: s[key] for s in _cells(summaries, precision=precision, method=a)}
    xb = {s["seed"]: s[key] for s in _cells(summaries, precision=precision, method=b)}
    return [xa[s] - xb[s] for s in sorted(xa) if s in xb and xa[s] is not None and xb[s] is not None]


def _fmt(m, lo, hi, digits=3) -> str:
    return f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def tables(summaries: list[dict]) -> str:
    """Markdown: final accuracy per cell, the named comparisons, and the three predictions (P1-P3)."""
    precisions = [p for p in PRECISIONS if _cells(summaries, precision=p)]
    methods = [m for m in METHODS if _cells(summaries, method=m)]
    lines = ["Final held-out accuracy (mean of the last 3 evaluations; mean over seeds, min–max), collapses, and "
             "the first-mini-batch |π − μ| (mean over steps and seeds):", "",
             "| precision | method | start | final acc | collapsed | ends below its start | \\|π−μ\\| | "
             "growth g (steps 31–40 minus 1–10) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in precisions:
        for m in methods:
            ss = _cells(summaries, precision=p, method=m)
            if not ss:
                continue
            finals = [s["final"] for s in ss]
            start = sum(s["acc"][0][1] for s in ss) / len(ss)
            mis = sum(sum(x for _, x in s["mismatch"]) / len(s["mismatch"]) for s in ss) / len(ss)
            growth = sum(s["growth"] for s in ss) / len(ss)
            lines.append(f"| {p} | {m} | {start:.3f} | {sum(finals) / len(finals):.3f} ({min(finals):.2f}–"
                         f"{max(finals):.2f}) | {sum(bool(s['collapse_step']) for s in ss)}/{len(ss)} | "
                         f"{sum(s['final'] < s['acc'][0][1] for s in ss)}/{len(ss)} | {mis:.1e} | {growth:+.1e} |")
    lines += ["", "Named comparisons: paired differences of final accuracy over seeds, mean [95 % interval], and the "
              "verdict by the rules fixed before the runs:", "",
              "| precision | comparison | seeds | difference | verdict |", "| --- | --- | --- | --- | --- |"]
    for p in precisions:
        for a, b in COMPARISONS:
            d = paired(summaries, p, a, b)
            if d:
                m, lo, hi = interval(d)
                lines.append(f"| {p} | {a} − {b} | {len(d)} | {_fmt(m, lo, hi)} | {verdict(lo, hi)} |")
    lines += ["", "(P1) Mismatch growth g (mean first-mini-batch |π − μ| over the last 10 steps minus the first 10), "
              "mean [95 % interval] over seeds:", "",
              "| precision | g(pg_is) | g(pg_tis) | g(dppo_tv) | g(pg_is) − g(dppo_tv) | holds |",
              "| --- | --- | --- | --- | --- | --- |"]
    for p in precisions:
        cols, ok = [], True
        for m in ("pg_is", "pg_tis", "dppo_tv"):
            g = [s["growth"] for s in _cells(summaries, precision=p, method=m)]
            if g:
                gm, lo, hi = interval(g)
                cols.append(_fmt(gm, lo, hi, 4) if abs(gm) >= 1e-4 else f"{gm:+.1e} [{lo:+.1e}, {hi:+.1e}]")
                ok = ok and (lo > 0 or m == "dppo_tv")
            else:
                cols.append("–")
        d = paired(summaries, p, "pg_is", "dppo_tv", "growth")
        if d:
            dm, lo, hi = interval(d)
            cols.append(f"{dm:+.1e} [{lo:+.1e}, {hi:+.1e}]")
            ok = ok and lo > 0
        judged = "reported only (float32)" if p == "float32" else ("yes" if ok and d else "no")
        lines.append(f"| {p} | " + " | ".join(cols) + f" | {judged} |")
    lines += ["", "(P2) On the same mini-batches: the share of masked tokens with μ(a) < 0.15 under ratio clipping and "
              "under DPPO-TV (per seed pooled over the run's steps, token-weighted), mean [95 % interval] over seeds:",
              "", "| precision | runs of | ratio clip's mask | DPPO-TV's mask | ratio's − DPPO-TV's | tokens masked "
              "(ratio / DPPO-TV) | holds |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in precisions:
        for m in ("dppo_tv", "ratio_clip"):
            ss = [s for s in _cells(summaries, precision=p, method=m)
                  if s["own_low_mu"] is not None and s["rival_low_mu"] is not None]
            if not ss:
                continue
            own, rival = [s["own_low_mu"] for s in ss], [s["rival_low_mu"] for s in ss]
            ratio, tv = (rival, own) if m == "dppo_tv" else (own, rival)
            n_ratio = sum(s["tokens_rival" if m == "dppo_tv" else "tokens_masked"] for s in ss)
            n_tv = sum(s["tokens_masked" if m == "dppo_tv" else "tokens_rival"] for s in ss)
            r, dd = interval(ratio), interval([x - y for x, y in zip(ratio, tv)])
            holds = "yes" if r[1] > 0.5 and dd[1] > 0 else "no"
            lines.append(f"| {p} | {m} | {_fmt(*r)} | {_fmt(*interval(tv))} | {_fmt(*dd)} | "
                         f"{n_ratio:.0f} / {n_tv:.0f} | {holds} |")
    lines += ["", "(P3) A recomputed anchor: the gap it hides (mean |π_old − μ| over its steps) and the mismatch "
              "growth beside the rollout anchor's, mean [95 % interval] over seeds:", "",
              "| precision | \\|π_old − μ\\| hidden | g(dppo_tv_old) − g(dppo_tv) | comparison (3) | holds |",
              "| --- | --- | --- | --- | --- |"]
    for p in precisions:
        old = _cells(summaries, precision=p, method="dppo_tv_old")
        d = paired(summaries, p, "dppo_tv_old", "dppo_tv", "growth")
        f = paired(summaries, p, "dppo_tv", "dppo_tv_old")
        if old and d and f:
            hidden = sum(s["anchor_dp"] for s in old) / len(old)
            gm, glo, ghi = interval(d)
            fm, flo, fhi = interval(f)
            holds = "yes" if glo > 0 and verdict(flo, fhi) == "better" else "no"
            lines.append(f"| {p} | {hidden:.1e} | {gm:+.1e} [{glo:+.1e}, {ghi:+.1e}] | {_fmt(fm, flo, fhi)} "
                         f"({verdict(flo, fhi)}) | {holds} |")
    return "\n".join(lines) + "\n"


def figure(summaries: list[dict], path: str) -> None:
    """Top row: first-mini-batch |pi - mu| over steps; bottom row: held-out accuracy; one column per precision, one
    line per method (mean over seeds), colours as NAMES."""
    from matplotlib.figure import Figure
    precisions = [p for p in PRECISIONS if _cells(summaries, precision=p)]
    fig = Figure(figsize=(5 * len(precisions), 8))
    axes = fig.subplots(2, len(precisions), squeeze=False)
    for c, p in enumerate(precisions):
        for m in METHODS:
            ss = _cells(summaries, precision=p, method=m)
            if not ss:
                continue
            steps = [step for step, _ in ss[0]["mismatch"]]
            mis = [sum(s["mismatch"][j][1] for s in ss) / len(ss) for j in range(len(steps))]
            axes[0][c].plot(steps, mis, color=NAMES[m][1], label=NAMES[m][0], lw=1.2)
            evals = [step for step, _ in ss[0]["acc"]]
            acc = [sum(s["acc"][j][1] for s in ss) / len(ss) for j in range(len(evals))]
            axes[1][c].plot(evals, acc, color=NAMES[m][1], label=NAMES[m][0], marker="o", ms=3)
        axes[0][c].set(yscale="log", xlabel="RL step", ylabel="first-mini-batch mean |π − μ|",
                       title=f"{p} sampler, float32 trainer")
        axes[1][c].set(ylim=(0, 1), xlabel="RL step", ylabel="held-out greedy accuracy")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle("Training–inference mismatch by sampler precision (lines: mean over seeds)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=100)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="where results are written")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--pilot", action="store_true", help="the recorded pilot that chooses the learning rate")
    mode.add_argument("--quick", action="store_true", help="a miniature of the grid: checks that everything runs")
    mode.add_argument("--replot", action="store_true", help="redraw tables and figure from --out/mismatch.json")
    mode.add_argument("--groups", action="store_true", help="the headline cells again, mini-batches of whole groups")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0, name = time.time(), "mismatch_pilot" if a.pilot else "mismatch_groups" if a.groups else "mismatch"
    if a.groups:
        summaries = run_grid(a.out, GROUPS, [LR], name)
        with open(os.path.join(a.out, f"{name}.json"), "w") as f:
            json.dump(summaries, f, indent=1)
        text = groups_table(json.load(open(os.path.join(a.out, "mismatch.json"))), summaries)
        with open(os.path.join(a.out, f"{name}.md"), "w") as f:
            f.write(text)
        print(text)
        return summaries
    if a.replot:  # the collapse step recomputed from each run's stored accuracy curve, by the rule as it is now
        summaries = json.load(open(os.path.join(a.out, "mismatch.json")))
        for s in summaries:
            s["collapse_step"] = collapse_step(s["acc"])
    else:
        grid = PILOT if a.pilot else QUICK if a.quick else FULL
        lrs = grid.get("lrs", [LR] if LR else None)
        if not lrs:
            sys.exit("LR is not set: run --pilot, apply the docstring's rule, commit LR, then run the grid")
        summaries = run_grid(a.out, grid, lrs)
        with open(os.path.join(a.out, f"{name}.json"), "w") as f:
            json.dump(summaries, f, indent=1)
    if a.pilot:
        text = pilot_table(summaries)
    else:
        text = tables(summaries)
        figure(summaries, os.path.join(a.out, f"{name}.png"))
    with open(os.path.join(a.out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"{len(summaries)} runs; this invocation took {time.time() - t0:.0f} s; "
          f"sum of run times {sum(s['seconds'] for s in summaries):.0f} s")
    return summaries


def groups_table(then: list[dict], now: list[dict]) -> str:
    """--groups: mean final accuracy per cell and comparisons (1), (2), with row-shuffled mini-batches (then) and
    whole-group ones (now)."""
    lines = ["Mean final held-out accuracy over 12 seeds (min–max), mini-batches of shuffled rows (then) and of "
             "whole groups (now):", "", "| precision | method | then | now |", "| --- | --- | --- | --- |"]
    for p in PRECISIONS:
        for m in GROUPS["methods"]:
            cells = []
            for runs in (then, now):
                finals = [s["final"] for s in _cells(runs, precision=p, method=m)]
                cells.append(f"{sum(finals) / len(finals):.3f} ({min(finals):.3f}–{max(finals):.3f})")
            lines.append(f"| {p} | {m} | {cells[0]} | {cells[1]} |")
    lines += ["", "Comparisons (1) and (2): paired difference of final accuracy, 95 % t interval, verdict:", "",
              "| comparison | precision | then | now |", "| --- | --- | --- | --- |"]
    for a, b in COMPARISONS[:2]:
        for p in PRECISIONS:
            cells = []
            for runs in (then, now):
                m, lo, hi = interval(paired(runs, p, a, b))
                cells.append(f"{_fmt(m, lo, hi)} {verdict(lo, hi)}")
            lines.append(f"| {a} − {b} | {p} | {cells[0]} | {cells[1]} |")
    changed = [line for line in lines[-6:] if line.split("|")[3].split()[-1] != line.split("|")[4].split()[-1]]
    lines += ["", f"Verdicts that changed: {len(changed)} of 6."]
    return "\n".join(lines) + "\n"


def pilot_table(summaries: list[dict]) -> str:
    """The pilot's runs, the lr its rule picks, and the grid's projected time."""
    lines = ["| lr | seed | start | final | collapsed at | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for s in sorted(summaries, key=lambda s: (s["lr"], s["seed"])):
        lines.append(f"| {s['lr']:g} | {s['seed']} | {s['acc'][0][1]:.3f} | {s['final']:.3f} | "
                     f"{s['collapse_step'] or '–'} | {s['seconds']:.1f} |")
    held = [lr for lr in sorted({s["lr"] for s in summaries})
            if all(s["final"] >= s["acc"][0][1] for s in _cells(summaries, lr=lr))]
    per_run = sum(s["seconds"] for s in summaries) / len(summaries)
    lines += ["", f"The rule's lr: {max(held) if held else 1e-4:g} (ratio clip ends at or above its start on both "
              f"seeds at: {', '.join(f'{x:g}' for x in held) or 'none'}).",
              f"Projected grid time: 252 runs x {per_run:.1f} s x 1.15 = {252 * per_run * 1.15 / 60:.0f} minutes "
              f"(warm starts aside)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
