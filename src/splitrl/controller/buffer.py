"""Replay buffer with a staleness sampler (DESIGN.md §4 "Replay buffer + sampler", §5).

The rollout pump ``put``s complete groups, each stamped with the policy version that generated
it; the train pump ``select``s groups for the open step. A group generated at version ``v_gen``
has staleness ``current_version - v_gen`` at trainer version ``current_version``; groups older than
``max_staleness`` versions are evicted (dropped and counted), never trained on. Capacity is
bounded in groups: a full buffer makes ``put`` wait, which throttles the rollout pump instead of
letting rollouts pile up while the trainer is busy.

The buffer only holds light :class:`~splitrl.types.Group` records (ids, rewards, versions); the
sample tensors stay in the data plane. It is meant for one asyncio event loop (the controller's)
and is not thread-safe: the synchronous methods are atomic with respect to that loop because they
never await.

Checkpoints: ``state_dict()`` holds the buffered groups as plain (JSON-serializable) dicts and the
counters; ``load_state_dict()`` restores them exactly. Groups whose ``put`` is still waiting for
space are not in the buffer and so not in its state: the controller keeps and saves them itself
(``SingleController._accepted_groups``), so that no accepted rollout is lost across a resume.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from splitrl.types import Group, SampleMeta

STATE_FORMAT_VERSION = 1

_GROUP_FIELDS = frozenset(f.name for f in dataclasses.fields(Group))
_SAMPLE_FIELDS = frozenset(f.name for f in dataclasses.fields(SampleMeta))
_GROUP_ADAPTER = TypeAdapter(Group)


class ReplayBufferConfig(BaseModel):
    """Configuration of :class:`ReplayBuffer`.

    Attributes:
        capacity_groups: most groups held at once; ``put`` waits while the buffer is full.
        max_staleness: at trainer version ``v`` only groups with ``policy_version >= v -
            max_staleness`` are trained on; older ones are evicted. 0 means strictly on-policy.
    """

    model_config = ConfigDict(extra="forbid")

    capacity_groups: int = Field(ge=1)
    max_staleness: int = Field(default=0, ge=0)


@dataclass(frozen=True)
class SelectStats:
    """What one :meth:`ReplayBuffer.select` call did, for the step's metrics.

    Attributes:
        current_version: trainer version the call was made at.
        num_selected_groups / num_selected_samples: what the call returned.
        staleness_mean / staleness_max: over the returned groups, in policy versions
            (``current_version - group.policy_version``); None when nothing was returned.
        num_evicted_groups / num_evicted_samples: evictions since the previous ``select`` call,
            this one included (``wait_ready`` may evict too; its evictions are reported here so
            every eviction is reported exactly once).
        size: groups left in the buffer after the call.
    """

    current_version: int
    num_selected_groups: int
    num_selected_samples: int
    staleness_mean: float | None
    staleness_max: int | None
    num_evicted_groups: int
    num_evicted_samples: int
    size: int

    def metrics(self) -> dict[str, float]:
        """Flat metrics dict (keys without a ``train/`` prefix; the logger adds it)."""
        out: dict[str, float] = {
            "buffer/size": float(self.size),
            "buffer/selected_groups": float(self.num_selected_groups),
            "buffer/evicted_groups": float(self.num_evicted_groups),
            "buffer/evicted_samples": float(self.num_evicted_samples),
        }
        if self.staleness_mean is not None:
            out["buffer/staleness_mean"] = self.staleness_mean
            out["buffer/staleness_max"] = float(self.staleness_max)
        return out


def staleness_metrics(groups: Iterable[Group], current_version: int) -> dict[str, float]:
    """Staleness (``current_version - policy_version``, in versions) of ``groups``: mean and max.

    Useful for a whole step made of several ``select`` calls. Returns ``{}`` for no groups.
    """
    staleness = [current_version - g.policy_version for g in groups]
    if not staleness:
        return {}
    return {
        "buffer/staleness_mean": sum(staleness) / len(staleness),
        "buffer/staleness_max": float(max(staleness)),
    }


def group_to_dict(group: Group) -> dict[str, Any]:
    """Plain-dict form of a group (JSON-serializable as long as every ``info`` value is)."""
    return dataclasses.asdict(group)


def group_from_dict(data: Any) -> Group:
    """Inverse of :func:`group_to_dict`.

    Raises:
        ValueError: ``data`` is not a dict with exactly the fields of :class:`Group` (samples with
            exactly the fields of :class:`SampleMeta`, defaults may be omitted) or a value has the
            wrong type.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a group must be a dict, got {type(data).__name__}")
    unknown = set(data) - _GROUP_FIELDS
    if unknown:
        raise ValueError(
            f"group dict has unknown fields {sorted(unknown)}; expected a subset of "
            f"{sorted(_GROUP_FIELDS)} (was it written by another splitrl version?)"
        )
    for i, sample in enumerate(data.get("samples") or []):
        extra = set(sample) - _SAMPLE_FIELDS if isinstance(sample, dict) else set()
        if extra:
            raise ValueError(
                f"sample {i} of group {data.get('group_id')!r} has unknown fields {sorted(extra)}; "
                f"expected a subset of {sorted(_SAMPLE_FIELDS)}"
            )
    try:
        return _GROUP_ADAPTER.validate_python(data)
    except ValidationError as e:
        raise ValueError(f"invalid group dict {data.get('group_id')!r}: {e}") from None


def _check_group(group: Group) -> None:
    if not isinstance(group, Group):
        raise ValueError(f"put expects a splitrl.types.Group, got {type(group).__name__}")
    if not group.samples:
        raise ValueError(f"group {group.group_id!r} has no samples; only complete groups go in")
    if group.policy_version < 0:
        raise ValueError(
            f"group {group.group_id!r} has policy_version {group.policy_version}; versions are >= 0"
        )
    mixed = [s.sample_id for s in group.samples if s.policy_version != group.policy_version]
    if mixed:
        raise ValueError(
            f"group {group.group_id!r} has policy_version {group.policy_version} but samples "
            f"{mixed} carry another version; a group is generated by one policy version (stamp "
            "every sample with the version of the weights that generated it)"
        )


class ReplayBuffer:
    """Bounded FIFO of complete groups with staleness-based eviction.

    Args:
        config: capacity and staleness limit.
    """

    def __init__(self, config: ReplayBufferConfig, on_evict: Callable[[Group], None] | None = None) -> None:
        self.config = config
        # called with every evicted group (the controller frees its tensors and requeues its prompt)
        self._on_evict = on_evict
        # Insertion-ordered dict: FIFO order plus O(1) duplicate checks by group_id.
        self._groups: dict[str, Group] = {}
        self.num_evicted_groups = 0
        self.num_evicted_samples = 0
        self.num_selected_groups = 0
        self._pending_evicted_groups = 0
        self._pending_evicted_samples = 0
        self._last_version: int | None = None
        self.last_select: SelectStats | None = None
        self._waiters: set[asyncio.Future[None]] = set()

    # ---- state -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def size(self) -> int:
        """Groups currently held."""
        return len(self._groups)

    @property
    def capacity(self) -> int:
        return self.config.capacity_groups

    @property
    def is_full(self) -> bool:
        return len(self._groups) >= self.config.capacity_groups

    @property
    def last_version(self) -> int | None:
        """Highest trainer version seen by ``select`` / ``wait_ready`` (None before the first)."""
        return self._last_version

    def metrics(self) -> dict[str, float]:
        """Cumulative buffer metrics (size, evictions since the start of the run)."""
        return {
            "buffer/size": float(self.size),
            "buffer/evicted_groups_total": float(self.num_evicted_groups),
            "buffer/evicted_samples_total": float(self.num_evicted_samples),
        }

    # ---- rollout side ------------------------------------------------------------------------

    def try_put(self, group: Group) -> bool:
        """Add ``group`` if there is room; never waits.

        Returns:
            True if the group was added, False if the buffer is full (nothing changed).

        Raises:
            ValueError: the group is empty, carries mixed or negative policy versions, or a group
                with the same ``group_id`` is already buffered.
        """
        _check_group(group)
        if group.group_id in self._groups:
            raise ValueError(
                f"group {group.group_id!r} is already in the replay buffer; group ids must be "
                "unique (include the prompt index and epoch in the id)"
            )
        if self.is_full:
            return False
        self._groups[group.group_id] = group
        self._notify()
        return True

    async def put(self, group: Group) -> None:
        """Add ``group``, waiting while the buffer is full (back-pressure on the rollout pump).

        Raises:
            ValueError: as :meth:`try_put`, raised before waiting.
        """
        _check_group(group)
        while True:
            if self.try_put(group):
                return
            await self._wait_for_change()

    # ---- train side --------------------------------------------------------------------------

    def select(self, current_version: int, max_groups: int, min_groups: int = 1) -> list[Group]:
        """Evict stale groups, then take up to ``max_groups`` of the rest, oldest first.

        A group is stale when ``policy_version < current_version - max_staleness``. The returned
        groups are removed from the buffer. Per-call statistics land in :attr:`last_select`.

        Args:
            current_version: the trainer's policy version (number of finished optimizer steps).
            max_groups: most groups to return.
            min_groups: return ``[]`` (taking nothing) when fewer fresh groups are ready.

        Returns:
            Between ``min_groups`` and ``max_groups`` groups in insertion order, or ``[]``.

        Raises:
            ValueError: bad bounds (``1 <= min_groups <= max_groups``, ``min_groups <=
                capacity_groups``), ``current_version`` lower than a version seen before, or a
                buffered group newer than ``current_version``. Raised before anything changes.
        """
        self._check_bounds(min_groups, max_groups)
        self._advance_version(current_version)
        self._evict_stale(current_version)

        ready = len(self._groups)
        taken: list[Group] = []
        if ready >= min_groups:
            for group_id in list(self._groups)[:max_groups]:
                taken.append(self._groups.pop(group_id))
        self.num_selected_groups += len(taken)

        staleness = [current_version - g.policy_version for g in taken]
        self.last_select = SelectStats(
            current_version=current_version,
            num_selected_groups=len(taken),
            num_selected_samples=sum(len(g.samples) for g in taken),
            staleness_mean=sum(staleness) / len(staleness) if staleness else None,
            staleness_max=max(staleness) if staleness else None,
            num_evicted_groups=self._pending_evicted_groups,
            num_evicted_samples=self._pending_evicted_samples,
            size=len(self._groups),
        )
        self._pending_evicted_groups = 0
        self._pending_evicted_samples = 0
        if taken:
            self._notify()
        return taken

    async def wait_ready(
        self, min_groups: int = 1, timeout: float | None = None, current_version: int | None = None
    ) -> bool:
        """Wait until at least ``min_groups`` groups are buffered.

        With ``current_version`` only fresh groups count, and stale ones are evicted while
        waiting (as ``select`` would) so they free their slots for the rollout pump; without it
        stale groups count too and ``select`` may still return fewer.

        Args:
            min_groups: groups to wait for.
            timeout: seconds; None waits forever.
            current_version: the trainer's policy version, or None.

        Returns:
            True when ready, False on timeout.

        Raises:
            ValueError: ``min_groups`` is < 1 or larger than ``capacity_groups`` (it could never be
                met), or ``current_version`` is lower than a version seen before.
        """
        self._check_bounds(min_groups, min_groups)
        if current_version is not None:
            self._advance_version(current_version)

        def ready() -> bool:
            if current_version is not None:
                self._evict_stale(current_version)
            return len(self._groups) >= min_groups

        # Checked before waiting so that timeout=0 works as a poll.
        if ready():
            return True
        try:
            await asyncio.wait_for(self._wait_until(ready), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def evict_stale(self, current_version: int) -> int:
        """Evict every group older than ``current_version - max_staleness`` now.

        Returns:
            The number of groups evicted (also counted in the cumulative counters and in the next
            ``select``'s :class:`SelectStats`).

        Raises:
            ValueError: as ``select`` for ``current_version``.
        """
        self._advance_version(current_version)
        return self._evict_stale(current_version)

    # ---- checkpoint --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Buffered groups (plain dicts, FIFO order) and counters; JSON-serializable when every
        sample's ``info`` holds JSON values."""
        return {
            "format_version": STATE_FORMAT_VERSION,
            "groups": [group_to_dict(g) for g in self._groups.values()],
            "num_evicted_groups": self.num_evicted_groups,
            "num_evicted_samples": self.num_evicted_samples,
            "num_selected_groups": self.num_selected_groups,
            "pending_evicted_groups": self._pending_evicted_groups,
            "pending_evicted_samples": self._pending_evicted_samples,
            "last_version": self._last_version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the buffer's content and counters with ``state`` (from :meth:`state_dict`).

        The configuration is not part of the state: a resumed run may change ``max_staleness``
        (the next ``select`` applies it), and ``capacity_groups`` as long as the groups fit.

        Raises:
            ValueError: a missing or malformed entry, an unknown format version, duplicate group
                ids, a group that fails the ``put`` checks, or more groups than
                ``capacity_groups``. Nothing changes when it raises.
        """
        if not isinstance(state, dict):
            raise ValueError(f"replay buffer state must be a dict, got {type(state).__name__}")
        expected = set(self.state_dict())
        if set(state) != expected:
            raise ValueError(
                f"replay buffer state has keys {sorted(state)}, expected {sorted(expected)}"
            )
        if state["format_version"] != STATE_FORMAT_VERSION:
            raise ValueError(
                f"replay buffer state format {state['format_version']!r} is not supported "
                f"(this splitrl reads format {STATE_FORMAT_VERSION})"
            )
        counters = [k for k in expected if k.startswith(("num_", "pending_"))]
        for key in counters:
            value = state[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"replay buffer state {key!r} must be an int >= 0, got {value!r}")
        last_version = state["last_version"]
        if last_version is not None and (
            not isinstance(last_version, int) or isinstance(last_version, bool) or last_version < 0
        ):
            raise ValueError(
                f"replay buffer state 'last_version' must be None or an int >= 0, "
                f"got {last_version!r}"
            )
        if not isinstance(state["groups"], list):
            raise ValueError("replay buffer state 'groups' must be a list of group dicts")
        groups: dict[str, Group] = {}
        for data in state["groups"]:
            group = group_from_dict(data)
            _check_group(group)
            if group.group_id in groups:
                raise ValueError(f"replay buffer state holds group {group.group_id!r} twice")
            groups[group.group_id] = group
        if len(groups) > self.config.capacity_groups:
            raise ValueError(
                f"replay buffer state holds {len(groups)} groups but capacity_groups is "
                f"{self.config.capacity_groups}; raise capacity_groups to at least {len(groups)}"
            )

        self._groups = groups
        self.num_evicted_groups = state["num_evicted_groups"]
        self.num_evicted_samples = state["num_evicted_samples"]
        self.num_selected_groups = state["num_selected_groups"]
        self._pending_evicted_groups = state["pending_evicted_groups"]
        self._pending_evicted_samples = state["pending_evicted_samples"]
        self._last_version = last_version
        self.last_select = None
        self._notify()

    # ---- internals ---------------------------------------------------------------------------

    def _check_bounds(self, min_groups: int, max_groups: int) -> None:
        if not 1 <= min_groups <= max_groups:
            raise ValueError(
                f"need 1 <= min_groups <= max_groups, got min_groups={min_groups}, "
                f"max_groups={max_groups}"
            )
        if min_groups > self.config.capacity_groups:
            raise ValueError(
                f"min_groups={min_groups} exceeds capacity_groups={self.config.capacity_groups}, "
                "so it could never be met; lower min_groups(_per_chunk) or raise capacity_groups"
            )

    def _advance_version(self, current_version: int) -> None:
        """Validate ``current_version`` against what was seen, then record it."""
        if current_version < 0:
            raise ValueError(f"current_version must be >= 0, got {current_version}")
        if self._last_version is not None and current_version < self._last_version:
            raise ValueError(
                f"current_version {current_version} is lower than version {self._last_version} "
                "seen before; the trainer's version only grows (was the buffer restored from "
                "another checkpoint than the trainer?)"
            )
        newer = [g.group_id for g in self._groups.values() if g.policy_version > current_version]
        if newer:
            raise ValueError(
                f"groups {newer[:5]} were generated by a policy newer than current_version "
                f"{current_version}; rollouts must use weights the trainer has produced"
            )
        self._last_version = current_version

    def _evict_stale(self, current_version: int) -> int:
        oldest_allowed = current_version - self.config.max_staleness
        stale = [gid for gid, g in self._groups.items() if g.policy_version < oldest_allowed]
        for group_id in stale:
            group = self._groups.pop(group_id)
            if self._on_evict is not None:
                self._on_evict(group)
            self.num_evicted_groups += 1
            self.num_evicted_samples += len(group.samples)
            self._pending_evicted_groups += 1
            self._pending_evicted_samples += len(group.samples)
        if stale:
            self._notify()
        return len(stale)

    def _notify(self) -> None:
        # Wake every waiter; each re-checks its own condition (putters: room, train pump: ready).
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def _wait_for_change(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._wait_for_change()


# ---- step composition ------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkRequest:
    """How many groups the next chunk of the open step may take (arguments for ``select``)."""

    min_groups: int
    max_groups: int


class StepComposer:
    """Tracks the open step so it gets exactly ``groups_per_step`` groups, streamed as chunks.

    DESIGN §5 "Step composition": the train pump streams whatever complete groups are ready as
    chunks of at least ``min_groups_per_chunk`` groups until the step is full. The last chunk may
    be smaller when fewer groups are missing. Typical use by the train pump::

        composer.start_step()
        while not composer.is_full:
            req = composer.next_chunk()
            await buffer.wait_ready(req.min_groups, current_version=version)
            groups = buffer.select(version, req.max_groups, req.min_groups)
            if groups:
                composer.add_chunk(groups)
                ...  # advantages, then policy.train_microbatch(chunk)
        step_groups = composer.finish_step()

    Args:
        groups_per_step: groups (prompts) per optimizer step, >= 1.
        min_groups_per_chunk: smallest chunk while more than that many groups are missing, in
            ``[1, groups_per_step]``.
        max_groups_per_chunk: optional cap on a chunk (bounds the memory of one chunk); None means
            up to everything the step still needs.

    Raises:
        ValueError: bounds out of range.
    """

    def __init__(
        self,
        groups_per_step: int,
        min_groups_per_chunk: int = 1,
        max_groups_per_chunk: int | None = None,
    ) -> None:
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        if not 1 <= min_groups_per_chunk <= groups_per_step:
            raise ValueError(
                f"min_groups_per_chunk must be in [1, groups_per_step={groups_per_step}], "
                f"got {min_groups_per_chunk}"
            )
        if max_groups_per_chunk is not None and max_groups_per_chunk < min_groups_per_chunk:
            raise ValueError(
                f"max_groups_per_chunk={max_groups_per_chunk} is below min_groups_per_chunk="
                f"{min_groups_per_chunk}; raise it or leave it unset"
            )
        self.groups_per_step = groups_per_step
        self.min_groups_per_chunk = min_groups_per_chunk
        self.max_groups_per_chunk = max_groups_per_chunk
        self._groups: list[Group] | None = None
        self.num_chunks = 0

    @property
    def is_open(self) -> bool:
        return self._groups is not None

    @property
    def groups_received(self) -> int:
        """Groups the open step has received (0 when no step is open)."""
        return len(self._groups) if self._groups is not None else 0

    @property
    def groups_missing(self) -> int:
        """Groups the open step still needs (0 when no step is open)."""
        return self.groups_per_step - self.groups_received if self.is_open else 0

    @property
    def is_full(self) -> bool:
        return self.is_open and self.groups_missing == 0

    @property
    def groups(self) -> list[Group]:
        """The open step's groups so far, in arrival order (a copy)."""
        return list(self._groups or [])

    def start_step(self) -> None:
        """Open a step. Raises RuntimeError if one is open (call finish_step or abort_step)."""
        if self.is_open:
            raise RuntimeError(
                "start_step called while a step is open; call finish_step() or abort_step() first"
            )
        self._groups = []
        self.num_chunks = 0

    def next_chunk(self) -> ChunkRequest:
        """Bounds for the next chunk. Raises RuntimeError if no step is open or it is full."""
        self._require_open("next_chunk")
        missing = self.groups_missing
        if missing == 0:
            raise RuntimeError("the step is full; call finish_step() instead of next_chunk()")
        cap = missing if self.max_groups_per_chunk is None else self.max_groups_per_chunk
        return ChunkRequest(
            min_groups=min(self.min_groups_per_chunk, missing), max_groups=min(missing, cap)
        )

    def add_chunk(self, groups: list[Group]) -> None:
        """Record that ``groups`` were sent to the open step as one chunk.

        Raises:
            RuntimeError: no step is open.
            ValueError: the chunk size is outside :meth:`next_chunk`'s bounds, or a group id is
                already part of the step. Nothing is recorded then.
        """
        self._require_open("add_chunk")
        if self.is_full:
            raise ValueError(f"the step already has its {self.groups_per_step} groups")
        req = self.next_chunk()
        if not req.min_groups <= len(groups) <= req.max_groups:
            raise ValueError(
                f"a chunk of {len(groups)} groups does not fit the open step: it needs between "
                f"{req.min_groups} and {req.max_groups} (select with next_chunk()'s bounds)"
            )
        ids = [g.group_id for g in groups]
        seen = {g.group_id for g in self._groups}
        dup = sorted({i for i in ids if i in seen or ids.count(i) > 1})
        if dup:
            raise ValueError(f"groups {dup} would appear twice in the step")
        self._groups.extend(groups)
        self.num_chunks += 1

    def finish_step(self) -> list[Group]:
        """Close the full step and return its groups.

        Raises:
            RuntimeError: no step is open, or it still misses groups.
        """
        self._require_open("finish_step")
        if not self.is_full:
            raise RuntimeError(
                f"finish_step called with {self.groups_missing} of {self.groups_per_step} groups "
                "still missing; keep adding chunks (or abort_step())"
            )
        groups, self._groups = self._groups, None
        return groups

    def abort_step(self) -> list[Group]:
        """Close the step without finishing it and return the groups it had (for a retry).

        Idempotent: with no open step it returns [].
        """
        groups, self._groups = self._groups or [], None
        return groups

    def _require_open(self, call: str) -> None:
        if not self.is_open:
            raise RuntimeError(f"{call} called with no open step; call start_step() first")
