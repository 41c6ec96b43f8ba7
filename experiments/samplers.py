"""
Samplers that stand for an inference engine, for the studies: each has sample_with_topk's signature and is handed
the policy at every call, so that `dppo.train(cfg, sampler=...)` runs with it.

  CopySampler(torch.bfloat16)  a bf16 copy of the policy, synced before each rollout (an engine's usual precision)
  Float8Sampler()              a simulated FP8 engine (W8A8): every matrix weight rounded to float8 e4m3 with one scale
                               per output channel after each sync, every linear input per token; the embeddings, the
                               head, norms and softmax stay float32. A model with a matrix weight outside nn.Linear
                               (GPT-2's Conv1D, fused MoE experts) is refused: its "FP8" would be partly float32.
  LaggedSampler(k)             samples with the policy's weights of k steps ago, as an asynchronous trainer does
  RecomputedAnchor(inner)      PPO's "old policy" (the paper's MiniRL): any of these, its log mu replaced by the
                               trainer's own scores of the same tokens before the update, pi_old; the gap
                               |pi_old - mu| it hides is kept in .log, one row per rollout

make_sampler(precision, lag, anchor) picks one ("float32", lag 0 and the rollout anchor: None, the policy itself).
The lagged sampler's history is not in dppo.py's checkpoint: a resumed run starts it afresh.
"""
import copy
import dataclasses
import os
import sys
from collections import deque

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
import dppo  # noqa: E402

FLOAT8_MAX = 448.0  # the largest float8 e4m3fn value


def round_to_float8(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to float8 e4m3 with one scale per slice along `dim`, s = max |x| / 448, then dequantised."""
    scale = (x.abs().amax(dim=dim, keepdim=True) / FLOAT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


class CopySampler:
    """sample_with_topk on a copy of the policy with its weights in `dtype`, synced from the policy before each call.
    Only the weights are cast: float32 buffers (rotary frequencies) stay float32, as an engine keeps them."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.copy = None

    def prepare(self, copy_of_policy) -> None:
        """Called once on the new copy (Float8Sampler adds its hooks here)."""

    def sync(self, model) -> None:
        if self.copy is None:
            self.copy = copy.deepcopy(model)
            with torch.no_grad():
                for p in self.copy.parameters():  # (not .to(dtype), which casts the buffers too)
                    p.data = p.data.to(self.dtype)
            self.prepare(self.copy)
        self.copy.load_state_dict(model.state_dict())

    def __call__(self, model, prompt_ids, prompt_mask, **kw) -> dppo.Rollout:
        self.sync(model)
        return dppo.sample_with_topk(self.copy, prompt_ids, prompt_mask, **kw)


def float8_linears(model) -> list:
    """The nn.Linear layers an FP8 engine quantises (all but the head); refuses a model whose other matrix weights
    (outside the input and output embeddings) are not in them."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    covered = {id(m.weight) for m in linears} | {id(head.weight), id(embed.weight)}
    other = [n for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in covered]
    if other:
        raise ValueError(f"Float8Sampler rounds nn.Linear weights only; {type(model).__name__} has {len(other)} other "
                         f"matrix weights (e.g. {other[0]}), which would stay float32")
    return linears


class Float8Sampler(CopySampler):
    """A simulated FP8 engine (W8A8) in float32 kernels: weights per output channel, activations per token."""

    def prepare(self, copy_of_policy) -> None:
        self.linears = float8_linears(copy_of_policy)
        for module in self.linears:
            module.register_forward_pre_hook(round_input)

    @torch.no_grad()
    def sync(self, model) -> None:
        super().sync(model)
        for module in self.linears:
            module.weight.copy_(self.round_weight(module.weight))

    def round_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The engine's weight format: float8 e4m3, one scale per output channel (a coarser engine overrides it)."""
        return round_to_float8(w, 1)


def round_input(module, args):
    return (round_to_float8(args[0], -1), *args[1:])  # one scale per token


class LaggedSampler:
    """Samples with the policy's weights of `lag` calls ago (fewer at the start), in a float32 copy."""

    def __init__(self, lag: int):
        self.states = deque(maxlen=lag + 1)
        self.copy = None

    def __call__(self, model, prompt_ids, prompt_mask, **kw) -> dppo.Rollout:
        if kw.get("greedy"):  # evaluation: the policy itself
            return dppo.sample_with_topk(model, prompt_ids, prompt_mask, **kw)
        self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if self.copy is None:
            self.copy = copy.deepcopy(model)
        self.copy.load_state_dict(self.states[0])
        return dppo.sample_with_topk(self.copy, prompt_ids, prompt_mask, **kw)


class RecomputedAnchor:
    """The rollout of `inner` (None: the policy itself) with log mu(a_t) and mu's top-K log-probs replaced by pi_old,
    the trainer's float32 scores of the same tokens before any update (in dppo.scoring_mode, as the trainer scores),
    so that the loss measures w and D against pi_old, as a trainer that recomputes the old policy does. The gap it
    hides, |pi_old(a_t) - mu(a_t)| over the completion tokens, is appended to .log per rollout (greedy calls pass
    through)."""

    def __init__(self, inner=None):
        self.inner = inner or dppo.sample_with_topk
        self.log = []  # per rollout: {"mismatch_dp_mean", "mismatch_dp_max", "anchor_dp_mean"}

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, **kw) -> dppo.Rollout:
        ro = self.inner(model, prompt_ids, prompt_mask, **kw)
        if kw.get("greedy"):
            return ro
        dppo.scoring_mode(model)  # as the trainer scores: no train-only noise
        logp, topk_logp = dppo.policy_logprobs(model, prompt_ids, prompt_mask, ro.completion_ids, ro.completion_mask,
                                               temperature=kw["temperature"], topk_ids=ro.topk_ids)  # (B, T), (B, T, K)
        logp = logp * ro.completion_mask  # (padding: log-prob 0, as captured)
        gap = (logp.exp() - ro.logp_mu.exp()).abs() * ro.completion_mask  # (B, T) |pi_old - mu|
        mean = float(gap.sum() / ro.completion_mask.sum().clamp_min(1))
        self.log.append({"mismatch_dp_mean": mean, "mismatch_dp_max": float(gap.max()), "anchor_dp_mean": mean})
        return dataclasses.replace(ro, logp_mu=logp, topk_logp_mu=topk_logp)


def make_sampler(precision: str = "float32", lag: int = 0, anchor: str = "rollout"):
    """The sampler a study's cell asks for; None (the policy itself) for float32 without lag on the rollout anchor."""
    if lag and precision != "float32":
        raise ValueError("a lagged sampler is float32 here")
    sampler = None
    if lag:
        sampler = LaggedSampler(lag)
    elif precision == "bfloat16":
        sampler = CopySampler(torch.bfloat16)
    elif precision == "float8":
        sampler = Float8Sampler()
    return RecomputedAnchor(sampler) if anchor == "recomputed" else sampler
