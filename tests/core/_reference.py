"""An independent, per-sample re-implementation of the step's losses (no microbatch builder, no
padding, no packing, plain cross-entropy and a dense KL) — what the worker's numbers are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_terms(model, batch, temperature=1.0):
    """For each sample: main logprobs of tokens 1..L-1, and per depth (term, hit, mask) vectors;
    the term is the model's ``mtp_objective`` (CE on the target, or KL(p̄ ‖ q_k) at ``temperature``)."""
    out = []
    D = model.num_mtp_depths
    for i in range(len(batch)):
        ids = batch.input_ids[i][None]
        tm = batch.token_mask[i].float()
        sm = float(batch.sample_mask[i])
        L = ids.shape[1]
        emb = model.backbone.model.embed_tokens(ids)
        h0 = model.backbone.model(inputs_embeds=emb).last_hidden_state  # plain causal, one sample
        W = model.backbone.lm_head.weight
        logits = F.linear(h0[0, :-1], W) / temperature
        lp = -F.cross_entropy(logits, ids[0, 1:], reduction="none")
        mask = tm[1:] * sm
        depths = []
        detach = model.mtp_config.mtp_detach_heads
        h_prev = h0.detach() if detach else h0
        e = emb.detach() if detach else emb
        Wm = W.detach() if detach else W
        pos = torch.arange(L)[None]
        for k in range(1, D + 1):
            n = L - k  # positions t with x_{t+k} inside the sample
            if n <= 0:
                depths.append(None)
                continue
            pe = model.backbone.model.rotary_emb(h_prev[:, :n], pos[:, :n])
            # depth k's own modules (one set for every depth when repeated), composed here by hand
            dm = model.mtp.depths[0 if model.mtp.repeated else k - 1]
            u = torch.cat([dm.pre_fc_norm_embedding(e[:, k : k + n]), dm.pre_fc_norm_hidden(h_prev[:, :n])], -1)
            x = dm.layer(
                F.linear(u, dm.fc.weight), attention_mask=None, position_embeddings=pe, position_ids=pos[:, :n]
            )
            if isinstance(x, tuple):
                x = x[0]
            h_k = dm.norm(x)
            # position t targets x_{t+k+1}: valid for t <= L-k-2
            m = n - 1
            if m <= 0:
                depths.append((torch.zeros(0), torch.zeros(0), torch.zeros(0)))
            else:
                logits_k = F.linear(h_k[0, :m], Wm)
                tgt = ids[0, k + 1 : k + 1 + m]
                if model.mtp_config.mtp_objective == "distill":
                    # KL(p̄ ‖ q_k) at T: p̄ the main head at t + k (predicting x_{t+k+1}), detached
                    teacher = F.log_softmax(F.linear(h0[0, k : k + m], W).detach() / temperature, -1)
                    student = F.log_softmax(logits_k / temperature, -1)
                    term = (teacher.exp() * (teacher - student)).sum(-1)
                else:
                    term = F.cross_entropy(logits_k, tgt, reduction="none")
                hit = (logits_k.argmax(-1) == tgt).float()
                depths.append((term, hit, tm[k + 1 : k + 1 + m] * sm))
            h_prev = h_k
        out.append({"logprobs": lp, "mask": mask, "depths": depths})
    return out


def mtp_raw_sum(terms, D):
    """Σ_k Σ_t ℓ_k(t)·mask_k(t) over every sample (λ/D not applied)."""
    total = 0.0
    for s in terms:
        for d in s["depths"]:
            if d is not None and d[0].numel():
                total = total + (d[0] * d[2]).sum()
    return total


def mtp_metrics(terms, D):
    out = {}
    for k in range(D):
        ce = sum(
            float((s["depths"][k][0] * s["depths"][k][2]).sum())
            for s in terms
            if s["depths"][k] is not None and s["depths"][k][0].numel()
        )
        hit = sum(
            float((s["depths"][k][1] * s["depths"][k][2]).sum())
            for s in terms
            if s["depths"][k] is not None and s["depths"][k][0].numel()
        )
        cnt = sum(
            float(s["depths"][k][2].sum()) for s in terms if s["depths"][k] is not None and s["depths"][k][0].numel()
        )
        out[f"mtp/mtp_{k + 1}_loss"] = ce / cnt
        out[f"mtp/mtp_{k + 1}_acceptance_rate"] = 100 * hit / cnt
        out[f"mtp/mtp_{k + 1}_num_tokens"] = cnt
    return out


def sequence_level_pg(terms, batch):
    """Sequence-level mean of −A·logπ (ratio 1 at the step start, no clip active) over N_s."""
    total, n_s = 0.0, float(batch.sample_mask.sum())
    for i, s in enumerate(terms):
        cnt = s["mask"].sum()
        if cnt > 0:
            total = total + (-(batch.advantages[i]) * s["logprobs"] * s["mask"]).sum() / cnt
    return total / n_s
