"""The driver-side handle of the data-parallel train workers (DESIGN §4 "policy client").

It shards a chunk's sample ids across the workers, balanced by token count, drives the split step
on all of them at once (they meet in collectives), and returns one metrics dict. The workers
all-reduce every count and metric inside ``finish_train_step``, so their dicts agree; the client
checks that they do and returns rank 0's.
"""

from __future__ import annotations

import asyncio
import math

from splitrl.types import Group, SampleMeta


def balance_by_tokens(samples: list[SampleMeta], num_shards: int) -> list[list[int]]:
    """Indices of ``samples`` per shard: longest first onto the shard with the fewest tokens.

    Ties go to the lowest shard, so the split is deterministic. A shard may be empty.
    """
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    loads = [0] * num_shards
    order = sorted(range(len(samples)), key=lambda i: (-(samples[i].prompt_len + samples[i].response_len), i))
    for i in order:
        r = min(range(num_shards), key=lambda k: (loads[k], k))
        shards[r].append(i)
        loads[r] += samples[i].prompt_len + samples[i].response_len
    return [sorted(s) for s in shards]


class PolicyClient:
    """Drives ``TrainActor`` s (see :mod:`splitrl.workers.train_actor`) through actor handles."""

    def __init__(self, actors: list) -> None:
        if not actors:
            raise ValueError("PolicyClient needs at least one train worker")
        self.actors = actors

    async def _all(self, method: str, *per_rank_args) -> list:
        calls = []
        for r, a in enumerate(self.actors):
            args = [x[r] for x in per_rank_args]
            calls.append(a.call(method, *args))
        return await asyncio.gather(*calls)

    async def begin(self, expected_num_tokens: int | None = None) -> None:
        await self._all("begin", [expected_num_tokens] * len(self.actors))

    async def train_chunk(self, groups: list[Group]) -> dict:
        """Send the samples of ``groups`` (advantages filled) to the workers; returns counts."""
        samples = [s for g in groups for s in g.samples]
        advantages = [a for g in groups for a in (g.advantages or [])]
        if len(advantages) != len(samples):
            raise ValueError("every group of a chunk needs its advantages (run the advantage stage first)")
        shards = balance_by_tokens(samples, len(self.actors))
        ids = [[samples[i].sample_id for i in s] for s in shards]
        adv = [[advantages[i] for i in s] for s in shards]
        mask = [[samples[i].sample_mask for i in s] for s in shards]
        outs = await self._all("train_chunk", ids, adv, mask)
        return {k: sum(o[k] for o in outs) for k in outs[0]}

    async def finish(self) -> dict[str, float]:
        outs = await self._all("finish")
        ref = outs[0]
        for r, o in enumerate(outs[1:], start=1):
            if set(o) != set(ref):
                raise RuntimeError(
                    f"train workers 0 and {r} returned different metric names: {sorted(set(o) ^ set(ref))}"
                )
            for k, v in ref.items():
                if k.startswith("timing/"):
                    continue
                w = o.get(k)
                same = (w == v) or (isinstance(v, float) and math.isnan(v) and w is not None and math.isnan(w))
                if not same and not math.isclose(v, w, rel_tol=1e-9, abs_tol=1e-12):
                    raise RuntimeError(f"train workers disagree on metric {k!r}: {v} vs {w}")
        metrics = dict(ref)
        metrics["timing/train_busy_s"] = max(o.get("timing/train_busy_s", 0.0) for o in outs)
        return metrics

    async def abort(self) -> None:
        await self._all("abort")

    async def policy_state_dict(self, to_cpu: bool = True):
        """Full policy tensors from rank 0 (every rank takes part in the gather)."""
        outs = await self._all("policy_state_dict", [to_cpu] * len(self.actors))
        return outs[0]

    async def broadcast_weights(self) -> int:
        """Send the policy to the generation workers through the weight-sync group (every rank
        takes part in the FSDP2 gathers; rank 0 broadcasts). Returns the bytes sent."""
        outs = await self._all("broadcast_weights")
        return outs[0]

    async def state_dict(self) -> dict:
        outs = await self._all("state_dict")
        return outs[0]

    async def load_state_dict(self, state: dict) -> None:
        await self._all("load_state_dict", [state] * len(self.actors))

    async def save_checkpoint(self, path: str, blocking: bool = False) -> float:
        """Every rank starts writing its shards into ``path``; returns once all have staged
        them (the most seconds any rank blocked). The files follow in the background."""
        outs = await self._all("save_checkpoint", [path] * len(self.actors), [blocking] * len(self.actors))
        return max(outs)

    async def checkpoint_written(self) -> bool:
        """Whether every rank's files of the last checkpoint are on disk (raises a rank's write error)."""
        return all(await self._all("checkpoint_written"))

    async def load_checkpoint(self, path: str) -> None:
        await self._all("load_checkpoint", [path] * len(self.actors))

    async def save_pretrained(self, path: str) -> None:
        await self._all("save_pretrained", [path] * len(self.actors))
