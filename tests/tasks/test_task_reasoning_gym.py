import collections

import pytest
import reasoning_gym

from splitrl.tasks import ReasoningGymTaskConfig, TaskPrompt, default_task_config, make_task

SORT3 = default_task_config().dataset_config


def _sorting(**overrides):
    return make_task(
        {"kind": "reasoning_gym", "dataset": "number_sorting", "dataset_config": SORT3,
         "compact_prompts": True, **overrides}
    )


def test_compact_number_sorting_prompts_match_the_generator_items():
    task = _sorting(seed=3)
    source = reasoning_gym.create_dataset("number_sorting", seed=3, **SORT3)
    for i in range(20):
        prompt, item = task.get_prompt(i), source[i]
        numbers = [n.removesuffix(".0") for n in item["metadata"]["original_numbers"]]
        direction = "asc" if item["metadata"]["direction"] == "ascending" else "desc"
        assert prompt.text == f"{direction} {','.join(numbers)}="
        ordered = sorted(numbers, key=int, reverse=direction == "desc")
        assert prompt.answer == ",".join(ordered)
        assert prompt.metadata["source_answer"] == item["answer"]
    assert task.get_prompt(5) == _sorting(seed=3).get_prompt(5)
    assert [task.get_prompt(i).text for i in range(20)] != [
        _sorting(seed=4000).get_prompt(i).text for i in range(20)
    ]


def test_number_sorting_strict_partial_and_own_scoring():
    prompt_of = lambda task: next(  # noqa: E731
        p for p in map(task.get_prompt, range(100)) if p.text == "asc 1,8,2="
    )
    strict, partial, own = (_sorting(scoring=s) for s in ("strict", "partial", "own"))
    prompt = prompt_of(strict)
    assert prompt.answer == "1,2,8"
    assert strict.score(prompt, "1,2,8") == 1.0
    assert strict.score(prompt, " 1,2,8 \n") == 1.0
    assert strict.score(prompt, "1, 2, 8") == 0.0
    # The generator's scorer accepts each number within ±1: the reason strict scoring exists.
    assert own.score(prompt, "2,2,8") == 1.0
    assert strict.score(prompt, "2,2,8") == 0.0
    assert own.score(prompt, "1,2,8") == 1.0
    assert own.score(prompt, "8,2,1") == 0.0
    assert partial.score(prompt, "2,2,8") == pytest.approx(2 / 3)
    assert partial.score(prompt, "1,2") == pytest.approx(2 / 3)
    assert partial.score(prompt, "1,2,8,9") == pytest.approx(3 / 4)
    assert partial.score(prompt, "") == 0.0


def test_a_scoring_process_imports_reasoning_gym_only_for_the_generators_own_scoring():
    """Kind: a start-up cost paid for nothing. Every reward worker (a spawned process) unpickles
    the task; rebuilt there in full it imported reasoning-gym (matplotlib, sympy and every
    generator) for ~1 s of CPU at each worker start, although a strict or partial score never
    reads the generator. The unpickled task builds it on first use: ``own`` scoring there still
    gives the generator's score (2,2,8 for 1,2,8 is within its ±1)."""
    import pickle
    import subprocess
    import sys

    code = (
        "import pickle, sys\n"
        "task, prompt, response = pickle.loads(sys.stdin.buffer.read())\n"
        "loaded = 'reasoning_gym' in sys.modules\n"
        "score = task.score(prompt, response)\n"
        "print(loaded, 'reasoning_gym' in sys.modules, score)\n"
    )
    for scoring, want in (("partial", "False False 0.6666666666666666"), ("own", "False True 1.0")):
        task = _sorting(scoring=scoring)
        prompt = next(p for p in map(task.get_prompt, range(100)) if p.text == "asc 1,8,2=")
        run = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((task, prompt, "2,2,8")),
                             capture_output=True, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        assert run.stdout.decode().split() == want.split(), (scoring, run.stdout, run.stderr.decode()[-2000:])


def test_spell_backward_and_basic_arithmetic_compact_prompts():
    spell = make_task({"kind": "reasoning_gym", "dataset": "spell_backward",
                       "compact_prompts": True, "scoring": "own",
                       "dataset_config": {"min_word_len": 3, "max_word_len": 3}})
    word = reasoning_gym.create_dataset("spell_backward", seed=0, min_word_len=3,
                                        max_word_len=3)[0]["metadata"]["word"]
    prompt = spell.get_prompt(0)
    assert prompt.text == f"{word}>" and prompt.answer == word[::-1]
    assert spell.score(prompt, word[::-1]) == 1.0
    hand = TaskPrompt(index=0, text="cat>", answer="tac",
                      metadata={"source_answer": "tac", "source_metadata": {}})
    partial = make_task({"kind": "reasoning_gym", "dataset": "spell_backward",
                         "compact_prompts": True, "scoring": "partial"})
    assert partial.score(hand, "tax") == pytest.approx(2 / 3)
    assert partial.score(hand, "tacc") == pytest.approx(3 / 4)

    arithmetic = make_task({
        "kind": "reasoning_gym", "dataset": "basic_arithmetic", "compact_prompts": True,
        "dataset_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                           "operators": ["+"], "allow_parentheses": False},
    })
    for i in range(10):
        prompt = arithmetic.get_prompt(i)
        a, b = prompt.text.removesuffix("=").split("+")
        assert prompt.answer == str(int(a) + int(b))
        assert arithmetic.score(prompt, prompt.answer) == 1.0
        assert arithmetic.score(prompt, prompt.answer + "0") == 0.0


def test_source_prompts_and_answer_tag():
    task = make_task({"kind": "reasoning_gym", "dataset": "number_sorting", "seed": 1,
                      "dataset_config": SORT3, "answer_format": "answer_tag", "size": 30})
    item = reasoning_gym.create_dataset("number_sorting", seed=1, size=30, **SORT3)[2]
    prompt = task.get_prompt(2)
    assert prompt.text == item["question"] and prompt.answer == item["answer"]
    response = f"thinking...<answer>wrong</answer> <answer>{item['answer']}</answer>"
    assert task.score(prompt, response) == 1.0
    assert task.score(prompt, item["answer"]) == 0.0  # no tag, no answer
    assert task.num_prompts == 30
    with pytest.raises(IndexError):
        task.get_prompt(30)


def test_reasoning_gym_config_errors_are_clear():
    with pytest.raises(ValueError, match="number_sorting"):
        ReasoningGymTaskConfig(dataset="number_sortin")
    with pytest.raises(ValueError, match="`seed` and `size`"):
        ReasoningGymTaskConfig(dataset="number_sorting", dataset_config={"seed": 1})
    with pytest.raises(ValueError, match="compact_prompts is not available"):
        ReasoningGymTaskConfig(dataset="letter_counting", compact_prompts=True)
    # a misspelt compact generator: the spelling, not "compact_prompts is not available" (a new
    # user's trial: the demo's compact prompts hid the typo until compact_prompts=false)
    from splitrl._lazy import deferred_import_checks

    with deferred_import_checks(), pytest.raises(ValueError, match=r"'number_sortin' .*did you mean 'number_sorting'\?"):
        ReasoningGymTaskConfig(dataset="number_sortin", compact_prompts=True)
    with pytest.raises(ValueError, match="rejected dataset_config"):
        make_task({"kind": "reasoning_gym", "dataset": "number_sorting",
                   "dataset_config": {"bogus": 1}})
    with pytest.raises(ValueError, match="rejected dataset_config"):
        make_task({"kind": "reasoning_gym", "dataset": "number_sorting",
                   "dataset_config": {"min_numbers": 0}})


def test_missing_reasoning_gym_package_is_a_clear_config_error(monkeypatch):
    """Seen on the GPU machine, which lacked the package: config loading raised a bare
    ModuleNotFoundError from inside the validator."""
    import sys

    from _configs import demo_config

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` fail
    with pytest.raises(ValueError, match=r"needs the reasoning-gym package.*reverse_digits"):
        demo_config(["task={kind: reasoning_gym, dataset: number_sorting}"])


def test_default_task_is_compact_and_not_degenerate():
    task = make_task(default_task_config())
    prompts = [task.get_prompt(i) for i in range(200)]
    assert max(len(p.text) for p in prompts) <= 16
    assert all(task.score(p, p.answer) == 1.0 for p in prompts)
    # No constant response does well: not the most common answer, not a fixed guess.
    common, count = collections.Counter(p.answer for p in prompts).most_common(1)[0]
    assert count / 200 < 0.05
    for constant in (common, "0,0,0", "1,2,3", ""):
        mean = sum(task.score(p, constant) for p in prompts) / 200
        assert mean == pytest.approx(sum(p.answer == constant for p in prompts) / 200)
        assert mean < 0.05
    assert {p.text.split()[0] for p in prompts} == {"asc", "desc"}


def test_a_dataset_override_that_keeps_anothers_dataset_config_says_how_to_fix_it():
    """Kind: an error that does not say how to fix it (a new user's trial). `splitrl train
    task.dataset=spell_backward` (a generator the README names) kept the demo's number_sorting
    dataset_config and failed with only "unexpected keyword argument 'min_numbers'"; the message
    now names the keys that are not the generator's, its own settings, and the override to add."""
    from _configs import demo_config

    config = demo_config(["task.dataset=spell_backward"])
    with pytest.raises(ValueError, match=r"\['max_decimals', .*'min_value'\] are not settings of 'spell_backward' "
                                         r"\(its settings: \['min_word_len', 'max_word_len', 'data_file'\]\).*"
                                         r"task.dataset_config=\{\}"):
        make_task(config.task)
    # a value the generator refuses (not an unknown key) keeps the plain message
    bad_value = ReasoningGymTaskConfig(dataset="number_sorting", compact_prompts=False,
                                       dataset_config={"min_numbers": 5, "max_numbers": 2})
    with pytest.raises(ValueError, match="rejected dataset_config") as e:
        make_task(bad_value)
    assert "are not settings" not in str(e.value)
