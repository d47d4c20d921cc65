"""Run-level semantics that used to be silently wrong (issue 6, items 1, 2, 12).

- one source of truth for the sampling temperature (kind: one setting, two unlinked places);
- stale samples get the truncated importance-sampling correction by default (kind: stale samples
  trained as on-policy);
- settings that can never learn are refused, and runs that learn nothing say so (kind: silent bad
  training).
"""

import logging

import pytest
import torch

from _configs import demo_config
from splitrl.config import DEFAULT_TIS_CAP, load_config
from splitrl.controller.health import RunHealth
from splitrl.loss import ClippedPGLoss
from splitrl.models import PolicyModel
from splitrl.rollout import RolloutEngine


# ------------------------------------------------------------------ item 1: one temperature
def test_the_trainer_takes_the_rollout_temperature():
    cfg = demo_config(["rollout.temperature=0.6", "loss.entropy_coef=0.05"])
    assert cfg.trainer_loss_config().temperature == 0.6
    # an equal value is allowed; the section keeps what the user wrote
    same = demo_config(["rollout.temperature=0.6", "loss.temperature=0.6"])
    assert same.trainer_loss_config().temperature == 0.6


@pytest.mark.parametrize(
    "overrides",
    [["rollout.temperature=0.6", "loss.temperature=1.0"], ["loss.temperature=0.6"]],
)
def test_a_second_different_temperature_is_refused_on_load(overrides):
    with pytest.raises(
        ValueError, match=r"loss.temperature=.* differs from rollout.temperature=.*remove loss.temperature"
    ):
        demo_config(overrides)


def test_trainer_logprobs_equal_the_rollout_engines_at_the_configured_temperature():
    """Real numbers: tokens sampled at T = 0.6 by the rollout engine are scored by the trainer's
    forward at the loss's temperature; the two logprobs agree (fp32, same weights; tolerance
    1e-4 nats for a KV-cached vs a full forward). At T = 1 they would differ by ~0.2 nats/token."""
    cfg = demo_config(["rollout.temperature=0.6", "rollout.max_new_tokens=12"])
    model = PolicyModel.from_config(cfg.model).eval()
    engine = RolloutEngine(model, cfg.rollout, device="cpu")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [4, 12, 13, 14, 15]]
    results = engine.generate(prompts, seeds=[1, 2, 3])
    loss = ClippedPGLoss(cfg.trainer_loss_config())
    worst = 0.0
    with torch.no_grad():
        for p, r in zip(prompts, results):
            ids = torch.tensor([p + r.response_ids])
            mask = torch.zeros(ids.shape)
            out = model(ids, mtp_loss_mask=mask, temperature=loss.temperature)
            trainer = out.logprobs[0, len(p) :]
            worst = max(worst, float((trainer - torch.tensor(r.logprobs)).abs().max().nan_to_num(float("inf"))))
            at_one = model(ids, mtp_loss_mask=mask, temperature=1.0).logprobs[0, len(p) :]
            assert float((at_one - torch.tensor(r.logprobs)).abs().mean()) > 0.01
    assert worst < 1e-4


# ------------------------------------------------------------------ item 2: stale samples
def test_stale_samples_get_truncated_is_weights_by_default():
    cfg = demo_config(["buffer.max_staleness=1"])
    assert cfg.trainer_loss_config().tis_cap == DEFAULT_TIS_CAP
    level, text = cfg.off_policy_summary()
    assert level == logging.INFO and "correction ON" in text and f"{DEFAULT_TIS_CAP:g}" in text
    # the cap is a config value
    assert demo_config(["loss.tis_cap=3.5"]).trainer_loss_config().tis_cap == 3.5
    # on-policy runs need none (and may still turn it on)
    on_policy = demo_config(["buffer.max_staleness=0"])
    assert on_policy.trainer_loss_config().tis_cap is None
    assert on_policy.off_policy_summary()[0] == logging.INFO
    assert demo_config(["buffer.max_staleness=0", "loss.tis_cap=2"]).trainer_loss_config().tis_cap == 2.0


def test_turning_the_correction_off_with_stale_samples_is_a_warning():
    cfg = demo_config(["buffer.max_staleness=2", "loss.tis_cap=null"])
    assert cfg.trainer_loss_config().tis_cap is None
    level, text = cfg.off_policy_summary()
    assert level == logging.WARNING
    assert "OFF" in text and "max_staleness=2" in text and "as if on-policy" in text


def test_the_example_configs_keep_their_meaning(tmp_path):
    cfg = load_config("examples/cpu_demo.yaml", [f"output_dir={tmp_path}"])
    assert cfg.trainer_loss_config().temperature == cfg.rollout.temperature
    assert cfg.trainer_loss_config().tis_cap == DEFAULT_TIS_CAP  # max_staleness 1


# ------------------------------------------------------------------ item 12: silent bad training
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_size_one_is_refused(estimator):
    with pytest.raises(ValueError, match="schedule.group_size=1.*at least 2"):
        demo_config(["schedule.group_size=1", f"advantage.estimator={estimator}"])
    assert demo_config(["schedule.group_size=2", f"advantage.estimator={estimator}"]).schedule.group_size == 2


def test_settings_a_run_would_ignore_or_fail_on_late_are_refused():
    with pytest.raises(ValueError, match="num_draft_tokens=3 > model.mtp.mtp_num_layers=1"):
        demo_config(["rollout.speculative=true", "rollout.num_draft_tokens=3"])
    # kind: a setting silently without effect (plain decoding drafts nothing)
    with pytest.raises(ValueError, match="num_draft_tokens=1 is set but rollout.speculative=false"):
        demo_config(["rollout.num_draft_tokens=1"])
    assert demo_config(["rollout.speculative=true", "rollout.num_draft_tokens=1"]).rollout.num_draft_tokens == 1
    with pytest.raises(ValueError, match="draft_vocab_size=8 is set but rollout.speculative=false.*draft_vocab_size=null"):
        demo_config(["rollout.draft_vocab_size=8"])
    assert demo_config(["rollout.speculative=true", "rollout.draft_vocab_size=8"]).rollout.draft_vocab_size == 8
    # kind: a promise the setting would break (deterministic runs are bit-reproducible across a resume)
    with pytest.raises(ValueError, match="rollout.draft_vocab_size with rollout.deterministic=true: .*unset one"):
        demo_config(["rollout.speculative=true", "rollout.draft_vocab_size=8", "rollout.deterministic=true"])
    with pytest.raises(ValueError, match="train.device=cpu differs from cluster.device=auto"):
        demo_config(["train.device=cpu"])
    assert demo_config(["cluster.device=cpu", "train.device=cpu"]).train.device == "cpu"


def test_greedy_rollouts_are_refused():
    with pytest.raises(ValueError, match="top_k=1.*zero reward variance"):
        demo_config(["rollout.top_k=1"])


HEALTHY = {
    "rollout/reward_timeout_rate": 0.0,
    "rollout/reward_error_rate": 0.0,
    "rollout/reward/zero_variance_group_fraction": 0.25,
    "train/empty_step": 0.0,
    "train/nonfinite_grad": 0.0,
}


def test_health_warns_about_runs_that_learn_nothing(caplog):
    health = RunHealth(reward_timeout_s=5.0)
    with caplog.at_level(logging.WARNING):
        assert health.check(1, HEALTHY) == []
        timeouts = health.check(2, dict(HEALTHY, **{"rollout/reward_timeout_rate": 1.0}))
        collapsed = health.check(3, dict(HEALTHY, **{"rollout/reward/zero_variance_group_fraction": 1.0}))
        empty = health.check(4, dict(HEALTHY, **{"train/empty_step": 1.0}))
        nonfinite = health.check(5, dict(HEALTHY, **{"train/nonfinite_grad": 1.0}))
    assert (
        len(timeouts) == 1
        and "100% of the answer checks timed out" in timeouts[0]
        and "reward.timeout_s=5" in timeouts[0]
    )
    assert len(collapsed) == 1 and "100% of the groups" in collapsed[0]
    assert len(empty) == 1 and "nothing to learn from" in empty[0]
    assert len(nonfinite) == 1 and "not finite" in nonfinite[0]
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 4


def test_health_repeats_a_persistent_warning_at_10_100_steps():
    health = RunHealth(reward_timeout_s=5.0)
    bad = dict(HEALTHY, **{"rollout/reward_error_rate": 0.7})
    warned_at = [s for s in range(1, 121) if health.check(s, bad)]
    assert warned_at == [1, 10, 100]
    assert health.check(121, HEALTHY) == []
    assert health.check(122, bad) != []  # a new streak warns again


def test_a_jump_of_the_logprob_gap_is_warned_about_once_and_noise_is_not():
    """The CPU demo's reward collapse (0.36 -> 0.05 for good) came one step after
    train/logprob_mismatch jumped from a median of 0.03 to 0.58; gaps of up to 0.16 in a run
    that learned well, a first steps' gap and a NaN step are not jumps."""
    health = RunHealth(reward_timeout_s=5.0)
    gaps = [0.15] + [0.03, 0.02, 0.16, 0.03, 0.025, float("nan")] * 4 + [0.577, 0.06, 0.1]
    warned = {s: w for s, g in enumerate(gaps, 1) if (w := health.check(s, dict(HEALTHY, **{"train/logprob_mismatch": g})))}
    assert list(warned) == [len(gaps) - 2], warned
    (msg,) = warned[len(gaps) - 2]
    assert "0.577 nats a token" in msg and "median 0.030" in msg and "train.optim.lr" in msg


def test_fp16_loss_scaling_skips_are_warned_only_when_they_persist():
    health = RunHealth(reward_timeout_s=5.0, loss_scaling=True)
    bad = dict(HEALTHY, **{"train/nonfinite_grad": 1.0})
    assert [s for s in range(1, 12) if health.check(s, bad)] == [3, 10]
