"""
The prepared check of the single-GPU path, for a bare CUDA machine: torch, transformers and matplotlib, and `datasets`
(dppo.py's embedded task is a datasets.Dataset), nothing else (no vLLM, no model hub: every model is built from a
config in code). A machine without `datasets` gets it from wheels carried beside the script (--wheels DIR, made here
with `pip download datasets -d DIR`), offline, or is told in one line what to install. Each check runs on its own,
prints PASS or FAIL against its threshold (ERROR if it raised), and the run ends with one Markdown table
(runs/gpu_check/results.md; the numbers in results.json). Well under 8 minutes on one H200.

    python experiments/gpu_check.py            # on one GPU
    python experiments/gpu_check.py --smoke    # tiny shapes, any device: checks the script itself (the tests do)
    python experiments/gpu_check.py --wheels wheels   # on a machine without `datasets`: installed from ./wheels

Checks and thresholds (the smoke size runs the same code at sizes where the accuracy threshold cannot hold):
1. `python dppo.py` on the device (embedded model and task, 60 steps): held-out accuracy at the end >= 0.90.
2. The same run's first mini-batch, float32 sampler and trainer: max |pi - mu| <= 1e-5.
3. `--dtype bfloat16` (3 steps): sampled in the precision it is scored in (first-mini-batch max |pi - mu| within
   dppo.SCORING_GAP["bfloat16"]), and autocast really on (its first step's entropy of mu differs from float32's).
4. One update of the embedded model under bf16 autocast with gradient checkpointing, split into micro-batches
   under a token budget of one row: the gradient equals the unsplit one within 4 bf16 ulps of its largest entry.
5. A soft-capped Gemma-2 (tiny, random): log mu captured while sampling equals log pi scored (128 float32 ulps),
   and the gradient of dppo_loss equals autograd through log_softmax(logits / T) in float64 (1e-4 of its largest).
6. A randomly initialised decoder with Qwen2.5-0.5B's shapes (V = 151,936, 24 layers, hidden 896, 14 query and
   2 key-value heads, tied embeddings), float32 weights, checkpointing on: B = 16 completions of exactly 1,024 tokens
   after 64-token prompts, sampled with top-K capture, then one update (M = 2, bf16 autocast) under
   --max_tokens_per_microbatch 4,352 and 2,176: the update's peak memory falls with the budget.
7. The same update in float32 and under bf16 autocast: tokens per second, bf16 / float32 >= 1.3.
8. Save and --resume: 2 steps, then --resume to 4, against 4 uninterrupted: steps 1..4 logged once each, final
   held-out accuracy within 0.05 (on CUDA the kernels are not bitwise deterministic, so not equal).
9. Graphed decode steps (GraphedDecoding, compiled on CUDA) against the plain steps, the model held in bf16 (a LoRA's
   base) under bf16 autocast, left-padded prompts, T = 64 new tokens, two batch sizes (the second narrower, its rows
   padded into the one cache): the graphed steps' tokens scored again by the plain steps on the same prefixes, log mu
   within dppo.GRAPH_GAP["bfloat16"] (whether independent draws match is reported); and a Mistral with a
   sliding window shorter than the sequence left on the plain steps by choose_decoding. Forced onto graphed steps
   anyway, that model's CUDA-graph recordings and recompiles are reported (TORCH_LOGS=cudagraphs shows each).
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
BF16_EPS = torch.finfo(torch.bfloat16).eps
F32_EPS = torch.finfo(torch.float32).eps


# --- helpers -----------------------------------------------------------------------------------------------
def run_dppo(out: str, device: str, *flags) -> list:
    """`python dppo.py` as a user runs it; its metrics.jsonl rows."""
    fresh = [] if "--resume" in flags else ["--overwrite"]
    subprocess.run([sys.executable, os.path.join(ROOT, "dppo.py"), "--out_dir", out, "--device", device, "--quiet",
                    *fresh, *flags], check=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_acc(rows: list) -> float:
    return [r["acc"] for r in rows if "acc" in r][-1]


def first_step(rows: list) -> dict:
    return next(r for r in rows if "mismatch_dp_max" in r)


class KeepGrads(torch.optim.SGD):
    """A step of size 0 that records the gradient it was given (update_policy frees .grad after the step)."""

    def __init__(self, params):
        self.params = list(params)
        super().__init__(self.params, lr=0.0)
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params])


def left_padded(V: int, lengths: list, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(3, V, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids.to(device), mask.to(device)


def max_rel_diff(got: list, want: list) -> float:
    scale = max(float(w.abs().max()) for w in want)
    return max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, want)) / scale


# --- the checks: each returns (passed, result text, numbers) ---------------------------------------------------
def check_default(ctx) -> tuple:
    rows = run_dppo(os.path.join(ctx.out, "default"), ctx.device, *ctx.short)
    ctx.default_rows = rows
    accs = [r["acc"] for r in rows if "acc" in r]
    return accs[-1] >= 0.90, f"{accs[0]:.3f} -> {accs[-1]:.3f}", {"acc_start": accs[0], "acc_end": accs[-1]}


def check_mismatch(ctx) -> tuple:
    m = first_step(ctx.default_rows)
    return (m["mismatch_dp_max"] <= 1e-5, f"max {m['mismatch_dp_max']:.1e}, mean {m['mismatch_dp_mean']:.1e}",
            {"mismatch_dp_max": m["mismatch_dp_max"], "mismatch_dp_mean": m["mismatch_dp_mean"]})


def check_bf16_run(ctx) -> tuple:
    rows = run_dppo(os.path.join(ctx.out, "bf16"), ctx.device, "--dtype", "bfloat16", "--steps", "3",
                    "--eval_every", "3", *ctx.short[2:])
    bf16, f32 = first_step(rows), first_step(ctx.default_rows)
    sampled_as_scored = bf16["mismatch_dp_max"] <= dppo.SCORING_GAP["bfloat16"]  # |dp| <= |d log p| for p <= 1
    autocast_on = bf16["entropy"] != f32["entropy"]  # mu's entropy, same prompts and seed: only the precision differs
    return sampled_as_scored and autocast_on, (f"max |pi - mu| {bf16['mismatch_dp_max']:.1e}, entropy of mu "
                                               f"{bf16['entropy']:.6f} (float32: {f32['entropy']:.6f})"), {
        "mismatch_dp_max": bf16["mismatch_dp_max"], "entropy": bf16["entropy"], "entropy_float32": f32["entropy"]}


def check_microbatches(ctx) -> tuple:
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=0).to(ctx.dev)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)({"use_reentrant": False})
    ids, mask = left_padded(len(tok), [3, 6, 4, 5, 2, 6, 5, 3], ctx.dev)
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=8, eos_token_id=1, pad_token_id=0, topk=0,
                               generator=torch.Generator(ctx.dev).manual_seed(0))
    adv = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(ctx.dev)
    batch = dppo.Batch(ids, mask, ro, torch.zeros(8, device=ctx.dev), adv)
    grads = {}
    for budget in (None, 1):
        cfg = dppo.Config(dtype="bfloat16", num_minibatches=1, group_size=2, max_tokens_per_microbatch=budget,
                          delta_low=0.05, delta_high=0.05)
        opt = KeepGrads(model.parameters())
        dppo.update_policy(model, opt, batch, cfg, torch.Generator())
        grads[budget] = opt.grads[0]
    diff = max_rel_diff(grads[1], grads[None])
    return diff <= 4 * BF16_EPS, f"max difference {diff:.1e} of the largest entry", {"rel_diff": diff}


def check_gemma2(ctx) -> tuple:
    import transformers as tf
    torch.manual_seed(0)
    V = 256
    config = tf.Gemma2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                             final_logit_softcapping=4.0, sliding_window=8, pad_token_id=0, eos_token_id=1,
                             bos_token_id=2)
    model = tf.Gemma2ForCausalLM(config).to(ctx.dev).eval()
    probe = torch.randint(3, V, (2, 12), device=ctx.dev)
    for _ in range(4):  # logits of a trained model's size (std 1.5), where the cap at 4 bends them
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5 / float(model(input_ids=probe).logits.std()))
    ids, mask = left_padded(V, [5, 3, 9, 6], ctx.dev)
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=8, temperature=0.7, topk=4, eos_token_id=1,
                               pad_token_id=0, generator=torch.Generator(ctx.dev).manual_seed(0))
    comp, comp_mask = ro.completion_ids, ro.completion_mask
    valid = comp_mask.bool()
    logp, _ = dppo.policy_logprobs(model, ids, mask, comp, comp_mask, temperature=0.7)
    capture = float((logp - ro.logp_mu)[valid].abs().max())
    capture_tol = 128 * F32_EPS * (1 + float(ro.logp_mu[valid].abs().max()))
    full, attn = torch.cat([ids, comp], 1), torch.cat([mask, comp_mask.long()], 1)
    logits = model(input_ids=full, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    ref = torch.log_softmax(logits[:, ids.shape[1] - 1:-1].double() / 0.7, -1).gather(-1, comp[..., None])[..., 0]
    adv = torch.randn(4, generator=torch.Generator().manual_seed(1)).to(ctx.dev)
    params = list(model.parameters())
    grads = []
    for lp in (logp, ref):
        loss, _ = dppo.dppo_loss(lp, ro.logp_mu.to(lp.dtype), adv.to(lp.dtype), comp_mask.to(lp.dtype))
        grads.append(torch.autograd.grad(loss, params, allow_unused=True))
    got = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads[0], params)]
    want = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads[1], params)]
    diff = max_rel_diff(got, want)
    passed = capture <= capture_tol and diff <= 1e-4
    return passed, f"capture {capture:.1e} (tolerance {capture_tol:.1e}); gradient {diff:.1e} of the largest", {
        "capture": capture, "rel_diff": diff}


def big_model(ctx):
    """The Qwen2.5-0.5B-shaped model and one rollout of exactly T tokens, made once for checks 6 and 7."""
    if getattr(ctx, "big", None) is None:
        from transformers import Qwen2Config, Qwen2ForCausalLM
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**ctx.shapes, tie_word_embeddings=True)).to(ctx.dev)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)({"use_reentrant": False})
        g = torch.Generator(device=ctx.dev).manual_seed(0)
        ids = torch.randint(0, ctx.shapes["vocab_size"], (ctx.B, ctx.P), generator=g, device=ctx.dev)
        mask = torch.ones_like(ids)
        ro, seconds, _ = timed(ctx, lambda: dppo.sample_with_topk(
            model, ids, mask, max_new_tokens=ctx.T, topk=20, eos_token_id=-1, pad_token_id=0, generator=g))
        assert ro.completion_ids.shape == (ctx.B, ctx.T), ro.completion_ids.shape  # nothing ended early
        adv = torch.randn(ctx.B, generator=g, device=ctx.dev)
        ctx.big = (model, dppo.Batch(ids, mask, ro, torch.zeros(ctx.B, device=ctx.dev), adv))
        ctx.sample_tokens_per_s = ctx.B * ctx.T / seconds
    return ctx.big


def timed(ctx, fn):
    cuda = ctx.dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan")  # GiB
    return result, time.perf_counter() - t0, peak


def big_update(ctx, budget: int, dtype: str) -> tuple:
    model, batch = big_model(ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    cfg = dppo.Config(loss="dppo", divergence="topk_tv", group_size=ctx.B // 2, num_minibatches=2, dtype=dtype,
                      max_tokens_per_microbatch=budget)  # two mini-batches of one group each
    _, seconds, peak = timed(ctx, lambda: dppo.update_policy(model, opt, batch, cfg, torch.Generator()))
    return ctx.B * (ctx.P + ctx.T) / seconds, peak


def check_memory(ctx) -> tuple:
    big, small = ctx.budget, ctx.budget // 2
    tps_big, peak_big = big_update(ctx, big, "bfloat16")
    tps_small, peak_small = big_update(ctx, small, "bfloat16")
    ctx.bf16_tokens_per_s = tps_big
    n = sum(p.numel() for p in big_model(ctx)[0].parameters()) / 1e6
    text = (f"{n:.0f}M parameters; sampling {ctx.sample_tokens_per_s:.0f} tokens/s; update peak {peak_big:.2f} GiB "
            f"at {big} tokens, {peak_small:.2f} GiB at {small}")
    passed = peak_small < peak_big  # (NaN off CUDA: FAIL, there is no peak to read)
    return passed, text, {"peak_GiB": [peak_big, peak_small], "budgets": [big, small],
                          "sample_tokens_per_s": ctx.sample_tokens_per_s, "update_tokens_per_s": [tps_big, tps_small]}


def check_dtype_speed(ctx) -> tuple:
    f32, _ = big_update(ctx, ctx.budget, "float32")
    bf16 = getattr(ctx, "bf16_tokens_per_s", None) or big_update(ctx, ctx.budget, "bfloat16")[0]
    return bf16 / f32 >= 1.3, f"bf16 {bf16:.0f}, float32 {f32:.0f} tokens/s: {bf16 / f32:.2f}x", {
        "bf16": bf16, "float32": f32}


def check_resume(ctx) -> tuple:
    flags = ["--steps", "4", "--eval_every", "4", *ctx.short[2:]]
    full = run_dppo(os.path.join(ctx.out, "resume_full"), ctx.device, *flags)
    split = os.path.join(ctx.out, "resume_split")
    run_dppo(split, ctx.device, *flags, "--steps", "2")
    rows = run_dppo(split, ctx.device, *flags, "--resume")
    steps = [r["step"] for r in rows if "mismatch_dp_max" in r]
    gap = abs(final_acc(rows) - final_acc(full))
    passed = steps == [1, 2, 3, 4] and gap <= 0.05
    return passed, f"steps {steps}; final accuracy {final_acc(rows):.3f} vs {final_acc(full):.3f} uninterrupted", {
        "steps": steps, "acc_gap": gap}


def graphed_against_plain(model, graphed, ids, mask, T: int, device) -> tuple:
    """Tokens sampled by the graphed steps, scored again by the plain steps (dppo.CachedDecoding) on the same prefixes
    under bf16 autocast -> (the max abs difference of log mu, whether an independent plain run drew the same)."""
    kw = dict(max_new_tokens=T, temperature=1.0, topk=0, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        fast = dppo.sample_with_topk(model, ids, mask, generator=torch.Generator(device).manual_seed(0),
                                     decoding=graphed, **kw)
        plain = dppo.sample_with_topk(model, ids, mask, generator=torch.Generator(device).manual_seed(0), **kw)
        steps, sampled = dppo.CachedDecoding(model, ids, mask, T), fast.completion_ids
        every = torch.arange(len(ids), device=device)
        logp = torch.stack([torch.log_softmax(steps.next_logits(sampled[:, :t], every), -1).gather(
            -1, sampled[:, t, None]) for t in range(T)], dim=1)[..., 0]                # (B, T) the plain steps' log mu
    return float((logp - fast.logp_mu).abs().max()), bool(torch.equal(fast.completion_ids, plain.completion_ids))


def check_graphed_decode(ctx) -> tuple:
    """Check 9: graphed against plain decode steps in bf16 (bf16 weights), two batch sizes; the sliding-window rule."""
    import transformers as tf
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    shapes = {**ctx.shapes, "num_hidden_layers": 2}
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**shapes, tie_word_embeddings=False))
    model = model.to(ctx.dev, torch.bfloat16).eval()
    model.get_output_embeddings().float()  # as dppo.adapt holds a bf16 base
    graphed = dppo.GraphedDecoding(model, compile=ctx.dev.type == "cuda")
    prompts = {B: left_padded(shapes["vocab_size"], [ctx.P - (i % 3) for i in range(B)], ctx.dev) for B in (8, 4)}
    runs = [graphed_against_plain(model, graphed, *prompts[B], 64, ctx.dev) for B in (8, 4)]
    gap = max(g for g, _ in runs)
    sliding = tf.MistralForCausalLM(tf.MistralConfig(**shapes, sliding_window=16)).to(ctx.dev).eval()
    _, note = dppo.choose_decoding(sliding, dppo.Config(max_new_tokens=64), True, "mistral", ctx.dev.type == "cuda")
    before = {k: sum(v.values()) for k, v in counters.items()}
    try:  # (informative only: some transformers' static sliding layers fail under autocast, one more reason)
        graphed_against_plain(sliding, dppo.GraphedDecoding(sliding, ctx.dev.type == "cuda"),
                              *left_padded(shapes["vocab_size"], [ctx.P] * 4, ctx.dev), 64, ctx.dev)
        grown = {k: sum(v.values()) - before.get(k, 0) for k, v in counters.items()
                 if sum(v.values()) > before.get(k, 0)}
    except Exception as e:
        grown = f"nothing: it raised {dppo._why(e)[:80]}"
    passed = gap <= dppo.GRAPH_GAP["bfloat16"] and "sliding-window" in note
    return passed, (f"max abs d log mu {gap:.2e} (B = 8, then 4 in the same cache); independent draws equal: "
                    f"{[same for _, same in runs]}; Mistral: {note}; forced onto graphed steps, the compiler's "
                    f"counters grew by {grown}"), {"graph_gap": gap, "draws_equal": [same for _, same in runs],
                                          "sliding_counters": grown}


CHECKS = [
    ("`python dppo.py`, 60 steps", "held-out accuracy >= 0.90", check_default),
    ("first mini-batch, float32", "max abs(pi - mu) <= 1e-5", check_mismatch),
    ("`--dtype bfloat16`, 3 steps", "mismatch above float32's", check_bf16_run),
    ("micro-batches, bf16 autocast, checkpointing", "gradient = unsplit within 4 bf16 ulps", check_microbatches),
    ("soft-capped Gemma-2", "capture = scoring; gradient = float64 autograd", check_gemma2),
    ("Qwen2.5-0.5B shapes, 1,024-token completions", "peak memory falls with the budget", check_memory),
    ("`--dtype bfloat16` vs float32 update", "bf16 tokens/s >= float32's", check_dtype_speed),
    ("save and `--resume`", "steps 1..4 once; accuracy within 0.05", check_resume),
    ("graphed decode, bf16 weights; a sliding window", "same tokens, log mu within GRAPH_GAP; sliding: plain",
     check_graphed_decode),
]


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")  # a pipe inside a cell would split it


def ensure_datasets(wheels) -> None:
    """`datasets` importable, or installed offline from the wheels in `wheels`, or one line saying what to do."""
    try:
        import datasets  # noqa: F401
        return
    except ImportError:
        if not wheels:
            sys.exit("gpu_check: this machine lacks `datasets` (dppo.py's task is a datasets.Dataset): pip install "
                     "datasets, or make wheels with `pip download datasets -d wheels` and pass --wheels wheels")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels, "datasets"],
                   check=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes and a 2-step default run, on any device")
    p.add_argument("--wheels", help="a folder of wheels to install `datasets` from, offline, when it is missing")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check"))
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    ensure_datasets(a.wheels)
    ctx = argparse.Namespace(out=a.out, dev=dppo.pick_device(a.device))
    ctx.device = str(ctx.dev)
    os.makedirs(a.out, exist_ok=True)
    ctx.short = ["--steps", "2", "--warm_start_steps", "20", "--eval_size", "50"] if a.smoke else []
    if a.smoke:
        ctx.shapes = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
        ctx.B, ctx.P, ctx.T, ctx.budget = 4, 8, 32, 80
    else:
        ctx.shapes = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768)
        ctx.B, ctx.P, ctx.T, ctx.budget = 16, 64, 1024, 4 * 1088
    name = torch.cuda.get_device_name() if ctx.dev.type == "cuda" else ctx.device
    res = {"device": name, "torch": torch.__version__, "smoke": a.smoke, "checks": []}
    t_all = time.time()
    for check, threshold, fn in CHECKS:
        t0 = time.time()
        try:
            passed, result, numbers = fn(ctx)
            verdict = "PASS" if passed else "FAIL"
        except Exception as e:  # one check's failure must not hide the others
            verdict, result, numbers = "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", {}
        row = {"check": check, "threshold": threshold, "result": result, "verdict": verdict,
               "seconds": round(time.time() - t0, 1), **numbers}
        res["checks"].append(row)
        print(f"{verdict}  {check}: {result} ({threshold}; {row['seconds']} s)", flush=True)
    res["seconds"] = round(time.time() - t_all, 1)
    lines = [f"{cell(name)}, torch {torch.__version__}{' (smoke size)' if a.smoke else ''}, {res['seconds']} s", "",
             "| check | threshold | result | verdict |", "| --- | --- | --- | --- |"]
    for row in res["checks"]:
        lines.append(f"| {cell(row['check'])} | {cell(row['threshold'])} | {cell(row['result'])} | {row['verdict']} |")
    res["markdown"] = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(res["markdown"])
    print("\n" + res["markdown"])
    return res


if __name__ == "__main__":
    main()
