"""The pieces that cut the op count of a decode step compute exactly what they replace (bit for
bit, torch.equal): the rotary table against the backbone's ``rotary_emb``, and whole rollouts with
the table against rollouts with the module."""

import pytest
import torch
from _rollout_helpers import make_model, random_prompts

from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout.forward import DecoderForward

VOCAB = 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "backbone",
    [
        {},
        dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1, rope_theta=1_000_000.0),
        dict(head_dim=24, rope_theta=500_000.0),
    ],
)
def test_rope_table_rows_equal_the_rotary_module(dtype, backbone):
    """Row p of the table is the module's cos/sin at position p in any call: one position or many,
    one row or several, in order or not (the values are elementwise in the position)."""
    model = make_model(vocab=VOCAB, **backbone).to(dtype)
    fwd = DecoderForward(model)
    M = 1000
    fwd.sync_rope_table(M)
    table = fwd.rope_table
    assert table.shape == (M, 2, model.config.head_dim) and table.dtype == dtype
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(1, dtype=dtype)
    shapes = [(1, 1), (1, 3), (4, 1), (3, 4), (7, 5), (2, 33), (1, 257)]
    for B, Q in shapes:
        for positions in (
            torch.randint(0, M, (B, Q), generator=g),
            (torch.randint(0, M - Q, (B, 1), generator=g) + torch.arange(Q)),  # consecutive, as in a verify
        ):
            cos_ref, sin_ref = model.rotary_emb(x, positions)
            cos, sin = fwd.rope(x, positions)
            assert cos.dtype == sin.dtype == dtype
            assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref), (B, Q)
    # whole prefixes (prefill): a view of the table
    for B, P in [(1, 1), (3, 17), (2, M)]:
        cos_ref, sin_ref = model.rotary_emb(x, torch.arange(P).expand(B, P))
        cos, sin = fwd._rope_prefix(x, B, P)
        assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)


def test_rope_table_follows_the_module():
    """The table is rebuilt when the frequencies change (in place: captured graphs read it), and not
    rebuilt otherwise; without a table (another dtype, a RoPE whose values depend on the call) the
    module is called."""
    model = make_model(vocab=VOCAB)
    fwd = DecoderForward(model)
    fwd.sync_rope_table(64)
    table = fwd.rope_table
    before = table.clone()
    fwd.sync_rope_table(64)
    assert fwd.rope_table is table
    rope = model.rotary_emb
    with torch.no_grad():
        rope.inv_freq.mul_(1.5)  # an in-place change of the buffer
    fwd.sync_rope_table(64)
    assert fwd.rope_table is table and not torch.equal(table, before)
    x = torch.zeros(1)
    pos = torch.tensor([[5, 63]])
    assert all(torch.equal(a, b) for a, b in zip(fwd.rope(x, pos), rope(x, pos)))
    rope.inv_freq = rope.inv_freq / 1.5  # a new buffer object
    fwd.sync_rope_table(64)
    assert torch.equal(fwd.rope_table, before)
    fwd.sync_rope_table(128)  # a longer cache: a new table
    assert fwd.rope_table.shape[0] == 128 and torch.equal(fwd.rope_table[:64], before)
    # another dtype than the table's: the module
    xb = torch.zeros(1, dtype=torch.bfloat16)
    assert fwd.rope(xb, pos)[0].dtype == torch.bfloat16
    rope.rope_type = "longrope"
    fwd.sync_rope_table(128)
    assert fwd.rope_table is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("speculative", [False, True])
def test_rollouts_with_the_rope_table_equal_rollouts_with_the_module(dtype, speculative):
    model = make_model(vocab=VOCAB, depths=2).to(dtype)
    cfg = GenerationConfig(speculative=speculative, temperature=0.9, max_new_tokens=16, batch_size=3)
    prompts = random_prompts(5, VOCAB, (1, 9), seed=2)
    out = []
    for table in (True, False):
        engine = RolloutEngine(model, cfg, "cpu")
        engine.speculative_switch_off = False
        if not table:
            engine.fwd.sync_rope_table = lambda length: None  # the module at every call
        out.append(engine.generate(prompts, list(range(5))))
        assert (engine.fwd.rope_table is not None) == table
    for a, b in zip(*out):
        assert a.response_ids == b.response_ids
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
