"""
Fourth study: does the trust region matter *because of* sampler mismatch? The third study (mismatch.py) could not
say: at its lr every method collapsed, as often with a float32 sampler as with FP8, and DPPO-TV's lead over PG-IS was
as large with a float32 sampler as with FP8 (interaction -0.062 [-0.158, +0.034]): a step-size effect. Here the step
size is chosen so that a float32 sampler alone does not break training, and the mismatch is dosed up until a trust
region can see it. On the embedded addition task on a CPU. Everything below was written, and committed, before the
calibration, the pilot or the grid ran; each stage's outcome is recorded in mismatch_dose.md before the next runs.

Stage 1, calibration (--calibrate; no training). The amplified sampler is the first of these candidates, in order,
whose mean |pi(a_t) - mu(a_t)| over the calibration rollouts' completion tokens is at least 2e-2 (SmolLM2-135M's FP8
level is 2.8e-2; the target is ~3e-2); the last one if none reaches it:
  w8a8  every nn.Linear weight (the head aside) rounded to float8 e4m3, one scale per output channel; every linear
        input to e4m3, one scale per token (experiments/samplers.py's Float8Sampler: the third study's FP8)
  w6a8  weights to FP6 e3m2 (max 28), activations e4m3, scales as above
  w4a8  weights to FP4 e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6), activations e4m3, scales as above
The calibration rollouts: warm starts 0, 1, 2 (below), two rollouts of 16 prompts x 8 from each, sampled by the
candidate and scored by the float32 trainer before any update. Reported per candidate: the mean |pi - mu|, its
largest value, the share of tokens with |pi - mu| > 0.15 (DPPO-TV's delta), and the float32 sampler as the control.

Stage 2, pilot (--pilot; recorded, its settings then fixed in this file before the grid):
  (a) LR = the largest of 1e-4, 2e-4, 4e-4 at which float32 PG-IS does not collapse (below) over 200 steps on both
      of seeds 0 and 1; 1e-4 if none. The equivalence margin m = min(0.05, max(0.02, sd / 2)), sd the standard
      deviation of AUC (below) over those two runs at LR.
  (b) At LR with the amplified sampler, seeds 0 and 1: ratio clip, and DPPO-TV at delta 0.10, 0.05 and 0.025.
      DELTA_MATCHED = the delta whose masked share of all tokens (pooled over both seeds' steps) is closest to ratio
      clip's; 0.15 if ratio clip masks less than DPPO-TV at 0.10.
  The pilot's runs are not grid cells (the grid makes its own warm starts and runs afresh).

Stage 3, the grid (python experiments/mismatch_dose.py; resumable; --replot re-tabulates mismatch_dose.json):
  seeds     0-11, each its own warm start (600 supervised steps, model seed s): 12 independent units; RL seed s
  cells     dppo_tv (delta 0.15), ratio_clip (eps 0.2 / 0.28), pg_is (delta inf)      x  {float32, amplified}
            dppo_tv_old   dppo_tv on a recomputed anchor (samplers.RecomputedAnchor), amplified sampler
            dppo_tv_match dppo_tv at DELTA_MATCHED, amplified sampler (as tight as ratio clip was in the pilot)
            dppo_tv_aa    dppo_tv, float32 sampler, RL seed s + 1000 (same warm start): the A/A pair, noise floor
  fixed     200 RL steps of 16 prompts x 8, 4 mini-batch updates per rollout, temperature 1, lr LR; 500 held-out
            prompts every 20 steps (11 evaluations, step 0 included).
  108 runs.

Decision rules (fixed before any result existed):
  Outcomes. AUC = the area under the held-out accuracy curve over steps 0-200 (trapezoids), divided by 200: the mean
    accuracy over training, which a collapse lowers whenever it happens. Collapse step = the first evaluation 20
    points or more below the best before it (mismatch.collapse_step); a run that never collapses counts as 220.
    Mismatch growth g = mean first-mini-batch |pi - mu| over steps 181-200 minus over steps 1-20 (the sampler's gap
    |pi_old - mu| for dppo_tv_old).
  Primary contrast, one: I = [AUC(pg_is) - AUC(dppo_tv)]_amplified - [AUC(pg_is) - AUC(dppo_tv)]_float32, per seed
    (all four runs share the seed's warm start); its 95 % Student-t interval over the 12 seeds (11 degrees of
    freedom). Verdict: "mismatch-driven" if the interval lies below 0 (the trust region's lead grows with the
    mismatch); "no interaction" if it lies inside [-m, +m]; "opposite" if it lies above 0; else "undecided".
  Secondary contrasts, Holm-corrected as one family of five (two-sided paired t tests over the 12 seeds; a contrast
    is "better" / "worse" when its Holm-adjusted p < 0.05, "no difference" when its interval lies inside [-m, +m],
    else "undecided"):
    (S1) AUC(dppo_tv) - AUC(ratio_clip), amplified
    (S2) collapse step(dppo_tv) - collapse step(pg_is), amplified (censored at 220)
    (S3) g(pg_is) - g(dppo_tv), amplified (the paper's P1: mismatch grows without a trust region)
    (S4) AUC(dppo_tv) - AUC(dppo_tv_old), amplified (the paper's Takeaway 2: the rollout anchor)
    (S5) AUC(dppo_tv_match) - AUC(ratio_clip), amplified (DPPO against ratio clip at matched tightness)
  Noise floor: AUC(dppo_tv_aa) - AUC(dppo_tv), float32, with its interval and p-value, reported beside every
    contrast; a contrast smaller than it is not read as an effect even where a rule calls it.

Stage 4, mechanism on a real model, no training (--mechanism): SmolLM2-135M-Instruct (experiments/real_model.py's
model directory), addition asked as a question, 8 rollouts of 8 prompts x 8 completions (48 new tokens, temperature
1) sampled by the w8a8 (FP8) engine from the float32 weights, scored by the float32 trainer. Per rollout, with the
group advantages of its rewards: the tokens each rule would mask (ratio clip at 0.2 / 0.28 and DPPO-TV at 0.15 on
the FP8-vs-float32 gap, both anchored to the FP8 mu) and, of those, the share with mu(a_t) < 0.15, against two base
rates: the share with mu < 0.15 among all sampled tokens, and among the bindable ones (A != 0, pushed away from mu).
Reported: each mean with its 95 % t interval over the 8 rollouts.

Outputs in --out (default: this folder): mismatch_dose.md (each stage's tables, appended in order),
mismatch_dose.json (the grid's summaries), mismatch_dose_{calibration,pilot,mechanism}.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dppo  # noqa: E402
from mismatch import collapse_step, holm, interval, p_value  # noqa: E402
from samplers import Float8Sampler, RecomputedAnchor  # noqa: E402
from stability import run_once  # noqa: E402  the first study's resumable run

AMPLIFIED = "w4a8"     # the calibration's pick (stage 1; none reached 2e-2), committed before the pilot
LR = 2e-4              # the pilot's (stage 2a: 4e-4 collapsed on both seeds), committed before the grid
MARGIN = 0.02          # the pilot's equivalence margin m (stage 2a: sd 0.004 / 2, raised to the floor 0.02)
DELTA_MATCHED = 0.15   # the pilot's (stage 2b: ratio clip masked 0.0328, DPPO-TV at 0.10 0.0332, so the rule's 0.15)
CANDIDATES = {"w8a8": (4, 3), "w6a8": (3, 2), "w4a8": (2, 1)}  # weight format: (exponent bits, mantissa bits)
CALIBRATION_TARGET = 2e-2
FULL = dict(seeds=list(range(12)), steps=200, eval_every=20, eval_size=500, prompts_per_step=16, group_size=8,
            depth=4, warm_start_steps=600)
QUICK = dict(seeds=[0, 1], steps=4, eval_every=2, eval_size=20, prompts_per_step=4, group_size=4, depth=2,
             warm_start_steps=20)
CELLS = {  # name: (dppo.Config fields, sampler: "float32" or "amplified", anchor, RL seed offset)
    "dppo_tv": (dict(loss="dppo", divergence="binary_tv"), "both", "rollout", 0),
    "ratio_clip": (dict(loss="ratio_clip"), "both", "rollout", 0),
    "pg_is": (dict(loss="dppo", divergence="binary_tv", delta_low=math.inf, delta_high=math.inf), "both", "rollout", 0),
    "dppo_tv_old": (dict(loss="dppo", divergence="binary_tv"), "amplified", "recomputed", 0),
    "dppo_tv_match": (dict(loss="dppo", divergence="binary_tv"), "amplified", "rollout", 0),  # delta: DELTA_MATCHED
    "dppo_tv_aa": (dict(loss="dppo", divergence="binary_tv"), "float32", "rollout", 1000),
}


# --- The amplified samplers: coarser weight formats ------------------------------------------------------------
def fp_grid(exponent_bits: int, mantissa_bits: int) -> torch.Tensor:
    """The non-negative values of a sign-exponent-mantissa float format without inf or NaN (OCP MX FP4 / FP6 / the
    e4m3 grid up to its finite values), subnormals included: e2m1 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    bias = 2 ** (exponent_bits - 1) - 1
    steps = 2 ** mantissa_bits
    values = [m / steps * 2.0 ** (1 - bias) for m in range(steps)]                       # 0 and the subnormals
    values += [2.0 ** (e - bias) * (1 + m / steps) for e in range(1, 2 ** exponent_bits) for m in range(steps)]
    return torch.tensor(sorted(set(values)), dtype=torch.float64)


def round_to_grid(x: torch.Tensor, grid: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to the nearest value of +-grid with one scale per slice along `dim` (s = max |x| / max(grid))."""
    scale = (x.abs().amax(dim=dim, keepdim=True) / float(grid[-1])).clamp_min(torch.finfo(torch.float32).tiny)
    y = (x.float() / scale).abs()
    grid = grid.to(y)
    idx = torch.bucketize(y, (grid[1:] + grid[:-1]) / 2)                # the nearest grid value's index
    return (torch.sign(x.float()) * grid[idx] * scale).to(x.dtype)


class GridSampler(Float8Sampler):
    """A simulated low-precision engine: Float8Sampler's activations (float8 e4m3 per token), its nn.Linear weights
    (the head aside) rounded to `fmt` per output channel instead of e4m3 (w8a8 is Float8Sampler itself)."""

    def __init__(self, fmt: str):
        super().__init__(torch.float32)
        self.grid = fp_grid(*CANDIDATES[fmt])

    def round_weight(self, w: torch.Tensor) -> torch.Tensor:
        return round_to_grid(w, self.grid, 1)


# --- Runs ---------------------------------------------------------------------------------------------------------
def auc(acc: list) -> float:
    """Trapezoidal area under [(step, accuracy), ...] divided by the steps it spans."""
    area = sum((a0 + a1) / 2 * (s1 - s0) for (s0, a0), (s1, a1) in zip(acc, acc[1:]))
    return area / (acc[-1][0] - acc[0][0])


def summarise(rows: list[dict], steps: int) -> dict:
    acc = [(r["step"], r["acc"]) for r in rows if "acc" in r]
    mismatch = [(r["step"], r["mismatch_dp_mean"]) for r in rows if "reward" in r]
    window = max(1, steps // 10)
    early = [m for s, m in mismatch if s <= window]
    late = [m for s, m in mismatch if s > steps - window]
    tokens = sum(r["tokens"] for r in rows if "reward" in r)
    return dict(acc=acc, auc=auc(acc), collapse_step=collapse_step(acc) or steps + 20,
                growth=sum(late) / len(late) - sum(early) / len(early),
                masked=sum(r["masked_frac"] * r["tokens"] for r in rows if "reward" in r) / tokens)


def make_engine(fmt: str):
    """w8a8: the third study's Float8Sampler itself; w6a8, w4a8: a GridSampler."""
    return Float8Sampler() if fmt == "w8a8" else GridSampler(fmt)


def sampler_for(kind: str, anchor: str = "rollout"):
    inner = make_engine(AMPLIFIED) if kind == "amplified" else None
    return RecomputedAnchor(inner) if anchor == "recomputed" else inner


def one_run(out, grid, warm, name, seed, lr, kind, fields, anchor="rollout", offset=0, where="mismatch_dose"):
    run_dir = os.path.join(out, "runs", where, f"{name}-{kind}-lr{lr:g}-seed{seed}")
    cfg = dppo.Config(model=warm, out_dir=run_dir, seed=seed + offset, lr=lr, quiet=True, steps=grid["steps"],
                      eval_every=grid["eval_every"], save_every=grid["steps"], eval_size=grid["eval_size"],
                      prompts_per_step=grid["prompts_per_step"], group_size=grid["group_size"],
                      num_minibatches=grid["depth"], **fields)
    s = run_once(run_dir, cfg, lambda rows: summarise(rows, grid["steps"]), sampler_for(kind, anchor), cell=name,
                 engine=kind, lr=lr, seed=seed, delta=fields.get("delta_high"))
    print(f"{name:>14} {kind:>9} lr {lr:g} seed {seed:2d}: AUC {s['auc']:.3f}, final {s['acc'][-1][1]:.3f}, "
          f"collapse {s['collapse_step']}, masked {s['masked']:.4f}", flush=True)
    return s


def warm_starts(out, grid, where="mismatch_dose") -> dict:
    return {s: dppo.warm_start_dir(os.path.join(out, "runs", where, f"warm{s}"), seed=s,
                                   warm_start_steps=grid["warm_start_steps"]) for s in grid["seeds"]}


# --- Stage 1: calibration ------------------------------------------------------------------------------------------
def calibrate(out, grid) -> dict:
    warm = warm_starts(out, dict(grid, seeds=[0, 1, 2] if len(grid["seeds"]) > 2 else [0]))  # (trains: grad on)
    results = {}
    for fmt in ["float32", *CANDIDATES]:
        gaps = []
        for seed, model_dir in warm.items():
            cfg = dppo.with_model_defaults(dppo.Config(model=model_dir, prompts_per_step=grid["prompts_per_step"],
                                                       group_size=grid["group_size"]))
            model, tok = dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))
            ds, reward_fn = dppo.load_task(cfg)
            gen = torch.Generator().manual_seed(seed)
            sampler = dppo.sample_with_topk if fmt == "float32" else make_engine(fmt)
            for _ in range(2):
                rows = ds["train"][torch.randint(len(ds["train"]), (cfg.prompts_per_step,), generator=gen).tolist()]
                batch = dppo.collect_rollout(model, tok, rows, reward_fn, cfg, sampler, gen)
                ro = batch.rollout
                with torch.no_grad():
                    logp, _ = dppo.policy_logprobs(model, batch.prompt_ids, batch.prompt_mask, ro.completion_ids,
                                                   ro.completion_mask)
                valid = ro.completion_mask.bool()
                gaps.append((logp.exp() - ro.logp_mu.exp()).abs()[valid])
        gap = torch.cat(gaps)
        results[fmt] = dict(mean=float(gap.mean()), max=float(gap.max()),
                            above_delta=float((gap > 0.15).float().mean()), tokens=int(gap.numel()))
        print(f"calibration {fmt:>7}: mean |pi - mu| {results[fmt]['mean']:.2e}, max {results[fmt]['max']:.3f}, "
              f"share above 0.15 {results[fmt]['above_delta']:.4f} of {results[fmt]['tokens']} tokens", flush=True)
    pick = next((f for f in CANDIDATES if results[f]["mean"] >= CALIBRATION_TARGET), list(CANDIDATES)[-1])
    return dict(results=results, pick=pick)


# --- Stage 2: the pilot --------------------------------------------------------------------------------------------
def pilot(out, grid) -> dict:
    if AMPLIFIED is None:
        sys.exit("AMPLIFIED must be set from the calibration (stage 1), committed, before the pilot")
    warm = warm_starts(out, dict(grid, seeds=grid["seeds"][:2]), "mismatch_dose_pilot")
    lrs = [1e-4, 2e-4, 4e-4]
    runs_a = [one_run(out, grid, warm[s], "pg_is", s, lr, "float32", CELLS["pg_is"][0], where="mismatch_dose_pilot")
              for lr in lrs for s in warm]
    ok = [lr for lr in lrs if all(r["collapse_step"] > grid["steps"] for r in runs_a if r["lr"] == lr)]
    lr = max(ok) if ok else lrs[0]
    aucs = [r["auc"] for r in runs_a if r["lr"] == lr]
    margin = min(0.05, max(0.02, statistics.stdev(aucs) / 2))
    runs_b = [one_run(out, grid, warm[s], "ratio_clip", s, lr, "amplified", CELLS["ratio_clip"][0],
                      where="mismatch_dose_pilot") for s in warm]
    for delta in (0.10, 0.05, 0.025):
        fields = dict(loss="dppo", divergence="binary_tv", delta_low=delta, delta_high=delta)
        runs_b += [one_run(out, grid, warm[s], f"dppo_tv_d{delta:g}", s, lr, "amplified", fields,
                           where="mismatch_dose_pilot") for s in warm]

    def pooled(name):
        return sum(r["masked"] for r in runs_b if r["cell"] == name) / len(warm)
    target = pooled("ratio_clip")
    ladder = {d: pooled(f"dppo_tv_d{d:g}") for d in (0.10, 0.05, 0.025)}
    matched = 0.15 if target < ladder[0.10] else min(ladder, key=lambda d: abs(ladder[d] - target))
    return dict(lr=lr, margin=margin, delta_matched=matched, ratio_clip_masked=target, ladder=ladder,
                runs=runs_a + runs_b)


# --- Stage 3: the grid and its verdicts ----------------------------------------------------------------------------
def run_grid(out, grid) -> list[dict]:
    if None in (AMPLIFIED, LR, MARGIN, DELTA_MATCHED):
        sys.exit("AMPLIFIED, LR, MARGIN and DELTA_MATCHED must be set from stages 1-2 (committed) before the grid")
    warm = warm_starts(out, grid)
    summaries = []
    for name, (fields, kinds, anchor, offset) in CELLS.items():
        if name == "dppo_tv_match" and DELTA_MATCHED == 0.15:  # the same runs as dppo_tv's amplified cell: reused
            summaries += [dict(s, cell=name) for s in summaries if (s["cell"], s["engine"]) == ("dppo_tv", "amplified")]
            continue
        if name == "dppo_tv_match":
            fields = dict(fields, delta_low=DELTA_MATCHED, delta_high=DELTA_MATCHED)
        for kind in (["float32", "amplified"] if kinds == "both" else [kinds]):
            summaries += [one_run(out, grid, warm[s], name, s, LR, kind, fields, anchor, offset) for s in grid["seeds"]]
    return summaries


def paired(summaries, a, kind_a, b, kind_b, key) -> list[float]:
    xa = {s["seed"]: s[key] for s in summaries if (s["cell"], s["engine"]) == (a, kind_a)}
    xb = {s["seed"]: s[key] for s in summaries if (s["cell"], s["engine"]) == (b, kind_b)}
    return [xa[s] - xb[s] for s in sorted(xa) if s in xb]


def verdicts(summaries, margin) -> str:
    gap = {k: paired(summaries, "pg_is", k, "dppo_tv", k, "auc") for k in ("float32", "amplified")}  # by seed
    inter = [a - f for a, f in zip(gap["amplified"], gap["float32"])]
    mean, lo, hi = interval(inter)
    primary = ("mismatch-driven" if hi < 0 else "opposite" if lo > 0 else
               "no interaction" if -margin <= lo and hi <= margin else "undecided")
    lines = [f"Primary: I = [PG-IS - DPPO-TV]_amplified - [PG-IS - DPPO-TV]_float32 (AUC) = {mean:+.4f} "
             f"[{lo:+.4f}, {hi:+.4f}], p = {p_value(inter):.3f}, margin {margin:.3f}: **{primary}**", "",
             "| contrast | mean [95 % interval] | p | Holm p | verdict |", "| --- | --- | --- | --- | --- |"]
    family = [("S1 DPPO-TV - ratio clip, AUC", paired(summaries, "dppo_tv", "amplified", "ratio_clip", "amplified",
                                                      "auc")),
              ("S2 collapse step DPPO-TV - PG-IS", paired(summaries, "dppo_tv", "amplified", "pg_is", "amplified",
                                                          "collapse_step")),
              ("S3 growth PG-IS - DPPO-TV", paired(summaries, "pg_is", "amplified", "dppo_tv", "amplified", "growth")),
              ("S4 DPPO-TV - recomputed anchor, AUC", paired(summaries, "dppo_tv", "amplified", "dppo_tv_old",
                                                             "amplified", "auc")),
              ("S5 matched DPPO-TV - ratio clip, AUC", paired(summaries, "dppo_tv_match", "amplified", "ratio_clip",
                                                              "amplified", "auc"))]
    adjusted = holm([p_value(d) for _, d in family])
    for (name, d), p_holm in zip(family, adjusted):
        m, lo, hi = interval(d)
        call = ("better" if m > 0 else "worse") if p_holm < 0.05 else \
            "no difference" if name.endswith("AUC") and -margin <= lo and hi <= margin else "undecided"
        lines.append(f"| {name} | {m:+.4f} [{lo:+.4f}, {hi:+.4f}] | {p_value(d):.3f} | {p_holm:.3f} | {call} |")
    aa = paired(summaries, "dppo_tv_aa", "float32", "dppo_tv", "float32", "auc")
    m, lo, hi = interval(aa)
    lines += ["", f"Noise floor (A/A): DPPO-TV float32, RL seed + 1000, minus DPPO-TV float32: {m:+.4f} "
              f"[{lo:+.4f}, {hi:+.4f}], p = {p_value(aa):.3f}"]
    return "\n".join(lines) + "\n"


# --- Stage 4: the mechanism on SmolLM2 ----------------------------------------------------------------------------
@torch.no_grad()
def mechanism(out, model_dir, rollouts=8, settings=None) -> dict:
    settings = settings or dict(prompts_per_step=8, group_size=8, max_new_tokens=48)
    cfg = dppo.with_model_defaults(dppo.Config(model=model_dir, eval_size=200, **settings))
    model, tok = dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))
    ds, reward_fn = dppo.load_task(cfg)
    gen, sampler, per = torch.Generator().manual_seed(0), make_engine("w8a8"), []
    for _ in range(rollouts):
        rows = ds["train"][torch.randint(len(ds["train"]), (cfg.prompts_per_step,), generator=gen).tolist()]
        batch = dppo.collect_rollout(model, tok, rows, reward_fn, cfg, sampler, gen)
        ro = batch.rollout
        lp, _ = dppo.policy_logprobs(model, batch.prompt_ids, batch.prompt_mask, ro.completion_ids, ro.completion_mask)
        lmu, adv = ro.logp_mu, batch.advantages[:, None].expand_as(ro.logp_mu)
        valid = ro.completion_mask.bool()
        low = lmu.exp() < 0.15
        away = ((adv > 0) & (lp > lmu)) | ((adv < 0) & (lp < lmu))
        ratio_d = ((lp - lmu).exp() - 1).abs()
        masks = {"ratio clip": dppo.trust_region_mask(lp, lmu, adv, ratio_d, 0.2, 0.28) == 0,
                 "DPPO-TV": dppo.trust_region_mask(lp, lmu, adv, dppo.binary_tv(lp, lmu), 0.15, 0.15) == 0}
        row = {"all sampled tokens": float(low[valid].float().mean()),
               "bindable tokens": float(low[valid & away].float().mean())}
        for name, m in masks.items():
            row[f"masked by {name}"] = float(low[valid & m].float().mean()) if (valid & m).any() else math.nan
            row[f"{name}: masked tokens"] = int((valid & m).sum())
        row["mean |pi - mu|"] = float((lp.exp() - lmu.exp()).abs()[valid].mean())
        per.append(row)
        print({k: round(v, 4) for k, v in row.items()}, flush=True)
    return dict(per_rollout=per)


def mechanism_table(result: dict) -> str:
    per = result["per_rollout"]
    lines = ["Share of tokens with mu(a_t) < 0.15 (SmolLM2-135M-Instruct, w8a8 sampler, no training; mean [95 % t "
             f"interval] over {len(per)} rollouts):", "", "| tokens | share with mu < 0.15 |", "| --- | --- |"]
    for key in ("all sampled tokens", "bindable tokens", "masked by ratio clip", "masked by DPPO-TV"):
        xs = [r[key] for r in per if not math.isnan(r[key])]
        m, lo, hi = interval(xs) if len(xs) > 1 else (xs[0], math.nan, math.nan) if xs else (math.nan,) * 3
        lines.append(f"| {key} ({len(xs)} rollouts) | {m:.3f} [{lo:.3f}, {hi:.3f}] |")
    for key in ("ratio clip: masked tokens", "DPPO-TV: masked tokens", "mean |pi - mu|"):
        lines.append(f"| {key} (mean over rollouts) | {sum(r[key] for r in per) / len(per):.4g} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="where results are written")
    p.add_argument("--quick", action="store_true", help="miniature sizes: checks that a stage runs")
    p.add_argument("--model", help="--mechanism: a SmolLM2 model directory (default: real_model.py's recipe)")
    stage = p.add_mutually_exclusive_group(required=True)
    for name in ("calibrate", "pilot", "grid", "replot", "mechanism"):
        stage.add_argument(f"--{name}", action="store_true")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    grid, t0 = QUICK if a.quick else FULL, time.time()
    md = os.path.join(a.out, "mismatch_dose.md")
    if a.calibrate:
        result = calibrate(a.out, grid)
        rows = [f"- {f}: mean |π − μ| {r['mean']:.2e}, max {r['max']:.3f}, share above 0.15 {r['above_delta']:.4f} "
                f"({r['tokens']} tokens)" for f, r in result["results"].items()]
        text = "## Stage 1: calibration\n\n" + "\n".join(rows) + f"\n\nThe rule picks **{result['pick']}**.\n"
    elif a.pilot:
        result = pilot(a.out, grid)
        text = (f"## Stage 2: pilot\n\n(a) LR = {result['lr']:g}; margin m = {result['margin']:.3f}. "
                f"(b) ratio clip masked {result['ratio_clip_masked']:.4f} of all tokens; DPPO-TV by delta "
                f"{ {d: round(x, 4) for d, x in result['ladder'].items()} }: "
                f"DELTA_MATCHED = {result['delta_matched']:g}.\n")
    elif a.mechanism:
        if a.model:
            model_dir = a.model
        else:
            from real_model import make_model_dir
            model_dir = make_model_dir(os.path.join(a.out, "runs", "smollm2"))  # real_model.py's
        result = mechanism(a.out, model_dir, rollouts=2 if a.quick else 8,
                           settings=dict(prompts_per_step=2, group_size=2, max_new_tokens=8) if a.quick else None)
        text = "## Stage 4: mechanism on SmolLM2\n\n" + mechanism_table(result)
    else:
        result = json.load(open(os.path.join(a.out, "mismatch_dose.json"))) if a.replot else run_grid(a.out, grid)
        text = "## Stage 3: the grid\n\n" + verdicts(result, MARGIN)
    stage = "calibration" if a.calibrate else "pilot" if a.pilot else "mechanism" if a.mechanism else None
    if not a.replot:
        with open(os.path.join(a.out, f"mismatch_dose_{stage}.json" if stage else "mismatch_dose.json"), "w") as f:
            json.dump(result, f, indent=1)
    with open(md, "a") as f:
        f.write(text + f"\n({time.time() - t0:.0f} s)\n\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
