"""Rewards under a time limit: each outcome of a check, measured through real worker processes."""

import os
import time

import pytest

from splitrl.tasks import (
    RewardResult,
    RewardScorer,
    Task,
    TaskPrompt,
    compute_rewards,
    make_task,
)


class ScriptedTask(Task):
    """Its score does what the response says: hang, raise, crash, or return a number."""

    def __init__(self, config=None):
        self.config = config

    @property
    def num_prompts(self):
        return 1

    def _make_prompt(self, index):
        return TaskPrompt(index=index, text="q", answer="a")

    def score(self, prompt, response_text):
        if response_text == "hang":
            time.sleep(600)  # far past any limit below: a check that is never cut shows
        if response_text == "raise":
            raise ZeroDivisionError("checker bug")
        if response_text == "crash":
            os._exit(3)
        return float(response_text)


class UnpicklableTask(ScriptedTask):
    def __reduce__(self):
        raise TypeError("no pickling")


def _rebuild_only_in(pid):
    if os.getpid() != pid:
        raise FileNotFoundError("data file missing on this machine")
    return ScriptedTask()


class BrokenInWorkerTask(ScriptedTask):
    def __reduce__(self):
        return (_rebuild_only_in, (os.getpid(),))


LIMIT_S = 5.0


@pytest.fixture(scope="module")
def scorer():
    # a limit a loaded machine's quick checks stay well inside (1 s cut a check that a busy
    # 2-core machine scheduled late)
    with RewardScorer(ScriptedTask(), timeout_s=LIMIT_S, num_workers=2) as scorer:
        scorer.start()
        yield scorer


def test_each_check_outcome_and_the_time_limit(scorer):
    prompt = ScriptedTask().get_prompt(0)
    responses = ["0.75", "hang", "raise", "2.5", "nan", "crash", "0"]
    started = time.monotonic()
    results = scorer.score([prompt] * len(responses), responses)
    elapsed = time.monotonic() - started
    assert results[0] == RewardResult(0.75)
    assert results[1] == RewardResult(0.0, timed_out=True, error=f"check exceeded the {LIMIT_S} s limit")
    assert results[2] == RewardResult(0.0, error="ZeroDivisionError: checker bug")
    assert results[3] == RewardResult(0.0, error="the task's score returned 2.5, outside [0, 1]")
    assert results[4].reward == 0.0 and "outside [0, 1]" in results[4].error
    assert results[5].reward == 0.0 and not results[5].timed_out
    assert "died during the check (exit code 3)" in results[5].error
    assert results[6] == RewardResult(0.0)
    # The hanging check (600 s) is cut at its limit; the crash costs a worker restart at most.
    # The upper bound only tells "cut" from "ran on", so it is generous for a loaded machine.
    assert LIMIT_S <= elapsed < 120


def test_scorer_recovers_after_a_timeout(scorer):
    prompt = ScriptedTask().get_prompt(0)
    first = scorer.score([prompt, prompt], ["hang", "0.5"])
    assert [r.timed_out for r in first] == [True, False]
    again = scorer.score([prompt] * 3, ["0.25", "1", "0.5"])
    assert [r.reward for r in again] == [0.25, 1.0, 0.5]
    assert scorer.score([], []) == []


def test_compute_rewards_on_a_config_built_task():
    task = make_task({"kind": "reverse_digits", "num_digits": 3})
    prompts = [task.get_prompt(i) for i in range(3)]
    responses = [prompts[0].answer, prompts[1].answer[:2], "x"]
    results = compute_rewards(task, prompts, responses, timeout_s=5.0)
    assert [r.reward for r in results] == [1.0, pytest.approx(2 / 3), 0.0]
    assert results == [RewardResult(r.reward) for r in results]


def test_scorer_rejects_bad_arguments_before_starting():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardScorer(ScriptedTask(), timeout_s=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardScorer(ScriptedTask(), timeout_s=1, num_workers=0)
    with pytest.raises(ValueError, match="cannot be pickled"):
        RewardScorer(UnpicklableTask(), timeout_s=1)
    scorer = RewardScorer(ScriptedTask(), timeout_s=1)
    with pytest.raises(ValueError, match="2 prompts and 1 responses"):
        scorer.score([ScriptedTask().get_prompt(0)] * 2, ["1"])
    assert scorer._workers == []  # nothing was started


def test_a_task_that_cannot_be_built_in_the_worker_raises_with_the_cause():
    scorer = RewardScorer(BrokenInWorkerTask(), timeout_s=1)
    with pytest.raises(RuntimeError, match="could not build the task: FileNotFoundError: data file"):
        scorer.score([ScriptedTask().get_prompt(0)], ["1"])
    assert scorer._workers == []  # stopped
