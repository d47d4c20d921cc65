"""Loss and metric contracts of the split step (DESIGN.md §2 "Loss denominators").

Per microbatch a loss returns *raw sums* (denominator 1). ``finish_train_step`` divides the
gradients by N_t (``TOKEN_LEVEL``) or N_s (``SEQUENCE_LEVEL``) once, after the counts are
all-reduced, and divides each metric by the denominator its :class:`Normalizer` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol

import torch

from splitrl.loss.config import LossType  # noqa: F401 - defined there, torch-free


class Normalizer(str, Enum):
    """Denominator of a metric at finish: N_t, N_s, or none (counts and extrema)."""

    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


Reduce = Literal["sum", "min", "max"]


@dataclass
class Metric:
    """One metric of one microbatch.

    Attributes:
        value: scalar tensor — a raw sum (``reduce="sum"``) or an extremum (``"min"``/``"max"``).
        normalizer: denominator at finish; ``None`` means "like the gradient" (the loss type's).
        reduce: how microbatches, chunks and ranks combine. Extrema are never summed.
    """

    value: torch.Tensor
    normalizer: Normalizer | None = None
    reduce: Reduce = "sum"

    def __post_init__(self) -> None:
        if self.reduce != "sum" and self.normalizer not in (None, Normalizer.NONE):
            raise ValueError(f"a {self.reduce} metric cannot be normalized (got normalizer={self.normalizer})")
        if self.reduce != "sum":
            self.normalizer = Normalizer.NONE


@dataclass
class LossOutput:
    """What a policy loss returns for one microbatch.

    Attributes:
        loss: differentiable scalar, the raw (un-normalized) sum of the objective.
        metrics: name -> :class:`Metric`; every microbatch of a step must return the same names.
    """

    loss: torch.Tensor
    metrics: dict[str, Metric] = field(default_factory=dict)


class PolicyLoss(Protocol):
    """A loss the train worker can drive: ``loss_type``, ``temperature`` and a call per microbatch.

    ``needs_entropy``: the forward computes the entropy of each position; ``needs_reference_logprobs``:
    every chunk carries the frozen reference policy's logprobs (the train actor runs that policy).
    Built from its options by :func:`splitrl.loss.registry.make_loss`.
    """

    loss_type: LossType
    temperature: float
    needs_entropy: bool
    needs_reference_logprobs: bool

    def validate_batch(self, batch) -> None:
        """Raise ``ValueError`` when a chunk lacks a field this loss needs (before any compute)."""

    def __call__(self, output, mb) -> LossOutput:
        """Raw-sum loss and metrics of one microbatch (``PolicyOutput``, ``MicroBatch``)."""
