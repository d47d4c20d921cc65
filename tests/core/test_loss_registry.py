"""The loss as a ``kind``-tagged config with a registry (issue 22): a registered loss goes from its
config to a trained step; an unknown kind is refused naming the known ones; a config without a
kind keeps meaning GRPO."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _toy_loss import ToyLoss, ToyLossConfig, register
from _utils import make_batch, make_model, make_worker

from _configs import demo_config
from splitrl.loss import ClippedPGLoss, GRPOLossConfig, make_loss, parse_loss_config, registry


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(registry, "_LOSSES", dict(registry._LOSSES))  # registered for this test only
    register()


def test_a_registered_loss_is_parsed_built_and_trained(toy_registered):
    """Kind: a new loss that needs more than its module and one registry line. The toy's options
    parse from a mapping, the factory builds it, and a step trains with it: its ``scale`` option
    reaches the gradient (scale 2 doubles the pre-clip norm, a power of two: exactly)."""
    config = parse_loss_config({"kind": "toy", "scale": 2.0})
    assert isinstance(config, ToyLossConfig) and config.scale == 2.0
    norms = []
    for loss in (make_loss(config), make_loss({"kind": "toy"})):
        assert isinstance(loss, ToyLoss)
        m = make_worker(make_model(seed=0)).train(make_batch(8, seed=1), loss)
        assert m["skipped_step"] == 0.0 and m["num_valid_tokens"] > 0
        norms.append(m["grad_norm"])
    assert math.isclose(norms[0], 2.0 * norms[1], rel_tol=1e-12)
    with pytest.raises(ValueError, match="kind 'toy' is registered already"):
        register()


def test_a_run_config_selects_a_registered_loss_by_kind(tmp_path):
    """The same toy through the run config (registered before ``splitrl.config`` is imported, as a
    plugin would be, so in a fresh interpreter): ``loss.kind=toy`` selects it and drops the default
    section's GRPO keys, the temperature comes from the rollout, GRPO keys are refused by name,
    and ``splitrl config`` lists the toy's keys under their kind."""
    script = """
from _toy_loss import ToyLoss, register
register()
from _configs import demo_config
from splitrl.config import RunConfig
from splitrl.config_help import config_keys
from splitrl.loss import make_loss

cfg = demo_config(["loss.kind=toy", "loss.scale=2", "rollout.temperature=0.7"])
assert type(cfg.loss).__name__ == "RunToyLossConfig" and cfg.loss.temperature is None, cfg.loss
trainer = cfg.trainer_loss_config()
assert (trainer.kind, trainer.scale, trainer.temperature) == ("toy", 2.0, 0.7), trainer
assert isinstance(make_loss(trainer), ToyLoss)
assert cfg.tis_cap() is None and "has none" in cfg.off_policy_summary()[1]
assert demo_config(["loss.entropy_coef=0.1"]).loss.kind == "grpo"
try:
    demo_config(["loss.kind=toy", "loss.clip_eps_low=0.1"])
    raise AssertionError("a GRPO key was accepted for the toy")
except ValueError as e:
    assert "  loss.clip_eps_low: unknown key" in str(e), e
keys = {k.path: k.when for k in config_keys(RunConfig, RunConfig().model_dump(mode="json"))}
assert keys["loss.scale"] == "loss.kind=toy" and keys["loss.tis_cap"] == "loss.kind=grpo", keys
print("ok")
"""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_an_unknown_loss_kind_names_the_known_ones():
    with pytest.raises(ValueError, match=r"  loss: kind 'nope' is not a known loss; known kinds: 'grpo'"):
        demo_config(["loss.kind=nope"])
    for call in (parse_loss_config, make_loss):
        with pytest.raises(ValueError, match=r"kind 'nope' is not a known loss; known kinds: 'grpo'"):
            call({"kind": "nope"})


def test_a_config_without_a_kind_is_grpo():
    """Configs written before ``kind`` existed keep their meaning: a section without one is GRPO,
    given whole or key by key; the factory builds the same loss as the class itself."""
    whole = demo_config(["loss={loss_type: sequence_level, clip_eps_high: 0.28}"])
    assert whole.loss.kind == "grpo" and whole.trainer_loss_config().clip_eps_high == 0.28
    assert demo_config(["loss.kl_coef=0.1"]).trainer_loss_config() == GRPOLossConfig(
        kl_coef=0.1, entropy_coef=0.02, tis_cap=2.0, temperature=1.0
    )
    loss = make_loss({"clip_eps_high": 0.28})
    assert isinstance(loss, ClippedPGLoss) and loss.config == GRPOLossConfig(clip_eps_high=0.28)
    with pytest.raises(ValueError, match="pass RunConfig.trainer_loss_config"):
        make_loss(whole.loss)


def test_resuming_a_checkpoint_written_before_loss_kind_warns_of_nothing(tmp_path, caplog):
    """Its run_config.json has no ``loss.kind``; that is GRPO, not a changed setting."""
    import json
    import logging

    from splitrl.controller.preflight import check_resume_config
    from splitrl.controller.run_checkpoint import RUN_CONFIG

    cfg = demo_config([f"output_dir={tmp_path}"])
    saved = cfg.model_dump(mode="json")
    del saved["loss"]["kind"]
    (tmp_path / RUN_CONFIG).write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING):
        check_resume_config(cfg, tmp_path)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
