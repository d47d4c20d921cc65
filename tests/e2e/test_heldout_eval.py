"""Held-out evaluation during training (issue 10, item 1): on the generation workers, every
``eval.eval_every`` steps and at the end, on prompt indices training never draws.

References: the same evaluation run directly on the checkpoint written at that step (the weights
the workers had), and the same run without evaluation (training is unchanged by it)."""

import json
import math

import pytest
from _tiny import TINY_STEP

from _configs import demo_config
from splitrl.controller.controller import train
from splitrl.eval_config import EvalConfig, heldout_indices
from splitrl.evaluation import evaluate
from splitrl.logging import read_metrics
from splitrl.logging.plot import plot_series
from splitrl.models import PolicyModel
from splitrl.tasks import build_char_tokenizer, make_task

TINY = TINY_STEP + ["cluster.backend=local", "dataplane.kind=inprocess", "logging.tensorboard=false",
                    "buffer.max_staleness=0", "schedule.num_steps=4", "checkpoint.every=2", "checkpoint.export_every=2"]
EVAL = ["eval.eval_every=2", "eval.num_prompts=3", "eval.num_samples=2", "eval.greedy=true",
        "eval.correct_threshold=0.3", "eval.seed=9"]


def test_heldout_indices():
    cfg = EvalConfig(num_prompts=3)
    assert heldout_indices(cfg, None, 16) == [16, 17, 18]  # past what training draws
    assert heldout_indices(cfg, 17, 16) == [16]  # a finite task: what is left
    with pytest.raises(ValueError, match="eval.task"):
        heldout_indices(cfg, 16, 16)  # drawn in full
    with pytest.raises(ValueError, match="overlaps"):
        heldout_indices(cfg.model_copy(update={"start_index": 4}), None, 16)
    separate = EvalConfig(num_prompts=3, task={"kind": "reverse_digits"})
    assert heldout_indices(separate, None, 16) == [0, 1, 2]  # a separate task starts at 0


def test_eval_during_training_matches_a_direct_evaluation_and_leaves_training_unchanged(tmp_path):
    # eval.ks=[2] adds k's; pass@1 is still reported (it went missing when ks left out 1)
    res = train(demo_config(TINY + EVAL + ["eval.ks=[2]", f"output_dir={tmp_path / 'eval'}"]))
    rows = read_metrics(tmp_path / "eval" / "metrics.jsonl")
    assert [("eval/reward_mean" in r) for r in rows] == [False, True, False, True]
    config = demo_config(TINY + EVAL)
    tok = build_char_tokenizer(config.tokenizer.charset)
    task = make_task(config.task)
    for row in (rows[1], rows[3]):
        step = row["step"]
        # the checkpoint of this step holds the weights the workers evaluated
        model = PolicyModel.from_pretrained(str(tmp_path / "eval" / "checkpoints" / f"step_{step:06d}" / "policy"))
        ref = evaluate(model, tok, task, config.rollout, [16, 17, 18], num_samples=2, ks=(1, 2), seed=9,
                       device="cpu", correct_threshold=0.3)
        greedy = evaluate(model, tok, task, config.rollout.model_copy(update={"top_k": 1}), [16, 17, 18],
                          num_samples=1, seed=9, device="cpu", correct_threshold=0.3, prefix="eval/greedy/")
        for key, value in {**ref.metrics, **greedy.metrics}.items():
            assert row[key] == value, (step, key, row[key], value)
        assert row["timing/eval_s"] > 0

    # the same run without evaluation trains identically (max_staleness 0: deterministic)
    plain = train(demo_config(TINY + [f"output_dir={tmp_path / 'plain'}"]))
    for a, b in zip(res.metrics, plain.metrics):
        for k, v in b.items():
            if k.startswith("timing/") or k == "rollout/tokens_per_s":
                continue
            assert a[k] == v or (math.isnan(a[k]) and math.isnan(v)), (k, a[k], v)

    # drawn in metrics.png: the evaluation's points at the steps evaluated
    panels = dict(plot_series(rows))
    series = {label: (xs, ys) for label, xs, ys, _ in panels["reward"]}
    assert series["eval/reward_mean"] == ([2, 4], [rows[1]["eval/reward_mean"], rows[3]["eval/reward_mean"]])
    assert "eval/greedy/pass@1" in series


def test_no_heldout_prompt_left_fails_before_anything_starts(tmp_path):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    out = tmp_path / "run"
    cfg = demo_config(TINY + [f"output_dir={out}", "eval.at_end=true", "tokenizer.charset=null",
                                    "model.backbone.vocab_size=100", f"task={{kind: math_file, path: {data}}}"])
    with pytest.raises(ValueError, match="eval.task"):
        train(cfg)
    # preflight may probe that output_dir is writable; nothing of a run is written
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("same", [True, False])
def test_an_eval_task_on_the_training_file_fails_before_anything_starts(tmp_path, same):
    """A new user's eval.task naming the training file itself logged eval/pass@1 on training
    prompts without a word; a separate file is fine (the check is on the source of the rows)."""
    rows = lambda lo: "".join(json.dumps({"problem": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(lo, lo + 40))  # noqa: E731
    (tmp_path / "train.jsonl").write_text(rows(0))
    (tmp_path / "test.jsonl").write_text(rows(100))
    eval_file = tmp_path / ("train.jsonl" if same else "test.jsonl")
    task = f"{{kind: math_file, path: {tmp_path / 'train.jsonl'}}}"
    cfg = demo_config(TINY + ["tokenizer.charset=null", "model.backbone.vocab_size=100", f"task={task}",
                              "eval.at_end=true", f"eval.task={{kind: math_file, path: {eval_file}, prompt_template: 'Q {{prompt}}'}}"])
    from splitrl.eval_config import plan_eval

    if same:
        with pytest.raises(ValueError, match=r"16 of the 32 eval prompts are rows training draws .*train.jsonl, line 1\).*leave eval.task out"):
            plan_eval(cfg)
    else:
        assert plan_eval(cfg) == list(range(32))
    same_generator = demo_config(TINY + ["eval.at_end=true", "eval.task={kind: reverse_digits}", "task={kind: reverse_digits}"])
    with pytest.raises(ValueError, match="kind reverse_digits"):
        plan_eval(same_generator)


def test_an_eval_task_serving_training_rows_under_another_split_is_refused(tmp_path):
    """Kind: scores on training prompts, silently. ASDiv's `split: all` as eval.task beside
    training's `split: train` shares every training row without being the same split; a shuffled
    copy of the training file's config too. Refused before anything starts, naming a shared row;
    the test split (or a file training never reads) is accepted."""
    from splitrl.eval_config import plan_eval

    rows = [{"passage": f"P{i}.", "question": f"Q{i}?", "answer": f"{i} cats"} for i in range(80)]
    asdiv = tmp_path / "asdiv.jsonl"
    asdiv.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_task = f"{{kind: asdiv, path: {asdiv}, split: train, num_test: 20}}"

    def cfg(eval_task, num_prompts=20):
        return demo_config(TINY + ["tokenizer.charset=null", "model.backbone.vocab_size=100", f"task={train_task}",
                                   "eval.at_end=true", f"eval.num_prompts={num_prompts}", f"eval.task={eval_task}"])  # fmt: skip

    with pytest.raises(ValueError, match=r"of the 20 eval prompts are rows training draws .*asdiv.jsonl, line \d+"):
        plan_eval(cfg(f"{{kind: asdiv, path: {asdiv}, split: all, num_test: 20, shuffle: true}}"))
    assert plan_eval(cfg(f"{{kind: asdiv, path: {asdiv}, split: test, num_test: 20}}")) == list(range(20))
    # a test split larger than training's held-out part reaches into the rows training draws
    with pytest.raises(ValueError, match=r"of the 30 eval prompts are rows training draws"):
        plan_eval(cfg(f"{{kind: asdiv, path: {asdiv}, split: test, num_test: 30}}", num_prompts=30))
    # math_file: the training file shuffled (another order, the same rows) is refused too, and the
    # same file with disjoint skip_rows (a held-out part of one file) is accepted
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    shuffled = demo_config(TINY + ["tokenizer.charset=null", "model.backbone.vocab_size=100",
                                   f"task={{kind: math_file, path: {data}}}", "eval.at_end=true",
                                   f"eval.task={{kind: math_file, path: {data}, shuffle: true, seed: 3}}"])  # fmt: skip
    with pytest.raises(ValueError, match=r"eval prompts are rows training draws .*train.jsonl, line \d+"):
        plan_eval(shuffled)
    halves = demo_config(TINY + ["tokenizer.charset=null", "model.backbone.vocab_size=100",
                                 f"task={{kind: math_file, path: {data}, skip_rows: {list(range(30, 40))}}}",
                                 "eval.at_end=true", "eval.num_prompts=10",
                                 f"eval.task={{kind: math_file, path: {data}, skip_rows: {list(range(30))}}}"])  # fmt: skip
    assert plan_eval(halves) == list(range(10))
