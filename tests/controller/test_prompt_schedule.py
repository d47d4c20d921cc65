"""The prompt schedule's books, driven directly: no asyncio, no Ray, no workers.

Guards the invariants the asynchronous controller relies on: a request takes prompts of one step
only and none past the run's end; generation never runs further ahead than ``max_staleness``
allows; every prompt is in exactly one place (never lost, never generated twice); the
``ordered`` and ``arrival`` strategies take each of the open step's prompts once, in their order,
and never a later step's; a resume regenerates exactly the prompts that were in flight."""

import pytest

from splitrl.controller.prompt_schedule import PromptSchedule, arrived_first, strategy_of
from splitrl.types import Group


def group(i: int) -> Group:
    return Group(f"p{i}", i, [], 0)


def schedule(strategy="ordered", groups_per_step=4, num_steps=3, max_staleness=0) -> PromptSchedule:
    return PromptSchedule(groups_per_step, num_steps, max_staleness, strategy)


def deliver(s: PromptSchedule, indices: list[int]) -> None:
    """Generate and buffer the groups of ``indices`` (as the controller's pump and _deliver do)."""
    groups = [group(i) for i in indices]
    s.generated(groups)
    for g in groups:
        s.buffered(g)


def test_strategy_follows_the_settings():
    assert strategy_of(0, "prompt", "async") == "ordered"
    assert strategy_of(0, "arrival", "sync") == "ordered"  # sync holds the whole step: prompt order
    assert strategy_of(0, "arrival", "async") == "arrival"
    assert strategy_of(2, "prompt", "async") == "staleness"
    assert strategy_of(1, "arrival", "sync") == "staleness"


def test_a_claim_stays_in_one_step_and_inside_the_run():
    s = schedule(groups_per_step=4, num_steps=2)
    assert s.claim(3) == [0, 1, 2]
    assert s.claim(3) == [3]  # the step's last prompt only: a request never spans two steps
    assert s.claim(3) == [4, 5, 6]
    assert s.claim(3) == [7]
    assert s.claim(3) == []  # past the last step
    assert s.in_flight == set(range(8))
    assert s.next_unclaimed() == 8 and not s.may_generate(8, synced_version=10)


def test_a_claim_skips_done_and_in_flight_prompts_and_moves_the_cursor_past_them():
    s = schedule()
    s.done = {0, 1, 3}
    s.in_flight = {2}
    assert s.next_unclaimed() == 4
    assert s.claim(2) == [4, 5]
    assert s.cursor == 4  # everything below is done or in flight
    s.evicted(3)  # a stale group left the buffer: generation goes back for it
    assert s.cursor == 3 and s.next_unclaimed() == 3
    assert s.claim(4) == [3]  # only the hole of step 0; 4 and 5 are in flight
    assert s.in_flight == {2, 3, 4, 5}
    s.release([4, 5])  # their request failed (the run stops with its error): no longer in flight
    assert s.in_flight == {2, 3}


def test_generation_runs_ahead_only_as_far_as_the_staleness_bound():
    strict = schedule(max_staleness=0)
    assert strict.may_generate(3, synced_version=0)  # step 0 with the weights of version 0
    assert not strict.may_generate(4, synced_version=0)  # step 1 waits for version 1
    assert strict.may_generate(4, synced_version=1)
    ahead = schedule("staleness", max_staleness=2, num_steps=5)
    assert ahead.may_generate(11, synced_version=0)  # step 2 = 0 + max_staleness
    assert not ahead.may_generate(12, synced_version=0)  # step 3 would be evicted on arrival
    assert not ahead.may_generate(20, synced_version=10)  # step 5 is past the run


def test_a_prompt_goes_from_in_flight_through_pending_to_done():
    s = schedule()
    indices = s.claim(2)
    s.started(indices, t=5.0)
    assert s.generating == {0: 5.0, 1: 5.0}
    groups = [group(0), group(1)]
    s.generated(groups)
    s.finished(indices)
    assert s.generating == {}
    assert set(s.pending) == {0, 1} and s.in_flight == {0, 1}  # pending: still in flight, saved by checkpoints
    assert s.accepted_groups() == groups
    s.buffered(groups[0])
    assert set(s.pending) == {1} and s.in_flight == {1} and s.done == {0}
    s.buffered(groups[1])
    assert s.pending == {} and s.in_flight == set() and s.done == {0, 1}
    assert s.accepted_groups() == []
    assert s.claim(4) == [2, 3]


def test_an_evicted_group_is_generated_again_and_not_lost():
    s = schedule("staleness", max_staleness=1)
    s.claim(4)
    deliver(s, [0, 1, 2, 3])
    assert s.claim(4) == [4, 5, 6, 7] and s.cursor == 4
    s.evicted(2)  # a stale group left the buffer
    assert 2 not in s.done and s.cursor == 2
    assert s.next_unclaimed() == 2
    assert s.claim(4) == [2]  # its step's only hole: 4..7 are in flight
    assert s.diagnosis(now=0.0, synced_version=1).startswith(" No generation is running and no prompt is missing")


def test_ordered_chunks_take_the_steps_prompts_in_prompt_order():
    s = schedule("ordered")
    s.claim(4)
    deliver(s, [0, 1, 2, 3])
    s.hold([group(2), group(0), group(3)])  # arrival order 2, 0, 3; 1 not yet taken from the buffer
    want, need = s.wanted(2, step=0)
    assert (want, need) == ([0, 1], 2)
    assert s.num_held(want) == 1  # 1 is missing: the controller waits for it
    s.hold([group(1)])
    assert s.num_held(want) == 2
    assert [g.prompt_index for g in s.take(2, step=0)] == [0, 1]
    assert s.next_index == 2 and list(s.held) == [2, 3]
    assert s.wanted(2, step=0) == ([2, 3], 2)
    assert [g.prompt_index for g in s.take(2, step=0)] == [2, 3]
    assert s.next_index == 4 and s.held == {}
    assert s.step_prompts(1) == [4, 5, 6, 7]  # schedule=sync holds all of these before step 1 trains


def test_arrival_chunks_take_the_open_steps_groups_first_come_and_never_a_later_steps():
    s = schedule("arrival")
    s.hold([group(5), group(2)])  # 5 is of step 1 (e.g. restored from a checkpoint)
    assert s.wanted(1, step=0) == ([0, 1, 2, 3], 1)
    assert [g.prompt_index for g in s.take(1, step=0)] == [2]
    assert s.taken == {2} and s.next_index == 0
    s.hold([group(3), group(0)])
    left, need = s.wanted(2, step=0)
    assert (left, need) == ([0, 1, 3], 2) and s.num_held(left) == 2
    assert [g.prompt_index for g in s.take(2, step=0)] == [3, 0]  # arrival order
    assert s.taken == {0, 2, 3}
    assert s.wanted(2, step=0) == ([1], 1)  # fewer than asked at the step's end
    s.hold([group(1)])
    assert [g.prompt_index for g in s.take(2, step=0)] == [1]
    assert s.next_index == 4 and s.taken == set() and list(s.held) == [5]  # the step is complete
    assert [g.prompt_index for g in s.take(1, step=1)] == [5]
    assert s.taken == {5} and s.next_index == 4


def test_arrived_first_keeps_arrival_order_and_the_open_step():
    assert arrived_first([9, 5, 4, 6], [4, 5, 6, 7], 2) == [5, 4]
    assert arrived_first([6], [4, 5, 6, 7], 2) == [6]
    assert arrived_first([], [4], 1) == []


def test_a_resume_regenerates_exactly_the_prompts_in_flight_at_the_checkpoint():
    """The checkpoint of step 1 (groups_per_step 4) was written with 0..3 trained, 4, 5 and 8
    buffered, 6 pending (waiting for buffer room) and 7, 9 being generated (not saved)."""
    before = schedule("staleness", max_staleness=1)
    before.claim(4)
    deliver(before, [0, 1, 2, 3])
    before.claim(4)
    deliver(before, [4, 5])
    before.generated([group(6)])
    before.claim(4)
    deliver(before, [8])
    saved_done, saved_accepted = sorted(before.done), before.accepted_groups()
    assert saved_done == [0, 1, 2, 3, 4, 5, 8] and [g.prompt_index for g in saved_accepted] == [6]

    after = schedule("staleness", max_staleness=1)
    after.restore(saved_done, saved_accepted)
    after.start_at(1)
    assert after.cursor == 0 and after.next_index == 4
    assert after.in_flight == {6}  # delivered to the buffer again by the controller
    assert after.claim(4) == [7]  # step 1's missing prompt, generated again
    assert after.claim(4) == [9, 10, 11]
    deliver(after, [6])  # the controller delivers the restored groups (_deliver)
    assert after.done == {0, 1, 2, 3, 4, 5, 6, 8} and after.pending == {}


def test_a_fresh_start_at_a_later_step_starts_the_train_side_there():
    s = schedule("ordered")
    s.restore(list(range(8)), [])
    s.start_at(2)
    assert s.next_index == 8 and s.next_unclaimed() == 8
    assert s.wanted(4, step=2) == ([8, 9, 10, 11], 4)


def test_held_groups_are_saved_with_the_checkpoint():
    s = schedule("ordered")
    s.claim(4)
    deliver(s, [0, 1, 2, 3])
    s.generated([group(4)])  # pending
    s.hold([group(3), group(1)])  # taken from the buffer ahead of their turn
    assert [g.prompt_index for g in s.accepted_groups()] == [4, 3, 1]


def test_the_diagnosis_names_what_the_train_pump_waits_for():
    s = schedule(num_steps=2)
    s.claim(4)
    s.started([0, 1, 2, 3], t=10.0)
    assert "Generation of prompts [0, 1, 2, 3] has run for 30.0 s" in s.diagnosis(now=40.0, synced_version=0)
    s.finished([0, 1, 2, 3])
    deliver(s, [0, 2, 3])
    s.release([1])
    s.cursor = 4  # as after a bug: prompt 1 is nowhere and below the cursor
    lost = s.diagnosis(now=40.0, synced_version=0)
    assert "prompts [1] are neither trained" in lost and "lost track" in lost
    s.cursor = 1
    s.claim(1)
    deliver(s, [1])
    assert "The next prompt to generate (4) waits for policy version 1" in s.diagnosis(now=0.0, synced_version=0)
    assert "no prompt is missing" not in s.diagnosis(now=0.0, synced_version=0)
    assert "no prompt is missing" in s.diagnosis(now=0.0, synced_version=1)


def test_the_train_side_of_the_staleness_strategy_is_the_buffers():
    s = schedule("staleness", max_staleness=1)
    with pytest.raises(AssertionError):
        s.wanted(2, step=0)
