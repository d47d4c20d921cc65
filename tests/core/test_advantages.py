"""Advantage stage against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from splitrl.loss.advantages import (
    AdvantageConfig,
    advantage_metrics,
    compute_group_advantages,
)
from splitrl.types import Group, SampleMeta


def make_group(gid: str, rewards: list[float], masks: list[float] | None = None) -> Group:
    masks = masks or [1.0] * len(rewards)
    samples = [
        SampleMeta(sample_id=f"{gid}-{i}", reward=r, prompt_len=2, response_len=3, sample_mask=m)
        for i, (r, m) in enumerate(zip(rewards, masks))
    ]
    return Group(group_id=gid, prompt_index=0, samples=samples, policy_version=0)


def test_config_is_validated():
    with pytest.raises(ValidationError):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValidationError):
        AdvantageConfig(eps=-1.0)
    with pytest.raises(ValidationError):
        AdvantageConfig(normalise_std=False)


def test_mean_baseline_without_std():
    g = make_group("g", [3.0, 1.0, 2.0, 0.0])  # mean 1.5
    compute_group_advantages([g], AdvantageConfig(normalize_std=False))
    assert g.advantages == pytest.approx([1.5, -0.5, 0.5, -1.5], abs=1e-12)


def test_mean_baseline_with_std():
    g = make_group("g", [3.0, 1.0, 2.0])  # mean 2, unbiased std 1
    eps = 1e-3
    compute_group_advantages([g], AdvantageConfig(normalize_std=True, eps=eps))
    assert g.advantages == pytest.approx([1 / (1 + eps), -1 / (1 + eps), 0.0], abs=1e-12)

    h = make_group("h", [1.0, 0.0, 0.0, 1.0])  # mean 0.5, unbiased std sqrt(1/3)
    compute_group_advantages([h], AdvantageConfig(eps=0.0))
    a = 0.5 / math.sqrt(1 / 3)
    assert h.advantages == pytest.approx([a, -a, -a, a], abs=1e-12)


def test_leave_one_out_baseline():
    g = make_group("g", [3.0, 1.0, 2.0])
    compute_group_advantages([g], AdvantageConfig(estimator="rloo", normalize_std=False))
    # Baselines: (1+2)/2, (3+2)/2, (3+1)/2.
    assert g.advantages == pytest.approx([1.5, -1.5, 0.0], abs=1e-12)


def test_zero_variance_group_gives_exact_zeros():
    groups = [make_group("const", [0.1, 0.1, 0.1]), make_group("one", [1.0])]
    configs = [
        AdvantageConfig(),
        AdvantageConfig(normalize_std=False),
        AdvantageConfig(estimator="rloo"),
    ]
    for cfg in configs:
        compute_group_advantages(groups, cfg)
        assert groups[0].advantages == [0.0, 0.0, 0.0]
        assert groups[1].advantages == [0.0]


def test_filtered_samples_do_not_count_and_get_zero():
    # The filtered 5.0 is left out of the baseline: counted rewards [1, 0, 0] have mean 1/3.
    g = make_group("g", [1.0, 0.0, 0.0, 5.0], masks=[1.0, 1.0, 1.0, 0.0])
    compute_group_advantages([g], AdvantageConfig(normalize_std=False))
    assert g.advantages == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0], abs=1e-12)
    assert g.advantages[3] == 0.0

    # Only one counted sample left: no signal, all zeros.
    h = make_group("h", [1.0, 0.0, 0.0], masks=[1.0, 0.0, 0.0])
    compute_group_advantages([h], AdvantageConfig())
    assert h.advantages == [0.0, 0.0, 0.0]


def test_metrics_by_hand():
    groups = [
        make_group("a", [1.0, 0.0, 0.0, 1.0]),
        make_group("b", [1.0, 1.0, 1.0, 1.0]),  # zero variance
        make_group("c", [2.0, 0.0, 1.0, 7.0], masks=[1.0, 1.0, 1.0, 0.0]),
    ]
    m = compute_group_advantages(groups, AdvantageConfig(normalize_std=False))
    rewards = [1, 0, 0, 1, 1, 1, 1, 1, 2, 0, 1, 7]
    mean = sum(rewards) / 12
    assert m["reward/mean"] == pytest.approx(mean)
    assert m["reward/std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rewards) / 12))
    assert m["reward/zero_variance_group_fraction"] == pytest.approx(1 / 3)
    # Counted advantages: a: ±0.5 (x4), b: 0 (x4), c: 1, -1, 0.
    assert m["advantage/mean"] == pytest.approx(0.0, abs=1e-12)
    assert m["advantage/abs_mean"] == pytest.approx((4 * 0.5 + 2) / 11)
    assert (m["advantage/min"], m["advantage/max"]) == (-1.0, 1.0)
    assert m["samples/filtered_fraction"] == pytest.approx(1 / 12)
    assert (m["samples/count"], m["groups/count"]) == (12.0, 3.0)
    # Metrics of a whole step equal those computed at once, whatever the chunks were.
    assert advantage_metrics(groups) == m


def test_invalid_input_changes_nothing():
    good = make_group("good", [1.0, 0.0])
    bad = make_group("bad", [1.0, float("nan")])
    with pytest.raises(ValueError, match="finite"):
        compute_group_advantages([good, bad], AdvantageConfig())
    assert good.advantages is None

    half = make_group("half", [1.0, 0.0], masks=[1.0, 0.5])
    with pytest.raises(ValueError, match="sample_mask"):
        compute_group_advantages([good, half], AdvantageConfig())
    assert good.advantages is None

    with pytest.raises(ValueError, match="at least one group"):
        compute_group_advantages([], AdvantageConfig())
    with pytest.raises(ValueError, match="compute_group_advantages first"):
        advantage_metrics([good])
