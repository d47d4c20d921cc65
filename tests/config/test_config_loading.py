"""Loading a run config (issue 6, items 5, 6, 11): run-level defaults reach components before
they validate, a whole-section override replaces the section, and malformed input (YAML syntax,
non-UTF-8 bytes, an unwritable output_dir) names the file / override and the line in one message."""

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

import splitrl.config as config_module
from _configs import demo_config
from splitrl.cli import main
from splitrl.config import RunConfig, load_config
from splitrl.tasks import ReverseDigitsTaskConfig, make_task

GPU_EXAMPLE = Path(__file__).parents[2] / "examples" / "qwen3_0p6b_gpu.yaml"


def _one_line_error(capsys, argv, code):
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------ kind: run-level default order
def test_run_level_default_reaches_a_component_before_its_own_check():
    """Kind: a component validator runs before the run-level default it depends on is filled (or
    the default never reaches the component). ``schedule=cosine`` without ``total_steps`` decays
    over the run's ``num_steps``; ``backend=local`` without a data-plane kind uses the in-process one
    (the only one it runs)."""
    cfg = demo_config(["train.optim.schedule=cosine", "schedule.num_steps=7", "train.optim.min_lr_ratio=0.1"])
    optim = cfg.train.optim
    assert optim.total_steps == 7
    assert optim.lr_factor(0) == pytest.approx(1.0)
    assert optim.lr_factor(7) == pytest.approx(0.1)  # the decay ends at the run's last step
    assert demo_config(["train.optim.schedule=cosine", "train.optim.total_steps=50"]).train.optim.total_steps == 50
    # the same through RunConfig directly (the programmatic path): the demo's num_steps
    assert RunConfig.model_validate({"train": {"optim": {"schedule": "cosine"}}}).train.optim.total_steps == 300

    # a dotted override into a section starts from the demo's section without freezing the keys
    # the run fills
    cfg = demo_config(["train.optim.schedule=cosine", "schedule.num_steps=9"])
    assert cfg.train.optim.total_steps == 9 and cfg.train.optim.lr == 5e-4  # the demo's lr kept
    assert (
        demo_config(["cluster.backend=local", "dataplane.transferqueue.num_storage_units=1"]).dataplane.kind
        == "inprocess"
    )

    assert demo_config(["cluster.backend=local"]).dataplane.kind == "inprocess"
    with pytest.raises(ValueError, match="dataplane.kind=transferqueue needs cluster.backend=ray"):
        demo_config(["cluster.backend=local", "dataplane.kind=transferqueue"])


def test_a_dotted_override_of_a_default_value_changes_nothing():
    """Every section the file does not set starts from the run's default: setting one of its keys
    to the value it already has gives the default run config, section by section."""
    default = RunConfig()
    for name in RunConfig.model_fields:
        section = getattr(default, name)
        if not isinstance(section, BaseModel):
            continue
        key = next(k for k in type(section).model_fields if k != "kind")
        value = section.model_dump(mode="json")[key]
        assert (
            load_config(None, [f"{name}.{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"]) == default
        ), name


# ------------------------------------------------------------- kind: section override merges
def test_whole_section_override_replaces_the_files_section():
    """Kind: a whole mapping given for a section was merged key by key into the file's section,
    so another task kind inherited the old kind's keys and failed."""
    cfg = load_config(GPU_EXAMPLE, ["cluster.device=cpu", "task={kind: reverse_digits, num_digits: 8}"])
    assert cfg.task == ReverseDigitsTaskConfig(num_digits=8)
    assert make_task(cfg.task).get_prompt(0).text  # a working task, not a hybrid
    # a whole mapping for a nested section replaces that section too
    cfg = load_config(GPU_EXAMPLE, ["cluster.device=cpu", "train.optim={lr: 1.0e-5}"])
    assert (cfg.train.optim.lr, cfg.train.optim.warmup_steps, cfg.train.optim.weight_decay) == (
        1e-5,
        0,
        0.0,
    )  # not the file's 2, 0.01
    assert cfg.train.precision == "bf16"  # the rest of the file's train section stays
    # dotted keys still set one key and keep the file's others
    cfg = load_config(GPU_EXAMPLE, ["cluster.device=cpu", "task.scoring=partial"])
    assert (cfg.task.dataset, cfg.task.scoring, cfg.task.compact_prompts) == ("basic_arithmetic", "partial", True)
    # a dotted kind change keeps only the keys overrides set, in either order
    for order in (["task.kind=reverse_digits", "task.num_digits=8"], ["task.num_digits=8", "task.kind=reverse_digits"]):
        assert load_config(GPU_EXAMPLE, ["cluster.device=cpu", *order]).task == ReverseDigitsTaskConfig(num_digits=8)
    # later overrides win: a key set inside a replaced section
    cfg = demo_config(["task={kind: reverse_digits}", "task.num_digits=5"])
    assert cfg.task == ReverseDigitsTaskConfig(num_digits=5)


def test_a_required_key_left_out_of_a_section_given_whole_says_why_and_what_to_do(tmp_path):
    """Kind: an error that did not say how to fix it (a new user's trial). `buffer: {max_staleness: 0}`
    in a file failed with `buffer.capacity_groups: Field required`, while `splitrl config` lists
    that key with a default (the run's, which a section given whole does not start from)."""
    path = tmp_path / "run.yaml"
    path.write_text("buffer: {max_staleness: 0}\n")
    for source, overrides in ((path, []), (None, ["buffer={max_staleness: 0}"])):
        with pytest.raises(
            ValueError,
            match=r"buffer.capacity_groups: Field required; a buffer section given whole .* "
            r"replaces the run's default buffer section, so give buffer.capacity_groups there too",
        ):
            load_config(source, overrides)
    # the dotted form keeps the run's other buffer keys
    assert demo_config(["buffer.max_staleness=0"]).buffer.capacity_groups == RunConfig().buffer.capacity_groups


# ------------------------------------------------------------ kind: unlocated syntax / bytes
def test_yaml_syntax_errors_name_the_file_or_override_and_the_line(tmp_path, capsys):
    """Kind: a parser error surfaced as a raw yaml traceback without saying which input it was."""
    bad = tmp_path / "run.yaml"
    bad.write_text("schedule: {num_steps: 3}\nmodel:\n  backbone: {hidden_size: 64\n")
    with pytest.raises(ValueError, match=r"config file '.*run\.yaml' line 4, column 1: not valid YAML.*line 3"):
        load_config(bad)
    err = _one_line_error(capsys, ["train", "--config", str(bad)], 2)
    assert err.startswith("splitrl: config file") and "run.yaml' line 4" in err and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match=r"override 'task=\{kind: x' line 1, column 14: not valid YAML"):
        demo_config(["task={kind: x"])
    err = _one_line_error(capsys, ["train", "schedule.num_steps=[1"], 2)
    assert err.startswith("splitrl: override 'schedule.num_steps=[1' line 1") and len(err.splitlines()) == 1


def test_non_utf8_input_names_the_file_and_line(tmp_path, capsys):
    """Kind: undecodable bytes raised a bare UnicodeDecodeError naming neither file nor line."""
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_bytes(b"num_steps: 3\n# caf\xe9\nseed: 1\n")
    with pytest.raises(ValueError, match=r"config file '.*run\.yaml' line 2: byte 0xe9 is not UTF-8"):
        load_config(cfg_file)
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"problem": "1+1", "answer": "2"}\n\n{"problem": "caf\xe9", "answer": "3"}\n')
    with pytest.raises(
        ValueError, match=r"data\.jsonl': 1 of its 2 rows .*line 3 \(row 1\): not UTF-8 \(byte 0xe9 at column 17"
    ):
        make_task({"kind": "math_file", "path": str(data)})
    parquet = tmp_path / "data.parquet"
    parquet.write_bytes(b"PAR1" + b"\x00" * 64)  # a cut-off file
    with pytest.raises(ValueError, match=r"data\.parquet' cannot be read as parquet"):
        make_task({"kind": "math_file", "path": str(parquet)})
    err = _one_line_error(
        capsys,
        [
            "train",
            "task.kind=math_file",
            f"task.path={data}",
            f"output_dir={tmp_path / 'run'}",
            "cluster.backend=local",
        ],
        2,
    )
    assert "line 3 (row 1): not UTF-8" in err and "task.skip_rows=[1]" in err and len(err.splitlines()) == 1


def test_output_dir_filesystem_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """Kind: an OSError under output_dir (cannot create, cannot write, fails mid-run) ended in a
    traceback; it is one line naming output_dir (preflight) or the file (during the run)."""
    from splitrl.controller.preflight import check_output_dir

    with pytest.raises(ValueError, match=r"output_dir='/proc/splitrl_x/run': cannot create it"):
        check_output_dir("/proc/splitrl_x/run")
    err = _one_line_error(capsys, ["train", "output_dir=/proc/splitrl_x/run", "cluster.backend=local"], 2)
    assert err.startswith("splitrl: output_dir='/proc/splitrl_x/run': cannot create it") and len(err.splitlines()) == 1
    # an entry of the run's of the wrong kind: a file named checkpoints let the run train every
    # step up to its first checkpoint, then stop (a new user's trial)
    (tmp_path / "f" / "checkpoints").parent.mkdir()
    (tmp_path / "f" / "checkpoints").write_text("")
    (tmp_path / "d" / "metrics.jsonl").mkdir(parents=True)
    for out, entry, kind in [("f", "checkpoints", "a file"), ("d", "metrics.jsonl", "a directory")]:
        err = _one_line_error(capsys, ["train", f"output_dir={tmp_path / out}", "cluster.backend=local"], 2)
        assert f"{tmp_path / out / entry} is {kind}, but the run writes its {entry} there" in err, err
    assert not (tmp_path / "f" / "config.yaml").exists()  # refused before the run wrote anything
    check_output_dir(str(tmp_path / "f" / "sub"))  # an existing output_dir with no such entry passes

    from splitrl.controller import controller

    def full_disk(config):
        raise OSError(28, "No space left on device", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(controller, "train", full_disk)
    err = _one_line_error(capsys, ["train", f"output_dir={tmp_path}", "cluster.backend=local"], 1)
    assert err.startswith("splitrl: stopped:") and len(err.splitlines()) == 1
    assert "No space left on device" in err and str(tmp_path / "metrics.jsonl") in err

    def dead_helper(config):  # a compile worker killed by a signal to the group: no file of the run
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(controller, "train", dead_helper)
    err = _one_line_error(capsys, ["train", f"output_dir={tmp_path}", "cluster.backend=local"], 1)
    assert err.startswith("splitrl: stopped: BrokenPipeError: Broken pipe in ") and "dead_helper" in err
    assert "cannot write the run's files" not in err and "another process of this run" in err


def test_a_key_written_twice_is_an_error_not_the_last_one_silently(tmp_path):
    """Kind: input silently ignored. PyYAML keeps the last of two equal keys, so `num_steps: 100`
    followed later by `num_steps: 5` ran 5 steps without a word (a new user's trial)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num_steps: 100\nseed: 1\nnum_steps: 5\n")
    with pytest.raises(ValueError, match=r"run.yaml' line 3, column 1: .*'num_steps' appears twice .*line 1"):
        load_config(str(cfg), [])
    with pytest.raises(ValueError, match=r"'temperature' appears twice"):
        demo_config(["rollout={temperature: 1.0, temperature: 0.5}"])
    cfg.write_text("num_steps: 5\nrollout: {temperature: 0.9}\nloss: {temperature: null}\n")  # same key, other mappings
    assert load_config(str(cfg), []).schedule.num_steps == 5


def test_a_yaml_boolean_is_not_taken_as_a_count():
    """Kind: input silently reinterpreted. `checkpoint_every: true` ran as checkpoint_every=1
    (pydantic's lax int accepts bools; a new user's trial)."""
    for key in ("checkpoint.every", "checkpoint.export_every", "schedule.num_steps"):
        with pytest.raises(ValueError, match=rf"{key} must be an integer, got true \(a YAML boolean\)"):
            demo_config([f"{key}=true"])
    assert demo_config(["checkpoint.every=1"]).checkpoint.every == 1


def test_a_config_path_naming_a_directory_says_so(tmp_path):
    """Kind: an error that names the wrong cause (a new user's trial). `--config examples` said
    `config file 'examples' does not exist`, though it does, as a directory."""
    with pytest.raises(ValueError, match=r"config file '.*' is a directory; give a YAML run config file"):
        load_config(str(tmp_path), [])
    with pytest.raises(ValueError, match=r"config file '.*nowhere.yaml' does not exist"):
        load_config(str(tmp_path / "nowhere.yaml"), [])


def test_a_config_from_a_pipe_is_read_and_other_odd_paths_are_named(tmp_path, monkeypatch):
    """Kind: an error that names the wrong cause (issue "Nothing lost, nothing silent", item 7).
    `--config <(cat f.yaml)` (a pipe, /dev/fd/63), a named FIFO or /dev/zero were reported as
    "does not exist"; a pipe is now read, a device named; a pipe that gives nothing (the command
    feeding it failed) is an error, not the demo config."""
    import os
    import threading

    def through_a_pipe(text: bytes, path=None) -> str:
        if path is None:
            r, w = os.pipe()
            path = f"/dev/fd/{r}"
            writer = threading.Thread(target=lambda: (os.write(w, text), os.close(w)))
        else:

            def feed():
                with open(path, "wb") as f:
                    f.write(text)

            writer, r = threading.Thread(target=feed), None
        writer.start()
        try:
            return load_config(path, [])
        finally:
            writer.join(60)
            if r is not None:
                os.close(r)

    assert through_a_pipe(b"schedule: {num_steps: 3}\nseed: 7\n").schedule.num_steps == 3  # process substitution
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert through_a_pipe(b"schedule: {num_steps: 4}\n", fifo).schedule.num_steps == 4  # a named FIFO
    with pytest.raises(ValueError, match=r"config file '/dev/fd/\d+' is a pipe that gave no data \(did the command"):
        through_a_pipe(b"")
    # a named FIFO no process writes to hung the CLI forever, printing nothing (a new user's trial)
    monkeypatch.setattr(config_module, "PIPE_WRITER_WAIT_S", 0.2)
    with pytest.raises(ValueError, match=r"fifo' is a named pipe that no process wrote to within 0.2 s"):
        load_config(str(fifo), [])
    with pytest.raises(ValueError, match=r"config file '/dev/zero' is a character device, not a file; give a YAML"):
        load_config("/dev/zero", [])
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match=r"loop.yaml' is a symbolic link that loops"):
        load_config(str(loop), [])
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    with pytest.raises(ValueError, match=r"dangling.yaml' is a symbolic link to '.*gone.yaml', which does not exist"):
        load_config(str(tmp_path / "dangling.yaml"), [])
    # an empty file (or comments only) ran the defaults silently, not the CPU demo of no --config
    for text in ("", "# nothing yet\n"):
        (tmp_path / "empty.yaml").write_text(text)
        with pytest.raises(ValueError, match=r"empty.yaml' is empty \(no keys\): .*'preset: cpu_demo'"):
            load_config(str(tmp_path / "empty.yaml"), [])


def test_an_output_dir_that_is_a_link_loop_or_a_dangling_link_says_so(tmp_path, capsys):
    """Kind: an error that names the wrong cause (item 7): a symlink loop as output_dir said
    "cannot create it (File exists)" (mkdir's EEXIST), after the config had loaded."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for out, why in [
        (loop, "is a symbolic link that loops"),
        (loop / "sub", f"is under {str(loop)!r}, a symbolic link that loops"),
        (tmp_path / "dangling", "is a symbolic link to '.*gone', which does not exist"),
    ]:
        with pytest.raises(ValueError, match=rf"output_dir='{out}' {why}.*give a directory .*or remove the link"):
            demo_config([f"output_dir={out}"])
    err = _one_line_error(capsys, ["train", f"output_dir={loop}", "cluster.backend=local"], 2)
    assert "symbolic link that loops" in err and "File exists" not in err
    assert not (tmp_path / "gone").exists()
    with pytest.raises(ValueError, match=r"output_dir='/dev/null' is a character device; give a directory"):
        demo_config(["output_dir=/dev/null"])


def test_a_yaml_boolean_is_not_taken_as_a_count_in_a_section():
    """Kind: input silently reinterpreted. The run-level check missed the sections:
    `buffer.max_staleness=true` ran at staleness 1, `model.mtp.mtp_num_layers=true` with one
    depth (a new user's trial)."""
    for key in (
        "buffer.max_staleness",
        "model.mtp.mtp_num_layers",
        "rollout.max_new_tokens",
        "eval.eval_every",
        "train.optim.total_steps",
    ):
        with pytest.raises(ValueError, match=rf"{key} must be an integer, got true \(a YAML boolean\)"):
            demo_config([f"{key}=true"])
    # a task section: the class its `kind` names is checked, in training and in evaluation
    for section in ("task", "eval.task"):
        with pytest.raises(ValueError, match=rf"{section}.num_digits must be an integer, got false"):
            demo_config([f"{section}={{kind: reverse_digits, num_digits: false}}"])
    cfg = demo_config(["buffer.max_staleness=0", "task={kind: reverse_digits, num_digits: 4}"])
    assert (cfg.buffer.max_staleness, cfg.task.num_digits) == (0, 4)
    assert demo_config(["rollout.speculative=true"]).rollout.speculative is True  # a real bool stays one


def test_eval_ks_above_num_samples_is_refused_on_load(capsys):
    """Kind: a key whose documented limit was not checked (a new user's trial). `eval.ks=[8]` with
    `eval.num_samples=4` loaded, trained, and the run's metrics silently had no eval/pass@8."""
    err = _one_line_error(capsys, ["train", "eval.ks=[8]", "eval.at_end=true", "--print-config"], 2)
    assert "eval.ks=[8]" in err and "eval.num_samples=4" in err
    err = _one_line_error(capsys, ["train", "eval.ks=[0, 2]", "--print-config"], 2)
    assert "got [0]" in err
    assert demo_config(["eval.ks=[1, 2, 8]", "eval.num_samples=8"]).eval.ks == [1, 2, 8]


def test_a_leading_tilde_in_a_path_key_is_the_home_directory(monkeypatch, tmp_path):
    """Kind: output written somewhere unexpected (a new user's trial). The shell does not expand ~
    in `key=value`, and `output_dir=~/runs/x` made a directory literally named `~` in the working
    directory (task.path already expanded it; model.pretrained_path and tokenizer.path did not)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    cfg = demo_config(["output_dir=~/runs/x", "model.pretrained_path=~/m", "tokenizer.path=~/tok"])
    assert cfg.output_dir == str(tmp_path / "runs" / "x")
    assert cfg.model.pretrained_path == str(model_dir)
    assert cfg.tokenizer.path == str(tmp_path / "tok")
    assert demo_config(["output_dir=runs/x"]).output_dir == "runs/x"  # anything else as written


def test_a_missing_pretrained_path_says_it_does_not_exist(tmp_path):
    """A new user's typo in model.pretrained_path read "has no config.json", as for a directory that
    exists but is not a model; now a missing path says so."""
    with pytest.raises(ValueError, match=r"model.pretrained_path='.*nowhere' does not exist; check the path"):
        demo_config([f"model.pretrained_path={tmp_path / 'nowhere'}"])
    with pytest.raises(
        ValueError, match=r"has no config.json \(not a Hugging Face model directory, nor a \.gguf file\)"
    ):
        demo_config([f"model.pretrained_path={tmp_path}"])


def test_a_pretrained_path_of_the_wrong_kind_says_what_it_is(tmp_path):
    """A new user's trial: a directory named *.gguf read "no such GGUF file", a file that is not
    .gguf "has no config.json"; each now says what is at the path and what is expected."""
    (tmp_path / "dir.gguf").mkdir()
    (tmp_path / "notes.txt").write_text("not a model\n")
    expected = r"; give a \.gguf file or a Hugging Face model directory \(one with config\.json\)"
    with pytest.raises(
        ValueError, match=r"model.pretrained_path='.*dir.gguf' is a directory, not a \.gguf file" + expected
    ):
        demo_config([f"model.pretrained_path={tmp_path / 'dir.gguf'}"])
    with pytest.raises(
        ValueError, match=r"model.pretrained_path='.*notes.txt' is a file but not a \.gguf file" + expected
    ):
        demo_config([f"model.pretrained_path={tmp_path / 'notes.txt'}"])
    (tmp_path / "loop.gguf").symlink_to(tmp_path / "loop.gguf")
    with pytest.raises(ValueError, match=r"loop.gguf' is a symbolic link that loops"):
        demo_config([f"model.pretrained_path={tmp_path / 'loop.gguf'}"])


@pytest.mark.parametrize("value", ["", "''", "' '", "null"])
def test_an_empty_output_dir_says_so(capsys, monkeypatch, tmp_path, value):
    """A new user's trial: `splitrl train output_dir=` read "output_dir: Input should be a valid
    string" (and `output_dir=''` trained the demo into the working directory: --print-config and
    a scratch working directory keep a regression from running it)."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", f"output_dir={value}"] + (["--print-config"] if value else [])
    err = _one_line_error(capsys, argv, 2)
    problems = [line for line in err.splitlines() if "output_dir" in line]
    assert problems == ["  output_dir is empty; give the directory the run writes to (e.g. output_dir=runs/my_run)"]
    assert "valid string" not in err
