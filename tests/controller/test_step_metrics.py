"""A step's record from hand-made recordings: rollout statistics over every sample, generation
throughput and acceptance over the step's generation calls, NaN where a step has no value, and
the time overlap of generation with training."""

import math
from types import SimpleNamespace

import pytest

from splitrl.controller.step_metrics import overlap, step_metrics
from splitrl.loss.advantages import AdvantageConfig, compute_group_advantages
from splitrl.types import Group, SampleMeta


def _groups() -> list[Group]:
    a = [SampleMeta("a0", 1.0, 5, 10), SampleMeta("a1", 0.0, 5, 20, truncated=True)]
    b = [
        SampleMeta("b0", 0.5, 7, 30, reward_timed_out=True),
        SampleMeta("b1", 0.5, 7, 40, info={"reward_error": "boom"}),
    ]
    groups = [Group("p0", 0, a, policy_version=2), Group("p1", 1, b, policy_version=1)]
    compute_group_advantages(groups, AdvantageConfig())  # as the train pump does before training
    return groups


def _record(calls, speculative=True, gen=((0.0, 2.0), (3.0, 4.0)), train=((1.0, 3.5),), draft_vocab=False):
    buffer = SimpleNamespace(size=3, num_evicted_groups=2, num_evicted_samples=4)
    return step_metrics(
        {"loss": 0.25, "timing/forward_s": 1.5},
        _groups(),
        calls=calls,
        speculative=speculative,
        draft_vocab=draft_vocab,
        buffer=buffer,
        version=3,
        gen_intervals=list(gen),
        train_intervals=list(train),
        wait_s=0.75,
        checkpoint_s=0.5,
        step_s=5.0,
        sync_s=0.125,
    )


def test_the_record_of_a_step():
    calls = [
        {
            "generated_tokens": 60,
            "generation_s": 2.0,
            "drafted_tokens": 40,
            "accepted_tokens": 30,
            "speculative_active": 1,
        },
        {
            "generated_tokens": 40,
            "generation_s": 3.0,
            "drafted_tokens": 10,
            "accepted_tokens": 0,
            "speculative_active": 0,
        },
    ]
    m = _record(calls)
    assert m["train/loss"] == 0.25 and m["timing/forward_s"] == 1.5  # timing/ keys keep their name
    assert m["train/reward"] == pytest.approx(0.5)
    assert m["rollout/response_length_mean"] == 25.0 and m["rollout/response_length_max"] == 40.0
    assert m["rollout/prompt_length_mean"] == 6.0
    assert m["rollout/truncation_rate"] == 0.25
    assert m["rollout/reward_timeout_rate"] == 0.25 and m["rollout/reward_error_rate"] == 0.25
    assert m["rollout/tokens_per_s"] == 20.0  # 100 tokens in 5 s of calls
    assert m["rollout/acceptance_rate"] == 60.0  # 30 of 50 drafted, a percentage
    assert m["rollout/speculative_active"] == 0.0  # the last call's
    # the step trained with version 2 (the record is made after the version moved to 3)
    assert m["buffer/staleness_mean"] == 0.5 and m["buffer/staleness_max"] == 1.0
    assert (m["buffer/size"], m["buffer/evicted_groups_total"], m["buffer/evicted_samples_total"]) == (3.0, 2.0, 4.0)
    assert m["timing/generation_s"] == 3.0 and m["timing/train_s"] == 2.5
    assert m["timing/generation_during_train_s"] == 1.5  # [1, 2] and [3, 3.5]
    assert (m["timing/step_s"], m["timing/weight_sync_s"], m["timing/checkpoint_s"]) == (5.0, 0.125, 0.5)
    assert m["timing/exposed_wait_s"] == 0.75 and m["timing/policy_version"] == 3.0


def test_a_step_without_generation_calls_has_the_same_keys_with_nan():
    full = _record(
        [
            {
                "generated_tokens": 1,
                "generation_s": 1.0,
                "drafted_tokens": 0,
                "accepted_tokens": 0,
                "speculative_active": 1,
            }
        ]
    )
    empty = _record([], gen=())
    assert empty.keys() == full.keys()
    assert math.isnan(empty["rollout/tokens_per_s"]) and math.isnan(empty["rollout/speculative_active"])
    assert math.isnan(full["rollout/acceptance_rate"])  # nothing drafted
    assert empty["timing/generation_s"] == 0.0 and empty["timing/generation_during_train_s"] == 0.0
    assert "rollout/acceptance_rate" not in _record([], speculative=False)


def test_draft_vocabulary_coverage_over_the_step_calls():
    calls = [
        {"generated_tokens": 10, "generation_s": 1.0, "drafted_tokens": 4, "accepted_tokens": 2,
         "speculative_active": 1, "draft_vocab_covered": 9, "draft_vocab_generated": 10},
        {"generated_tokens": 30, "generation_s": 1.0, "drafted_tokens": 4, "accepted_tokens": 2,
         "speculative_active": 1, "draft_vocab_covered": 21, "draft_vocab_generated": 30},
    ]  # fmt: skip
    assert _record(calls, draft_vocab=True)["rollout/draft_vocab_coverage"] == 75.0  # 30 of 40 tokens
    assert "rollout/draft_vocab_coverage" not in _record(calls)
    assert math.isnan(_record([], gen=(), draft_vocab=True)["rollout/draft_vocab_coverage"])


def test_overlap_sums_every_pair():
    assert overlap([(0.0, 2.0), (3.0, 5.0)], [(1.0, 4.0)]) == 2.0
    assert overlap([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0
    assert overlap([], [(0.0, 1.0)]) == 0.0
