"""The GRPO clipped policy-gradient loss (DESIGN.md §2), returned as raw sums.

Legend: b = rows of a microbatch, s = positions, n = samples of the microbatch.

Per valid token t of sample i (mask m_t = token_mask[t]·sample_mask[i], position 0 of a sample
never counts):

    r_t   = exp(logπ(x_t) − logπ_prev(x_t))            token ratio (PPO, Schulman et al. 2017, eq. 7)
    r_t   = sg[s_i] · π(x_t) / sg[π(x_t)]              with ``ratio_level="sequence"`` (the GSPO-token
            s_i = exp(mean_t' [logπ − logπ_prev])       form, Zheng et al. 2025): its value is the
                                                       sequence ratio s_i, its gradient s_i·∇logπ_t
    pg_t  = −min(r_t·A_i, clip(r_t, 1−ε_low, 1+ε_high)·A_i)          (ε_high > ε_low: DAPO clip-higher)
    pg_t  = min(pg_t, −c·A_i) where A_i < 0            dual clip (Ye et al. 2020, eq. 5), c > 1
    pg_t *= w_t = min(exp(logπ_prev − logπ_gen), C)    truncated importance sampling (detached);
                                                       token t's gradient carries its own w_t, in
                                                       GSPO too (DESIGN §5)
    ℓ_t   = pg_t + β·KL_t − α·H_t                      KL estimators k1/k2/k3 (Schulman 2020) of π vs ref

TOKEN_LEVEL returns Σ_t ℓ_t·m_t (finish divides by N_t); SEQUENCE_LEVEL returns
Σ_i sample_mask_i · Σ_t ℓ_t·m_t / Σ_t m_t (finish divides by N_s).

``prev`` logprobs: a chunk's ``prev_logprobs`` when given; otherwise, with
``recompute_prev_logprobs`` (default), the forward's own logprobs, detached. That *is* the
recomputation DESIGN §5 asks for: one step makes one optimizer update, so every microbatch of a
step runs with the weights of the step's start; no second forward is needed. With
``recompute_prev_logprobs=False`` they are the generation logprobs.
"""

from __future__ import annotations

import torch

from splitrl.loss.base import LossOutput, LossType, Metric, Normalizer
from splitrl.loss.config import GRPOLossConfig  # noqa: F401 - defined there, torch-free


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    fill = float("inf") if kind == "min" else float("-inf")
    vals = torch.where(mask > 0, x.detach(), torch.full_like(x, fill))
    return vals.min() if kind == "min" else vals.max()


class ClippedPGLoss:
    """GRPO clipped policy-gradient loss; see the module docstring.

    Args:
        config: :class:`GRPOLossConfig` (or keyword arguments of it).

    Metrics (raw sums; normalizer in brackets): ``loss``, ``pg_loss``, ``kl_loss``,
    ``entropy_loss`` [like the gradient]; ``entropy``, ``clip_fraction``, ``kl``,
    ``is_weight_mean``, ``logprob_mismatch`` (|logπ − logπ_gen|, the trainer's logprobs at the step's
    start against the rollout engine's), ``ratio_mean`` [TOKENS];
    ``ratio_min``/``ratio_max``, ``is_weight_max`` [min/max]; ``num_tokens``, ``num_samples`` [NONE].
    """

    def __init__(self, config: GRPOLossConfig | None = None, **kwargs) -> None:
        self.config = config if config is not None else GRPOLossConfig(**kwargs)
        self.loss_type = self.config.loss_type
        self.temperature = self.config.temperature
        self.needs_entropy = True
        self.needs_reference_logprobs = self.config.kl_coef > 0

    def validate_batch(self, batch) -> None:
        """Raise ``ValueError`` when the chunk lacks a field this configuration needs."""
        cfg = self.config
        need_gen = (not cfg.recompute_prev_logprobs) or cfg.tis_cap is not None
        if need_gen and batch.generation_logprobs is None:
            raise ValueError(
                "this loss needs generation_logprobs (recompute_prev_logprobs=False or tis_cap set); "
                "pass the rollout engine's logprobs in the chunk"
            )
        if cfg.kl_coef > 0 and batch.reference_logprobs is None:
            raise ValueError(
                f"kl_coef={cfg.kl_coef} needs reference_logprobs in every chunk; compute them with the "
                "reference policy or set kl_coef=0"
            )

    def _reduce(self, values_bs: torch.Tensor, mask_bs: torch.Tensor, mb) -> torch.Tensor:
        if self.loss_type == LossType.TOKEN_LEVEL:
            return (values_bs * mask_bs).sum()
        per_sample = mb.per_sample_sum(values_bs * mask_bs)
        counts = mb.per_sample_sum(mask_bs).clamp(min=1.0)
        return (per_sample / counts * mb.sample_mask).sum()

    def __call__(self, output, mb) -> LossOutput:
        cfg = self.config
        m = mb.loss_mask
        curr = output.logprobs
        gen = mb.generation_logprobs
        if mb.prev_logprobs is not None:
            prev = mb.prev_logprobs
        elif cfg.recompute_prev_logprobs or gen is None:
            prev = curr.detach()
        else:
            prev = gen
        adv = mb.token_advantages()

        log_ratio = (curr - prev) * m
        if cfg.ratio_level == "sequence":
            seq = mb.per_sample_sum(log_ratio) / mb.per_sample_sum(m).clamp(min=1.0)
            # GSPO-token form: the value is the sequence ratio s_i, the gradient at token t is
            # s_i·∇logπ_t, so a per-token weight w_t multiplies token t's own gradient (with the
            # plain broadcast form every token would get the sample's mean weight)
            log_ratio = mb.gather_samples(seq).detach() + (curr - curr.detach()) * m
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
        surr = torch.minimum(ratio * adv, clipped * adv)
        pg = -surr
        if cfg.dual_clip_c is not None:
            pg = torch.where(adv < 0, torch.minimum(pg, -cfg.dual_clip_c * adv), pg)
        is_clipped = ((ratio * adv) > (clipped * adv)).float()

        metrics: dict[str, Metric] = {}
        if gen is not None:
            is_weight = torch.exp((prev - gen) * m).detach()
            if cfg.tis_cap is not None:
                is_weight = is_weight.clamp(max=cfg.tis_cap)
                pg = pg * is_weight
            metrics["is_weight_mean"] = Metric((is_weight * m).sum(), Normalizer.TOKENS)
            metrics["is_weight_max"] = Metric(_masked_extreme(is_weight, m, "max"), reduce="max")
            # the trainer's own logprobs at the step's start against the rollout engine's
            metrics["logprob_mismatch"] = Metric(((curr.detach() - gen).abs() * m).sum(), Normalizer.TOKENS)

        total = pg
        pg_loss = self._reduce(pg, m, mb)
        kl_loss = pg_loss.new_zeros(())
        if cfg.kl_coef > 0:
            ref = mb.reference_logprobs
            delta = (ref - curr) * m
            if cfg.kl_estimator == "k1":
                kl = -delta
            elif cfg.kl_estimator == "k2":
                kl = 0.5 * delta**2
            else:
                kl = torch.exp(delta) - delta - 1.0
            total = total + cfg.kl_coef * kl
            kl_loss = self._reduce(cfg.kl_coef * kl, m, mb)
            metrics["kl"] = Metric((kl * m).sum().detach(), Normalizer.TOKENS)
        entropy_loss = pg_loss.new_zeros(())
        if cfg.entropy_coef > 0:
            total = total - cfg.entropy_coef * output.entropy
            entropy_loss = self._reduce(-cfg.entropy_coef * output.entropy, m, mb)
        loss = self._reduce(total, m, mb)

        metrics.update(
            {
                "loss": Metric(loss.detach()),
                "pg_loss": Metric(pg_loss.detach()),
                "kl_loss": Metric(kl_loss.detach()),
                "entropy_loss": Metric(entropy_loss.detach()),
                "entropy": Metric((output.entropy.detach() * m).sum(), Normalizer.TOKENS),
                "clip_fraction": Metric((is_clipped * m).sum(), Normalizer.TOKENS),
                "ratio_mean": Metric((ratio.detach() * m).sum(), Normalizer.TOKENS),
                "ratio_min": Metric(_masked_extreme(ratio, m, "min"), reduce="min"),
                "ratio_max": Metric(_masked_extreme(ratio, m, "max"), reduce="max"),
                "num_tokens": Metric(m.sum().detach(), Normalizer.NONE),
                "num_samples": Metric(mb.sample_mask.sum().detach(), Normalizer.NONE),
            }
        )
        return LossOutput(loss=loss, metrics=metrics)
