import pytest
from pydantic import ValidationError

from splitrl.tasks import ReverseDigitsTaskConfig, make_task


def test_reverse_digits_prompts_are_deterministic_in_index_and_seed():
    task = make_task({"kind": "reverse_digits", "num_digits": 4, "seed": 7})
    again = make_task({"kind": "reverse_digits", "num_digits": 4, "seed": 7})
    other_seed = make_task({"kind": "reverse_digits", "num_digits": 4, "seed": 8})
    forward = [task.get_prompt(i) for i in range(50)]
    backward = [again.get_prompt(i) for i in reversed(range(50))][::-1]
    assert forward == backward
    assert [p.text for p in forward] != [other_seed.get_prompt(i).text for i in range(50)]
    assert len({p.text for p in forward}) > 40  # 10^4 possible prompts: hardly any repeats
    for i, prompt in enumerate(forward):
        digits = prompt.text[:-1]
        assert prompt.index == i
        assert prompt.text.endswith(">") and len(digits) == 4 and digits.isdigit()
        assert prompt.answer == digits[::-1]
    assert task.num_prompts is None
    assert task.get_prompt(10**12).text == again.get_prompt(10**12).text


def test_reverse_digits_partial_and_strict_rewards():
    task = make_task(ReverseDigitsTaskConfig(num_digits=3))
    prompt = task.get_prompt(0).__class__(index=0, text="604>", answer="406")
    assert task.score(prompt, "406") == 1.0
    assert task.score(prompt, " 406\n") == 1.0
    assert task.score(prompt, "401") == pytest.approx(2 / 3)
    assert task.score(prompt, "46") == pytest.approx(1 / 3)  # '4' matches; '6' is misplaced
    assert task.score(prompt, "4069") == pytest.approx(3 / 4)  # extra digits cost too
    assert task.score(prompt, "") == 0.0
    assert task.score(prompt, "604") == pytest.approx(1 / 3)
    strict = make_task(ReverseDigitsTaskConfig(scoring="strict"))
    assert strict.score(prompt, "406") == 1.0
    assert strict.score(prompt, "401") == 0.0


def test_reverse_digits_rejects_bad_config_and_index():
    with pytest.raises(ValidationError):
        ReverseDigitsTaskConfig(num_digits=0)
    with pytest.raises(ValueError, match="extra"):
        make_task({"kind": "reverse_digits", "digits": 3})
    with pytest.raises(IndexError, match="out of range"):
        make_task({"kind": "reverse_digits"}).get_prompt(-1)
