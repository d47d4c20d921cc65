"""In-process data plane: a dict in the current process (unit tests, single-process runs).

Samples live only in the process that created the object, so it refuses to be pickled: a copy sent
to a Ray actor would silently diverge from the original. Use the TransferQueue adapter to share
samples between processes.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from splitrl.dataplane.base import DataPlane, missing_field_error, unknown_ids_error


class InProcessDataPlane(DataPlane):
    """Dict-backed :class:`~splitrl.dataplane.base.DataPlane`.

    Tensors are stored as detached CPU copies and returned as fresh copies, so neither the
    producer's nor the consumer's in-place edits reach what is stored.
    """

    def __init__(self) -> None:
        super().__init__()
        self._samples: dict[str, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        """Number of stored samples."""
        return len(self._samples)

    def _put(self, sample_ids: list[str], fields: dict[str, list[torch.Tensor]]) -> None:
        # Copy everything before touching the dict so a failing copy stores nothing.
        copies = {name: [_stored_copy(t) for t in values] for name, values in fields.items()}
        for i, sample_id in enumerate(sample_ids):
            sample = self._samples.setdefault(sample_id, {})
            for name, values in copies.items():
                sample[name] = values[i]

    def _get(self, sample_ids: list[str], fields: list[str]) -> dict[str, list[torch.Tensor]]:
        self._check_known(sample_ids)
        samples = [self._samples[i] for i in sample_ids]
        for name in fields:
            lacking = [i for i, s in zip(sample_ids, samples, strict=True) if name not in s]
            if lacking:
                common = set.intersection(*(set(s) for s in samples))
                raise missing_field_error(name, lacking, common)
        return {name: [s[name].clone() for s in samples] for name in fields}

    def _delete(self, sample_ids: list[str]) -> None:
        self._check_known(sample_ids)
        for sample_id in sample_ids:
            del self._samples[sample_id]

    def _clear(self) -> None:
        self._samples.clear()

    def _close(self) -> None:
        self._samples.clear()

    def _check_known(self, sample_ids: list[str]) -> None:
        missing = [i for i in sample_ids if i not in self._samples]
        if missing:
            raise unknown_ids_error(missing)

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "InProcessDataPlane holds its samples in this process only and cannot be sent to another "
            "process (a copy would diverge). Use DataPlaneConfig(kind='transferqueue') to share samples "
            "between Ray actors."
        )


def _stored_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", copy=True)
