"""The engine's fast path (static cache, device-side sampling, continuous batching) against the
sampling definition recomputed with a full forward per token; weight updates in place."""

import pytest
import torch
from _rollout_helpers import make_model, random_prompts, reference_sample

from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout import runner as runner_mod
from splitrl.rollout import scheduler as scheduler_mod

VOCAB = 64


# the dense families of the registry, each through the same exactness test (qwen2: q/k/v biases)
FAMILIES = ["qwen3", "llama", "qwen2"]
_BY_FAMILY: dict = {}


def _family_model(family):
    if family not in _BY_FAMILY:
        _BY_FAMILY[family] = make_model(vocab=VOCAB, depths=2, seed=3, family=family)
    return _BY_FAMILY[family]


@pytest.fixture(scope="module")
def model():
    return _family_model("qwen3")


def _check_against_reference(model, cfg, prompts, seeds, results):
    for prompt, seed, res in zip(prompts, seeds, results):
        tokens, logprobs, reason = reference_sample(
            model,
            prompt,
            seed,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=tuple(cfg.stop_token_ids),
        )
        assert res.response_ids == tokens and res.finish_reason == reason
        torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(logprobs), atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "speculative,temperature,top_k,top_p",
    [(False, 1.0, 0, 1.0), (False, 0.7, 10, 0.9), (True, 1.0, 0, 1.0), (True, 0.8, 12, 0.85)],
)
def test_tokens_and_logprobs_equal_the_step_by_step_reference(family, speculative, temperature, top_k, top_p):
    """Ragged prompts, more prompts than slots (refills), stop tokens, filters; plain and speculative;
    every dense family."""
    model = _family_model(family)
    cfg = GenerationConfig(
        speculative=speculative,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=12,
        stop_token_ids=[1, 2, 3],
        batch_size=3,
    )
    prompts = random_prompts(8, VOCAB, (1, 11), seed=21)
    seeds = [1000 + i for i in range(8)]
    engine = RolloutEngine(model, cfg, "cpu")
    results = engine.generate(prompts, seeds)
    _check_against_reference(model, cfg, prompts, seeds, results)
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}, reasons  # both end conditions exercised
    if speculative:
        assert engine.last_stats.accepted_tokens > 0


def test_results_do_not_depend_on_slots_refills_or_compaction(monkeypatch, model):
    """The same samples with 1 slot, 2 slots (refills) and 8 slots (rows moved to lower slots
    when a smaller bucket suffices), syncing every step or every 16 steps."""
    cfg = GenerationConfig(temperature=1.0, max_new_tokens=20, stop_token_ids=[4, 5, 6, 7], batch_size=8)
    prompts = random_prompts(8, VOCAB, (1, 9), seed=22)
    seeds = list(range(8))
    moves = []
    original = scheduler_mod.Scheduler.compact

    def recording(self, active, *a):
        moves.append(list(active))
        return original(self, active, *a)

    monkeypatch.setattr(scheduler_mod.Scheduler, "compact", recording)
    wide = RolloutEngine(model, cfg, "cpu").generate(prompts, seeds)
    assert any(m != list(range(len(m))) for m in moves)  # some rows really moved
    monkeypatch.setattr(scheduler_mod, "SYNC_EVERY", 1)
    for slots in (1, 2):
        narrow = RolloutEngine(model, cfg.model_copy(update={"batch_size": slots}), "cpu").generate(prompts, seeds)
        for a, b in zip(wide, narrow):
            assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert len({len(r.response_ids) for r in wide}) > 2  # ragged lengths


@pytest.mark.parametrize("speculative", [False, True])
def test_refills_padded_to_graph_buckets_sample_as_the_reference(monkeypatch, speculative):
    """The CUDA path's refills are padded to (rows, length) buckets (extra rows repeat the first
    one's inputs into a sink slot; prompts right-padded): run here eagerly, with refills of 1..3
    rows into 4 slots, the samples equal the step-by-step reference, and the padding happened."""
    model = make_model(vocab=VOCAB, depths=2, seed=3)
    cfg = GenerationConfig(
        speculative=speculative, temperature=0.9, max_new_tokens=10, stop_token_ids=[1, 2, 3], batch_size=4
    )
    prompts = random_prompts(9, VOCAB, (1, 20), seed=24)
    seeds = [500 + i for i in range(9)]
    shapes = []
    original = runner_mod.ModelRunner.prefill_device

    def recording(self, ids, lens, sl, *a):
        pad_slots = [s for s in sl.tolist()[1:] if s == self.sink]
        shapes.append((len(sl) - len(pad_slots), tuple(ids.shape)))
        assert self.sink == cfg.batch_size and len(set(sl.tolist()) - {self.sink}) == len(sl) - len(pad_slots)
        return original(self, ids, lens, sl, *a)

    monkeypatch.setattr(runner_mod.ModelRunner, "prefill_device", recording)
    monkeypatch.setattr(scheduler_mod, "REFILL_MIN_FRACTION", 0.0)  # refill single slots too
    engine = RolloutEngine(model, cfg, "cpu")
    engine.prefill_buckets = True
    for n in (3, 9):  # 3 prompts: a refill of 3 rows into bucket 4
        results = engine.generate(prompts[:n], seeds[:n])
        _check_against_reference(model, cfg, prompts[:n], seeds[:n], results)
    D = engine.num_drafts
    assert all(w - D in (16, 24, 32) for _, (_, w) in shapes), shapes  # lengths 1..20 padded
    assert any(rows == 4 and real == 3 for real, (rows, _) in shapes), shapes  # a row into the sink
    assert any(rows == 1 for _, (rows, _) in shapes), shapes
    # a refill too large for a graph runs unpadded
    monkeypatch.setattr(runner_mod, "GRAPH_PREFILL_TOKENS", 0)
    shapes.clear()
    engine = RolloutEngine(model, cfg, "cpu")
    engine.prefill_buckets = True
    engine.generate(prompts[:3], seeds[:3])
    assert shapes[0] == (3, (3, max(len(p) for p in prompts[:3]) + D)), shapes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: run with a GPU (the device machine)")
@pytest.mark.parametrize("drafts", [0, 1, 2])
def test_refills_run_as_cuda_graphs_and_sample_as_the_reference(monkeypatch, caplog, drafts):
    """On CUDA every small refill is captured as a graph (a capture failure only warns and falls
    back to eager prefills, so it must be checked here: the first version's captures all failed on
    the H200 unnoticed) and the samples still equal the step-by-step reference (fp32); with 0
    (plain), 1 (fewer than the heads: the measured choice's other kind, its own graphs) and 2 drafts
    a verify."""
    model = make_model(vocab=VOCAB, depths=2, seed=3).to("cuda")
    cfg = GenerationConfig(
        speculative=drafts > 0, temperature=0.9, max_new_tokens=10, stop_token_ids=[1, 2, 3], batch_size=4
    )
    prompts = random_prompts(9, VOCAB, (1, 20), seed=24)
    seeds = [500 + i for i in range(9)]
    monkeypatch.setattr(scheduler_mod, "REFILL_MIN_FRACTION", 0.0)  # refills of 1..4 rows
    engine = RolloutEngine(model, cfg, "cuda")
    engine.speculative_switch_off = False
    monkeypatch.setattr(engine.policy, "choose", lambda bucket, peek=False: drafts)
    assert engine.use_cuda_graphs and engine.prefill_buckets
    with caplog.at_level("WARNING", logger="splitrl.rollout.runner"):
        results = engine.generate(prompts, seeds)
    assert not [r for r in caplog.records if "capture" in r.getMessage()], caplog.text
    assert sum(k[0] == "prefill" for k in engine.runner.graphs) >= 2, list(engine.runner.graphs)
    kind = runner_mod.step_kind(drafts, engine.num_drafts)
    assert any(k[0] == kind for k in engine.runner.graphs) and engine.last_stats.num_drafts == drafts
    assert all(k[3] == drafts for k in engine.runner.graphs if k[0] == "prefill")
    _check_against_reference(model, cfg, prompts, seeds, results)
    again = engine.generate(prompts, seeds)  # the graphs replayed on other inputs
    assert [r.response_ids for r in again] == [r.response_ids for r in results]


def _assert_logprobs_match_a_full_forward(model, prompts, results) -> None:
    """Each emitted token's logprob against a full bf16 forward over prompt + response: up to bf16
    rounding (max < 0.25, mean < 0.05 nats); a misplaced cache entry would be off by whole nats."""
    from _rollout_helpers import teacher_forced

    errors = []
    for prompt, res in zip(prompts, results):
        lp, _ = teacher_forced(model, prompt, res.response_ids, 1.0)
        errors.append((torch.tensor(res.logprobs) - lp.float().cpu()).abs())
    errors = torch.cat(errors)
    assert errors.max() < 0.25 and errors.mean() < 0.05, (errors.max(), errors.mean())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 CUDA path: run with a GPU (the device machine)")
@pytest.mark.parametrize("speculative", [False, True])
def test_bf16_cuda_path_logprobs_match_a_full_forward(monkeypatch, caplog, speculative):
    """The path the benchmarks time (bf16, T = 1, CUDA graphs, the flash cache layout with keys and
    values written by one copy, the Triton / flash decode attention, the sampler reading the bf16
    head output): each emitted token's logprob matches a full bf16 forward over prompt + response
    up to bf16 rounding (the bench's 12-prompt check measured a max of 0.031 on the H200); a
    misplaced cache entry would be off by whole nats. Written 2026-12-01 without a GPU to run it
    on: first run there pending."""
    model = make_model(vocab=VOCAB, depths=2, seed=3, init=0.05, head_dim=64).to("cuda", torch.bfloat16)
    cfg = GenerationConfig(speculative=speculative, temperature=1.0, max_new_tokens=24, batch_size=4)
    prompts = random_prompts(7, VOCAB, (3, 40), seed=31)
    monkeypatch.setattr(scheduler_mod, "REFILL_MIN_FRACTION", 0.0)
    engine = RolloutEngine(model, cfg, "cuda")
    engine.speculative_switch_off = False
    with caplog.at_level("WARNING", logger="splitrl.rollout.runner"):
        results = engine.generate(prompts, list(range(7)))
    assert not [r for r in caplog.records if "capture" in r.getMessage()], caplog.text
    assert any(k[0] == "prefill" for k in engine.runner.graphs)
    _assert_logprobs_match_a_full_forward(model, prompts, results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 CUDA path: run with a GPU (the device machine)")
@pytest.mark.parametrize("drafts", [0, 1, 2])
def test_bf16_fused_decode_kernels_logprobs_match_a_full_forward(monkeypatch, drafts):
    """A shape on which the decode step takes its Triton kernels (o_proj and down_proj split along K,
    so their add + norm epilogue; gate/up with silu · mul; the q/k norm + rotary + cache write
    kernel; silu · mul after the prefill's cuBLAS gate/up product): they run (counted), and each
    emitted logprob matches a full bf16 forward as on the torch path (test above); plain, and
    verifies of 1 and 2 drafts of two MTP heads."""
    from splitrl.rollout import forward as forward_mod
    from splitrl.rollout import rope_write, silu_mul, skinny_gemm

    if not (forward_mod.SKINNY_GEMM and rope_write.AVAILABLE):
        pytest.skip("needs Triton and the skinny kernel switched on (SPLITRL_SKINNY_GEMM)")
    # on whatever the environment says: this tests their values
    monkeypatch.setattr(forward_mod, "SKINNY_EPILOGUE", True)
    monkeypatch.setattr(forward_mod, "ROPE_WRITE", True)
    monkeypatch.setattr(forward_mod, "SKINNY_GATED", True)
    monkeypatch.setattr(forward_mod, "SILU_MUL", True)
    calls = {"epilogue": 0, "rope_write": 0, "gated": 0, "silu": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        skinny_gemm, "skinny_linear_add_rms_norm", counted(skinny_gemm.skinny_linear_add_rms_norm, "epilogue")
    )
    monkeypatch.setattr(rope_write, "norm_rope_write", counted(rope_write.norm_rope_write, "rope_write"))
    monkeypatch.setattr(skinny_gemm, "skinny_linear_silu_mul", counted(skinny_gemm.skinny_linear_silu_mul, "gated"))
    monkeypatch.setattr(silu_mul, "silu_mul", counted(silu_mul.silu_mul, "silu"))
    shape = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    model = make_model(vocab=VOCAB, depths=2, seed=5, init=0.05, **shape).to("cuda", torch.bfloat16)
    assert skinny_gemm.plan(4, 512, 512)[3] > 1 and skinny_gemm.plan(4, 512, 1536)[3] > 1
    cfg = GenerationConfig(speculative=drafts > 0, temperature=1.0, max_new_tokens=24, batch_size=4)
    prompts = random_prompts(7, VOCAB, (3, 40), seed=37)
    engine = RolloutEngine(model, cfg, "cuda")
    engine.speculative_switch_off = False
    monkeypatch.setattr(engine.policy, "choose", lambda bucket, peek=False: drafts)
    results = engine.generate(prompts, list(range(7)))
    assert engine.last_stats.num_drafts == drafts
    assert all(calls.values()), calls
    _assert_logprobs_match_a_full_forward(model, prompts, results)


def test_stream_yields_each_sample_when_it_finishes(model):
    cfg = GenerationConfig(max_new_tokens=30, stop_token_ids=[4, 5, 6, 7], batch_size=2)
    prompts = random_prompts(6, VOCAB, (1, 5), seed=23)
    engine = RolloutEngine(model, cfg, "cpu")
    order = []
    for i, res in engine.generate_stream(prompts, list(range(6))):
        order.append(i)
        assert res.response_ids  # complete when yielded
    assert sorted(order) == list(range(6))
    full = engine.generate(prompts, list(range(6)))
    assert engine.last_stats.generated_tokens == sum(len(r.response_ids) for r in full)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("speculative", [False, True])
def test_weight_update_is_in_place_and_used(speculative, family):
    """After load_state_dict the engine samples exactly as a fresh engine on the new weights (MTP
    heads included: same drafts, same acceptance counts; Qwen2: the fused q/k/v biases too), and no
    parameter storage moved (the property captured CUDA graphs rely on)."""
    old = make_model(vocab=VOCAB, depths=2, seed=4, family=family)
    new = make_model(vocab=VOCAB, depths=2, seed=5, family=family)
    cfg = GenerationConfig(speculative=speculative, max_new_tokens=10, batch_size=2, temperature=0.9)
    prompts, seeds = random_prompts(3, VOCAB, (2, 6), seed=24), [7, 8, 9]
    engine = RolloutEngine(old, cfg, "cpu")
    engine.speculative_switch_off = False  # every call speculative (the measured choice would try plain)
    before = engine.generate(prompts, seeds)
    pointers = {n: p.data_ptr() for n, p in engine.model.state_dict().items()}
    engine.load_state_dict(new.state_dict(), version=1)
    assert pointers == {n: p.data_ptr() for n, p in engine.model.state_dict().items()}
    after = engine.generate(prompts, seeds)
    fresh = RolloutEngine(make_model(vocab=VOCAB, depths=2, seed=5, family=family), cfg, "cpu").generate(prompts, seeds)
    assert [r.response_ids for r in after] != [r.response_ids for r in before]
    for a, f in zip(after, fresh):
        assert a.response_ids == f.response_ids and a.policy_version == 1
        assert (a.drafted_tokens, a.accepted_tokens) == (f.drafted_tokens, f.accepted_tokens)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(f.logprobs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_fused_projections_keep_parameters_names_and_values(family):
    """fuse_projections puts q/k/v and gate/up in one tensor each (MTP layers too; Qwen2's q/k/v
    biases in one bias tensor) without changing what the model is: same Parameter objects, names
    and values; a copy into a module's weight or bias is a copy into the fused tensor; a tensor moved
    off the fused storage is detected and fused again. Guards against a rollout that reads a stale
    copy of a weight after a sync."""
    from splitrl.rollout.forward import _FUSED, fuse_projections, mtp_parts

    model = make_model(vocab=VOCAB, depths=2, seed=6, family=family)
    biased = model.family.qkv_bias
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    fuse_projections(model)
    assert dict(model.named_parameters()) == params  # the same objects
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, values[n], atol=0, rtol=0)
    layers = [*model.backbone.model.layers, *(mtp_parts(model, k)[3] for k in (1, 2))]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        w, b = getattr(attn, _FUSED)
        torch.testing.assert_close(w, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        with torch.no_grad():
            attn.k_proj.weight.add_(1.0)
        assert w[attn.q_proj.weight.shape[0] :][: attn.k_proj.weight.shape[0]].eq(attn.k_proj.weight).all()
        assert (b is not None) == biased
        if biased:
            torch.testing.assert_close(b, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
            with torch.no_grad():
                attn.k_proj.bias.add_(1.0)
            assert b[attn.q_proj.bias.shape[0] :][: attn.k_proj.bias.shape[0]].eq(attn.k_proj.bias).all()
        gw, _ = getattr(mlp, _FUSED)
        assert gw.data_ptr() == mlp.gate_proj.weight.data_ptr()
    # a weight replaced by a new tensor (e.g. .to() of one module) is fused again, with its value
    attn = model.backbone.model.layers[0].self_attn
    attn.v_proj.weight.data = attn.v_proj.weight.detach().clone() * 2
    fuse_projections(model)
    w, _ = getattr(attn, _FUSED)
    torch.testing.assert_close(w[-attn.v_proj.weight.shape[0] :], attn.v_proj.weight, atol=0, rtol=0)
    assert w.data_ptr() == attn.q_proj.weight.data_ptr()
    if biased:  # so is a bias replaced alone (the weights still views of theirs)
        attn.q_proj.bias.data = attn.q_proj.bias.detach().clone() * 3
        fuse_projections(model)
        _, b = getattr(attn, _FUSED)
        torch.testing.assert_close(b[: attn.q_proj.bias.shape[0]], attn.q_proj.bias, atol=0, rtol=0)
        assert b.data_ptr() == attn.q_proj.bias.data_ptr()


def test_the_first_large_bucket_captures_the_one_and_two_row_graphs_too(monkeypatch):
    """The compiled step kernels specialize a bucket of 1 row (and the samplers become dynamic at
    their second row count): the runner captures those buckets with the first bucket of > 2 rows, so
    that a later call whose tail reaches 1 or 2 rows does not compile then (after a train step, a
    speculative call's first 1-row tail compiled 24 graphs on the GPU: 23.6 s). The capture itself
    is faked on the CPU; what is checked is which graphs are made, once each, and that the live
    state is left as it was."""
    engine = RolloutEngine(make_model(depths=1), GenerationConfig(max_new_tokens=4, batch_size=8, speculative=True))
    engine.generate(random_prompts(8, 128, (3, 6)), list(range(8)))  # buffers and state exist
    runner = engine.runner
    made = []

    def fake_capture(warmup, body, pool):
        warmup()
        made.append(body)
        return object()

    monkeypatch.setattr(runner, "_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    before = [t.clone() for t in runner.state.snapshot()]
    with torch.inference_mode():  # as inside generate
        for kind in ("spec", "plain"):
            runner.graph(kind, 8, 64)
            runner.graph(kind, 4, 64)  # a second large bucket: nothing more
    assert sorted(k for k in runner.graphs if k[0] in ("spec", "plain")) == sorted(
        (kind, b, 64) for kind in ("spec", "plain") for b in (1, 2, 4, 8)
    )
    assert len(made) == 8
    assert all(torch.equal(a, b) for a, b in zip(before, runner.state.snapshot()))
