"""Held-out evaluation during training: its config and which prompts it uses (no torch import).

A run draws prompt indices 0 … N−1 of its task (N = ``schedule.num_steps × schedule.groups_per_step``; prompt i
belongs to step ⌊i / groups_per_step⌋). Evaluation uses prompts training never samples: by
default indices N, N+1, … of the same task, or a separate task (``eval.task``, e.g. a test file),
from index 0. A task with a finite number of prompts that training draws in full has no unused
index left: then ``eval.task`` must name a separate one.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitrl.tasks import TaskConfig


class EvalConfig(BaseModel):
    """Held-out evaluation on the generation workers, logged as ``eval/*`` metrics of its step.

    Attributes:
        eval_every: evaluate after every this many steps (0: not during training).
        at_end: also evaluate after the last step.
        num_prompts: held-out prompts per evaluation.
        num_samples: k, sampled responses per prompt (reported: pass@1 and pass@k).
        ks: more k of pass@k (each at most ``num_samples``; pass@1 and pass@num_samples are always reported).
        greedy: also decode each prompt greedily (top_k=1), reported as ``eval/greedy/*``.
        correct_threshold: a response counts as correct for pass@k when its reward >= this; in (0, 1]
            (rewards lie in [0, 1]).
        seed: seed of the evaluation's samples (the same prompts and seeds at every evaluation).
        task: a separate held-out task (e.g. ``{kind: math_file, path: test.jsonl}``); default:
            the training task at prompt indices the run never draws.
        start_index: first prompt index (default: N for the training task, 0 for ``task``).
    """

    model_config = ConfigDict(extra="forbid")

    eval_every: int = Field(0, ge=0)
    at_end: bool = False
    num_prompts: int = Field(32, ge=1)
    num_samples: int = Field(4, ge=1)
    ks: list[int] = Field(default_factory=lambda: [1])
    greedy: bool = True
    # rewards lie in [0, 1]: <= 0 counts every sample correct, > 1 (or nan) none — a constant pass@k
    correct_threshold: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0
    task: TaskConfig | None = None
    start_index: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _ks_fit_num_samples(self) -> EvalConfig:
        # pass@k needs k samples per prompt: a k above num_samples would be dropped without a word
        bad = [k for k in self.ks if not 1 <= k <= self.num_samples]
        if bad:
            raise ValueError(
                f"eval.ks={self.ks}: each k of pass@k must be between 1 and eval.num_samples={self.num_samples} "
                f"(pass@k needs k samples per prompt), got {bad}; raise eval.num_samples or lower eval.ks"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.eval_every > 0 or self.at_end

    def due(self, step: int, num_steps: int) -> bool:
        """Whether to evaluate after ``step`` (1-indexed) of a ``num_steps`` run."""
        return (self.eval_every > 0 and step % self.eval_every == 0) or (self.at_end and step == num_steps)


def heldout_indices(config: EvalConfig, num_task_prompts: int | None, drawn: int) -> list[int]:
    """The prompt indices an evaluation uses.

    Args:
        config: the eval config.
        num_task_prompts: prompts of the evaluated task (None: unbounded).
        drawn: N, prompt indices the training run draws (0 … N−1), counted only when the
            evaluated task is the training task (``config.task`` is None).

    Raises:
        ValueError: no index is left (a finite training task drawn in full, or ``start_index``
            past the end), or an explicit ``start_index`` on the training task below N.
    """
    separate = config.task is not None
    start = config.start_index if config.start_index is not None else (0 if separate else drawn)
    if not separate and start < drawn:
        raise ValueError(
            f"eval.start_index={start} overlaps the prompts training draws (0..{drawn - 1}); "
            f"use eval.start_index >= {drawn} or a separate eval.task"
        )
    stop = start + config.num_prompts
    if num_task_prompts is not None:
        stop = min(stop, num_task_prompts)
    if stop <= start:
        where = "the training task" if not separate else "eval.task"
        raise ValueError(
            f"no held-out prompts: {where} has {num_task_prompts} prompts and evaluation would start at index "
            f"{start} (training draws schedule.num_steps x schedule.groups_per_step = {drawn} prompts). Give a "
            "separate test set as eval.task (e.g. {kind: math_file, path: test.jsonl}), or lower schedule.num_steps"
        )
    return list(range(start, stop))


def plan_eval(run_config) -> list[int]:
    """The held-out prompt indices of a run (:func:`heldout_indices` on the task it evaluates).

    Builds the evaluated task, so a missing test file fails here, before any worker starts.

    Raises:
        ValueError: the task cannot be built, no held-out index is left, or eval.task serves prompts
            training draws (the same generated config, or rows of the same file).
    """
    from splitrl.tasks import make_task

    ecfg = run_config.eval
    task = make_task(ecfg.task if ecfg.task is not None else run_config.task)
    drawn = run_config.schedule.num_steps * run_config.schedule.groups_per_step
    indices = heldout_indices(ecfg, task.num_prompts, drawn)
    if ecfg.task is None:
        return indices
    if task.source_of(indices[0]) is not None:  # rows of a file: compare them with training's
        _refuse_training_rows(task, make_task(run_config.task), indices, drawn)
    elif ecfg.task == run_config.task:  # a generated task: the same config makes the same prompts
        raise ValueError(
            f"eval.task reads the prompts training draws from (kind {ecfg.task.kind}): its scores would be on "
            "training prompts. Leave eval.task out (evaluation then uses the task's prompts training never "
            "draws), or give a held-out file or split as eval.task"
        )
    return indices


def _refuse_training_rows(task, train_task, indices: list[int], drawn: int) -> None:
    """Raise ValueError when eval prompts come from rows training draws (the same file rows under
    another split, template or order: e.g. ASDiv ``split: all`` beside training's ``split: train``)."""
    n = train_task.num_prompts
    if train_task.source_of(0) is None:
        return
    trained = {train_task.source_of(i) for i in range(min(drawn, n) if n is not None else drawn)}
    shared = [i for i in indices if task.source_of(i) in trained]
    if shared:
        path, where = task.source_of(shared[0])
        raise ValueError(
            f"{len(shared)} of the {len(indices)} eval prompts are rows training draws (e.g. eval prompt "
            f"{shared[0]}: {path}, {where}): their scores "
            "would be on training prompts. Give eval.task rows training never draws (ASDiv: split: test beside "
            "training's split: train; a file: a held-out file), or leave eval.task out"
        )
