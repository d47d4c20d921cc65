"""The pieces that cut the op count of a decode step compute exactly what they replace (bit for
bit, torch.equal): the rotary table against the backbone's ``rotary_emb``, and whole rollouts with
the table against rollouts with the module."""

import pytest
import torch
from _rollout_helpers import make_model, random_prompts

from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout.forward import DecoderForward, mtp_parts

VOCAB = 128


def _norm(fwd, module, x):
    """The op-by-op norm of the code before the fused MTP input."""
    return fwd.k.rms_norm(x, module.weight, module.variance_epsilon)


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


# ---------------------------------------------------------------------------------------- MTP input


def _reference_drafter_step(drafter, h0_BWH, targets_BW, accepted_B, p0_B, counter_B, carry, seed_lo, seed_hi, length):
    """MTPDrafter.step as it was before its inputs were fused (embedding lookups, concatenations
    and norms as separate ops): the reference of the fused version."""
    B, W, H = h0_BWH.shape
    D = drafter.D
    model, fwd = drafter.model, drafter.fwd
    rows = torch.arange(B)
    embeds = model.embed_tokens(targets_BW)
    n_minus_1 = p0_B + accepted_B
    prev = h0_BWH
    new_carry, drafts, query = [], [], None
    for k in range(1, D + 1):
        pos, write, limit = fwd.k.draft_window(p0_B, accepted_B, n_minus_1, k, W, drafter.cache.scratch)
        hidden = prev if k == 1 else torch.cat([carry[k - 2][:, None], prev[:, : W - 1]], dim=1)
        emb = embeds
        if k >= 2:
            emb = torch.cat([embeds, model.embed_tokens(drafts[-1])[:, None]], dim=1)
            hidden = torch.cat([hidden, query[:, None]], dim=1)
        enorm, hnorm, fc, _, _ = mtp_parts(model, k)
        x = fc(torch.cat([_norm(fwd, enorm, emb), _norm(fwd, hnorm, hidden)], dim=-1))
        out = _mtp_decode_from_input(fwd, k, x, pos, write, limit, drafter.cache, length)
        window = out[:, :W]
        if k < D:
            new_carry.append(window[rows, accepted_B])
        query = window[rows, accepted_B] if k == 1 else out[:, W]
        drafts.append(drafter._draw(query, seed_lo, seed_hi, counter_B + (k - 1), k))
        prev = window
    carry_out = torch.stack(new_carry) if new_carry else carry
    return torch.stack(drafts, dim=1), carry_out


def _mtp_decode_from_input(fwd, depth, x, positions, write, limit, cache, length):
    _, _, _, layer, norm = mtp_parts(fwd.model, depth)
    cos, sin = fwd.model.rotary_emb(x, positions)
    plan = cache.plan(write, write, limit, length, None, kernels=fwd.k)
    return fwd._layer(layer, x, fwd._input_norm(layer, x), norm, cos, sin, cache, depth - 1, plan=plan)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("depths", [2, 3])
def test_drafter_step_equals_the_unfused_reference(dtype, depths):
    """The drafter step (fused MTP inputs, gathers, one carry copy) against the op-by-op reference:
    the same drafts, carry and MTP cache entries, bit for bit, over several acceptance lengths."""
    model = make_model(vocab=VOCAB, depths=depths).to(dtype)
    B = 4
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=30, batch_size=B), "cpu")
    engine.speculative_switch_off = False
    engine.generate(random_prompts(B, VOCAB, (3, 9), seed=1), list(range(B)))  # caches, state, drafter
    drafter, st = engine.runner.drafter, engine.runner.state
    D, W, H = drafter.D, drafter.D + 1, model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for trial in range(3):
            h0 = torch.randn(B, W, H, generator=g).to(dtype)
            targets = torch.randint(0, VOCAB, (B, W), generator=g)
            accepted = torch.tensor([0, D, 1, D - 1])[torch.randperm(B, generator=g)]
            p0 = torch.randint(2, 20, (B,), generator=g)
            counter = torch.randint(1, 10, (B,), generator=g)
            carry = torch.randn(D - 1, B, H, generator=g).to(dtype)
            args = (h0, targets, accepted, p0, counter, carry, st.seed_lo[:B], st.seed_hi[:B], 64)
            cache = drafter.cache
            saved = cache.k.clone(), cache.v.clone()
            drafts_out = torch.full((B, D), -1, dtype=torch.int64) if trial % 2 else None  # the engine's way
            drafts, new_carry = drafter.step(*args, drafts_out=drafts_out)
            assert drafts_out is None or drafts is drafts_out
            after = cache.k.clone(), cache.v.clone()
            cache.k.copy_(saved[0])
            cache.v.copy_(saved[1])
            ref_drafts, ref_carry = _reference_drafter_step(drafter, *args)
            assert torch.equal(drafts, ref_drafts) and torch.equal(new_carry, ref_carry), trial
            assert torch.equal(after[0], cache.k) and torch.equal(after[1], cache.v), trial
            assert new_carry.shape == (D - 1, B, H)


def test_mtp_input_with_a_custom_embedding_module():
    """An embedding that is not a plain lookup runs its own forward (here: a scaled embedding)."""
    model = make_model(vocab=VOCAB, depths=2)
    fwd = DecoderForward(model)
    assert fwd.plain_embedding is model.embed_tokens.weight
    ids = [torch.tensor([[1, 2, 3]]), torch.tensor([[4]])]
    hidden = [torch.randn(1, 3, 64), torch.randn(1, 1, 64)]
    enorm, hnorm, fc, _, _ = mtp_parts(model, 1)

    def reference(emb):
        h = torch.cat(hidden, 1)
        return fc(torch.cat([_norm(fwd, enorm, emb), _norm(fwd, hnorm, h)], dim=-1))

    with torch.no_grad():
        assert torch.equal(fwd._mtp_input(1, ids, hidden), reference(model.embed_tokens(torch.cat(ids, 1))))

        class Scaled(torch.nn.Embedding):
            def forward(self, x):
                return super().forward(x) * 2.0

        scaled = Scaled(VOCAB, 64)
        scaled.weight.copy_(model.embed_tokens.weight)
        model.backbone.set_input_embeddings(scaled)
        assert fwd.plain_embedding is None
        assert torch.equal(fwd._mtp_input(1, ids, hidden), reference(scaled(torch.cat(ids, 1))))


def test_step_index_helpers_equal_their_inline_versions():
    from splitrl.rollout import fused

    g = torch.Generator().manual_seed(0)
    for B, D in [(1, 1), (3, 2), (5, 3)]:
        tok, pos, cnt = (torch.randint(0, 50, (B,), generator=g) for _ in range(3))
        drafts = torch.randint(0, 50, (B, D), generator=g)
        steps = torch.arange(D + 1)
        ids, positions, counters = fused.verify_inputs(tok, drafts, pos, cnt)
        assert torch.equal(ids, torch.cat([tok[:, None], drafts], dim=1))
        assert torch.equal(positions, pos[:, None] + steps) and torch.equal(counters, cnt[:, None] + steps)
        width = 37
        rows = torch.arange(B)[:, None] * width
        ref = (rows + cnt[:, None] + torch.arange(D + 1)).reshape(-1)
        assert torch.equal(fused.output_index(cnt, width, D + 1), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,M", [(1, 1), (3, 1), (2, 3)])
def test_qkv_rope_equals_split_then_qk_rope(dtype, B, M):
    """The decode layer's split + norms + rotary of the fused q/k/v projection, against the separate
    ops; keys and values come back stacked in one contiguous [2, B, M, Hk, d] tensor (the cache
    writes both with one index_copy_)."""
    from splitrl.rollout import fused

    H, Hk, d = 4, 2, 16
    g = torch.Generator().manual_seed(B * 10 + M)
    qkv = torch.randn(B, M, (H + 2 * Hk) * d, generator=g).to(dtype)
    cos, sin = torch.randn(2, B, M, d, generator=g).to(dtype)
    qw, kw = torch.randn(2, d, generator=g).to(dtype)
    q, k, v = qkv.split([H * d, Hk * d, Hk * d], dim=-1)
    q, k, v = q.reshape(B, M, -1, d), k.reshape(B, M, -1, d), v.reshape(B, M, -1, d)
    nq, nk = H * d, Hk * d
    for new, ref in (
        (fused.qkv_norm_rope(qkv, nq, nk, d, qw, kw, 1e-6, cos, sin), fused.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)),
        (fused.qkv_rope(qkv, nq, nk, d, cos, sin), fused.qk_rope(q, k, cos, sin)),
    ):
        q_new, kv = new
        assert torch.equal(q_new, ref[0]) and torch.equal(kv[0], ref[1]) and torch.equal(kv[1], v)
        assert kv.shape == (2, B, M, Hk, d) and kv.is_contiguous()


def test_draft_window_default_query_is_p0_plus_accepted():
    from splitrl.rollout import fused

    g = torch.Generator().manual_seed(1)
    p0, a = torch.randint(0, 30, (6,), generator=g), torch.randint(0, 3, (6,), generator=g)
    for depth in (1, 2, 3):
        new = fused.draft_window(p0, a, None, depth, 3, 63)
        ref = fused.draft_window(p0, a, p0 + a, depth, 3, 63)
        assert all(torch.equal(x, y) for x, y in zip(new, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backbone_decode_with_fused_embedding_equals_the_module_path(dtype, monkeypatch):
    """backbone_decode's lookup + first input norm (one fused function) against the embedding module
    and a separate norm: the same h⁰ and the same cache entries, bit for bit."""
    from splitrl.rollout.kv import StaticKVCache

    model = make_model(vocab=VOCAB).to(dtype)
    fwd = DecoderForward(model)
    fwd.sync_rope_table(64)
    c = model.config
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (3, 2), generator=g)
    positions = torch.randint(0, 40, (3, 1), generator=g) + torch.arange(2)
    outs = []
    for fused_lookup in (True, False):
        if not fused_lookup:
            monkeypatch.setattr(DecoderForward, "plain_embedding", property(lambda self: None))
        cache = StaticKVCache(c.num_hidden_layers, 3, c.num_key_value_heads, 64, c.head_dim, dtype, "cpu")
        with torch.no_grad():
            outs.append((fwd.backbone_decode(ids, positions, cache, 48), cache.k, cache.v))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_compiled_index_helpers_equal_eager():
    """The integer helpers are compiled on CUDA: compiled (CPU backend, shape-dynamic) against eager."""
    from splitrl.rollout import fused

    torch._dynamo.reset()
    names = ("verify_inputs", "output_index", "draft_window")
    comp = {n: torch.compile(getattr(fused, n), dynamic=True) for n in names}
    g = torch.Generator().manual_seed(2)
    for B in (3, 7):
        tok, pos, cnt = (torch.randint(0, 50, (B,), generator=g) for _ in range(3))
        drafts = torch.randint(0, 50, (B, 2), generator=g)
        new, ref = comp["verify_inputs"](tok, drafts, pos, cnt), fused.verify_inputs(tok, drafts, pos, cnt)
        assert all(torch.equal(x, y) for x, y in zip(new, ref))
        assert torch.equal(comp["output_index"](cnt, 41, 3), fused.output_index(cnt, 41, 3))
        a = torch.randint(0, 3, (B,), generator=g)
        for depth in (1, 2):
            e, c = fused.draft_window(pos, a, None, depth, 3, 63), comp["draft_window"](pos, a, None, depth, 3, 63)
            assert all(torch.equal(x, y) for x, y in zip(e, c))


def test_a_model_made_under_inference_mode_generates():
    """Kind: crash on valid input (review). Tensors made under ``torch.inference_mode()`` have no
    version counter; the rope table's staleness check read it and every ``generate`` raised."""
    model = make_model(vocab=VOCAB)
    with torch.inference_mode():
        model = model.to(torch.bfloat16)
    assert model.rotary_emb.inv_freq.is_inference()
    engine = RolloutEngine(model, GenerationConfig(max_new_tokens=4, batch_size=2), "cpu")
    first = engine.generate([[1, 2, 3]], [0])
    assert len(first[0].response_ids) == 4
    assert engine.generate([[1, 2, 3]], [0])[0].response_ids == first[0].response_ids  # the table kept


def test_rope_table_sync_says_when_the_table_is_a_new_tensor():
    """The engine drops its captured CUDA graphs when the table becomes a new tensor (they read the
    old storage), and only then: a refresh of the values is in place."""
    model = make_model(vocab=VOCAB)
    fwd = DecoderForward(model)
    assert fwd.sync_rope_table(64) is True  # first build
    assert fwd.sync_rope_table(64) is False
    with torch.no_grad():
        model.rotary_emb.inv_freq.mul_(1.25)
    assert fwd.sync_rope_table(64) is False  # values refreshed in place
    assert fwd.sync_rope_table(128) is True
    model.to(torch.bfloat16)
    assert fwd.sync_rope_table(128) is True and fwd.rope_table.dtype == torch.bfloat16


def test_compiled_float_helpers_match_eager():
    """The fused float functions run compiled on CUDA; compiled here with the CPU backend (dynamic
    shapes, as Kernels compiles them) they match the eager ones to fp32 rounding (a reduction may be
    reordered, so not bit for bit), with every output in place: guards a function that traces into
    something else (a wrong split, a dropped norm, a mis-ordered concatenation)."""
    from splitrl.rollout import fused

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    H, d, nq, nk = 16, 4, 16, 8
    w_e, w_h, w_q, w_k = (torch.rand(n, generator=g) + 0.5 for n in (H, H, d, d))
    emb = torch.randn(VOCAB, H, generator=g)
    for B, Q in ((2, 1), (3, 3)):
        ids = torch.randint(0, VOCAB, (B, Q), generator=g)
        hid = torch.randn(B, Q, H, generator=g)
        qkv = torch.randn(B, Q, nq + 2 * nk, generator=g)
        cos, sin = torch.randn(B, Q, d, generator=g), torch.randn(B, Q, d, generator=g)
        cases = [
            (fused.embed_rms_norm, (ids, emb, w_e, 1e-6)),
            (fused.mtp_input, ([ids[:, :1], ids[:, 1:]] if Q > 1 else [ids], [hid], w_e, 1e-6, w_h, 1e-5, emb)),
            (fused.mtp_input, (emb[ids], [hid[:, :1], hid[:, 1:]] if Q > 1 else [hid], w_e, 1e-6, w_h, 1e-5)),
            (fused.qkv_norm_rope, (qkv, nq, nk, d, w_q, w_k, 1e-6, cos, sin)),
            (fused.qkv_rope, (qkv, nq, nk, d, cos, sin)),
        ]
        for fn, args in cases:
            eager = fn(*args)
            comp = torch.compile(fn, dynamic=True)(*args)
            eager = eager if isinstance(eager, tuple) else (eager,)
            comp = comp if isinstance(comp, tuple) else (comp,)
            assert len(eager) == len(comp)
            for e, c in zip(eager, comp):
                assert e.shape == c.shape and torch.allclose(e, c, atol=1e-5, rtol=1e-5), fn.__name__
            if fn in (fused.qkv_norm_rope, fused.qkv_rope):  # write_kv views the compiled kv as [2, -1, d]
                assert comp[1].is_contiguous()


@pytest.mark.parametrize("position_major", [False, True])
def test_write_kv_stores_what_write_stores(position_major):
    """The decode step's single write of stacked keys and values puts every entry where the two
    separate writes put it (both cache layouts; rows written to slots out of order, with a
    plan of the MTP depths' kind: explicit slots)."""
    from splitrl.rollout.kv import StaticKVCache

    g = torch.Generator().manual_seed(7)
    N, S, Hk, M, d, B, Q = 2, 5, 2, 12, 8, 3, 3
    caches = [StaticKVCache(N, S, Hk, M, d, torch.float32, "cpu", position_major=position_major) for _ in range(2)]
    for c in caches:
        assert c.k.data_ptr() == c.kv.data_ptr() and c.v.data_ptr() == c.kv[1].data_ptr()
    pos = torch.tensor([[3, 4, 5], [0, 1, 2], [7, 8, 9]])
    slots = torch.tensor([4, 0, 2])
    plans = [c.plan(pos, pos, pos, M, slots) for c in caches]
    k, v = torch.randn(2, B, Q, Hk, d, generator=g)
    caches[0].write(1, plans[0], k, v)
    caches[1].write_kv(1, plans[1], torch.stack((k, v)))
    assert torch.equal(caches[0].kv, caches[1].kv)
    assert torch.count_nonzero(caches[1].kv) == 2 * B * Q * Hk * d  # written once each, layer 1 only
    src, dst = torch.tensor([4]), torch.tensor([1])
    caches[1].move(src, dst)
    assert torch.equal(caches[1].k[:, 1], caches[1].k[:, 4]) and torch.equal(caches[1].v[:, 1], caches[1].v[:, 4])
