"""The run config's layout (issue 22, item 3): run-level keys in sections, the old flat keys still
read for a release with a warning naming the new key, the CPU demo a preset rather than the
defaults, and every config-only check in one module."""

import json
import logging

import pytest
import yaml

from _configs import DEMO_CHARSET, demo_config
from splitrl.cli import main
from splitrl.config import MOVED_KEYS, RunConfig, load_config, upgrade_layout
from splitrl.config_checks import check_run_config
from splitrl.controller.preflight import check_resume_config
from splitrl.controller.run_checkpoint import RUN_CONFIG, write_complete
from splitrl.presets import preset_path

SECTIONS = ("schedule", "cluster", "checkpoint", "faults", "reward")


def flat(dump: dict) -> dict:
    """A config dump in the flat layout of earlier releases (what their run_config.json holds)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in dump.items()}
    for old, new in MOVED_KEYS.items():
        section, key = new.split(".")
        out[f"_{old}"] = out[section].pop(key)
    for section in SECTIONS:
        assert not out.pop(section), section  # every key of the section has an old name
    return {k.removeprefix("_"): v for k, v in out.items()}


def _moved_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


# ------------------------------------------------------------------ kind: the layout
def test_the_top_level_holds_seed_output_dir_and_sections_only():
    dump = RunConfig().model_dump(mode="json")
    scalars = [k for k, v in dump.items() if not isinstance(v, dict)]
    assert scalars == ["seed", "output_dir"]
    assert list(dump)[2:7] == list(SECTIONS)
    assert set(MOVED_KEYS.values()) == {f"{s}.{k}" for s in SECTIONS for k in dump[s]}  # all moved


# ------------------------------------------------------------- kind: old flat keys still read
def test_old_flat_keys_in_a_file_are_read_with_a_warning_naming_the_new_key(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("num_steps: 7\nbackend: local\nschedule: sync\ncheckpoint_every: 0\nreward_timeout_s: 2\n")
    with caplog.at_level(logging.WARNING, logger="splitrl.config"):
        cfg = demo_config(path=path)
    assert (cfg.schedule.num_steps, cfg.cluster.backend, cfg.schedule.mode) == (7, "local", "sync")
    assert (cfg.checkpoint.every, cfg.reward.timeout_s) == (0, 2.0)
    # run-level defaults follow the old keys as they follow the new ones
    assert cfg.dataplane.kind == "inprocess" and cfg.buffer.max_staleness == 0
    (message,) = _moved_warnings(caplog)
    assert f"config file '{path}'" in message
    assert "num_steps -> schedule.num_steps" in message and "schedule -> schedule.mode" in message


def test_an_old_flat_override_is_read_with_a_warning_naming_the_new_key(caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="splitrl.config"):
        cfg = demo_config(["num_steps=10", "schedule=sync"])
    assert cfg.schedule.num_steps == 10 and cfg.schedule.mode == "sync" and cfg.buffer.max_staleness == 0
    (message,) = _moved_warnings(caplog)
    assert "num_steps is deprecated: use schedule.num_steps" in message
    assert "schedule is deprecated: use schedule.mode" in message
    # a mapping for `schedule` is the section, not the old key
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="splitrl.config"):
        assert demo_config(["schedule={mode: sync, num_steps: 2}"]).schedule.num_steps == 2
    assert not _moved_warnings(caplog)
    # only a text value is the old key: a list is the section with the wrong type (it was read as
    # the old key and reported as "schedule.mode: Input should be 'async' or 'sync'")
    for bad in ("schedule=[1, 2]", "schedule=3"):
        with pytest.raises(ValueError, match=r"schedule\n?.*a section: give a mapping of its keys") as err:
            demo_config([bad])
        assert "schedule.mode" not in str(err.value) and not _moved_warnings(caplog)
    # the CLI: the same, before anything runs
    assert main(["train", "num_steps=3", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["schedule"]["num_steps"] == 3


def test_an_old_key_and_its_new_key_both_given_is_an_error(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("num_steps: 5\nschedule: {num_steps: 6}\n")
    with pytest.raises(
        ValueError, match=r"num_steps and schedule.num_steps are both given; .* keep schedule.num_steps"
    ):
        load_config(path)
    with pytest.raises(ValueError, match=r"overrides: device and cluster.device are both given"):
        demo_config(["device=cpu", "cluster.device=cpu"])
    with pytest.raises(ValueError, match="resume and checkpoint.resume are both given"):
        demo_config(["checkpoint={resume: false}", "resume=true"])
    with pytest.raises(ValueError, match="RunConfig: group_size and schedule.group_size are both given"):
        RunConfig(group_size=4, schedule={"group_size": 2})
    # an override over a file is an override, whichever name either uses
    path.write_text("schedule: {num_steps: 6}\n")
    assert load_config(path, ["num_steps=9"]).schedule.num_steps == 9


def test_a_config_of_the_old_layout_loads_as_the_new_one(tmp_path, caplog):
    """A saved run config of an earlier release (run_config.json / config.yaml, every key flat)
    gives the same config as its new-layout dump; so does RunConfig built from it in code."""
    cfg = demo_config(["schedule.num_steps=3", "cluster.backend=local", "checkpoint.export_every=0"])
    old = flat(cfg.model_dump(mode="json"))
    assert "num_steps" in old and "schedule" in old and old["schedule"] == "async"
    path = tmp_path / "config.yaml"  # the run's saved config.yaml (YAML reads JSON's 1e-06 as text)
    path.write_text(yaml.safe_dump(old))
    with caplog.at_level(logging.WARNING, logger="splitrl.config"):
        assert load_config(path) == cfg
    (message,) = _moved_warnings(caplog)
    assert "deprecated flat keys, read as their new keys: " in message  # one line for them all
    assert "schedule -> schedule.mode" in message and "checkpoint_every -> checkpoint.every" in message
    assert RunConfig.model_validate(old) == cfg
    assert upgrade_layout(old, "x", warn=False) == cfg.model_dump(mode="json")


def test_resume_over_a_checkpoint_whose_saved_config_has_the_old_layout(tmp_path, caplog):
    """The resume check compares the saved config key by key: an old-layout run_config.json is
    read in the new layout (no setting reported as changed), and a groups_per_step change is
    still refused, by its new name."""
    cfg = demo_config([f"output_dir={tmp_path}"])
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    (ckpt / RUN_CONFIG).write_text(json.dumps(flat(cfg.model_dump(mode="json"))))
    write_complete(ckpt, 1)
    with caplog.at_level(logging.WARNING):
        check_resume_config(cfg, ckpt)
    assert not [r for r in caplog.records if "differ" in r.getMessage()], caplog.text
    other = demo_config([f"output_dir={tmp_path}", "schedule.groups_per_step=8"])
    with pytest.raises(ValueError, match=r"schedule.groups_per_step=16, this run has schedule.groups_per_step=8"):
        check_resume_config(other, ckpt)
    # a changed setting is named by its new key
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_resume_config(demo_config([f"output_dir={tmp_path}", "schedule.group_size=4"]), ckpt)
    assert "schedule.group_size: 8 -> 4" in caplog.text


# ------------------------------------------------------------------ kind: the demo is a preset
def test_the_defaults_are_a_real_runs_and_the_demo_is_a_preset():
    default, demo = RunConfig(), demo_config()
    assert load_config(None) == default
    # the demo's values live in the preset, not in the defaults
    assert default.rollout.max_new_tokens == 256 and demo.rollout.max_new_tokens == 8
    assert default.tokenizer.kind == "pretrained" and demo.tokenizer.charset == DEMO_CHARSET
    assert default.model.mtp.mtp_num_layers == 0 and demo.model.mtp.mtp_num_layers == 1
    assert default.cluster.torch_threads is None and demo.cluster.torch_threads == 1
    assert demo.output_dir == "runs/demo" and demo.task.scoring == "partial_chars"
    # the example is the preset plus a held-out evaluation
    example = load_config("examples/cpu_demo.yaml")
    assert example.model_copy(update={"eval": demo.eval, "output_dir": demo.output_dir}) == demo
    assert example.eval.eval_every == 50 and example.output_dir == "runs/demo_eval"


def test_a_file_on_a_preset_merges_into_it_and_overrides_name_presets(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: cpu_demo\nrollout: {temperature: 0.7}\ntask: {kind: reverse_digits, num_digits: 3}\n")
    cfg = load_config(path)
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.max_new_tokens == 8  # merged key by key
    assert cfg.task.kind == "reverse_digits" and not hasattr(cfg.task, "dataset")  # another kind replaces
    assert load_config(None, ["preset=cpu_demo"]) == demo_config()
    assert load_config(path, ["preset=null"]).rollout.max_new_tokens == 256  # no preset: the defaults
    with pytest.raises(ValueError, match=r"preset='gpu' is not a preset; the presets are: cpu_demo"):
        load_config(None, ["preset=gpu"])
    with pytest.raises(ValueError, match="preset takes a name"):
        load_config(None, ["preset.x=1"])
    assert "preset" not in demo_config().model_dump()  # a loading instruction, not a saved key
    assert yaml.safe_load(preset_path("cpu_demo").read_text())["output_dir"] == "runs/demo"


def test_splitrl_train_without_a_config_runs_the_demo_and_says_so(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="splitrl"):
        assert main(["train", "schedule.num_steps=0"]) == 2  # refused on load, after the notice
    assert "no --config: the CPU demo (preset cpu_demo" in caplog.text
    assert "schedule.num_steps" in capsys.readouterr().err
    assert main(["train", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == demo_config().model_dump(mode="json")
    assert main(["train", "preset=null", "--print-config"]) == 0  # the plain defaults, when asked for
    assert yaml.safe_load(capsys.readouterr().out) == RunConfig().model_dump(mode="json")


# ------------------------------------------------------------- kind: checks in one place
def test_the_config_checks_run_on_load_and_on_their_own():
    cfg = demo_config()
    check_run_config(cfg)  # valid: nothing raised
    bad = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"min_groups_per_chunk": 99})})
    with pytest.raises(ValueError, match="schedule.min_groups_per_chunk=99 > schedule.groups_per_step=16"):
        check_run_config(bad)
    with pytest.raises(ValueError, match="schedule.min_groups_per_chunk=99 > schedule.groups_per_step=16"):
        demo_config(["schedule.min_groups_per_chunk=99"])


def test_a_longer_run_that_trains_on_the_earlier_heldout_prompts_says_so(tmp_path, caplog):
    """Raising schedule.num_steps on resume moves training into the prompt indices the earlier run
    held out for its evaluation (its default start): the eval/ figures it logged are no longer
    held out from this run (a new user's trial). A separate eval.task, or no evaluation, is quiet."""
    def resume(saved_overrides, now_overrides):
        ckpt = tmp_path / "step_000300"
        ckpt.mkdir(exist_ok=True)
        saved = demo_config([f"output_dir={tmp_path}", "schedule.num_steps=300", *saved_overrides])
        (ckpt / RUN_CONFIG).write_text(json.dumps(saved.model_dump(mode="json")))
        write_complete(ckpt, 300)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            check_resume_config(demo_config([f"output_dir={tmp_path}", "schedule.num_steps=310", *now_overrides]), ckpt)
        return caplog.text

    text = resume(["eval.at_end=true"], ["eval.at_end=true"])
    assert "schedule.num_steps 300 -> 310: training now draws prompt indices 4800..4959" in text, text
    assert "starts at index 4960" in text
    assert "training now draws" not in resume([], [])  # the earlier run did not evaluate
    assert "training now draws" not in resume(["eval.at_end=true", "eval.start_index=100000"], ["eval.at_end=true"])
