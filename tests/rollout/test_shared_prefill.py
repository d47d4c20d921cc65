"""A refill prefills each distinct prompt once (``RolloutEngine.shared_prefill``): the copies of a
GRPO group's prompt take the cache entries and hidden states of one prefill, and sample as they
would from prefills of their own."""

import pytest
import torch
from _rollout_helpers import make_model, random_prompts, teacher_forced

import splitrl.rollout.runner as runner_mod
import splitrl.rollout.scheduler as scheduler_mod
from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout.kv import StaticKVCache
from splitrl.rollout.runner import shared_rows

VOCAB = 128


def test_shared_rows_maps_each_row_to_the_first_row_of_its_prompt():
    prompts = [[1, 2], [3], [1, 2], [4], [3], [1, 2]]
    first, src, copy_from, copy_to = shared_rows(prompts, [0, 1, 2, 5, 6, 7])
    assert first == [0, 1, 3] and src == [0, 1, 0, 2, 1, 0]
    assert copy_from == [0, 1, 0] and copy_to == [2, 6, 7]  # rows 2, 4, 5 copy the slots of rows 0, 1, 0
    assert shared_rows([[1, 2], [2, 1], [1]], [0, 1, 2]) is None  # all differ: nothing to share
    assert shared_rows([[5]], [3]) is None


@pytest.mark.parametrize("position_major", [True, False])
def test_copy_prefix_copies_the_prompt_entries_only(position_major):
    cache = StaticKVCache(3, 5, 2, 8, 4, torch.float32, "cpu", flash=False, position_major=position_major)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    before = cache.kv.clone()
    cache.copy_prefix(torch.tensor([0, 0, 4]), torch.tensor([2, 3, 1]), 5)
    pos = 2 if position_major else 3  # the positions' dim of one slot's kv [2, layers, ...]
    for src, dst in ((0, 2), (0, 3), (4, 1)):
        got, want = cache.kv[:, :, dst].narrow(pos, 0, 5), before[:, :, src].narrow(pos, 0, 5)
        assert torch.equal(got, want)
        assert torch.equal(cache.kv[:, :, dst].narrow(pos, 5, 3), before[:, :, dst].narrow(pos, 5, 3))
    assert torch.equal(cache.kv[:, :, [0, 4]], before[:, :, [0, 4]])  # the sources unchanged


def _groups(seed: int) -> tuple[list[list[int]], list[int]]:
    """3 prompts of 4 samples each, not adjacent, and 2 prompts of one: 14 samples, distinct seeds."""
    base = random_prompts(5, VOCAB, (3, 12), seed=seed)
    order = [0, 1, 0, 2, 3, 1, 0, 2, 1, 4, 2, 0, 1, 2]
    return [base[i] for i in order], [300 + i for i in range(len(order))]


def _generate(model, cfg, prompts, seeds, device, shared: bool, drafts: int | None = None):
    engine = RolloutEngine(model, cfg, device)
    engine.shared_prefill = shared
    if drafts is not None:
        engine.speculative_switch_off = False
        engine.policy.choose = lambda bucket, peek=False: drafts
    return engine.generate(prompts, seeds), engine.last_stats


@pytest.mark.parametrize("speculative", [False, True])
def test_groups_prefilled_once_sample_as_separate_prefills(monkeypatch, speculative):
    """fp32 on the CPU, 14 samples of 5 prompts in 8 slots (stop tokens: rows finish apart, so
    later refills share too): the samples and logprobs equal those of one prefill a sample; the
    call prefilled each distinct prompt once a refill (``prefill_tokens`` < ``prompt_tokens``);
    plain and with two drafts a verify (the MTP depths' caches filled from the shared hidden
    states). Guard: without the copy of the cache entries the copies' samples differ."""
    model = make_model(vocab=VOCAB, depths=2)
    cfg = GenerationConfig(
        temperature=1.0, max_new_tokens=12, stop_token_ids=[5, 6], batch_size=8, speculative=speculative
    )
    prompts, seeds = _groups(seed=7)
    monkeypatch.setattr(scheduler_mod, "REFILL_MIN_FRACTION", 0.0)
    drafts = 2 if speculative else None
    shared, stats = _generate(model, cfg, prompts, seeds, "cpu", True, drafts)
    separate, stats_sep = _generate(model, cfg, prompts, seeds, "cpu", False, drafts)
    assert [r.response_ids for r in shared] == [r.response_ids for r in separate]
    for a, b in zip(shared, separate):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert stats.prompt_tokens == stats_sep.prompt_tokens == stats_sep.prefill_tokens == sum(map(len, prompts))
    first_fill = {tuple(p) for p in prompts[:8]}  # the first refill: slots 0..7, 5 distinct prompts
    assert sum(map(len, first_fill)) <= stats.prefill_tokens < stats.prompt_tokens
    if speculative:
        assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0
    # guard: copies that keep their own (zero) cache entries sample otherwise
    monkeypatch.setattr(StaticKVCache, "copy_prefix", lambda self, src, dst, length: None)
    broken, _ = _generate(model, cfg, prompts, seeds, "cpu", True, drafts)
    assert [r.response_ids for r in broken] != [r.response_ids for r in separate]


def test_a_padded_refill_is_not_shared():
    """Refills padded to their buckets (``prefill_buckets``, here on the CPU without graphs) prefill
    every row, as before; the samples are those of the unpadded refill."""
    model = make_model(vocab=VOCAB, depths=0)
    cfg = GenerationConfig(temperature=1.0, max_new_tokens=6, batch_size=8)
    prompts, seeds = _groups(seed=8)
    engine = RolloutEngine(model, cfg, "cpu")
    engine.prefill_buckets = True
    padded = engine.generate(prompts, seeds)
    assert engine.last_stats.prefill_tokens == engine.last_stats.prompt_tokens
    shared, stats = _generate(model, cfg, prompts, seeds, "cpu", True)
    assert stats.prefill_tokens < stats.prompt_tokens
    assert [r.response_ids for r in padded] == [r.response_ids for r in shared]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path: run with a GPU (the device machine)")
@pytest.mark.parametrize("speculative", [False, True])
def test_shared_prefill_on_the_gpu(monkeypatch, speculative):
    """CUDA (the flash cache's position-major layout, the prefill reading the cache in place over
    the distinct rows' slots), every refill eager (``GRAPH_PREFILL_TOKENS`` 0, so each is shared):
    fp32 samples equal those of separate prefills; bf16 logprobs match a full bf16 forward over
    prompt + response up to bf16 rounding (a copy misplaced would be off by whole nats)."""
    monkeypatch.setattr(runner_mod, "GRAPH_PREFILL_TOKENS", 0)
    monkeypatch.setattr(scheduler_mod, "REFILL_MIN_FRACTION", 0.0)
    prompts, seeds = _groups(seed=9)
    drafts = 2 if speculative else None
    model = make_model(vocab=VOCAB, depths=2, seed=3).to("cuda")
    cfg = GenerationConfig(temperature=0.9, max_new_tokens=10, stop_token_ids=[1, 2], batch_size=8, speculative=speculative)
    shared, stats = _generate(model, cfg, prompts, seeds, "cuda", True, drafts)
    separate, _ = _generate(model, cfg, prompts, seeds, "cuda", False, drafts)
    assert stats.prefill_tokens < stats.prompt_tokens
    assert [r.response_ids for r in shared] == [r.response_ids for r in separate]
    model = make_model(vocab=VOCAB, depths=2, seed=3, init=0.05, head_dim=64).to("cuda", torch.bfloat16)
    cfg = cfg.model_copy(update={"temperature": 1.0, "stop_token_ids": [], "max_new_tokens": 24})
    results, stats = _generate(model, cfg, prompts, seeds, "cuda", True, drafts)
    assert stats.prefill_tokens < stats.prompt_tokens
    errors = []
    for prompt, res in zip(prompts, results):
        lp, _ = teacher_forced(model, prompt, res.response_ids, 1.0)
        errors.append((torch.tensor(res.logprobs) - lp.float().cpu()).abs())
    errors = torch.cat(errors)
    assert errors.max() < 0.25 and errors.mean() < 0.05, (errors.max(), errors.mean())
