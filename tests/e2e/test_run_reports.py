"""A whole local run, checked for what a user reads off it (issue 6, items 1, 2, 14):

- kind "one setting, two unlinked places": rollout.temperature=0.6 alone makes an on-policy step
  score the tokens at the temperature they were sampled at (logprob mismatch ~0, not ~0.25 nats);
- kind "stale samples trained as on-policy": the run says at start what it does about staleness;
- kind "invisible counts": the mean reward under one name, per-depth MTP target counts, and every
  step's record with the same keys (speculation on, so its keys are there every step).
"""

import logging
import math

from _tiny import TINY_STEP

from _configs import demo_config
from splitrl.controller.controller import train
from splitrl.logging import read_metrics

TINY = TINY_STEP + ["cluster.backend=local", "dataplane.kind=inprocess", "logging.tensorboard=false"]


def test_on_policy_run_at_temperature_0p6_reports_consistent_metrics(tmp_path, caplog):
    cfg = demo_config(
        TINY
        + [
            f"output_dir={tmp_path}",
            "schedule.num_steps=2",
            "buffer.max_staleness=0",
            "rollout.temperature=0.6",
            "rollout.speculative=true",
        ],
    )
    with caplog.at_level(logging.INFO, logger="splitrl"):
        res = train(cfg)
    assert any(
        "off-policy correction" in r.getMessage() and "max_staleness=0" in r.getMessage() for r in caplog.records
    )

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    keys = set(rows[0])
    assert all(set(r) == keys for r in rows), [sorted(set(r) ^ keys) for r in rows]
    assert {"rollout/acceptance_rate", "rollout/speculative_active", "rollout/tokens_per_s"} <= keys

    # the mean reward: one name, equal to the mean over the step's samples
    reward_keys = sorted(k for k in keys if "reward" in k and ("mean" in k or k.endswith("/reward")))
    assert reward_keys == ["train/reward"]
    assert all(0.0 <= r["train/reward"] <= 1.0 for r in rows)

    # per-depth MTP target counts explain the per-depth metrics
    assert all(r["train/mtp/mtp_1_num_tokens"] > 0 for r in rows)
    assert all(math.isfinite(r["train/mtp/mtp_1_loss"]) for r in rows)

    # step 1 is on-policy and fp32 on both sides: trainer and rollout logprobs agree at T = 0.6
    first = res.metrics[0]
    assert first["train/logprob_mismatch"] < 1e-4
    assert abs(first["train/is_weight_max"] - 1.0) < 1e-3
