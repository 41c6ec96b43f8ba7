"""
Second stability study: where the trust region matters. The axes are the ones a trust region exists for,
off-policy depth (optimiser steps per rollout) and stale rollouts (the sampler k steps behind the trainer, as in
an asynchronous system: `--rollout_lag`), on the embedded addition task on a CPU. The paper's claims:
  (a) ratio clipping mostly masks low-probability tokens, a divergence mask the tokens whose probability moved;
      judged here on the same mini-batches: every run logs which tokens the other rule would have masked;
  (b) without a trust region (PG-IS) training degrades as updates go off-policy, DPPO does not;
  (c) a trust region anchored to a recomputed "old" policy loses that protection once mu is stale.

The grid, written here before it was run (python experiments/offpolicy.py; resumable: finished runs are skipped;
--replot redraws the tables and figures from offpolicy.json):
  variants   dppo_tv      DPPO, binary TV, delta 0.15
             dppo_kl      DPPO, binary KL, delta 0.05
             ratio_clip   PPO/GRPO Clip-Higher, eps 0.2 / 0.28
             pg_is        the DPPO loss with delta = inf: importance-weighted policy gradient, no trust region
             dppo_tv_old  dppo_tv anchored to a trainer-recomputed old policy instead of mu
  depth      1, 4, 16 mini-batch updates per rollout of 16 prompts x 8 completions (mini-batches of 128, 32, 8)
  lag        0 and 2 (--rollout_lag: rollouts from the weights of 2 steps earlier)
  lr         LRS below: 1e-4 (the default run's) and one more, chosen by the pilot (--pilot) by this rule, fixed
             before the pilot ran: the smallest pilot lr at which PG-IS ends below its warm start while DPPO-TV does
             not; 2e-4 if there is none. Until LRS holds both, the grid refuses to run.
  seeds      0, 1, 2; two warm starts (600 supervised steps, model seeds 0 and 1): seed s starts from warm start s % 2
  fixed      40 RL steps; temperature 1; float32 sampler and trainer; 1,000 held-out prompts (standard error of an
             accuracy near 0.5: 0.016) evaluated every 5 steps.
Collapse, defined so that evaluation noise cannot produce it: the accuracy smoothed over 3 consecutive evaluations
falls 20 points below the best smoothed value the run reached before (a 20-point drop is > 10 standard errors of a
3-evaluation mean). Final accuracy = the mean of the last 3 evaluations. Added after the pilot, while the grid ran
and before any of its results were read: the tables also count the runs that end below their own start (a run that
degrades from step 0 never falls 20 points below a best).
Masked shares are token-weighted (each step's share weighted by its masked-token count), never averaged as fractions.
The pilot (--pilot, recorded in offpolicy_pilot.md): dppo_tv, ratio_clip and pg_is at depth 16, lag 2, seed 0,
lr 5e-5, 1e-4, 2e-4, 4e-4; it also measures the time per run, so the grid's budget (<= 75 minutes) is checked
before it runs. It ran before the grid: final accuracy from the warm start's 0.390 — lr 5e-5: 0.895 / 0.903 / 0.906
(dppo_tv / ratio_clip / pg_is); 1e-4: 0.736 / 0.839 / 0.713; 2e-4: 0.354 / 0.219 / 0.053; 4e-4: 0.021 / 0.006 /
0.000. No lr has PG-IS below the warm start with DPPO-TV above it (at 2e-4 both are below), so the rule gives
2e-4: LRS = 1e-4, 2e-4. 9-13 s a run: the 180 runs should take about 35 minutes.
Outputs in --out (default: this folder): offpolicy.md (tables), offpolicy_depth.png (b), offpolicy_masks.png (a),
offpolicy_anchor.png (c), offpolicy.json (one summary per run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dppo  # noqa: E402
from samplers import make_sampler  # noqa: E402
from stability import NAMES, VARIANTS as ALL_VARIANTS, config_kw, run_once  # noqa: E402  the first study's variants

VARIANTS = {v: ALL_VARIANTS[v] for v in ("dppo_tv", "dppo_kl", "ratio_clip", "pg_is", "dppo_tv_old")}
LRS = [1e-4, 2e-4]  # from the pilot by the docstring's rule (no pilot lr met it: 2e-4), committed before the grid
FULL = dict(depths=[1, 4, 16], lags=[0, 2], seeds=[0, 1, 2], warm_starts=2, steps=40, eval_every=5,
            prompts_per_step=16, group_size=8, eval_size=1000, warm_start_steps=600)
PILOT = dict(FULL, variants=["dppo_tv", "ratio_clip", "pg_is"], lrs=[5e-5, 1e-4, 2e-4, 4e-4], depths=[16], lags=[2],
             seeds=[0])
QUICK = dict(variants=["dppo_tv", "ratio_clip", "dppo_tv_old"], depths=[1, 2], lags=[2], seeds=[0, 1],
             warm_starts=2, steps=3, eval_every=1, prompts_per_step=4, group_size=4, eval_size=50,
             warm_start_steps=30, lrs=[1e-4])
SMOOTH, COLLAPSE_DROP = 3, 0.20


def run_grid(out: str, grid: dict, lrs: list) -> list[dict]:
    """Every run of the grid (those already finished are read back); one summary per run."""
    runs_dir = os.path.join(out, "runs", "offpolicy")
    warm = [dppo.warm_start_dir(os.path.join(runs_dir, f"warm{w}"), warm_start_steps=grid["warm_start_steps"], seed=w)
            for w in range(grid["warm_starts"])]
    jobs = [(v, m, k, lr, s) for lr in lrs for k in grid["lags"] for m in grid["depths"]
            for v in grid.get("variants", VARIANTS) for s in grid["seeds"]]
    summaries = []
    for i, (variant, depth, lag, lr, seed) in enumerate(jobs, 1):
        run_dir = os.path.join(runs_dir, f"{variant}-M{depth}-lag{lag}-lr{lr:g}-seed{seed}")
        cfg = dppo.Config(model=warm[seed % len(warm)], out_dir=run_dir, seed=seed, lr=lr, quiet=True,
                          num_minibatches=depth, steps=grid["steps"], eval_every=grid["eval_every"],
                          save_every=grid["steps"], prompts_per_step=grid["prompts_per_step"],
                          group_size=grid["group_size"], eval_size=grid["eval_size"], **config_kw(VARIANTS[variant]))
        sampler = make_sampler(lag=lag, anchor=VARIANTS[variant].get("anchor", "rollout"))
        summaries.append(s := run_once(run_dir, cfg, summarise, sampler, variant=variant, depth=depth,
                                       lag=lag, lr=lr,
                                       seed=seed, warm_start=seed % len(warm)))
        print(f"[{i}/{len(jobs)}] {os.path.basename(run_dir)}: {s['acc'][0][1]:.3f} -> {s['final']:.3f}"
              f"{' collapsed at step %d' % s['collapse_step'] if s['collapse_step'] else ''} ({s['seconds']:.0f} s)",
              flush=True)
    return summaries


def summarise(rows: list[dict]) -> dict:
    """Accuracy curve, smoothed final and best, collapse step, token-weighted masked shares and mismatch."""
    acc = [(r["step"], r["acc"]) for r in rows if "acc" in r]
    smooth = [(acc[j][0], sum(a for _, a in acc[j + 1 - SMOOTH:j + 1]) / SMOOTH) for j in range(SMOOTH - 1, len(acc))]
    collapse, best = None, -1.0
    for step, a in smooth:
        collapse = step if collapse is None and best - a >= COLLAPSE_DROP else collapse
        best = max(best, a)
    steps = [r for r in rows if "reward" in r]
    pooled = lambda k, w: (sum(r[k] * r[w] for r in steps) / n) if (n := sum(r[w] for r in steps)) else None  # noqa
    return dict(acc=acc, final=sum(a for _, a in acc[-SMOOTH:]) / len(acc[-SMOOTH:]), best=max(a for _, a in smooth),
                collapse_step=collapse, mismatch=sum(r["mismatch_dp_mean"] for r in steps) / len(steps),
                anchor_dp=pooled("anchor_dp_mean", "tokens") if "anchor_dp_mean" in steps[0] else None,
                masked=pooled("masked_frac", "tokens"), rival_masked=pooled("rival_masked_frac", "tokens"),
                low_mu=pooled("masked_low_mu", "tokens_masked"), masked_dp=pooled("masked_dp", "tokens_masked"),
                rival_low_mu=pooled("rival_masked_low_mu", "tokens_rival"),
                rival_dp=pooled("rival_masked_dp", "tokens_rival"),
                tokens_masked=sum(r["tokens_masked"] for r in steps),
                tokens_rival=sum(r["tokens_rival"] for r in steps))


def _cells(summaries, **match):
    return [s for s in summaries if all(s[k] == v for k, v in match.items())]


def _pooled_per_seed(summaries, variant, key, tokens) -> list:
    """Per seed: `key` pooled over every run of the variant, weighted by its `tokens` counts (None: no tokens)."""
    out = []
    for seed in sorted({s["seed"] for s in summaries}):
        ss = _cells(summaries, variant=variant, seed=seed)
        n = sum(s[tokens] for s in ss)
        out.append(sum((s[key] or 0) * s[tokens] for s in ss) / n if n else None)
    return out


def _spread(xs) -> str:
    xs = [x for x in xs if x is not None]
    return f"{sum(xs) / len(xs):.3f} ({min(xs):.2f}–{max(xs):.2f})" if xs else "–"


def tables(summaries: list[dict]) -> str:
    """Markdown: (b) final accuracy per cell; (a) the same-token mask comparison; (c) the anchors under lag."""
    lines = ["(b) Final accuracy (mean of the last 3 evaluations; mean over seeds, min–max) and collapses:", "",
             "| lr | lag | depth | variant | final acc | best (smoothed) | collapsed | ends below its start | "
             "first-mini-batch \\|π−μ\\| |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(s["lr"], s["lag"], s["depth"]) for s in summaries})
    for lr, lag, depth in keys:
        for v in VARIANTS:
            ss = _cells(summaries, lr=lr, lag=lag, depth=depth, variant=v)
            if ss:
                lines.append(f"| {lr:g} | {lag} | {depth} | {v} | {_spread([s['final'] for s in ss])} | "
                             f"{_spread([s['best'] for s in ss])} | {sum(bool(s['collapse_step']) for s in ss)}/"
                             f"{len(ss)} | {sum(s['final'] < s['acc'][0][1] for s in ss)}/{len(ss)} | "
                             f"{sum(s['mismatch'] for s in ss) / len(ss):.1e} |")
    lines += ["", "(a) On the same mini-batches: of the tokens each rule masks, the share with μ(a) < 0.15, and their "
              "mean |π − μ| (token-weighted over every step of every run of a seed; mean over seeds, min–max):",
              "",
              "| run's loss | its own mask: μ < 0.15 | its own: \\|Δp\\| | the other rule's: μ < 0.15 | "
              "the other's: \\|Δp\\| | masked tokens own / other |", "| --- | --- | --- | --- | --- | --- |"]
    for v in VARIANTS:
        n, nr = (sum(s[t] for s in _cells(summaries, variant=v)) for t in ("tokens_masked", "tokens_rival"))
        if n or nr:
            cols = [_pooled_per_seed(summaries, v, k, t) for k, t in [("low_mu", "tokens_masked"),
                    ("masked_dp", "tokens_masked"), ("rival_low_mu", "tokens_rival"), ("rival_dp", "tokens_rival")]]
            lines.append(f"| {v} | " + " | ".join(_spread(c) for c in cols) + f" | {n:.0f} / {nr:.0f} |")
    lines += ["", "(c) Rollout anchor (μ) against recomputed anchor (π_old) at lag 2: final accuracy, and the gap "
              "the recomputed anchor hides (mean |π_old − μ|):", "",
              "| lr | depth | dppo_tv final | dppo_tv_old final | first-mini-batch \\|π−μ\\| | "
              "\\|π_old − μ\\| |",
              "| --- | --- | --- | --- | --- | --- |"]
    for lr, lag, depth in keys:
        a, b = _cells(summaries, lr=lr, lag=lag, depth=depth, variant="dppo_tv"), \
            _cells(summaries, lr=lr, lag=lag, depth=depth, variant="dppo_tv_old")
        if lag and a and b:
            lines.append(f"| {lr:g} | {depth} | {_spread([s['final'] for s in a])} | "
                         f"{_spread([s['final'] for s in b])} | {sum(s['mismatch'] for s in a) / len(a):.1e} | "
                         f"{sum(s['anchor_dp'] or 0 for s in b) / len(b):.1e} |")
    return "\n".join(lines) + "\n"


def figures(summaries: list[dict], out: str) -> None:
    """(b) final accuracy against depth, per variant, rows lr, columns lag; (a) own vs other rule's low-mu share per
    seed; (c) the two anchors at lag 2 against depth. Points: seeds; lines: their mean."""
    from matplotlib.figure import Figure
    lrs, lags, depths = (sorted({s[k] for s in summaries}) for k in ("lr", "lag", "depth"))
    fig = Figure(figsize=(5.5 * len(lags), 3.8 * len(lrs) + 1))
    axes = fig.subplots(len(lrs), len(lags), squeeze=False, sharey=True)
    for r, lr in enumerate(lrs):
        for c, lag in enumerate(lags):
            ax = axes[r][c]
            for j, v in enumerate(VARIANTS):
                pts = [(d, [s["final"] for s in _cells(summaries, lr=lr, lag=lag, depth=d, variant=v)]) for d in depths]
                pts = [(d, f) for d, f in pts if f]
                if pts:
                    x = [d * (1 + 0.04 * (j - 2)) for d, _ in pts]  # a small offset per variant
                    ax.plot(x, [sum(f) / len(f) for _, f in pts], color=NAMES[v][1], marker="o", label=NAMES[v][0])
                    for xi, (_, f) in zip(x, pts):
                        ax.scatter([xi] * len(f), f, color=NAMES[v][1], s=8, alpha=0.5)
            ax.set(xscale="log", xticks=depths, xticklabels=[str(d) for d in depths], ylim=(0, 1),
                   xlabel="mini-batch updates per rollout", ylabel="final held-out accuracy",
                   title=f"lr {lr:g}, rollout lag {lag}")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle("(b) final accuracy against off-policy depth (line: mean over seeds; dots: seeds)", fontsize=11)
    fig.tight_layout(rect=(0, 0.9 / (3.8 * len(lrs) + 1), 1, 0.96))
    fig.savefig(os.path.join(out, "offpolicy_depth.png"), dpi=100)

    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    for j, v in enumerate(v for v in VARIANTS if v != "pg_is"):
        # Each bar in the colour of the rule whose mask it counts: the run's own rule, then the other rule
        # (ratio clipping beside a DPPO run, DPPO-TV beside ratio clipping), hatched as a counterfactual.
        other = "dppo_tv" if v == "ratio_clip" else "ratio_clip"
        pairs = [("low_mu", "tokens_masked", None, v), ("rival_low_mu", "tokens_rival", "//", other)]
        for k, (key, tokens, hatch, rule) in enumerate(pairs):
            vals = [x or 0.0 for x in _pooled_per_seed(summaries, v, key, tokens)]
            ax.bar(j * 3 + k, sum(vals) / len(vals), color=NAMES[rule][1], hatch=hatch, alpha=0.7)
            ax.scatter([j * 3 + k] * len(vals), vals, color="k", s=10)
    from matplotlib.patches import Patch
    rules = [v for v in VARIANTS if v != "pg_is"]
    handles = [Patch(color=NAMES[v][1], alpha=0.7, label=f"{NAMES[v][0]}'s own mask") for v in rules]
    handles.append(Patch(facecolor="white", edgecolor="k", hatch="//", label="hatched: the other rule's mask"))
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    ax.set_xticks([j * 3 + 0.5 for j in range(len(VARIANTS) - 1)],
                  [f"{v}\nown | other rule's" for v in VARIANTS if v != "pg_is"], fontsize=8)
    ax.set(ylabel="masked tokens with μ(a) < 0.15", title="(a) the same mini-batches: which tokens each rule masks\n"
           "(bar: mean over seeds; dots: seeds; hatched: the other rule's mask; colour: the rule that masks)")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "offpolicy_masks.png"), dpi=100)

    fig = Figure(figsize=(5.5 * len(lrs), 4))
    for ax, lr in zip(fig.subplots(1, len(lrs), squeeze=False)[0], lrs):
        for v in ("dppo_tv", "dppo_tv_old"):
            pts = [(d, [s["final"] for s in _cells(summaries, lr=lr, lag=max(lags), depth=d, variant=v)])
                   for d in depths]
            pts = [(d, f) for d, f in pts if f]
            if pts:
                ax.plot([d for d, _ in pts], [sum(f) / len(f) for _, f in pts], color=NAMES[v][1], marker="o",
                        label=NAMES[v][0])
                for d, f in pts:
                    ax.scatter([d] * len(f), f, color=NAMES[v][1], s=8, alpha=0.5)
        ax.set(xscale="log", xticks=depths, xticklabels=[str(d) for d in depths], ylim=(0, 1), title=f"lr {lr:g}",
               xlabel="mini-batch updates per rollout", ylabel="final held-out accuracy")
        ax.legend(fontsize=8)
    fig.suptitle(f"(c) rollout anchor vs recomputed anchor, rollout lag {max(lags)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "offpolicy_anchor.png"), dpi=100)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="where results are written")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--pilot", action="store_true", help="the recorded pilot that chooses the second lr")
    mode.add_argument("--quick", action="store_true", help="a miniature of the grid: checks that everything runs")
    mode.add_argument("--replot", action="store_true", help="redraw tables and figures from --out/offpolicy.json")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0, name = time.time(), "offpolicy_pilot" if a.pilot else "offpolicy"
    if a.replot:
        summaries = json.load(open(os.path.join(a.out, "offpolicy.json")))
    else:
        grid = PILOT if a.pilot else QUICK if a.quick else FULL
        lrs = grid.get("lrs", LRS)
        if not lrs or len(lrs) < 2 and grid is FULL:
            sys.exit("LRS is not set: run --pilot, apply the docstring's rule, commit LRS, then run the grid")
        summaries = run_grid(a.out, grid, lrs)
        with open(os.path.join(a.out, f"{name}.json"), "w") as f:
            json.dump(summaries, f, indent=1)
    text = tables(summaries)
    with open(os.path.join(a.out, f"{name}.md"), "w") as f:
        f.write(text)
    figures(summaries, a.out) if not a.pilot else None
    print(text)
    print(f"{len(summaries)} runs; this invocation took {time.time() - t0:.0f} s; "
          f"sum of run times {sum(s['seconds'] for s in summaries):.0f} s")
    return summaries


if __name__ == "__main__":
    main()
