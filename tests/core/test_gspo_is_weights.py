"""Kind guarded: a per-token weight smeared over the sequence (issue 6, item 4).

With sequence-level ratios (GSPO) and truncated importance weights w_t, token t's gradient must
carry its own w_t: the GSPO-token form r_t = sg[s_i]·π_t/sg[π_t] (value s_i, gradient s_i·∇logπ_t)
times w_t. The plain broadcast s_i would give every token the sample's mean weight.

Reference: the objective written out per sample below (independently of the loss's batched code),
differentiated by autograd; and, for unclipped samples, the closed form ∂L/∂logπ_t = −A·s·w_t.
"""

from types import SimpleNamespace

import pytest
import torch

from splitrl.loss import ClippedPGLoss, GRPOLossConfig, LossType
from splitrl.train import MicrobatchConfig, TrainBatch, build_microbatches

CAP = 1.5
EPS = 0.2


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, tm, gen, prev = [], [], [], []
    for i in range(6):
        P, R = 3, 4 + i % 3
        ids.append(torch.randint(0, 50, (P + R,), generator=g))
        tm.append(torch.cat([torch.zeros(P), torch.ones(R)]))
        p = -torch.rand(P + R, generator=g) * 3
        prev.append(p)
        gen.append(p + 0.8 * torch.randn(P + R, generator=g))  # weights on both sides of the cap
    return TrainBatch(
        input_ids=ids,
        token_mask=tm,
        advantages=torch.tensor([1.0, -0.7, 0.4, -1.3, 0.9, -0.2]),
        generation_logprobs=gen,
        prev_logprobs=prev,
    )


def _reference(curr_rows, batch, loss_type):
    """Σ over samples of the GSPO-token surrogate with per-token truncated IS weights."""
    total = 0.0
    for i, c_all in enumerate(curr_rows):
        keep = batch.loss_mask(i) > 0
        c, p, gen = c_all[keep], batch.prev_logprobs[i][keep], batch.generation_logprobs[i][keep]
        A = batch.advantages[i]
        s = torch.exp((c - p).mean())
        r = s.detach() * torch.exp(c - c.detach())
        w = torch.clamp(torch.exp(p - gen), max=CAP)
        pg = -torch.minimum(r * A, torch.clamp(r, 1 - EPS, 1 + EPS) * A) * w
        total = total + (pg.sum() if loss_type == LossType.TOKEN_LEVEL else pg.mean())
    return total


@pytest.mark.parametrize("loss_type", [LossType.TOKEN_LEVEL, LossType.SEQUENCE_LEVEL])
def test_gspo_token_gradient_carries_each_tokens_own_is_weight(loss_type):
    batch = _batch()
    (mb,) = build_microbatches(batch, MicrobatchConfig(micro_batch_size=len(batch)))
    g = torch.Generator().manual_seed(1)
    # the current policy: prev plus small moves, so some samples sit inside the clip range and
    # some outside it
    shift = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.4, -0.4])[:, None]  # samples 4, 5: clipped (A > 0, A < 0)
    base = (mb.prev_logprobs + shift + 0.1 * torch.randn(mb.prev_logprobs.shape, generator=g)) * mb.loss_mask
    curr = base.clone().requires_grad_(True)
    loss_fn = ClippedPGLoss(
        GRPOLossConfig(loss_type=loss_type, ratio_level="sequence", tis_cap=CAP, clip_eps_low=EPS, clip_eps_high=EPS)
    )
    out = loss_fn(SimpleNamespace(logprobs=curr, entropy=torch.zeros_like(curr)), mb)
    out.loss.backward()

    ref_curr = base.clone().requires_grad_(True)
    ref = _reference([ref_curr[i, : n] for i, n in enumerate(batch.lengths)], batch, loss_type)
    ref.backward()
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(curr.grad, ref_curr.grad, rtol=1e-6, atol=1e-7)

    # closed form on unclipped samples: −A·s·w_t (÷ |y| for the sequence-level mean)
    unclipped = 0
    for i in range(len(batch)):
        keep = mb.loss_mask[i] > 0
        s = torch.exp((base[i][keep] - mb.prev_logprobs[i][keep]).mean())
        if not (1 - EPS <= s <= 1 + EPS):
            continue
        unclipped += 1
        w = torch.clamp(torch.exp(mb.prev_logprobs[i][keep] - mb.generation_logprobs[i][keep]), max=CAP)
        expect = -batch.advantages[i] * s * w
        if loss_type == LossType.SEQUENCE_LEVEL:
            expect = expect / keep.sum()
        torch.testing.assert_close(curr.grad[i][keep], expect, rtol=1e-5, atol=1e-7)
        assert w.std() > 0.05  # the weights differ per token: the mean-weight form would fail here
    assert 0 < unclipped < len(batch)
