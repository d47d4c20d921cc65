"""The prompt schedule (DESIGN §4, §5): where every prompt index of a run is, and which prompts
the next generation request and the next train chunk take. Plain and synchronous: the asyncio
controller drives it (it awaits the workers and the buffer; this class only keeps the books).

Prompt index i belongs to step ``i // groups_per_step``; a run has ``num_steps * groups_per_step``
of them. Each index is in one place at a time:

    not claimed ──claim──► in flight ──generated──► pending ──buffered──► done
        ▲                  (generating)              (waits for buffer room)   │ (the buffer, then a
        └──────────── release (a failed request), evicted (a stale group) ─────┘  step, hold it)

``held`` are groups the train pump took out of the buffer ahead of their turn (``max_staleness:
0``): their indices stay done. ``cursor`` is the lowest index that may still need generating;
generation restarts there, so an evicted or released prompt is generated again and no prompt
of the schedule is lost.

The train side has three strategies (:func:`strategy_of`):

- ``ordered`` (``max_staleness: 0`` with ``schedule.chunk_order: prompt``, and ``schedule.mode: sync``): a
  step trains exactly its own prompts, in prompt order; chunk k of a step is the next ``n``
  indices from ``next_index``. Deterministic.
- ``arrival`` (``max_staleness: 0``, ``schedule.chunk_order: arrival``): the open step's own prompts, in
  the order their groups arrived; ``taken`` are the open step's prompts already trained.
- ``staleness`` (``max_staleness > 0``): the replay buffer's sampler decides (any complete groups
  within the staleness bound); the schedule only tracks generation.

Checkpoints save ``done`` and :meth:`accepted_groups` (pending and held groups, with their
tensors); in-flight prompts are not saved: they are not done, so a resumed run generates them
again (:meth:`restore`).
"""

from __future__ import annotations

from typing import Literal

from splitrl.types import Group

Strategy = Literal["ordered", "arrival", "staleness"]


def strategy_of(max_staleness: int, chunk_order: str, schedule: str) -> Strategy:
    """The train side's strategy for a run's settings (see the module docstring)."""
    if max_staleness > 0:
        return "staleness"
    # schedule.mode=sync holds the whole step before it trains: arrival order would only cost
    # reproducibility
    return "ordered" if chunk_order == "prompt" or schedule == "sync" else "arrival"


def arrived_first(held_in_arrival_order: list[int], step_prompts: list[int], n: int) -> list[int]:
    """The next chunk under ``schedule.chunk_order: arrival``: the first ``n`` prompt indices of
    ``step_prompts`` (the open step's untrained prompts) in the order their groups arrived
    (``held_in_arrival_order``); fewer when fewer have arrived."""
    wanted = set(step_prompts)
    return [i for i in held_in_arrival_order if i in wanted][:n]


class PromptSchedule:
    """The books of a run's prompt indices (see the module docstring).

    Args:
        groups_per_step: prompts (groups) per step.
        num_steps: steps of the run; indices of later steps are never claimed.
        max_staleness: a request for step s needs synced weights of version ≥ s − max_staleness.
        strategy: how the train side picks its chunks (:func:`strategy_of`).
    """

    def __init__(self, groups_per_step: int, num_steps: int, max_staleness: int, strategy: Strategy) -> None:
        self.groups_per_step = groups_per_step
        self.num_steps = num_steps
        self.max_staleness = max_staleness
        self.strategy = strategy
        self.cursor = 0  # every index below is done or in flight
        self.done: set[int] = set()  # buffered, held or trained
        self.in_flight: set[int] = set()  # claimed: being generated, or pending
        self.generating: dict[int, float] = {}  # prompt index -> start time of its request
        self.pending: dict[int, Group] = {}  # generated, waiting for buffer room
        # taken from the buffer ahead of their turn; insertion order = arrival order
        self.held: dict[int, Group] = {}
        self.taken: set[int] = set()  # arrival: prompts of the open step already trained
        self.next_index = 0  # ordered / arrival: the first index of the open step not yet trained

    def step_of(self, index: int) -> int:
        return index // self.groups_per_step

    # ---------------------------------------------------------------- generation side
    def next_unclaimed(self) -> int:
        """The lowest prompt index that is neither done nor in flight (possibly past the run's
        last step)."""
        i = self.cursor
        while i in self.done or i in self.in_flight:
            i += 1
        return i

    def may_generate(self, index: int, synced_version: int) -> bool:
        """Whether ``index`` may be generated now: it is of one of the run's steps, and the
        synced weights are ones the sampler will accept for its step (no wasted work)."""
        step = self.step_of(index)
        return step < self.num_steps and synced_version >= step - self.max_staleness

    def claim(self, n: int) -> list[int]:
        """The next ``n`` prompt indices not yet done or in flight, all of one step (fewer at the
        step's end, none past the last step); they are in flight from now on."""
        out: list[int] = []
        i = self.cursor
        while len(out) < n:
            if i in self.done or i in self.in_flight:
                if not out:
                    self.cursor = i + 1
                i += 1
                continue
            if out and self.step_of(i) != self.step_of(out[0]):
                break
            if self.step_of(i) >= self.num_steps:
                break
            out.append(i)
            i += 1
        self.in_flight.update(out)
        return out

    def started(self, indices: list[int], t: float) -> None:
        """A request for ``indices`` started at time ``t`` (``time.perf_counter``)."""
        for j in indices:
            self.generating[j] = t

    def finished(self, indices: list[int]) -> None:
        """The request for ``indices`` returned (or failed)."""
        for j in indices:
            self.generating.pop(j, None)

    def release(self, indices: list[int]) -> None:
        """A request failed: its prompts are no longer in flight (the run stops with the error;
        the cursor stays, as a resumed run starts it at 0)."""
        for j in indices:
            self.in_flight.discard(j)

    def generated(self, groups: list[Group]) -> None:
        """Groups were generated: pending until :meth:`buffered` (still in flight, saved by
        checkpoints)."""
        for g in groups:
            self.pending[g.prompt_index] = g

    def buffered(self, group: Group) -> None:
        """A pending group is in the buffer: its prompt is done."""
        del self.pending[group.prompt_index]
        self.done.add(group.prompt_index)
        self.in_flight.discard(group.prompt_index)

    def evicted(self, prompt_index: int) -> None:
        """A stale group left the buffer: its prompt is generated again."""
        self.done.discard(prompt_index)
        self.cursor = min(self.cursor, prompt_index)

    # ---------------------------------------------------------------- train side
    def step_prompts(self, step: int) -> list[int]:
        """``schedule.mode: sync``: the open step's prompts not yet trained (all must be held before
        it trains)."""
        return list(range(self.next_index, (step + 1) * self.groups_per_step))

    def wanted(self, n: int, step: int) -> tuple[list[int], int]:
        """The prompt indices the next chunk of ``n`` groups may take, and how many of them must
        be held before it is taken (``ordered`` / ``arrival`` only)."""
        if self.strategy == "ordered":
            want = list(range(self.next_index, self.next_index + n))
            return want, len(want)
        assert self.strategy == "arrival", self.strategy
        end = (step + 1) * self.groups_per_step
        left = [i for i in range(self.next_index, end) if i not in self.taken]
        return left, min(n, len(left))

    def num_held(self, want: list[int]) -> int:
        return sum(i in self.held for i in want)

    def hold(self, groups: list[Group]) -> None:
        """Groups taken from the buffer are held for their turn (in arrival order)."""
        for g in groups:
            self.held[g.prompt_index] = g

    def take(self, n: int, step: int) -> list[Group]:
        """The next chunk of (at most) ``n`` held groups of the open ``step``, in the strategy's
        order; :meth:`wanted` says which must be held first."""
        if self.strategy == "ordered":
            want = list(range(self.next_index, self.next_index + n))
            groups = [self.held.pop(i) for i in want]
            self.next_index += n
            return groups
        assert self.strategy == "arrival", self.strategy
        end = (step + 1) * self.groups_per_step
        left, _ = self.wanted(n, step)
        chosen = arrived_first(list(self.held), left, n)
        groups = [self.held.pop(i) for i in chosen]
        self.taken.update(chosen)
        if len(self.taken) == end - self.next_index:  # the step is complete
            self.next_index, self.taken = end, set()
        return groups

    # ---------------------------------------------------------------- checkpoints
    def accepted_groups(self) -> list[Group]:
        """Groups generated and accepted but in no buffer: waiting for room, or held for a later
        chunk. Checkpoints save them (DESIGN §4: no prompt is lost)."""
        return [*self.pending.values(), *self.held.values()]

    def restore(self, done: list[int], accepted: list[Group]) -> None:
        """The state of a checkpoint: its ``done`` indices, and its accepted groups, in flight
        again until the controller has delivered them to the buffer."""
        self.done = set(done)
        for g in accepted:
            self.in_flight.add(g.prompt_index)

    def start_at(self, step: int) -> None:
        """Start (or resume) at ``step``: the train side at its first prompt, generation at the
        lowest index that is not done (a prompt in flight at a checkpoint is generated again)."""
        self.cursor = 0
        self.next_index = step * self.groups_per_step

    # ---------------------------------------------------------------- diagnosis
    def diagnosis(self, now: float, synced_version: int) -> str:
        """Why nothing arrives, from where every prompt of the schedule is: the end of a
        watchdog's report (``now``: ``time.perf_counter()``)."""
        if self.generating:
            oldest = min(self.generating.values())
            return (
                f" Generation of prompts {sorted(self.generating)[:8]} has run for {now - oldest:.1f} s: a generation "
                "worker may be hung or dead."
            )
        accounted = self.done | self.in_flight | set(self.held)
        total = self.num_steps * self.groups_per_step
        missing = [i for i in range(total) if i not in accounted]
        lost = [i for i in missing if i < self.cursor]
        if lost:
            return (
                f" No generation is running, and prompts {lost[:8]} are neither trained, buffered nor in flight, "
                "and below the generation cursor, so no worker will generate them: the controller lost track of them "
                "(a bug; please report it with this message). Restart the run: it resumes from the last checkpoint."
            )
        if missing and synced_version < self.step_of(missing[0]) - self.max_staleness:
            return (
                f" The next prompt to generate ({missing[0]}) waits for policy version "
                f"{self.step_of(missing[0]) - self.max_staleness}; nothing is being generated."
            )
        return (
            " No generation is running and no prompt is missing: the wait cannot be explained by a hung worker "
            "(a bug; please report it with this message)."
        )
