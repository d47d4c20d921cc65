"""A config you can discover (issue 10, item 5): ``splitrl config``, "did you mean", ``--version``,
``train --help``, and config errors that come back before torch / transformers are imported."""

import json
import subprocess
import sys

import pytest

from _configs import demo_config
from splitrl import __version__
from splitrl._lazy import deferred_import_checks
from splitrl.cli import main
from splitrl.config import RunConfig
from splitrl.config_help import REQUIRED, attribute_docs, config_keys, suggest_key
from splitrl.controller.config import ScheduleConfig


def _leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("backbone", "dataset_config"):  # dict-valued keys are leaves
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize(
    "override,suggestion",
    [
        ("model.mtp.mtp_num_layer=2", "model.mtp.mtp_num_layers"),  # a typo
        ("mtp_num_layers=2", "model.mtp.mtp_num_layers"),  # the right name in the wrong section
        ("model.mpt.mtp_num_layers=2", "model.mtp"),  # a misspelled section
        ("task.pat=x.jsonl", "task.path"),  # a key of another task kind (tagged union)
        ("rollout.max_new_token=4", "rollout.max_new_tokens"),
    ],
)
def test_unknown_key_suggests_the_closest_valid_one(override, suggestion):
    with pytest.raises(ValueError) as e:
        demo_config([override])
    assert f"did you mean {suggestion}?" in str(e.value)
    assert "splitrl config" in str(e.value)


def test_no_suggestion_for_a_key_unlike_any():
    with pytest.raises(ValueError) as e:
        demo_config(["zzzz=1"])
    assert "zzzz: unknown key" in str(e.value) and "did you mean" not in str(e.value)


def test_suggest_key_rules():
    valid = ["model.mtp.mtp_num_layers", "model.mtp", "num_steps", "backend"]
    assert suggest_key("num_step", valid) == "num_steps"
    assert suggest_key("mtp_num_layers", valid) == "model.mtp.mtp_num_layers"
    assert suggest_key("bad", valid) is None  # 'bad' ~ 'backend' is too weak a match
    assert suggest_key("num_steps", valid) is None  # valid: nothing to suggest
    # a short common name inside a real section: that section's keys only (a new user's trial:
    # task.name was answered with logging.wandb.name)
    valid = ["task.dataset", "task.seed", "task.path", "logging.wandb.name", "model.mtp.mtp_num_layers"]
    assert suggest_key("task.name", valid) is None
    assert suggest_key("task.seeds", valid) == "task.seed"
    assert suggest_key("train.mtp_num_layers", valid) == "model.mtp.mtp_num_layers"  # a long name: misplaced


def test_reference_lists_every_key_with_the_runs_default():
    """Every leaf of the resolved default config appears once per task kind with its value."""
    with deferred_import_checks():
        defaults = RunConfig().model_dump(mode="json")
    keys = config_keys(RunConfig, defaults)
    by_path = {}
    for k in keys:
        if k.type != "section" and (not k.when or k.when == "task.kind=reasoning_gym"):
            by_path[k.path] = k
    leaves = dict(_leaves(defaults))
    assert set(leaves) <= set(by_path)
    for path, value in leaves.items():
        assert by_path[path].default == value, path
    # run-level defaults differ from the class defaults: the reference shows the run's
    assert by_path["tokenizer.kind"].default == "pretrained" and by_path["buffer.max_staleness"].default == 1
    assert by_path["buffer.capacity_groups"].default == 64  # the class has none
    assert by_path["model.mtp.mtp_num_layers"].type == "int"
    assert by_path["model.mtp.mtp_num_layers"].doc == "D; 0 disables MTP entirely"
    assert by_path["cluster.backend"].type == "'auto' | 'ray' | 'local'"
    assert by_path["loss.loss_type"].type == "'token_level' | 'sequence_level'"
    # keys of the other task kinds are listed with their condition; a required one says so
    path_key = next(k for k in keys if k.path == "task.path")
    assert path_key.when == "task.kind=math_file" and path_key.default is REQUIRED


def test_attribute_docs_reads_shared_entries_and_first_sentences():
    docs = attribute_docs(ScheduleConfig)
    assert docs["groups_per_step"] == docs["group_size"]
    assert docs["num_steps"] == "optimizer steps of the run."
    assert attribute_docs(RunConfig)["seed"].startswith("seed of the run")


def test_splitrl_config_prints_filtered_keys(capsys):
    assert main(["config", "mtp_num_layers"]) == 0
    out = [line for line in capsys.readouterr().out.splitlines() if line]
    assert out == ["  model.mtp.mtp_num_layers (int) = 0  # D; 0 disables MTP entirely"]
    assert main(["config", "MTP_Num_Layers"]) == 0  # case ignored (`config MTP` found nothing)
    assert [line for line in capsys.readouterr().out.splitlines() if line] == out
    assert main(["config", "no_such_key_anywhere"]) == 1


def test_splitrl_config_says_what_each_chunk_order_does(capsys):
    """Kind: a key's meaning missing from its help (a new user's trial). `splitrl config
    chunk_order` printed only the docstring's first sentence, which named neither value."""
    assert main(["config", "chunk_order"]) == 0
    meaning = capsys.readouterr().out.split("#", 1)[1]
    assert "``prompt`` (default; bitwise reproducible)" in meaning and "``arrival`` (as they finish" in meaning


def test_version_and_train_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"splitrl {__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "examples/" in out and "splitrl config" in out


_NO_HEAVY_IMPORTS = """
import sys
from splitrl.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "reasoning_gym", "ray", "numpy") if m in sys.modules)
print("RESULT", rc, "heavy:" + ",".join(heavy))
"""


@pytest.mark.parametrize("override", ["bad.key=1", "model.mtp.mtp_num_layer=2", "schedule.num_steps=-1"])
def test_config_errors_come_back_before_heavy_imports(override):
    """The bug this guards: validating a config imported torch, transformers and reasoning-gym
    first (10-25 s on 2 busy cores before a typo was reported)."""
    res = subprocess.run(
        [sys.executable, "-c", _NO_HEAVY_IMPORTS, "train", override], capture_output=True, text=True, timeout=120
    )
    last = res.stdout.strip().splitlines()[-1]
    assert last == "RESULT 2 heavy:", (last, res.stderr[-2000:])
    assert "invalid config" in res.stderr


def test_full_validation_still_checks_what_needs_imports():
    # the reasoning-gym generator name is checked in the second pass, with its own hint
    with pytest.raises(ValueError, match="number_sorting"):
        demo_config(["task.dataset=number_sortin"])
    cfg = demo_config(["schedule.num_steps=3"])
    assert cfg.schedule.num_steps == 3 and json.loads(cfg.model_dump_json())["task"]["dataset"] == "number_sorting"


def test_ctrl_c_before_a_run_starts_is_one_line_not_a_traceback(capsys, monkeypatch):
    """Kind: a raw traceback instead of a clear message (a new user's trial). Ctrl-C in the first
    seconds of `splitrl train` (config validation, the torch import) or during `splitrl eval`
    printed a KeyboardInterrupt traceback from deep inside pydantic / torch; now one line and the
    shell's status for SIGINT (130)."""
    import splitrl.cli_eval as cli_eval
    import splitrl.config as config_mod

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def run(argv):
        try:
            return main(argv)
        except KeyboardInterrupt:  # escaped: the user would see its traceback
            pytest.fail(f"KeyboardInterrupt escaped splitrl {argv[0]}")

    monkeypatch.setattr(config_mod, "load_config", interrupted)
    assert run(["train", "schedule.num_steps=1"]) == 130
    err = capsys.readouterr().err
    assert "splitrl: SIGINT: stopped before anything was written" in err and "Traceback" not in err
    monkeypatch.setattr(cli_eval, "load_policy_and_config", interrupted)
    assert run(["eval", "somewhere"]) == 130
    assert "SIGINT: stopped" in capsys.readouterr().err


def test_ctrl_c_in_a_runs_shutdown_names_the_checkpoint_it_wrote(capsys, monkeypatch, tmp_path):
    """Kind: a message that says the opposite of what happened (a new user's trial). Ctrl-C, then
    Ctrl-C again 0.5 s later: the first one's checkpoint (step 11) was written, the second reached
    the run's shutdown after its signal handlers were removed, and splitrl printed `SIGINT before
    the first step: stopped, nothing to save`."""
    import splitrl.controller.controller as controller_mod
    from splitrl.controller.run_checkpoint import COMPLETE, step_dir

    def stopped_in_shutdown(config):
        step_dir(config.output_dir, 11).mkdir(parents=True)
        (step_dir(config.output_dir, 11) / COMPLETE).write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(controller_mod, "train", stopped_in_shutdown)
    assert main(["train", f"output_dir={tmp_path}", "cluster.backend=local"]) == 130
    err = capsys.readouterr().err
    assert f"splitrl: SIGINT: stopped; the newest checkpoint is {tmp_path}/checkpoints/step_000011" in err, err
    assert "nothing to save" not in err and "Traceback" not in err

    def stopped_in_startup(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(controller_mod, "train", stopped_in_startup)
    assert main(["train", f"output_dir={tmp_path / 'new'}", "cluster.backend=local"]) == 130
    assert f"splitrl: SIGINT: stopped; no checkpoint in {tmp_path / 'new'}" in capsys.readouterr().err


def test_a_key_of_several_forms_is_one_line_without_pydantic_tags(capsys):
    """Kind: internals in an error message (a new user's trial). `loss.tis_cap=0` printed two lines
    named `loss.tis_cap.constrained-float` and `loss.tis_cap.literal['auto']`; now one line names
    the key and every allowed form. Tuple and list indices stay in the key."""
    assert main(["train", "loss.tis_cap=0", "train.speed.activation_checkpointing=x", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "  loss.tis_cap: Input should be greater than 0, or 'auto'\n" in err
    assert (
        "  train.speed.activation_checkpointing: Input should be a valid boolean, unable to interpret input, or 'auto'\n"
        in err
    )
    assert "constrained" not in err and "literal[" not in err
    assert main(["train", "train.optim.betas=[0.9]", "--print-config"]) == 2
    assert "  train.optim.betas.1: Field required" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override,line",
    [
        # a field validator of a section (GenerationConfig)
        ("rollout.stop_strings=['']", "  rollout.stop_strings: stop_strings [''] has an empty string, which every"),
        ("rollout.temperature=0", "  rollout.temperature: temperature must be > 0"),
        # a before-validator of a tagged section (the loss registry)
        ("loss.kind=nosuch", "  loss: kind 'nosuch' is not a known loss; known kinds: 'grpo'"),
        # the run's own checks (config_checks)
        (
            "model.pretrained_path=nowhere.gguf",
            "  model.pretrained_path='nowhere.gguf': no such GGUF file; check the path",
        ),
    ],
)
def test_a_validators_own_words_come_without_pydantics_value_error_prefix(capsys, override, line):
    """`splitrl eval --temperature 0` printed "--temperature: Value error, temperature must be > 0
    ..." (a new user's trial); train's config errors name the key and then the validator's own
    words, each a line of its own: this keeps them so, whichever kind of validator refused."""
    assert main(["train", override, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "Value error" not in err and "validation error" not in err, err
    assert err.startswith("splitrl: invalid config:\n" + line), err


@pytest.mark.parametrize(
    "override,line",
    [
        ("logging.wandb=yes", "  logging.wandb: is a section: give a mapping of its keys (e.g. logging.wandb='{key: value}'"),
        ("schedule=5", "  schedule: is a section: give a mapping of its keys"),
        ("train.optim.lr=nan", "  train.optim.lr: Input should be greater than 0 (got 'nan', which is not a number)"),
        (
            "rollout.draft_vocab_size=0",
            "  rollout.draft_vocab_size: Input should be greater than or equal to 1; or leave it unset "
            "(rollout.draft_vocab_size=null on the command line) for its default\n",
        ),
        ("rollout.num_draft_tokens=0", "  rollout.num_draft_tokens: Input should be greater than or equal to 1; or leave"),
        ("schedule.num_steps=0", "  schedule.num_steps: Input should be greater than or equal to 1\n"),
    ],
)
def test_a_section_given_a_scalar_or_a_nan_is_said_in_the_users_words(capsys, override, line):
    """"Input should be a valid dictionary or instance of WandbConfig" named a class the user never
    wrote, and lr=nan read "should be greater than 0" (a new user's trial); an optional key out of
    its bound (draft_vocab_size=0) now says how to get its default back, a required one does not."""
    assert main(["train", override, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitrl: invalid config:\n" + line) and "Config" not in err.splitlines()[1], err


def test_a_misspelt_environment_setting_is_a_one_line_error(tmp_path):
    """SPLITRL_DECODE_ATTENTION is read when the rollout code is imported; a typo was a traceback
    from inside the import chain. Now: exit 2, one line naming the choices, nothing written."""
    import os

    out = tmp_path / "run"
    env = dict(os.environ, SPLITRL_DECODE_ATTENTION="trition")
    res = subprocess.run(
        [sys.executable, "-m", "splitrl.cli", "train", "schedule.num_steps=1", f"output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "SPLITRL_DECODE_ATTENTION='trition': use one of triton, flash" in res.stderr
    assert "Traceback" not in res.stderr and not out.exists()


def test_print_config_checks_the_model_keys(capsys):
    """`--print-config model.backbone.hiden_size=32` printed the typo with exit 0 (only a run caught it)."""
    assert main(["train", "--print-config", "model.backbone.hiden_size=32"]) == 2
    assert (
        "model.backbone.hiden_size is not a key of the qwen3 config (did you mean 'hidden_size'?)"
        in capsys.readouterr().err
    )
    assert main(["train", "--print-config", "model.backbone.hidden_size=32"]) == 0
    assert "hidden_size: 32" in capsys.readouterr().out


def test_a_number_yaml_reads_as_text_gets_a_hint(capsys, tmp_path):
    """A new user wrote `num_steps: 1e3`: PyYAML (YAML 1.1) read it as the string "1e3". It now
    reads as the number (YAML 1.2 floats); a quoted one is text and the error says what to write."""
    assert main(["train", "schedule.num_steps=2e3", "--print-config"]) == 0
    assert "num_steps: 2000" in capsys.readouterr().out
    assert main(["train", 'schedule.num_steps="2e3"', "--print-config"]) == 2
    assert (
        "num_steps: Input should be a valid integer, unable to parse string as an integer (YAML reads 2e3 as text, not a number: write 2000)"
        in capsys.readouterr().err
    )
    path = tmp_path / "run.yaml"
    path.write_text("num_steps: 1.5E+3x\n")  # not a number at all: no hint
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    assert "YAML reads" not in capsys.readouterr().err


def test_a_config_key_typed_as_a_flag_gets_the_key_value_form(capsys):
    """A new user typed `splitrl train --num-steps 8`: the error said only "unrecognized
    arguments"; now it shows the key=value form with the value they gave."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--num-steps", "8"])
    assert e.value.code == 2
    assert (
        "unrecognized arguments: --num-steps; config keys are set as key=value: schedule.num_steps=8"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["train", "--model.mtp.mtp-num-layers=2"])
    assert "model.mtp.mtp_num_layers=2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--bogus"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --bogus")


def test_floats_without_a_dot_are_floats_in_yaml_and_in_a_saved_run_config(tmp_path):
    """PyYAML (YAML 1.1) reads ``1e-06`` as a string; json.dumps writes floats that way, so a
    run_config.json read back gave model.backbone a string rms_norm_eps."""
    import json

    from splitrl.config import load_config

    f = tmp_path / "run_config.json"
    f.write_text(json.dumps({"model": {"backbone": {"rms_norm_eps": 1e-06}}, "train": {"optim": {"lr": 1e-05}}}))
    cfg = load_config(str(f), ["preset=cpu_demo"])
    assert cfg.model.backbone["rms_norm_eps"] == 1e-06 and isinstance(cfg.model.backbone["rms_norm_eps"], float)
    assert cfg.train.optim.lr == 1e-05
    cfg = load_config(None, ["model.backbone={rms_norm_eps: 1e-5}"])
    assert isinstance(cfg.model.backbone["rms_norm_eps"], float)
