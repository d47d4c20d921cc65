"""Tiny fp32 models and teacher-forced references for the rollout tests."""

from __future__ import annotations

import random

import torch

from splitrl.models import ModelConfig, MTPConfig, PolicyModel
from splitrl.models.config import TINY_BACKBONE
from splitrl.models.policy import build_attention_mask


def make_model(
    vocab: int = 128,
    depths: int = 2,
    init: float = 0.3,
    attn: str = "sdpa",
    repeated: bool = False,
    seed: int = 0,
    family: str = "qwen3",
    **backbone,
) -> PolicyModel:
    """A random tiny policy of ``family`` (Qwen3 by default); a large ``init`` makes its
    distributions peaky (entropy ~2.5 nats). Biases (Qwen2's q/k/v), which transformers initializes
    to zero, are drawn like the weights, so that a forward that dropped or misplaced one would differ."""
    cfg = dict(TINY_BACKBONE, vocab_size=vocab, initializer_range=init, **backbone)
    mtp = MTPConfig(mtp_num_layers=depths, mtp_use_repeated_layer=repeated)
    model = PolicyModel.from_config(
        ModelConfig(family=family, backbone=cfg, mtp=mtp, attn_implementation=attn, seed=seed)
    ).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * init)
    return model


def random_prompts(n: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@torch.no_grad()
def teacher_forced(
    model: PolicyModel, prompt: list[int], response: list[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [R] from PolicyModel.forward, logits / T [R, V]) of the response tokens."""
    ids = torch.tensor([prompt + response], device=model.output_weight.device)
    mask = torch.zeros(ids.shape, device=ids.device) if model.num_mtp_depths else None
    lp = model(ids, mtp_loss_mask=mask, temperature=temperature).logprobs[0, len(prompt) :]
    hidden = model.backbone.model(input_ids=ids).last_hidden_state[0]
    logits = (hidden @ model.output_weight.T).float() / temperature
    return lp, logits[len(prompt) - 1 : -1]


@torch.no_grad()
def teacher_forced_mtp_hidden(model: PolicyModel, ids: list[int]) -> list[torch.Tensor]:
    """h^k [S, H] for k = 0..D over the full sequence, causal, positions 0..S-1 (as in training)."""
    x = torch.tensor([ids])
    S = x.shape[1]
    seg = torch.zeros_like(x)
    pos = torch.arange(S)[None]
    mask = build_attention_mask(seg, model.config._attn_implementation, torch.float32)
    embeds = model.embed_tokens(x)
    h = model.backbone.model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).last_hidden_state
    out = [h[0]]
    pe = model.rotary_emb(h, pos)
    for k in range(1, model.num_mtp_depths + 1):
        emb_k = torch.nn.functional.pad(embeds[:, k:], (0, 0, 0, k))
        h = model.mtp.depth_forward(k, emb_k, h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        out.append(h[0])
    return out


@torch.no_grad()
def reference_sample(
    model: PolicyModel,
    prompt: list[int],
    seed: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 16,
    stop_token_ids: tuple[int, ...] = (),
) -> tuple[list[int], list[float], str]:
    """The sampling definition, step by step with a full forward per token (no cache, no batch):
    token c = race_sample(filter(logits / T), seed, c); logprob of the unfiltered softmax(logits / T)."""
    from splitrl.rollout.sampling import STREAM_TARGET, filter_logits, race_sample, seed_words

    device = model.output_weight.device
    lo, hi = seed_words([seed], device)
    tokens: list[int] = []
    logprobs: list[float] = []
    while True:
        ids = torch.tensor([prompt + tokens], device=device)
        hidden = model.backbone.model(input_ids=ids).last_hidden_state[:, -1]
        logits = (hidden @ model.output_weight.T).float() / temperature
        c = torch.tensor([len(tokens)], device=device)
        y = int(race_sample(filter_logits(logits, top_k, top_p), lo, hi, c, STREAM_TARGET)[0])
        tokens.append(y)
        logprobs.append(float(logits.log_softmax(-1)[0, y]))
        if y in stop_token_ids:
            return tokens, logprobs, "stop"
        if len(tokens) >= max_new_tokens:
            return tokens, logprobs, "length"


def scripted_draw(ref: dict[int, list[int]], wrong: set[tuple[int, int]], vocab: int):
    """A stand-in for ``MTPDrafter._draw`` (monkeypatch it in): the draft at response index i of
    the sample with seed s is the reference token ``ref[s][i]``, made wrong (+1 mod vocab) when
    (s, i) is in ``wrong``; 0 past the reference."""

    def draw(self, hidden, seed_lo, seed_hi, counter, depth):
        out = []
        for s, i in zip(seed_lo.tolist(), counter.tolist()):
            tok = ref[s][i] if i < len(ref[s]) else 0
            out.append((tok + 1) % vocab if (s, i) in wrong else tok)
        return torch.tensor(out)

    return draw


def run_python(code: str, **env_vars):
    """``python -c code`` in a subprocess with ``env_vars`` set, importing the splitrl this test
    imported (environment switches are read at import: a subprocess sees them)."""
    import os
    import subprocess
    import sys

    import splitrl

    src = os.path.dirname(os.path.dirname(splitrl.__file__))
    env = {**os.environ, **env_vars, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def run_interpreted(code: str, **env_vars) -> list[str]:
    """The words ``code`` prints when run under Triton's interpreter (``TRITON_INTERPRET=1``: the
    kernels run on the CPU, in fp32; its bf16 is not faithful); skips where the interpreter cannot
    run, fails on any error."""
    import pytest

    res = run_python(code, TRITON_INTERPRET="1", **env_vars)
    if "only 0-dimensional arrays can be converted" in res.stderr:
        # Triton's interpreter takes int() of 1-element arrays, which some numpy versions refuse
        pytest.skip("Triton's interpreter does not run with this numpy; the CUDA tests run the kernel")
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.split()
