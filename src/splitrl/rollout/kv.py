"""Removing dead slots from a KV cache whose rows share slot indices.

Legend: B = rows, L = cache slots, Hk = key/value heads, d = head dim.

Speculative decoding appends the same number of slots to every row and masks out the rejected
ones, so a cache gains holes; they cost memory, attention and the per-step concatenation of
``DynamicCache``. Compaction moves each row's valid slots, in order, to the right end of a shorter
cache (left padding again). Attention only sees validity and slot order and rotary positions are
explicit, so the model's outputs do not change.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def compact_cache(cache: DynamicCache, valid_BL: torch.Tensor) -> torch.Tensor:
    """Keep only each row's valid slots, left-padded to the longest row; returns the new validity.

    Args:
        cache: a ``DynamicCache`` of full-attention layers whose slots match ``valid_BL``.
        valid_BL: bool, which slots hold entries that later queries may attend to.

    Returns:
        bool [B, L'] validity of the compacted cache, L' = max valid slots of a row.
    """
    B, L = valid_BL.shape
    keep = int(valid_BL.sum(dim=1).max()) if B else 0
    # stable sort: invalid slots first, then the valid ones in their original order
    order = torch.sort(valid_BL.to(torch.int8), dim=1, stable=True).indices[:, L - keep :]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or layer.keys.numel() == 0:
            continue
        _, Hk, Lc, d = layer.keys.shape
        assert Lc == L, f"cache has {Lc} slots but the validity mask {L}"
        index = order[:, None, :, None].expand(B, Hk, keep, d)
        layer.keys = layer.keys.gather(2, index)
        layer.values = layer.values.gather(2, index)
    return valid_BL.gather(1, order)
