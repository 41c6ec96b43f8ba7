"""
Stability study at toy scale: does DPPO's trust region hold up where ratio clipping or no trust region do not,
once the sampler and the trainer disagree and the updates go off-policy? The paper's claims, tested on the
embedded addition task on a CPU:
  (a) ratio clipping mostly blocks low-probability tokens (paper: most clipped tokens have mu < 0.15), a
      divergence mask blocks the tokens that moved probability mass;
  (b) without a trust region (PG-IS) or with a truncated weight (PG-TIS) training destabilises as mismatch and
      off-policyness grow, while DPPO stays stable;
  (c) anchoring the trust region to a recomputed "old" policy instead of mu loses that protection.

The grid, written here before it was run (python experiments/stability.py; resumable: finished runs are
skipped; --replot redraws the table and figure from stability.json):
  variants  dppo_tv      DPPO, binary TV, delta 0.15
            dppo_kl      DPPO, binary KL, delta 0.05
            ratio_clip   PPO/GRPO Clip-Higher, eps 0.2 / 0.28
            pg_is        the DPPO loss with delta = inf: importance-weighted policy gradient, no trust region
            pg_tis       pg_is with the weight capped at 5 (truncated IS)
            dppo_tv_old  dppo_tv anchored to a trainer-recomputed old policy instead of mu
  mismatch  off (float32 rollouts, |pi - mu| ~ 1e-7) and on (a bf16 copy of the policy samples)
  lr        3e-4 and 6e-4 (a first probe: 3e-4 already strains every variant, 1e-3 collapses all in 10 steps)
  seeds     0, 1, 2 (the RL seed; all runs start from one warm start, the default 600 steps)
  fixed     60 RL steps, 32 prompts x 8 completions, 8 mini-batch updates per rollout, eval every 5 steps
A run collapses when its held-out accuracy falls 30 points below the best it reached before; the table gives
how many of the 3 seeds did and the mean step at which they did.
Outputs: stability.md (the tables), stability.png (accuracy curves, mean and min-max band over seeds),
stability.json (one summary per run), all in --out (default: this folder).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
import dppo  # noqa: E402
from compare import compared_loss, with_shares  # noqa: E402
from samplers import make_sampler  # noqa: E402

VARIANTS = {
    "dppo_tv": dict(loss="dppo", divergence="binary_tv"),
    "dppo_kl": dict(loss="dppo", divergence="binary_kl"),
    "ratio_clip": dict(loss="ratio_clip"),
    "pg_is": dict(loss="dppo", divergence="binary_tv", delta_low=math.inf, delta_high=math.inf),
    "pg_tis": dict(loss="dppo", divergence="binary_tv", delta_low=math.inf, delta_high=math.inf, ratio_cap=5.0),
    "dppo_tv_old": dict(loss="dppo", divergence="binary_tv", anchor="recomputed"),
}
MISMATCH = {"off": "float32", "on": "bfloat16"}
FULL = dict(lrs=[3e-4, 6e-4], seeds=[0, 1, 2], steps=60, eval_every=5, prompts_per_step=32, group_size=8,
            num_minibatches=8, warm_start_steps=600)
QUICK = dict(lrs=[3e-4], seeds=[0], steps=3, eval_every=3, prompts_per_step=8, group_size=4, num_minibatches=2,
             warm_start_steps=50)
COLLAPSE_DROP = 0.30


def config_kw(variant: dict) -> dict:
    """A variant's dppo.Config fields (its anchor is the sampler's business: samplers.make_sampler)."""
    return {k: v for k, v in variant.items() if k != "anchor"}


def run_once(run_dir: str, cfg, summarise, sampler=None, **meta) -> dict:
    """One resumable run: trained (afresh) unless run_dir/summary.json exists, sampling with `sampler` (None: the
    policy itself), both rules' masks compared on its tokens (compare.py); its summary = summarise(metrics rows) |
    meta. A RecomputedAnchor's per-rollout gap replaces the steps' mismatch_dp_* (which its loss measured against
    pi_old) and adds anchor_dp_mean, as a study reads them."""
    done = os.path.join(run_dir, "summary.json")
    if not os.path.exists(done):
        t0 = time.time()
        dppo.train(dataclasses.replace(cfg, overwrite=True), sampler=sampler, loss_fn=compared_loss)
        rows = [with_shares(json.loads(line)) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        for row, gap in zip([r for r in rows if "reward" in r], getattr(sampler, "log", [])):
            row.update(gap)
        json.dump(summarise(rows) | meta | dict(seconds=time.time() - t0), open(done, "w"))
    return json.load(open(done))


def run_grid(out: str, grid: dict) -> list[dict]:
    """Every run of the grid (skipping those already finished); returns one summary per run."""
    runs_dir = os.path.join(out, "runs")
    warm = dppo.warm_start_dir(os.path.join(runs_dir, "warm"), warm_start_steps=grid["warm_start_steps"])
    jobs = [(v, mm, lr, seed) for lr in grid["lrs"] for mm in MISMATCH for v in VARIANTS for seed in grid["seeds"]]
    summaries = []
    for i, (variant, mm, lr, seed) in enumerate(jobs, 1):
        name = f"{variant}-mismatch_{mm}-lr{lr:g}-seed{seed}"
        run_dir = os.path.join(runs_dir, name)
        cfg = dppo.Config(model=warm, out_dir=run_dir, seed=seed, lr=lr, quiet=True,
                          steps=grid["steps"], eval_every=grid["eval_every"],
                          save_every=grid["steps"], prompts_per_step=grid["prompts_per_step"],
                          group_size=grid["group_size"], num_minibatches=grid["num_minibatches"],
                          **config_kw(VARIANTS[variant]))
        sampler = make_sampler(MISMATCH[mm], anchor=VARIANTS[variant].get("anchor", "rollout"))
        summaries.append(s := run_once(run_dir, cfg, summarise, sampler, variant=variant,
                                       mismatch=mm, lr=lr, seed=seed))
        print(f"[{i}/{len(jobs)}] {name}: acc {s['acc'][0][1]:.3f} -> {s['final']:.3f} (best {s['best']:.3f})"
              f"{' collapsed at step %d' % s['collapse_step'] if s['collapse_step'] else ''}", flush=True)
    return summaries


def summarise(rows: list[dict]) -> dict:
    """Accuracy curve, best, final, collapse step and the run's mean diagnostics from one metrics.jsonl."""
    acc = [(r["step"], r["acc"]) for r in rows if "acc" in r]
    collapse, best = None, -1.0
    for step, a in acc:
        if best - a >= COLLAPSE_DROP and collapse is None:
            collapse = step
        best = max(best, a)
    steps = [r for r in rows if "reward" in r]
    mean = lambda k: sum(r[k] for r in steps) / len(steps)  # noqa: E731
    masked = sum(r["masked_frac"] for r in steps)  # every step has the same number of completions
    return dict(acc=acc, best=max(a for _, a in acc), final=acc[-1][1], collapse_step=collapse,
                abs_dp_mean=mean("abs_dp_mean"), mismatch_dp_mean=mean("mismatch_dp_mean"),
                masked_frac=mean("masked_frac"), masked_frac_neg=mean("masked_frac_neg"),
                # claim (a): of all masked tokens over the run, the share with mu(a) < 0.15
                masked_low_mu=(sum(r["masked_low_mu"] * r["masked_frac"] for r in steps) / masked) if masked else None)


def tables(summaries: list[dict]) -> str:
    """Markdown: one row per (lr, mismatch, variant), means over seeds; then claim (a)."""
    def avg(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else float("nan")
    lines = ["| lr | mismatch | variant | final acc (min–max) | best acc | collapsed | collapse step | "
             "mean \\|π−μ\\| | first-mini-batch \\|π−μ\\| | masked | masked, Â<0 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(s["lr"], s["mismatch"]) for s in summaries}, key=lambda k: (k[0], k[1] == "on"))
    for lr, mm in keys:
        for v in VARIANTS:
            ss = [s for s in summaries if (s["lr"], s["mismatch"], s["variant"]) == (lr, mm, v)]
            if not ss:
                continue
            fin = [s["final"] for s in ss]
            col = [s["collapse_step"] for s in ss if s["collapse_step"]]
            lines.append(f"| {lr:g} | {mm} | {v} | {avg(fin):.3f} ({min(fin):.2f}–{max(fin):.2f}) | "
                         f"{avg([s['best'] for s in ss]):.3f} | {len(col)}/{len(ss)} | "
                         f"{avg(col):.0f} | {avg([s['abs_dp_mean'] for s in ss]):.4f} | "
                         f"{avg([s['mismatch_dp_mean'] for s in ss]):.1e} | "
                         f"{avg([s['masked_frac'] for s in ss]):.3f} | "
                         f"{avg([s['masked_frac_neg'] for s in ss]):.3f} |".replace("| nan |", "| – |"))
    lines += ["", "Claim (a): of the tokens each rule masked over a run, the share whose rollout probability μ(a) "
              "was below 0.15 (mean over the runs of that variant, all lrs and mismatch settings):", "",
              "| variant | masked tokens with μ(a) < 0.15 |", "| --- | --- |"]
    for v in ("ratio_clip", "dppo_tv", "dppo_kl", "dppo_tv_old"):
        vals = [s["masked_low_mu"] for s in summaries if s["variant"] == v]
        if vals:
            lines.append(f"| {v} | {avg(vals):.3f} |")
    return "\n".join(lines) + "\n"


NAMES = {"dppo_tv": ("DPPO, binary TV (δ 0.15)", "tab:blue"), "dppo_kl": ("DPPO, binary KL (δ 0.05)", "tab:green"),
         "ratio_clip": ("ratio clip (ε 0.2 / 0.28)", "tab:orange"), "pg_is": ("PG-IS: no trust region", "tab:red"),
         "pg_tis": ("PG-TIS: weight capped at 5", "tab:purple"),
         "dppo_tv_old": ("DPPO-TV, recomputed anchor", "tab:brown")}
DEFAULT_RUN = (0.964, 0.974)  # `python dppo.py` (lr 1e-4, 4 mini-batches) at step 60 on two machines (README)


def figure(summaries: list[dict], path: str) -> None:
    """Held-out accuracy per variant: mean over seeds with a min-max band; rows lr, columns mismatch off/on; the
    warm start and the default run's end as reference lines; the legend below the panels."""
    from matplotlib.figure import Figure
    lrs = sorted({s["lr"] for s in summaries})
    fig = Figure(figsize=(12, 3.9 * len(lrs) + 1.1))
    axes = fig.subplots(len(lrs), 2, squeeze=False, sharey=True)
    for r, lr in enumerate(lrs):
        for c, mm in enumerate(MISMATCH):
            ax = axes[r][c]
            for v in VARIANTS:
                ss = [s for s in summaries if (s["lr"], s["mismatch"], s["variant"]) == (lr, mm, v)]
                if not ss:
                    continue
                steps = [st for st, _ in ss[0]["acc"]]
                curves = [[a for _, a in s["acc"]] for s in ss]
                name, color = NAMES[v]
                ax.plot(steps, [sum(col) / len(col) for col in zip(*curves)], color=color, lw=1.6, label=name)
                ax.fill_between(steps, [min(col) for col in zip(*curves)], [max(col) for col in zip(*curves)],
                                color=color, alpha=0.12)
            warm = summaries[0]["acc"][0][1]
            ax.axhline(warm, color="k", ls="--", lw=0.9, label=f"warm start ({warm:.3f})")
            ax.axhspan(*DEFAULT_RUN, color="k", alpha=0.15, label="default run, lr 1e-4 and 4 mini-batches, at step 60")
            ax.set_title(f"lr {lr:g}, {'bf16' if mm == 'on' else 'float32'} rollouts "
                         f"(mismatch {mm})", fontsize=10)
            ax.set_xlabel("RL step")
            ax.set_ylabel("held-out greedy accuracy")
            ax.set_ylim(0, 1)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    n = len({s["seed"] for s in summaries})
    fig.suptitle(f"Stability study: held-out accuracy per variant, mean over {n} seeds (line) and min–max over "
                 f"seeds (band); 8 mini-batch updates per rollout", fontsize=11)
    fig.tight_layout(rect=(0, 0.8 / (3.9 * len(lrs) + 1.1), 1, 0.97))
    fig.savefig(path, dpi=100)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="where results are written")
    p.add_argument("--quick", action="store_true", help="one seed, one lr, 3 steps: checks that everything runs")
    p.add_argument("--replot", action="store_true", help="redraw the table and figure from --out/stability.json")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    if a.replot:
        summaries = json.load(open(os.path.join(a.out, "stability.json")))
    else:
        summaries = run_grid(a.out, QUICK if a.quick else FULL)
        with open(os.path.join(a.out, "stability.json"), "w") as f:
            json.dump(summaries, f, indent=1)
    with open(os.path.join(a.out, "stability.md"), "w") as f:
        f.write(tables(summaries))
    figure(summaries, os.path.join(a.out, "stability.png"))
    print(tables(summaries))
    print(f"{len(summaries)} runs; this invocation took {time.time() - t0:.0f} s; "
          f"sum of run times {sum(s['seconds'] for s in summaries):.0f} s")
    return summaries


if __name__ == "__main__":
    main()
