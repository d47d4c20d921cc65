"""Nothing lost across stops (issue 6, items 7-9): accepted rollouts survive a checkpoint, an
interrupt still checkpoints, a damaged or unwritable checkpoint is handled. Local backend."""

import asyncio
import signal
import threading

import pytest
from _tiny import TINY_STEP

from splitrl.config import load_config
from splitrl.controller import controller as C
from splitrl.controller import generation
from splitrl.controller.policy_client import PolicyClient

TINY = TINY_STEP + ["backend=local", "dataplane.kind=inprocess", "logging.tensorboard=false"]

# the settings of issue 6 item 7: generation runs two steps ahead into a buffer of two groups
AHEAD = [
    "num_generation_workers=2",
    "generation_groups_per_call=1",
    "groups_per_step=2",
    "group_size=2",
    "min_groups_per_chunk=1",
    "buffer.capacity_groups=2",
    "buffer.max_staleness=2",
    "checkpoint_every=1",
    "num_steps=3",
    "watchdog_timeout_s=20",
]


def test_a_group_waiting_for_buffer_room_at_a_checkpoint_is_trained_exactly_once(tmp_path, monkeypatch):
    """Kind: accepted work outside every saved structure. Prompt 1 is held back until prompt 4 is
    generated, so at the first checkpoint it waits for buffer room (buffer full with 3 and 4, prompt
    5 waiting too); an interrupt stops the run there. The resumed run must train every prompt index
    of the 3 steps exactly once (before the fix: prompt 1 was in neither the done set nor the
    buffer, never trained, and the last step waited for the watchdog)."""
    generated: list[int] = []
    trained: list[int] = []
    four_done, one_done = threading.Event(), threading.Event()
    first_run = {"on": True, "finishes": 0}
    real_generate = generation.GenerationWorker.generate_groups
    real_train, real_finish = PolicyClient.train_chunk, PolicyClient.finish

    def generate(self, indices, group_size):
        if first_run["on"] and 1 in indices:
            assert four_done.wait(60)
        out = real_generate(self, indices, group_size)
        generated.extend(indices)
        four_done.set() if 4 in indices else None
        one_done.set() if 1 in indices else None
        return out

    async def train_chunk(self, groups):
        trained.extend(g.prompt_index for g in groups)
        return await real_train(self, groups)

    async def finish(self):
        first_run["finishes"] += 1
        if first_run["on"] and first_run["finishes"] == 1:
            # step 1 ends only once prompt 1 is generated and waits for room; then Ctrl-C
            while not one_done.is_set():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            signal.raise_signal(signal.SIGINT)
            await asyncio.sleep(0.1)
        return await real_finish(self)

    monkeypatch.setattr(generation.GenerationWorker, "generate_groups", generate)
    monkeypatch.setattr(PolicyClient, "train_chunk", train_chunk)
    monkeypatch.setattr(PolicyClient, "finish", finish)
    cfg = load_config(None, TINY + [f"output_dir={tmp_path}", *AHEAD])
    first = C.train(cfg)
    assert first.interrupted and first.steps_done == 1
    assert sorted(trained) == [0, 2]
    first_run["on"] = False
    second = C.train(cfg)
    assert second.steps_done == 3
    assert sorted(trained) == list(range(6)), trained  # every prompt index trained exactly once
    assert sorted(generated) == list(range(6)), generated  # the waiting groups were not generated again


def _stalled_controller(tmp_path, **state):
    cfg = load_config(None, TINY + [f"output_dir={tmp_path}", *AHEAD])
    c = C.SingleController(cfg)
    c.buffer = C.ReplayBuffer(cfg.buffer)
    defaults = dict(
        step=2, version=2, synced_version=2, cursor=5, done_indices={0, 2, 3, 4}, in_flight=set(),
        generating={}, pending={}, held={},
    )
    for k, v in {**defaults, **state}.items():
        setattr(c, k, v)
    return c


def test_the_watchdog_names_a_lost_prompt_instead_of_blaming_a_worker(tmp_path):
    """Kind: a stall report that guesses. With no generation running and prompt 1 accounted for
    nowhere, the report names prompt 1 as lost and does not say a worker hung; with a request
    running it names the prompts being generated and the worker."""
    lost = _stalled_controller(tmp_path)._stall_report("2 groups")
    assert "[1]" in lost and "lost track" in lost
    assert "hung" not in lost
    import time

    hung = _stalled_controller(tmp_path, generating={5: time.perf_counter() - 30}, in_flight={5}, done_indices={0, 1, 2, 3, 4})
    report = hung._stall_report("2 groups")
    assert "[5]" in report and "hung or dead" in report and "lost" not in report
