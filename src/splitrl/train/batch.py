"""The batch types of the train step.

Legend: B = samples of a chunk, L_i = tokens of sample i, b = rows of a microbatch, s = positions
of a row, n = samples of a microbatch.

A :class:`TrainBatch` is what a chunk is: samples kept jagged (one 1-D tensor per sample, prompt
then response, no padding). The microbatch builder cuts it into :class:`MicroBatch` es — padded
or packed rows — that the model and the loss read.

Alignment: every token-aligned tensor is indexed by the token it describes. ``logprobs[t]`` is the
logprob of token t (predicted from position t − 1); the loss mask of position t is
``token_mask[t] · sample_mask`` and position 0 of a sample never counts (nothing predicts it). This
is DESIGN §1's ``token_mask[:, 1:]`` written in token coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from splitrl.models.config import ModelCapabilities

_OPTIONAL_TOKEN_FIELDS = ("generation_logprobs", "prev_logprobs", "reference_logprobs")


@dataclass
class TrainBatch:
    """A chunk of samples (jagged).

    Attributes:
        input_ids: B tensors [L_i] int64, prompt then response.
        token_mask: B tensors [L_i] float32, 1 on generated (trainable) tokens.
        advantages: [B] float32, one advantage per sample (GRPO).
        sample_mask: [B] float32, 1 = counts, 0 = filtered out (default: all ones).
        generation_logprobs / prev_logprobs / reference_logprobs: optional, B tensors [L_i]
            float32 aligned with ``input_ids``. Values where :meth:`loss_mask` is 0 (prompt,
            position 0, filtered samples) are never read — they may be -inf or NaN; the
            microbatch builder replaces them with 0.
        sample_ids: optional ids (for logging and balancing), B strings.
    """

    input_ids: list[torch.Tensor]
    token_mask: list[torch.Tensor]
    advantages: torch.Tensor
    sample_mask: torch.Tensor | None = None
    generation_logprobs: list[torch.Tensor] | None = None
    prev_logprobs: list[torch.Tensor] | None = None
    reference_logprobs: list[torch.Tensor] | None = None
    sample_ids: list[str] | None = None

    def __post_init__(self) -> None:
        if self.sample_mask is None:
            self.sample_mask = torch.ones(len(self.input_ids), dtype=torch.float32)
        self.advantages = torch.as_tensor(self.advantages, dtype=torch.float32)
        self.sample_mask = torch.as_tensor(self.sample_mask, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        return [int(x.numel()) for x in self.input_ids]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def loss_mask(self, i: int) -> torch.Tensor:
        """[L_i] float32 mask of the positions of sample i that the loss reads:
        ``token_mask · sample_mask`` with position 0 zeroed (nothing predicts it). The one
        definition that validation, the microbatch builder and N_t share."""
        mask = self.token_mask[i].float() * self.sample_mask[i]
        mask[0] = 0.0
        return mask

    def validate(self) -> None:
        """Check shapes and dtypes.

        Raises:
            ValueError: naming the field and sample that is wrong.
        """
        for name in ("input_ids", "token_mask", *_OPTIONAL_TOKEN_FIELDS):
            vals = getattr(self, name)
            if vals is not None and not all(isinstance(v, torch.Tensor) for v in vals):
                raise ValueError(f"{name} must be a list of 1-D torch tensors (one per sample)")
        B = len(self.input_ids)
        if len(self.token_mask) != B:
            raise ValueError(f"token_mask has {len(self.token_mask)} entries for {B} samples; give one per sample")
        for name in ("advantages", "sample_mask"):
            t = getattr(self, name)
            if t.shape != (B,):
                raise ValueError(f"{name} must have shape [B]=[{B}], got {tuple(t.shape)}")
        if not torch.isfinite(self.sample_mask).all():
            raise ValueError("sample_mask holds non-finite values; it must be 1.0 (counts) or 0.0 (filtered out)")
        # a filtered sample's values are never read (the builder replaces them), so only counted
        # samples must be finite
        bad = ~torch.isfinite(self.advantages) & (self.sample_mask != 0)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"advantages[{i}] is {float(self.advantages[i])} on a counted sample; fix the rewards or "
                "filter that sample out (sample_mask=0)"
            )
        if self.sample_ids is not None and len(self.sample_ids) != B:
            raise ValueError(f"sample_ids has {len(self.sample_ids)} entries for {B} samples")
        for i, (ids, tm) in enumerate(zip(self.input_ids, self.token_mask)):
            if ids.dim() != 1 or ids.numel() == 0:
                raise ValueError(f"input_ids[{i}] must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
            if ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"input_ids[{i}] must be an integer tensor, got {ids.dtype}")
            if tm.shape != ids.shape:
                raise ValueError(f"token_mask[{i}] has shape {tuple(tm.shape)}, input_ids[{i}] {tuple(ids.shape)}")
            if not ((tm == 0) | (tm == 1)).all():
                raise ValueError(f"token_mask[{i}] must hold only 0.0 and 1.0 (1 = generated token)")
        for name in _OPTIONAL_TOKEN_FIELDS:
            vals = getattr(self, name)
            if vals is None:
                continue
            if len(vals) != B:
                raise ValueError(f"{name} has {len(vals)} entries for {B} samples")
            for i, (v, ids) in enumerate(zip(vals, self.input_ids)):
                if v.shape != ids.shape:
                    raise ValueError(f"{name}[{i}] has shape {tuple(v.shape)}, input_ids[{i}] {tuple(ids.shape)}")
                # only where the loss reads them: prompt, padding and filtered samples may hold
                # anything (-inf, NaN); the builder replaces those values
                bad = ~torch.isfinite(v) & (self.loss_mask(i) > 0)
                if bad.any():
                    t = int(bad.nonzero()[0])
                    raise ValueError(
                        f"{name}[{i}] is {float(v[t])} at token {t}, a trained token of a counted sample; fix "
                        "the logprobs or filter that sample out (sample_mask=0)"
                    )

    def select(self, indices: list[int]) -> "TrainBatch":
        """The samples at ``indices``, in that order (field presence is kept, even when empty)."""
        idx = torch.as_tensor(indices, dtype=torch.long)

        def pick(xs):
            return None if xs is None else [xs[i] for i in indices]

        return TrainBatch(
            input_ids=pick(self.input_ids),
            token_mask=pick(self.token_mask),
            advantages=self.advantages[idx] if len(indices) else self.advantages[:0],
            sample_mask=self.sample_mask[idx] if len(indices) else self.sample_mask[:0],
            generation_logprobs=pick(self.generation_logprobs),
            prev_logprobs=pick(self.prev_logprobs),
            reference_logprobs=pick(self.reference_logprobs),
            sample_ids=pick(self.sample_ids),
        )

    @staticmethod
    def concat(batches: list["TrainBatch"]) -> "TrainBatch":
        """Samples of several batches, in order (fields must be present in all or none)."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        out = {}
        for f in fields(TrainBatch):
            vals = [getattr(b, f.name) for b in batches]
            if f.name in ("advantages", "sample_mask"):
                out[f.name] = torch.cat(vals)
            elif all(v is None for v in vals):
                out[f.name] = None
            elif any(v is None for v in vals):
                raise ValueError(f"field {f.name} is present in some batches and missing in others")
            else:
                out[f.name] = [x for v in vals for x in v]
        return TrainBatch(**out)

    @staticmethod
    def from_padded(
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_mask: torch.Tensor,
        advantages: torch.Tensor,
        sample_mask: torch.Tensor | None = None,
        **token_fields: torch.Tensor,
    ) -> "TrainBatch":
        """Build from padded [B, S] tensors (left or right padding; ``attention_mask`` 1 = real token).

        ``token_fields``: any of generation_logprobs / prev_logprobs / reference_logprobs, [B, S].
        """
        unknown = set(token_fields) - set(_OPTIONAL_TOKEN_FIELDS)
        if unknown:
            raise ValueError(f"unknown token fields {sorted(unknown)}; expected some of {_OPTIONAL_TOKEN_FIELDS}")
        keep = [attention_mask[i].bool() for i in range(input_ids.shape[0])]
        return TrainBatch(
            input_ids=[input_ids[i][k].long() for i, k in enumerate(keep)],
            token_mask=[token_mask[i][k].float() for i, k in enumerate(keep)],
            advantages=advantages,
            sample_mask=sample_mask,
            **{n: [v[i][k].float() for i, k in enumerate(keep)] for n, v in token_fields.items()},
        )


@dataclass
class MicroBatch:
    """One forward/backward's worth of rows, padded or packed.

    Attributes:
        input_ids: [b, s] int64 (padding: 0).
        segment_ids: [b, s] int64, sample number within its row; -1 = padding.
        position_ids: [b, s] int64, restarting at 0 for every sample.
        sample_index: [b, s] int64, index of the position's sample in this microbatch; -1 = padding.
        loss_mask: [b, s] float32, token_mask·sample_mask in token coordinates (0 at a sample's
            first position); Σ loss_mask over a step is N_t.
        mtp_loss_mask: [b, s] float32, the *unshifted* ``token_mask * sample_mask`` (DESIGN §3),
            built per sample before cutting/packing.
        advantages: [n] float32 (0.0 for filtered samples); sample_mask: [n] float32.
        generation_logprobs / prev_logprobs / reference_logprobs: [b, s] float32 or None; 0.0
            wherever ``loss_mask`` is 0 (always finite there).
        packed: rows hold several samples.
        capabilities: the model's flags, unchanged.
    """

    input_ids: torch.Tensor
    segment_ids: torch.Tensor
    position_ids: torch.Tensor
    sample_index: torch.Tensor
    loss_mask: torch.Tensor
    mtp_loss_mask: torch.Tensor
    advantages: torch.Tensor
    sample_mask: torch.Tensor
    generation_logprobs: torch.Tensor | None = None
    prev_logprobs: torch.Tensor | None = None
    reference_logprobs: torch.Tensor | None = None
    packed: bool = False
    capabilities: ModelCapabilities = field(default_factory=ModelCapabilities)

    @property
    def num_samples(self) -> int:
        return int(self.advantages.numel())

    @property
    def num_tokens(self) -> int:
        return int((self.segment_ids >= 0).sum())

    def per_sample_sum(self, values_bs: torch.Tensor) -> torch.Tensor:
        """Σ over each sample's positions: [b, s] -> [n] (padding dropped)."""
        if self.num_samples == 0:
            return values_bs.new_zeros(0)
        idx = self.sample_index.clamp(min=0).reshape(-1)
        vals = (values_bs * (self.sample_index >= 0)).reshape(-1)
        return vals.new_zeros(self.num_samples).index_add(0, idx, vals)

    def gather_samples(self, values_n: torch.Tensor) -> torch.Tensor:
        """Broadcast per-sample values [n] to positions [b, s] (0 on padding)."""
        if self.num_samples == 0:
            return torch.zeros(self.sample_index.shape, dtype=values_n.dtype, device=values_n.device)
        out = values_n[self.sample_index.clamp(min=0)]
        return out * (self.sample_index >= 0)

    def token_advantages(self) -> torch.Tensor:
        """[b, s] advantage of each position's sample."""
        return self.gather_samples(self.advantages)

    def to(self, device: torch.device | str) -> "MicroBatch":
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)
