import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from splitrl.tasks import MathFileTaskConfig, compute_rewards, make_task

ROWS = [
    {"question": "What is 1/2 as a decimal?", "solution": "0.5", "id": 0},
    {"question": "Half of one?", "solution": "\\frac{1}{2}", "id": 1},
    {"question": "1+2?", "solution": 3, "id": 2},
    {"question": "Expand.", "solution": "x^2+1", "id": 3},
]


def _config(path, **overrides):
    return {"kind": "math_file", "path": str(path), "prompt_column": "question",
            "answer_column": "solution", **overrides}


def _write_jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_loads_jsonl_parquet_and_saved_dataset_alike(tmp_path):
    jsonl = _write_jsonl(tmp_path / "rows.jsonl")
    parquet = tmp_path / "rows.parquet"
    table = {k: [str(r[k]) if k == "solution" else r[k] for r in ROWS] for k in ROWS[0]}
    pq.write_table(pa.table(table), parquet)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(table).save_to_disk(str(saved))
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(table),
                          "test": datasets.Dataset.from_dict(table).select([3, 2])}
                         ).save_to_disk(str(splits))
    expected = [(r["question"], str(r["solution"])) for r in ROWS]
    for path in (jsonl, parquet, saved):
        task = make_task(_config(path))
        assert task.num_prompts == 4
        assert [(p.text, p.answer) for p in map(task.get_prompt, range(4))] == expected
    test_split = make_task(_config(splits, split="test"))
    assert [test_split.get_prompt(i).answer for i in range(2)] == ["x^2+1", "3"]
    with pytest.raises(ValueError, match="set `split`"):
        make_task(_config(splits))


def test_prompt_template_and_seeded_shuffle(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl")
    template = "Solve: {prompt} Put the answer in \\boxed{}."
    task = make_task(_config(path, prompt_template=template))
    assert task.get_prompt(2).text == "Solve: 1+2? Put the answer in \\boxed{}."
    shuffled = make_task(_config(path, shuffle=True, seed=5))
    order = [shuffled.get_prompt(i).metadata["row"] for i in range(4)]
    assert sorted(order) == [0, 1, 2, 3]
    assert order == [make_task(_config(path, shuffle=True, seed=5)).get_prompt(i).metadata["row"]
                     for i in range(4)]
    assert shuffled.get_prompt(0).answer == str(ROWS[order[0]]["solution"])
    with pytest.raises(ValueError, match="must contain '\\{prompt\\}'"):
        MathFileTaskConfig(path=str(path), prompt_template="no slot")


def test_relative_path_is_made_absolute_on_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_jsonl(tmp_path / "rows.jsonl")
    config = MathFileTaskConfig(path="rows.jsonl", prompt_column="question",
                                answer_column="solution")
    assert config.path == str(tmp_path / "rows.jsonl")
    monkeypatch.chdir("/")
    assert make_task(config).get_prompt(2).answer == "3"


def test_missing_file_column_or_type_raise_value_error(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl")
    with pytest.raises(ValueError, match="does not exist"):
        make_task(_config(tmp_path / "nope.jsonl"))
    found = r"no column 'answer'; columns found: \['id', 'question', 'solution'\]"
    with pytest.raises(ValueError, match=found):
        make_task(_config(path, answer_column="answer"))
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        make_task(_config(_write_jsonl(tmp_path / "rows.csv")))
    partial = _write_jsonl(tmp_path / "partial.jsonl", ROWS[:2] + [{"question": "q"}])
    with pytest.raises(ValueError, match=r"line 3 \(row 2\): 'solution' is missing"):
        make_task(_config(partial))
    with pytest.raises(ValueError, match="no rows"):
        make_task(_config(_write_jsonl(tmp_path / "empty.jsonl", [])))


def test_every_bad_row_is_named_in_one_error_with_the_skip_rows_that_leaves_them_out(tmp_path):
    """Kind: bad data trained on silently (issue "Nothing lost, nothing silent", item 5). A null
    problem became the prompt "None", a number the prompt "17", an empty answer could never score;
    other bad rows (no key, not JSON) were reported one at a time without the skip_rows fix."""
    lines = [
        json.dumps({"question": "1+1?", "solution": "2"}),  # row 0: fine
        json.dumps({"question": None, "solution": "2"}),  # row 1
        "",  # a blank line: no row
        json.dumps({"question": "Half of one?", "solution": ""}),  # row 2
        json.dumps({"question": 17, "solution": "17"}),  # row 3
        json.dumps({"solution": "3"}),  # row 4
        "{not json",  # row 5
        json.dumps({"question": "ok", "solution": 3}),  # row 6: a number is a fine answer
        json.dumps({"question": "  ", "solution": None}),  # row 7
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        make_task(_config(path))
    message = str(err.value)
    for named in [
        "6 of its 8 rows cannot be trained on",
        "line 2 (row 1): 'question' is null",
        "line 4 (row 2): 'solution' is empty",
        "line 5 (row 3): 'question' is 17 (a number, not text)",
        "line 6 (row 4): 'question' is missing",
        "line 7 (row 5): not valid JSON",
        "line 9 (row 7): 'question' is empty, 'solution' is null",
        "task.skip_rows=[1,2,3,4,5,7]",
    ]:
        assert named in message, (named, message)
    assert "line 1 (" not in message and "row 6" not in message and len(message.splitlines()) == 1
    # the fix it gives works: the good rows are served, nothing else
    task = make_task(_config(path, skip_rows=[1, 2, 3, 4, 5, 7]))
    assert [(p.text, p.answer) for p in map(task.get_prompt, range(task.num_prompts))] == [("1+1?", "2"), ("ok", "3")]
    # rows already skipped are not reported again, and the fix keeps them
    with pytest.raises(ValueError, match=r"5 of its 8 rows .*task\.skip_rows=\[1,2,3,4,5,6,7\]"):
        make_task(_config(path, skip_rows=[6, 7]))
    # rows the file does not have, or negative ones, are refused (a new user's trial: [99, -1] on a
    # 50-row file ran without a word, and a bad-rows message kept 99 in the fix it gave)
    with pytest.raises(ValueError, match=r"skip_rows names rows it does not have: \[8, 99\] \(it has 8 rows, 0-7\); remove"):
        make_task(_config(path, skip_rows=[1, 2, 3, 4, 5, 7, 8, 99]))
    with pytest.raises(ValueError, match=r"skip_rows has negative row numbers \[-1\]: rows count from 0"):
        make_task(_config(path, skip_rows=[-1, 2]))


def test_bad_rows_of_parquet_and_saved_datasets_are_named_too(tmp_path):
    table = {"question": ["1+1?", None, "x", 17.5], "solution": ["2", "3", None, "4"]}
    pq.write_table(pa.table({"question": [None if q is None else str(q) for q in table["question"]],
                             "solution": table["solution"]}), tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match=r"2 of its 4 rows .*row 1: 'question' is null; row 2: 'solution' is null\. "
                                         r".*task\.skip_rows=\[1,2\] \(rows count from 0 in file order\)"):
        make_task(_config(tmp_path / "rows.parquet"))
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"question": [1, 2], "solution": ["a", "b"]}).save_to_disk(str(saved))
    with pytest.raises(ValueError, match=r"2 of its 2 rows .*row 0: 'question' is 1 \(a number, not text\).*"
                                         r"Every row is bad: check prompt_column / answer_column"):
        make_task(_config(saved))


@pytest.mark.parametrize(
    ("answer", "response", "reward"),
    [
        ("0.5", "The answer is \\boxed{1/2}", 1.0),
        ("\\frac{1}{2}", "0.5", 1.0),
        ("\\frac{1}{2}", "so $\\boxed{0.5}$", 1.0),
        ("x^2+1", "\\boxed{1+x^2}", 1.0),
        ("3", "\\boxed{4}", 0.0),
        ("3", "I do not know", 0.0),
        ("3", "", 0.0),
    ],
)
def test_math_verify_equivalences(tmp_path, answer, response, reward):
    path = _write_jsonl(tmp_path / "one.jsonl", [{"question": "q", "solution": answer}])
    task = make_task(_config(path))
    assert task.score(task.get_prompt(0), response) == reward


def test_math_file_task_scores_in_worker_processes(tmp_path):
    task = make_task(_config(_write_jsonl(tmp_path / "rows.jsonl")))
    prompts = [task.get_prompt(i) for i in range(4)]
    results = compute_rewards(task, prompts, ["\\boxed{1/2}", "0.5", "4", "\\boxed{x^2+1}"], 20.0)
    assert [r.reward for r in results] == [1.0, 1.0, 0.0, 1.0]
    assert not any(r.timed_out or r.error for r in results)
