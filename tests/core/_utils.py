"""Shared builders for the core-engine tests: a tiny model, ragged batches, chunked steps."""

from __future__ import annotations

import copy
import os
import random

import torch

from splitrl.loss import ClippedPGLoss, GRPOLossConfig, LossType
from splitrl.models import ModelConfig, MTPConfig, PolicyModel
from splitrl.train import MicrobatchConfig, OptimConfig, SpeedConfig, TrainBatch, TrainConfig, TrainWorker

VOCAB = 128
# SPLITRL_TEST_DEVICE=cuda runs the worker tests on a GPU (the device machine); comparisons
# happen on CPU copies.
DEVICE = os.environ.get("SPLITRL_TEST_DEVICE", "cpu")


def make_model(
    D=0, detach=True, repeated=False, lam=0.1, family="qwen3", seed=0, objective="ce", **backbone
) -> PolicyModel:
    cfg = ModelConfig(
        family=family,
        seed=seed,
        mtp=MTPConfig(
            mtp_num_layers=D,
            mtp_detach_heads=detach,
            mtp_use_repeated_layer=repeated,
            mtp_loss_scaling_factor=lam,
            mtp_objective=objective,
        ),
    )
    if backbone:
        cfg.backbone.update(backbone)
    return PolicyModel.from_config(cfg)


def make_batch(n=16, seed=0, masked=(3, 10), prev=True, ref=False) -> TrainBatch:
    """n samples with ragged prompt (2-6) and response (1-9) lengths; ``masked`` samples filtered."""
    g = torch.Generator().manual_seed(seed)
    ids, tm, gen, prv, rf = [], [], [], [], []
    for i in range(n):
        P = int(torch.randint(2, 7, (), generator=g))
        R = int(torch.randint(1, 10, (), generator=g))
        ids.append(torch.randint(0, VOCAB, (P + R,), generator=g))
        tm.append(torch.cat([torch.zeros(P), torch.ones(R)]))
        gen.append(-torch.rand(P + R, generator=g) * 5)
        prv.append(gen[-1] + 0.3 * torch.randn(P + R, generator=g))
        rf.append(gen[-1] + 0.2 * torch.randn(P + R, generator=g))
    sample_mask = torch.ones(n)
    for i in masked:
        if i < n:
            sample_mask[i] = 0.0
    return TrainBatch(
        input_ids=ids,
        token_mask=tm,
        advantages=torch.randn(n, generator=g),
        sample_mask=sample_mask,
        generation_logprobs=gen,
        prev_logprobs=prv if prev else None,
        reference_logprobs=rf if ref else None,
    )


def make_loss(loss_type=LossType.TOKEN_LEVEL, **kw) -> ClippedPGLoss:
    base = dict(loss_type=loss_type, clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=2.0, entropy_coef=0.01)
    base.update(kw)
    return ClippedPGLoss(GRPOLossConfig(**base))


def make_worker(
    model,
    lr=1e-3,
    precision="fp32",
    mbs=3,
    max_tokens=None,
    pack=False,
    max_grad_norm=1.0,
    device=None,
    speed=None,
    **optim,
):
    """A train worker on ``device`` (default: ``SPLITRL_TEST_DEVICE``, else cpu); ``speed``: a
    :class:`SpeedConfig` (default: the defaults)."""
    cfg = TrainConfig(
        precision=precision,
        device=device or DEVICE,
        speed=speed or SpeedConfig(),
        microbatch=MicrobatchConfig(micro_batch_size=mbs, max_tokens_per_microbatch=max_tokens, pack_sequences=pack),
        optim=OptimConfig(lr=lr, max_grad_norm=max_grad_norm, weight_decay=0.01, warmup_steps=1, **optim),
    )
    return TrainWorker(model, cfg)


def partition(batch: TrainBatch, sizes: list[int], order: list[int] | None = None) -> list[TrainBatch]:
    idx = list(range(len(batch))) if order is None else order
    out, start = [], 0
    for s in sizes:
        out.append(batch.select(idx[start : start + s]))
        start += s
    assert start == len(batch)
    return out


def capture_grads(worker: TrainWorker) -> list[dict[str, torch.Tensor]]:
    """Normalized, clipped gradients of every step, captured right before optimizer.step."""
    store: list[dict[str, torch.Tensor]] = []

    def hook(opt, args, kwargs):
        grads = {}
        for n, p in worker.model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach()
                g = g.full_tensor() if hasattr(g, "full_tensor") else g  # FSDP2 shards (collective)
                grads[n] = g.cpu().clone()
        store.append(grads)

    worker.optimizer.register_step_pre_hook(hook)
    return store


def run_split(worker, loss, steps: list[list[TrainBatch]]) -> list[dict]:
    metrics = []
    for chunks in steps:
        worker.begin_train_step(loss)
        for c in chunks:
            worker.train_microbatch(c)
        metrics.append(worker.finish_train_step())
    return metrics


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return copy.deepcopy(tree)


def optim_state(worker) -> dict:
    return _to_cpu(worker.optimizer.state_dict())


def assert_metrics_close(a: dict, b: dict, rtol=1e-5, atol=1e-9):
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for k in a:
        x, y = a[k], b[k]
        if x != x and y != y:  # both NaN
            continue
        assert abs(x - y) <= atol + rtol * abs(y), f"metric {k}: {x} vs {y}"


def assert_params_close(pa, pb, lr, rms=1e-3, worst=0.1):
    """Per tensor, in units of lr: RMS(Δ) ≤ ``rms``·lr and max|Δ| ≤ ``worst``·lr."""
    for n in pa:
        d = (pa[n] - pb[n]).abs()
        assert d.pow(2).mean().sqrt().item() <= rms * lr, (
            f"param {n}: RMS diff {d.pow(2).mean().sqrt().item()} > {rms}*lr"
        )
        assert d.max().item() <= worst * lr, f"param {n}: max diff {d.max().item()} > {worst}*lr"


def assert_grads_close(ga, gb, rtol=1e-5, floor=None):
    """rtol per element, with an absolute floor of ``floor`` (default rtol) × the tensor's largest
    entry (an element near zero has no meaningful relative error)."""
    assert set(ga) == set(gb), sorted(set(ga) ^ set(gb))
    for n in ga:
        atol = (floor or rtol) * float(gb[n].abs().max()) + 1e-12
        torch.testing.assert_close(ga[n], gb[n], rtol=rtol, atol=atol, msg=lambda m: f"grad {n}: {m}")


def assert_optim_close(sa, sb, rtol=1e-5, floor=1e-4, sq_floor=None):
    """AdamW moments: rtol, with an absolute floor of ``floor`` × the tensor's max for exp_avg and
    ``sq_floor`` (default 3 · ``floor``) for exp_avg_sq, which holds squared gradients: a gradient
    error δ <= f · max|g| makes g² off by up to 2|g|δ <= 2 f · max g² at each step."""
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            ref = sb["state"][i][k]
            f = (3 * floor if sq_floor is None else sq_floor) if k == "exp_avg_sq" else floor
            atol = f * float(ref.abs().max()) + 1e-30
            torch.testing.assert_close(sa["state"][i][k], ref, rtol=rtol, atol=atol)


def shuffled(n, seed) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order
