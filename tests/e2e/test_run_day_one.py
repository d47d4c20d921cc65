"""What a new user sees of a run (issue 10, items 3 and 7): the start-up phases are logged in
order before the first step, and the checkpoint's ``policy/`` carries the tokenizer and the
rollout stop tokens, loadable by plain transformers."""

import json
import logging

from transformers import AutoTokenizer

from _configs import DEMO_CHARSET, demo_config
from splitrl.controller.controller import train
from splitrl.tasks import build_char_tokenizer

START_UP = [
    "start-up: starting the inprocess data plane",
    "start-up: starting 1 train worker(s) and 1 generation worker(s) on cpu",
    "start-up: waiting for the workers to load the model",
    "start-up: workers ready and weights synced in",
]


def test_start_up_is_logged_and_checkpoint_policy_dir_is_standalone(tmp_path, caplog):
    cfg = demo_config([
        "schedule.groups_per_step=2", "schedule.group_size=2", "schedule.min_groups_per_chunk=1", "schedule.generation_groups_per_call=2",
        "rollout.max_new_tokens=4", "rollout.stop_token_ids=[7]", "logging.progress_bar=false",
        "logging.tensorboard=false", "cluster.backend=local", "dataplane.kind=inprocess", "schedule.num_steps=1",
        f"output_dir={tmp_path}",
    ])
    with caplog.at_level(logging.INFO, logger="splitrl.controller.controller"):
        train(cfg)
    messages = [r.getMessage() for r in caplog.records if r.name == "splitrl.controller.controller"]
    positions = [next(i for i, m in enumerate(messages) if m.startswith(p)) for p in START_UP]
    assert positions == sorted(positions), messages  # in the order they happen
    ready = messages[positions[-1]]
    assert "generating the first rollouts (step 1: 2 prompts x 2 samples)" in ready
    first_checkpoint = next(i for i, m in enumerate(messages) if m.startswith("checkpoint step 1"))
    assert positions[-1] < first_checkpoint  # all of it before the first step's end

    policy = tmp_path / "checkpoints" / "step_000001" / "policy"
    tok = AutoTokenizer.from_pretrained(policy)
    ref = build_char_tokenizer(DEMO_CHARSET)
    assert tok.get_vocab() == ref.get_vocab()
    assert tok("desc 5,2,7=")["input_ids"] == ref("desc 5,2,7=")["input_ids"]
    gen = json.loads((policy / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [7, 2] and gen["max_new_tokens"] == 4  # the run's stop token, then EOS
