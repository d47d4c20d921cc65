"""The data-plane interface: bulk per-sample tensors keyed by sample id (DESIGN.md §4).

Generation workers ``put`` the token-aligned tensors of each finished sample (``input_ids``,
``token_mask``, ``generation_logprobs``, ... see :mod:`splitrl.types`) under its sample id; train
workers ``get`` the fields they need for the ids of a chunk; the controller only ever handles the
ids. Every adapter behaves the same, so code written against the in-process adapter runs unchanged
on TransferQueue.

Storage model. A sample id maps to a set of named fields; each field holds one tensor per sample:

- token-aligned fields are 1-D tensors of the sample's own length ``L_i`` (jagged: lengths differ
  between samples and nothing is padded, neither in storage nor on the wire);
- scalars (a reward, a policy version) are 0-d tensors;
- a field may also carry trailing fixed dimensions (``[L_i, k]``); only the first one is jagged.

Rules shared by all adapters (enforced here, before any state changes):

- ids are ``str`` and unique within one call; field names are non-empty ``str``;
- in one ``put`` every field's list has one tensor per id, and within a field all tensors share
  dtype, number of dimensions and trailing shape (a field has one type; store values of another
  type under another field name);
- ``put`` on an id that is already stored adds the given fields to it and replaces those it
  already had (e.g. the trainer can add ``prev_logprobs`` to a generated sample);
- tensors are stored detached, on CPU, as copies: editing a tensor in place after ``put``, or a
  tensor returned by ``get``, never changes what is stored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from types import TracebackType

import torch

# How many offending ids an error message lists before it abbreviates.
_MAX_IDS_IN_MESSAGE = 8


class DataPlane(ABC):
    """Key-value store of per-sample tensors: ``sample_id -> {field name -> tensor}``.

    Subclasses implement ``_put``, ``_get``, ``_delete``, ``_clear`` and ``_close``; the public
    methods validate the arguments first, so every adapter raises the same errors for the same
    mistakes. A closed data plane raises ``RuntimeError`` on every call except ``close``.
    Usable as a context manager (``close`` on exit).
    """

    def __init__(self) -> None:
        self._closed = False

    # ---- public API -------------------------------------------------------------------------

    def put(self, sample_ids: list[str], fields: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Store ``fields[name][i]`` under ``(sample_ids[i], name)`` for every field and id.

        Args:
            sample_ids: ids of the samples, unique within the call.
            fields: field name -> one tensor per id (same order as ``sample_ids``). Token-aligned
                fields are 1-D ``[L_i]`` tensors of varying length; scalars are 0-d tensors.

        Raises:
            ValueError: malformed arguments (see the module docstring); nothing is stored.
            RuntimeError: the data plane is closed, or the backend failed.
        """
        self._check_open("put")
        _check_ids(sample_ids, "put")
        _check_put_fields(sample_ids, fields)
        if sample_ids:
            self._put(list(sample_ids), {name: list(values) for name, values in fields.items()})

    def get(self, sample_ids: list[str], fields: list[str]) -> dict[str, list[torch.Tensor]]:
        """Return the selected fields of the given samples.

        Args:
            sample_ids: ids to read, unique within the call.
            fields: names of the fields to read; each must be stored for every id.

        Returns:
            ``{name: [tensor of sample_ids[0], tensor of sample_ids[1], ...]}`` for each name in
            ``fields``; each tensor has exactly the shape and dtype it was stored with, on CPU.
            An empty ``sample_ids`` gives empty lists.

        Raises:
            ValueError: malformed arguments (duplicate ids or fields, no field named).
            KeyError: an id is not stored, or a field is not stored for every id.
            RuntimeError: the data plane is closed, or the backend failed.
        """
        self._check_open("get")
        _check_ids(sample_ids, "get")
        _check_field_names(fields)
        if not sample_ids:
            return {name: [] for name in fields}
        return self._get(list(sample_ids), list(fields))

    def delete(self, sample_ids: list[str]) -> None:
        """Remove the samples (all their fields).

        Raises:
            ValueError: duplicate or non-``str`` ids.
            KeyError: an id is not stored; nothing is deleted then.
            RuntimeError: the data plane is closed, or the backend failed.
        """
        self._check_open("delete")
        _check_ids(sample_ids, "delete")
        if sample_ids:
            self._delete(list(sample_ids))

    def clear(self) -> None:
        """Remove every sample of this data plane (for TransferQueue: of its partition)."""
        self._check_open("clear")
        self._clear()

    def close(self) -> None:
        """Release the data plane's resources. Idempotent; later calls other than ``close`` raise."""
        if not self._closed:
            self._closed = True
            self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- adapter hooks (arguments already validated, ids non-empty) -------------------------

    @abstractmethod
    def _put(self, sample_ids: list[str], fields: dict[str, list[torch.Tensor]]) -> None: ...

    @abstractmethod
    def _get(self, sample_ids: list[str], fields: list[str]) -> dict[str, list[torch.Tensor]]: ...

    @abstractmethod
    def _delete(self, sample_ids: list[str]) -> None: ...

    @abstractmethod
    def _clear(self) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.{call}: the data plane is closed; create a new one.")


# ---- validation shared by the adapters --------------------------------------------------------


def format_ids(ids: Sequence[str]) -> str:
    """Short, readable list of ids for error messages."""
    shown = ", ".join(repr(i) for i in list(ids)[:_MAX_IDS_IN_MESSAGE])
    more = len(ids) - _MAX_IDS_IN_MESSAGE
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


def unknown_ids_error(missing: Sequence[str]) -> KeyError:
    return KeyError(
        f"{len(missing)} sample id(s) not in the data plane: {format_ids(missing)}. "
        "Put them first; ids that were deleted or cleared are gone."
    )


def missing_field_error(name: str, lacking: Sequence[str], stored: Sequence[str]) -> KeyError:
    return KeyError(
        f"field {name!r} is not stored for sample id(s) {format_ids(lacking)}; "
        f"fields stored for all requested ids: {sorted(stored)}."
    )


def _check_ids(sample_ids: Sequence[str], call: str) -> None:
    if isinstance(sample_ids, str) or not isinstance(sample_ids, Sequence):
        raise ValueError(f"{call}: sample_ids must be a list of str, got {type(sample_ids).__name__}.")
    bad = [i for i in sample_ids if not isinstance(i, str)]
    if bad:
        raise ValueError(f"{call}: sample ids must be str, got {[type(i).__name__ for i in bad[:3]]}.")
    dups = [i for i, n in Counter(sample_ids).items() if n > 1]
    if dups:
        raise ValueError(
            f"{call}: duplicate sample id(s) in one call: {format_ids(dups)}; pass each id once."
        )


def _check_field_names(names: Sequence[str]) -> None:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ValueError(f"get: fields must be a list of field names, got {type(names).__name__}.")
    if not names:
        raise ValueError("get: name at least one field to read.")
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"get: field names must be non-empty str, got {bad[:3]!r}.")
    dups = [n for n, c in Counter(names).items() if c > 1]
    if dups:
        raise ValueError(f"get: duplicate field name(s) {dups}; name each field once.")


def _check_put_fields(sample_ids: Sequence[str], fields: Mapping[str, Sequence[torch.Tensor]]) -> None:
    if not isinstance(fields, Mapping):
        raise ValueError(
            f"put: fields must be a dict of field name -> list of tensors, got {type(fields).__name__}."
        )
    if not fields:
        raise ValueError("put: pass at least one field.")
    for name, values in fields.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"put: field names must be non-empty str, got {name!r}.")
        if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
            raise ValueError(
                f"put: field {name!r} must be a list with one tensor per sample id, "
                f"got {type(values).__name__} "
                "(a batched tensor [B, ...] can be passed as list(t.unbind(0)))."
            )
        if len(values) != len(sample_ids):
            raise ValueError(
                f"put: field {name!r} has {len(values)} tensor(s) for {len(sample_ids)} sample id(s); "
                "pass exactly one tensor per id, in the order of sample_ids."
            )
        _check_one_field_type(name, values)


def _check_one_field_type(name: str, values: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(values):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"put: field {name!r}, entry {i} is a {type(t).__name__}, not a torch.Tensor.")
        if t.is_nested or t.layout != torch.strided:
            raise ValueError(
                f"put: field {name!r}, entry {i} has layout {t.layout}; pass one dense tensor per sample "
                "(unbind nested/sparse tensors first)."
            )
    if not values:
        return
    first = values[0]
    for i, t in enumerate(values[1:], start=1):
        if t.dtype != first.dtype or t.dim() != first.dim() or t.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"put: field {name!r} mixes tensor types: entry 0 is {_describe(first)}, entry {i} is "
                f"{_describe(t)}. All tensors of a field must share dtype, number of dimensions and all "
                "but the first dimension; store other kinds of values under another field name."
            )


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}"
