"""Replay buffer (FIFO, staleness eviction, back-pressure, checkpoint state) and step composer."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from splitrl.controller.buffer import (
    ChunkRequest,
    ReplayBuffer,
    ReplayBufferConfig,
    StepComposer,
    group_from_dict,
    group_to_dict,
    staleness_metrics,
)
from splitrl.types import Group, SampleMeta


def make_group(gid: str, version: int = 0, num_samples: int = 2, prompt_index: int = 0) -> Group:
    samples = [
        SampleMeta(
            sample_id=f"{gid}-s{i}",
            reward=float(i % 2),
            prompt_len=3,
            response_len=4 + i,
            policy_version=version,
            info={"text": f"answer {i}", "accepted": [1, 2]},
        )
        for i in range(num_samples)
    ]
    return Group(group_id=gid, prompt_index=prompt_index, samples=samples, policy_version=version)


def make_buffer(capacity: int = 100, max_staleness: int = 0) -> ReplayBuffer:
    return ReplayBuffer(ReplayBufferConfig(capacity_groups=capacity, max_staleness=max_staleness))


def ids(groups: list[Group]) -> list[str]:
    return [g.group_id for g in groups]


# ---- config and put checks -------------------------------------------------------------------


def test_config_is_validated():
    with pytest.raises(ValidationError):
        ReplayBufferConfig(capacity_groups=0)
    with pytest.raises(ValidationError):
        ReplayBufferConfig(capacity_groups=4, max_staleness=-1)
    with pytest.raises(ValidationError):
        ReplayBufferConfig(capacity_groups=4, staleness=1)  # typo of max_staleness


def test_put_rejects_bad_groups_without_changing_state():
    buf = make_buffer()
    assert buf.try_put(make_group("a"))
    with pytest.raises(ValueError, match="already in the replay buffer"):
        buf.try_put(make_group("a"))
    with pytest.raises(ValueError, match="no samples"):
        buf.try_put(Group(group_id="e", prompt_index=0, samples=[], policy_version=0))
    mixed = make_group("m", version=2)
    mixed.samples[1].policy_version = 1
    with pytest.raises(ValueError, match="another version"):
        asyncio.run(buf.put(mixed))
    assert ids(buf.select(0, 10)) == ["a"]


# ---- select: FIFO, min_groups, staleness -----------------------------------------------------


def test_select_is_fifo_and_removes_what_it_returns():
    buf = make_buffer()
    for i in range(5):
        buf.try_put(make_group(f"g{i}"))
    assert ids(buf.select(0, max_groups=2)) == ["g0", "g1"]
    assert buf.size == 3
    assert ids(buf.select(0, max_groups=10)) == ["g2", "g3", "g4"]
    assert buf.size == 0
    assert buf.num_selected_groups == 5


def test_select_returns_nothing_below_min_groups():
    buf = make_buffer()
    buf.try_put(make_group("a"))
    buf.try_put(make_group("b"))
    assert buf.select(0, max_groups=5, min_groups=3) == []
    assert buf.size == 2
    assert buf.last_select.num_selected_groups == 0
    assert buf.last_select.staleness_mean is None
    assert ids(buf.select(0, max_groups=5, min_groups=2)) == ["a", "b"]


def test_select_bounds_are_validated():
    buf = make_buffer(capacity=3)
    buf.try_put(make_group("a"))
    with pytest.raises(ValueError, match="min_groups <= max_groups"):
        buf.select(0, max_groups=1, min_groups=2)
    with pytest.raises(ValueError, match="could never be met"):
        buf.select(0, max_groups=5, min_groups=4)
    assert buf.size == 1


def test_eviction_counts_with_explicit_versions():
    buf = make_buffer(max_staleness=1)
    # (id, version, samples); at version 2 only versions >= 1 survive.
    for gid, version, n in [("a", 0, 2), ("b", 1, 3), ("c", 2, 4), ("d", 0, 5), ("e", 2, 6)]:
        buf.try_put(make_group(gid, version, n))

    assert ids(buf.select(2, max_groups=2)) == ["b", "c"]
    stats = buf.last_select
    assert (stats.num_evicted_groups, stats.num_evicted_samples) == (2, 7)
    assert (buf.num_evicted_groups, buf.num_evicted_samples) == (2, 7)
    assert stats.staleness_mean == pytest.approx(0.5)  # staleness 1 and 0
    assert stats.staleness_max == 1
    assert stats.num_selected_samples == 7
    assert stats.size == 1
    assert stats.metrics()["buffer/evicted_samples"] == 7.0

    buf.try_put(make_group("f", 2, 3))
    buf.try_put(make_group("g", 3, 1))
    # Version 4 keeps versions >= 3: "e" and "f" (version 2) go.
    assert ids(buf.select(4, max_groups=10)) == ["g"]
    assert (buf.last_select.num_evicted_groups, buf.last_select.num_evicted_samples) == (2, 9)
    assert (buf.num_evicted_groups, buf.num_evicted_samples) == (4, 16)
    assert buf.last_select.staleness_max == 1
    assert buf.metrics()["buffer/evicted_groups_total"] == 4.0


def test_max_staleness_zero_is_on_policy():
    buf = make_buffer(max_staleness=0)
    for gid, version in [("old0", 0), ("new0", 1), ("old1", 0), ("new1", 1)]:
        buf.try_put(make_group(gid, version))
    selected = buf.select(1, max_groups=10)
    assert ids(selected) == ["new0", "new1"]
    assert all(g.policy_version == 1 for g in selected)
    assert buf.num_evicted_groups == 2
    assert buf.last_select.staleness_max == 0
    assert staleness_metrics(selected, 1) == {
        "buffer/staleness_mean": 0.0,
        "buffer/staleness_max": 0.0,
    }


def test_versions_must_not_go_backwards_or_be_ahead_of_the_trainer():
    buf = make_buffer(max_staleness=3)
    buf.try_put(make_group("a", version=2))
    buf.select(5, max_groups=1, min_groups=1)  # takes "a"
    buf.try_put(make_group("b", version=4))
    with pytest.raises(ValueError, match="lower than version 5"):
        buf.select(4, max_groups=1)
    buf.try_put(make_group("c", version=7))
    with pytest.raises(ValueError, match="newer than current_version"):
        buf.select(6, max_groups=5)
    assert ids(buf.select(7, max_groups=5)) == ["b", "c"]


# ---- back-pressure and waiting ---------------------------------------------------------------

# how long a wait that should succeed at once may take: generous, for a loaded machine (the
# short timeouts below, 0 and 0.01 s, are waits that must time out, whatever the speed)
WAIT_S = 60.0


def test_put_blocks_when_full_and_resumes_after_select():
    async def scenario():
        buf = make_buffer(capacity=2)
        await buf.put(make_group("g0"))
        await buf.put(make_group("g1"))
        assert buf.is_full
        assert not buf.try_put(make_group("x"))

        blocked = asyncio.create_task(buf.put(make_group("g2")))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not blocked.done()
        assert buf.size == 2

        assert ids(buf.select(0, max_groups=1)) == ["g0"]
        await asyncio.wait_for(blocked, timeout=WAIT_S)
        assert buf.size == 2
        return ids(buf.select(0, max_groups=5))

    assert asyncio.run(scenario()) == ["g1", "g2"]


def test_eviction_frees_space_for_a_blocked_put():
    async def scenario():
        buf = make_buffer(capacity=2, max_staleness=0)
        await buf.put(make_group("stale0", version=0))
        await buf.put(make_group("stale1", version=0))
        blocked = asyncio.create_task(buf.put(make_group("fresh", version=1)))
        await asyncio.sleep(0)
        assert not blocked.done()
        # The train pump waits at version 1: waiting evicts the stale groups, which lets the
        # rollout pump deliver a fresh one.
        ready = await buf.wait_ready(1, timeout=WAIT_S, current_version=1)
        assert ready
        await asyncio.wait_for(blocked, timeout=WAIT_S)
        selected = buf.select(1, max_groups=5)
        return ids(selected), buf.last_select.num_evicted_groups, buf.num_evicted_groups

    assert asyncio.run(scenario()) == (["fresh"], 2, 2)


def test_wait_ready_times_out_and_wakes_on_put():
    async def scenario():
        buf = make_buffer(capacity=4)
        assert not await buf.wait_ready(1, timeout=0.01)
        assert not await buf.wait_ready(1, timeout=0)
        waiter = asyncio.create_task(buf.wait_ready(2, timeout=WAIT_S))
        await buf.put(make_group("a"))
        await asyncio.sleep(0)
        assert not waiter.done()
        await buf.put(make_group("b"))
        assert await waiter
        assert await buf.wait_ready(2, timeout=0)
        with pytest.raises(ValueError, match="could never be met"):
            await buf.wait_ready(5)

    asyncio.run(scenario())


# ---- checkpoint state ------------------------------------------------------------------------


def filled_buffer() -> ReplayBuffer:
    buf = make_buffer(capacity=8, max_staleness=1)
    for gid, version in [("a", 0), ("b", 1), ("c", 1)]:
        buf.try_put(make_group(gid, version, num_samples=3))
    buf.select(2, max_groups=1)  # evicts "a", takes "b"
    buf.try_put(make_group("d", 2, num_samples=2))
    buf.try_put(make_group("e", 0, num_samples=4))
    assert buf.evict_stale(2) == 1  # "e": reported by the next select, after the checkpoint
    buf.try_put(make_group("h", 0, num_samples=2))  # stale; evicted by the next select
    g = make_group("f", 2)
    g.advantages = [0.5, -0.5]
    g.samples[0].sample_mask = 0.0
    buf.try_put(g)
    return buf


def test_state_round_trip_gives_identical_selects():
    original = filled_buffer()
    state = json.loads(json.dumps(original.state_dict()))  # must survive a JSON checkpoint

    restored = make_buffer(capacity=8, max_staleness=1)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()

    a, b = original.select(2, 2), restored.select(2, 2)
    assert a == b
    assert ids(a) == ["c", "d"]
    assert restored.last_select.num_evicted_groups == 2  # "e" (before the checkpoint) and "h"
    assert original.last_select == restored.last_select
    a, b = original.select(3, 5), restored.select(3, 5)
    assert a == b
    assert ids(a) == ["f"]
    assert a[0].advantages == [0.5, -0.5]
    assert original.last_select == restored.last_select
    assert original.last_select.num_evicted_groups == 0
    assert (restored.num_evicted_groups, restored.num_evicted_samples) == (3, 9)


def test_load_state_dict_validates_before_changing_anything():
    state = filled_buffer().state_dict()
    buf = make_buffer(capacity=8, max_staleness=1)
    buf.try_put(make_group("mine", 0))

    small = make_buffer(capacity=2)
    with pytest.raises(ValueError, match="raise capacity_groups"):
        small.load_state_dict(state)

    bad_cases = []
    dup = json.loads(json.dumps(state))
    dup["groups"].append(dup["groups"][0])
    bad_cases.append((dup, "twice"))
    unknown = json.loads(json.dumps(state))
    unknown["groups"][1]["samples"][0]["logprob"] = 0.1
    bad_cases.append((unknown, "unknown fields"))
    wrong_type = json.loads(json.dumps(state))
    wrong_type["groups"][0]["prompt_index"] = "first"
    bad_cases.append((wrong_type, "invalid group"))
    negative = dict(state, num_evicted_groups=-1)
    bad_cases.append((negative, "num_evicted_groups"))
    missing = {k: v for k, v in state.items() if k != "last_version"}
    bad_cases.append((missing, "expected"))
    for bad, match in bad_cases:
        with pytest.raises(ValueError, match=match):
            buf.load_state_dict(bad)
    assert ids(buf.select(0, 5)) == ["mine"]


def test_group_dict_round_trip():
    g = make_group("x", 3, num_samples=3)
    g.advantages = [1.0, 0.0, -1.0]
    assert group_from_dict(json.loads(json.dumps(group_to_dict(g)))) == g


# ---- step composition ------------------------------------------------------------------------


def test_composer_chunk_bounds_and_sizes():
    comp = StepComposer(groups_per_step=10, min_groups_per_chunk=3)
    comp.start_step()
    assert comp.next_chunk() == ChunkRequest(min_groups=3, max_groups=10)
    comp.add_chunk([make_group(f"a{i}") for i in range(4)])
    assert (comp.groups_received, comp.groups_missing) == (4, 6)
    with pytest.raises(ValueError, match="between 3 and 6"):
        comp.add_chunk([make_group("small0"), make_group("small1")])
    with pytest.raises(ValueError, match="between 3 and 6"):
        comp.add_chunk([make_group(f"big{i}") for i in range(7)])
    comp.add_chunk([make_group(f"b{i}") for i in range(5)])
    # One group missing: the last chunk may be smaller than min_groups_per_chunk.
    assert comp.next_chunk() == ChunkRequest(min_groups=1, max_groups=1)
    with pytest.raises(RuntimeError, match="still missing"):
        comp.finish_step()
    comp.add_chunk([make_group("c0")])
    assert comp.is_full
    assert comp.num_chunks == 3
    step = comp.finish_step()
    assert ids(step) == [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(5)] + ["c0"]
    assert not comp.is_open


def test_composer_max_chunk_duplicates_and_state_machine():
    with pytest.raises(ValueError, match="min_groups_per_chunk"):
        StepComposer(groups_per_step=4, min_groups_per_chunk=5)
    with pytest.raises(ValueError, match="below min_groups_per_chunk"):
        StepComposer(groups_per_step=4, min_groups_per_chunk=2, max_groups_per_chunk=1)

    comp = StepComposer(groups_per_step=5, min_groups_per_chunk=2, max_groups_per_chunk=3)
    with pytest.raises(RuntimeError, match="start_step"):
        comp.next_chunk()
    comp.start_step()
    with pytest.raises(RuntimeError, match="finish_step"):
        comp.start_step()
    assert comp.next_chunk() == ChunkRequest(min_groups=2, max_groups=3)
    comp.add_chunk([make_group("a"), make_group("b")])
    with pytest.raises(ValueError, match=r"\['a'\]"):
        comp.add_chunk([make_group("a"), make_group("z")])
    assert comp.groups_received == 2
    assert ids(comp.abort_step()) == ["a", "b"]
    assert comp.abort_step() == []
    comp.start_step()
    assert comp.groups_missing == 5


def test_train_pump_composes_exact_steps_from_a_streaming_buffer():
    groups_per_step, min_chunk, num_steps = 7, 3, 3

    async def rollout_pump(buf: ReplayBuffer, version: list[int]) -> None:
        for i in range(groups_per_step * num_steps):
            await buf.put(make_group(f"g{i}", version=version[0], prompt_index=i))
            await asyncio.sleep(0.001 * (i % 3))

    async def train_pump(buf: ReplayBuffer, version: list[int]) -> list[list[int]]:
        comp = StepComposer(groups_per_step, min_chunk)
        chunk_sizes = []
        for _ in range(num_steps):
            comp.start_step()
            sizes = []
            while not comp.is_full:
                req = comp.next_chunk()
                assert await buf.wait_ready(req.min_groups, timeout=WAIT_S, current_version=version[0])
                groups = buf.select(version[0], req.max_groups, req.min_groups)
                if groups:
                    comp.add_chunk(groups)
                    sizes.append(len(groups))
            assert len(comp.finish_step()) == groups_per_step
            chunk_sizes.append(sizes)
            version[0] += 1
        return chunk_sizes

    async def scenario():
        buf = make_buffer(capacity=4, max_staleness=2)
        version = [0]
        pump = asyncio.create_task(rollout_pump(buf, version))
        sizes = await train_pump(buf, version)
        await asyncio.wait_for(pump, timeout=WAIT_S)
        return sizes, buf.num_evicted_groups

    chunk_sizes, evicted = asyncio.run(scenario())
    assert evicted == 0
    for sizes in chunk_sizes:
        assert sum(sizes) == groups_per_step
        assert all(s >= min_chunk for s in sizes[:-1])
        assert all(s <= 4 for s in sizes)  # never more than the buffer holds


def test_on_evict_hook_sees_every_evicted_group():
    from splitrl.controller.buffer import ReplayBuffer, ReplayBufferConfig
    from splitrl.types import Group, SampleMeta

    evicted = []
    buf = ReplayBuffer(ReplayBufferConfig(capacity_groups=4, max_staleness=1), on_evict=evicted.append)
    for v in (0, 1, 2):
        g = Group(f"g{v}", v, [SampleMeta(f"s{v}", 1.0, 1, 1, policy_version=v)], policy_version=v)
        assert buf.try_put(g)
    out = buf.select(current_version=2, max_groups=4)
    assert [g.group_id for g in evicted] == ["g0"]
    assert [g.group_id for g in out] == ["g1", "g2"]
