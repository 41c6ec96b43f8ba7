"""
The studies' comparison of the two rules on the same tokens, kept out of dppo.py's copyable losses.

`compared_loss` has dppo.rows_loss's signature, so `dppo.train(cfg, loss_fn=compared_loss)` runs the configured loss
unchanged and adds to its statistics (sums and counts, as the losses' own) the tokens that the run's own rule masked
and that the other rule would have masked on the same tokens: beside DPPO (any divergence, PG-IS, PG-TIS), ratio
clipping at 0.2 / 0.28; beside ratio clipping, DPPO-TV at 0.15. For each, how many were rare under mu (mu < 0.15,
where the paper finds most of PPO's clipped tokens) and how far they had moved (|pi - mu|). `with_shares` turns a
metrics.jsonl row's sums into the shares the studies' tables read (masked_low_mu, masked_dp, rival_*).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
import dppo  # noqa: E402

LOW_MU = 0.15            # "rare under mu"
RIVAL_EPS = (0.2, 0.28)  # beside DPPO: ratio clipping with Clip-Higher
RIVAL_DELTA = 0.15       # beside ratio clipping: DPPO-TV


@torch.no_grad()
def both_masks(cfg: dppo.Config, ro: dppo.Rollout, adv, i, logp, topk_logp) -> tuple[torch.Tensor, torch.Tensor]:
    """(the run's own rule's M_t, the other rule's M_t) on rows i, (b, T') each, as dppo's losses compute them."""
    T = logp.shape[1]
    lp, lmu = dppo._logp32(logp.detach()), dppo._logp32(ro.logp_mu[i, :T])  # (b, T) each
    a = adv[i].float()[:, None].expand_as(lp)                                 # (b, T)
    w = (lp - lmu).clamp(-dppo.LOG_RATIO_CLAMP, dppo.LOG_RATIO_CLAMP).exp()   # (b, T) r_t

    def clip_kept(eps_low, eps_high):  # 0 where the clipped branch of min(rA, clip(r)A) wins
        return (w.clamp(1 - eps_low, 1 + eps_high) * a >= w * a).float()
    if cfg.loss == "ratio_clip":
        tv_kept = dppo.trust_region_mask(lp, lmu, a, (lp.exp() - lmu.exp()).abs(), RIVAL_DELTA, RIVAL_DELTA)
        return clip_kept(cfg.eps_low, cfg.eps_high), tv_kept
    if cfg.divergence.startswith("topk"):
        div = dppo.DIVERGENCES[cfg.divergence](topk_logp, ro.topk_logp_mu[i, :T])
    else:
        div = dppo.DIVERGENCES[cfg.divergence](lp, lmu)
    default = dppo.DIVERGENCE_DEFAULT_DELTA[cfg.divergence.split("_")[1]]
    low = default if cfg.delta_low is None else cfg.delta_low
    high = default if cfg.delta_high is None else cfg.delta_high
    return dppo.trust_region_mask(lp, lmu, a, div, low, high), clip_kept(*RIVAL_EPS)


def compared_loss(cfg: dppo.Config, ro: dppo.Rollout, adv, i, logp, topk_logp):
    """dppo.rows_loss, its statistics extended by the comparison's sums (0-dim tensors)."""
    loss, stats = dppo.rows_loss(cfg, ro, adv, i, logp, topk_logp)
    own, other = both_masks(cfg, ro, adv, i, logp, topk_logp)
    with torch.no_grad():
        T = logp.shape[1]
        valid = ro.completion_mask[i, :T].float()                              # (b, T)
        lp, lmu = dppo._logp32(logp.detach()), dppo._logp32(ro.logp_mu[i, :T])
        dp = (lp.exp() - lmu.exp()).abs()                                      # |pi(a_t) - mu(a_t)|
        low = (lmu.exp() < LOW_MU).float()                                     # rare under mu
        cut, rival = valid * (1 - own), valid * (1 - other)
        stats.update(low_mu_masked=(cut * low).sum(), dp_masked=(cut * dp).sum(), tokens_rival=rival.sum(),
                     low_mu_rival=(rival * low).sum(), dp_rival=(rival * dp).sum())
    return loss, stats


def with_shares(row: dict) -> dict:
    """A metrics.jsonl row with the comparison's sums turned into the shares the studies read (rows without them, and
    rows already converted, are returned as they are)."""
    if "low_mu_masked" not in row:
        return row
    row = dict(row)
    cut, rival = max(row["tokens_masked"], 1.0), max(row["tokens_rival"], 1.0)
    row["masked_low_mu"], row["masked_dp"] = row.pop("low_mu_masked") / cut, row.pop("dp_masked") / cut
    row["rival_masked_frac"] = row["tokens_rival"] / max(row["tokens"], 1.0)
    row["rival_masked_low_mu"], row["rival_masked_dp"] = row.pop("low_mu_rival") / rival, row.pop("dp_rival") / rival
    return row
