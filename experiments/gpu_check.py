"""
The prepared check of the single-GPU path: one script that a CUDA machine runs in well under 8 minutes with only
what the working tree carries (no model hub: every model is built from a config in code).

    python experiments/gpu_check.py            # on one GPU
    python experiments/gpu_check.py --smoke    # tiny shapes, any device: checks the script itself (CI does)

1. The default `python dppo.py` on the device (embedded model and task, 60 steps): held-out accuracy before and
   after, the first mini-batch's |pi - mu| (float32 sampler and trainer), seconds; then 3 steps with
   `--dtype bfloat16` for the mismatch bf16 autocast makes.
2. A randomly initialised decoder with Qwen2.5-0.5B's shapes (V = 151,936, 24 layers, hidden 896, 14 query and
   2 key-value heads, tied embeddings), float32 weights, gradient checkpointing on: B = 16 completions of exactly
   1,024 tokens after 64-token prompts (no EOS can end them), sampled with top-K capture, then one update of
   M = 2 mini-batches split under --max_tokens_per_microbatch 4,352 (4 sequences a pass), bf16 decoder. Printed:
   peak GPU memory and tokens per second for the sampling and for the update.
Results go to runs/gpu_check/results.json and are printed as a Markdown table.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import dppo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_run(out: str, device: str, extra: list) -> dict:
    """`python dppo.py` as a user runs it; the numbers from its metrics.jsonl."""
    t0 = time.time()
    subprocess.run([sys.executable, os.path.join(ROOT, "dppo.py"), "--out_dir", out, "--device", device, "--quiet",
                    *extra], check=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    accs = [r["acc"] for r in rows if "acc" in r]
    return {"acc_start": accs[0], "acc_end": accs[-1], "mismatch_dp_max": rows[1]["mismatch_dp_max"],
            "mismatch_dp_mean": rows[1]["mismatch_dp_mean"], "seconds": round(time.time() - t0, 1)}


def big_model_step(device: torch.device, shapes: dict, B: int, P: int, T: int, budget: int) -> dict:
    """Sampling and one update of a randomly initialised Qwen2-shaped model: peak memory and tokens per second."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shapes, tie_word_embeddings=True)).to(device)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator(device=device).manual_seed(0)
    prompt_ids = torch.randint(0, shapes["vocab_size"], (B, P), generator=g, device=device)
    prompt_mask = torch.ones_like(prompt_ids)
    cuda = device.type == "cuda"
    peak = lambda: torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan")  # noqa: E731  GiB

    def timed(fn):
        if cuda:
            torch.cuda.synchronize(), torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
        return result, time.perf_counter() - t0, peak()

    ro, t_sample, mem_sample = timed(lambda: dppo.sample_with_topk(
        model, prompt_ids, prompt_mask, max_new_tokens=T, topk=20, eos_token_id=-1, pad_token_id=0, generator=g))
    assert ro.completion_ids.shape == (B, T), ro.completion_ids.shape  # nothing ended early
    batch = dppo.Batch(prompt_ids, prompt_mask, ro, torch.zeros(B), torch.randn(B, generator=g, device=device))
    cfg = dppo.Config(loss="dppo", divergence="topk_tv", group_size=8, num_minibatches=2, dtype="bfloat16",
                      max_tokens_per_microbatch=budget)
    m, t_update, mem_update = timed(lambda: dppo.update_policy(model, opt, batch, cfg, torch.Generator()))
    return {"B": B, "prompt": P, "completion": T, "micro_budget": budget, "sample_s": round(t_sample, 2),
            "sample_tokens_per_s": round(B * T / t_sample), "sample_peak_GiB": round(mem_sample, 2),
            "update_s": round(t_update, 2), "update_tokens_per_s": round(B * (P + T) / t_update),
            "update_peak_GiB": round(mem_update, 2), "mismatch_dp_max": m["mismatch_dp_max"],
            "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes and a 2-step default run, on any device")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check"))
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    device = dppo.pick_device(a.device)
    os.makedirs(a.out, exist_ok=True)
    short = ["--steps", "2", "--warm_start_steps", "20", "--eval_size", "50"] if a.smoke else []
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
           "torch": torch.__version__,
           "default": default_run(os.path.join(a.out, "default"), str(device), short),
           "default_bf16": default_run(os.path.join(a.out, "bf16"), str(device), ["--dtype", "bfloat16", "--steps", "3",
                                       "--eval_every", "3", *short[2:]])}
    qwen05 = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768)
    tiny = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256)
    res["qwen2.5-0.5b_shapes"] = big_model_step(device, tiny if a.smoke else qwen05, B=4 if a.smoke else 16,
                                                P=8 if a.smoke else 64, T=32 if a.smoke else 1024,
                                                budget=80 if a.smoke else 4 * 1088)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    d, b, q = res["default"], res["default_bf16"], res["qwen2.5-0.5b_shapes"]
    print(f"\n{res['device']} | torch {res['torch']}\n")
    print("| check | result |\n| --- | --- |")
    print(f"| `python dppo.py` | {d['acc_start']:.3f} -> {d['acc_end']:.3f} in {d['seconds']} s; first mini-batch "
          f"|pi-mu| max {d['mismatch_dp_max']:.1e} |")
    print(f"| `--dtype bfloat16` | first mini-batch |pi-mu| mean {b['mismatch_dp_mean']:.1e}, "
          f"max {b['mismatch_dp_max']:.1e} |")
    print(f"| {q['params_M']}M-parameter Qwen2.5-0.5B shapes, B={q['B']}, {q['completion']}-token completions | "
          f"sampling {q['sample_tokens_per_s']} tokens/s, peak {q['sample_peak_GiB']} GiB; update "
          f"{q['update_tokens_per_s']} tokens/s, peak {q['update_peak_GiB']} GiB (micro-batch budget "
          f"{q['micro_budget']} tokens) |")
    return res


if __name__ == "__main__":
    main()
