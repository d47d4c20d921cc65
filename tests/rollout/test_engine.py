"""Plain batched decoding: exact logprobs, filters, stops, per-sample determinism, padding."""

import pytest
import torch
from _rollout_helpers import make_model, random_prompts, teacher_forced

from splitrl.rollout import GenerationConfig, RolloutEngine

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    return make_model(vocab=VOCAB, depths=2)


@pytest.mark.parametrize("attn,family", [("sdpa", "qwen3"), ("eager", "qwen3"), ("sdpa", "llama"), ("sdpa", "qwen2")])
def test_logprobs_equal_teacher_forced_and_filters_hold(attn, family):
    model = make_model(vocab=VOCAB, depths=1, attn=attn, family=family)
    T, top_k, top_p = 0.7, 20, 0.9
    cfg = GenerationConfig(temperature=T, top_k=top_k, top_p=top_p, max_new_tokens=10, batch_size=3, stop_token_ids=[5])
    engine = RolloutEngine(model, cfg, "cpu")
    prompts = random_prompts(7, VOCAB, (1, 9), seed=1)
    results = engine.generate(prompts, seeds=list(range(7)))
    for prompt, res in zip(prompts, results):
        assert len(res.response_ids) == len(res.logprobs) > 0
        ref_lp, logits = teacher_forced(model, prompt, res.response_ids, T)
        # fp32: the padded, KV-cached batch and the one unpadded forward sum in different orders
        # (1.4e-5 seen on the CI's CPU for llama); a wrong position, bias, mask or temperature is >= 1e-2
        torch.testing.assert_close(torch.tensor(res.logprobs), ref_lp, atol=5e-5, rtol=0)
        for t, tok in enumerate(res.response_ids):
            # within the top-k, and within the smallest top-p nucleus of the top-k
            order = logits[t].argsort(descending=True)
            rank = int((order == tok).nonzero())
            assert rank < top_k
            top = logits[t][order[:top_k]].softmax(-1)
            assert float(top[:rank].sum()) < top_p
    stats = engine.last_stats
    assert stats.generated_tokens == sum(len(r.response_ids) for r in results)
    assert stats.num_samples == 7 and stats.wall_time_s > 0 and not stats.speculative_active


def test_top_k_one_is_greedy_argmax(model):
    engine = RolloutEngine(model, GenerationConfig(top_k=1, max_new_tokens=8, batch_size=4), "cpu")
    prompts = random_prompts(5, VOCAB, (2, 6), seed=2)
    for prompt, res in zip(prompts, engine.generate(prompts, seeds=[3, 1, 4, 1, 5])):
        _, logits = teacher_forced(model, prompt, res.response_ids, 1.0)
        assert res.response_ids == logits.argmax(-1).tolist()
        assert res.finish_reason == "length" and len(res.response_ids) == 8


def test_stop_tokens_end_rows(model):
    stops = list(range(0, VOCAB, 6))  # about a sixth of the vocabulary: most rows stop early
    cfg = GenerationConfig(max_new_tokens=12, stop_token_ids=stops, batch_size=8)
    engine = RolloutEngine(model, cfg, "cpu")
    prompts = random_prompts(16, VOCAB, (1, 5), seed=3)
    results = engine.generate(prompts, seeds=list(range(100, 116)))
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}
    for r in results:
        assert all(t not in stops for t in r.response_ids[:-1])
        if r.finish_reason == "stop":
            assert r.response_ids[-1] in stops
        else:
            assert len(r.response_ids) == 12 and r.response_ids[-1] not in stops


def test_same_prompt_and_seed_give_the_same_sample_in_any_batch(model):
    cfg = GenerationConfig(temperature=1.0, max_new_tokens=10, stop_token_ids=[7], batch_size=16)
    engine = RolloutEngine(model, cfg, "cpu")
    short = [11, 12]
    alone = engine.generate([short], seeds=[42])[0]
    # with longer (left padding) and shorter prompts, other seeds, and at another batch position
    others = random_prompts(6, VOCAB, (1, 14), seed=4)
    mixed = engine.generate(others[:3] + [short] + others[3:], seeds=[1, 2, 3, 42, 4, 5, 6])[3]
    assert mixed.response_ids == alone.response_ids
    torch.testing.assert_close(torch.tensor(mixed.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    # smaller batches (rows split across forwards) give the same sample too
    small_batches = RolloutEngine(model, cfg.model_copy(update={"batch_size": 2}), "cpu")
    split = small_batches.generate(others[:3] + [short], seeds=[1, 2, 3, 42])[3]
    assert split.response_ids == alone.response_ids
    # the seed matters
    draws = {tuple(engine.generate([short], seeds=[s])[0].response_ids) for s in range(6)}
    assert len(draws) > 1


def test_left_padding_gives_the_unpadded_logprobs(model):
    engine = RolloutEngine(model, GenerationConfig(top_k=1, max_new_tokens=6), "cpu")
    short = [3, 4, 5]
    alone = engine.generate([short], seeds=[0])[0]
    padded = engine.generate([list(range(20, 40)), short, list(range(50, 61))], seeds=[0, 0, 0])[1]
    assert padded.response_ids == alone.response_ids
    torch.testing.assert_close(torch.tensor(padded.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_weight_sync_changes_the_policy_and_its_version(model):
    engine = RolloutEngine(
        make_model(vocab=VOCAB, depths=2, seed=1), GenerationConfig(top_k=1, max_new_tokens=5), "cpu"
    )
    prompt = [[9, 8, 7]]
    before = engine.generate(prompt, seeds=[0])[0]
    assert before.policy_version == 0
    engine.load_state_dict(model.state_dict(), version=3)
    after = engine.generate(prompt, seeds=[0])[0]
    assert after.policy_version == 3 and engine.last_stats.policy_version == 3
    ref_lp, _ = teacher_forced(model, prompt[0], after.response_ids, 1.0)
    torch.testing.assert_close(torch.tensor(after.logprobs), ref_lp, atol=1e-5, rtol=0)
    assert before.logprobs != after.logprobs
    # a sync without the MTP tensors is refused and changes nothing
    partial = {
        k: v for k, v in make_model(vocab=VOCAB, depths=2, seed=2).state_dict().items() if not k.startswith("mtp.")
    }
    with pytest.raises(ValueError, match="MTP tensors"):
        engine.load_state_dict(partial, version=4)
    assert engine.policy_version == 3
    assert engine.generate(prompt, seeds=[0])[0].logprobs == after.logprobs


def test_user_mistakes_raise_value_errors(model):
    with pytest.raises(ValueError, match="top_k=1"):
        GenerationConfig(temperature=0.0)
    # an infinite temperature samples uniformly: the run would learn nothing, silently
    with pytest.raises(ValueError, match="temperature must be finite, got inf"):
        GenerationConfig(temperature=float("inf"))
    # "" is in every text: every response was cut to one token, silently
    with pytest.raises(ValueError, match="empty string"):
        GenerationConfig(stop_strings=["</answer>", ""])
    with pytest.raises(ValueError):
        GenerationConfig(top_p=0.0)
    with pytest.raises(ValueError):
        GenerationConfig(beam_width=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        RolloutEngine(model, GenerationConfig(stop_token_ids=[VOCAB]), "cpu")
    with pytest.raises(ValueError, match="MTP heads"):
        RolloutEngine(make_model(vocab=VOCAB, depths=0), GenerationConfig(speculative=True), "cpu")
    with pytest.raises(ValueError, match="exceeds the model's 2 MTP depths"):
        RolloutEngine(model, GenerationConfig(speculative=True, num_draft_tokens=3), "cpu")
    with pytest.raises(ValueError, match="num_draft_tokens=1 is set but speculative=False"):  # the CLI's rule too
        RolloutEngine(model, GenerationConfig(num_draft_tokens=1), "cpu")
    engine = RolloutEngine(model, GenerationConfig(max_new_tokens=4), "cpu")
    with pytest.raises(ValueError, match="one seed per prompt"):
        engine.generate([[1], [2]], seeds=[0])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], seeds=[0])
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[VOCAB]], seeds=[0])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[1] * 510], seeds=[0])
    assert engine.generate([], seeds=[]) == []
