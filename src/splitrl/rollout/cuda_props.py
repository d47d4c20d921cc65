"""What the decode kernels' launch rules read of a CUDA device, read once per device index.

:func:`sm_major` (PDL from sm90, Hopper's warpgroup tiles at sm90) and :func:`shared_memory_optin`
(the bytes of shared memory a block may opt into: how many pipeline stages fit) are asked at every
launch a decode step makes outside its CUDA graphs, so ``torch.cuda.get_device_properties`` is
called once per device.
"""

from __future__ import annotations

import torch

_PROPS: dict[int, tuple[int, int]] = {}  # device index -> (major compute capability, opt-in shared memory)


def _props(device: torch.device) -> tuple[int, int]:
    """(major, opt-in shared memory bytes) of a CUDA ``device`` (no index: the current device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROPS:
        props = torch.cuda.get_device_properties(index)
        _PROPS[index] = (int(props.major), int(getattr(props, "shared_memory_per_block_optin", 0) or 0))
    return _PROPS[index]


def sm_major(device: torch.device) -> int:
    """The major compute capability of a CUDA ``device`` (9: Hopper)."""
    return _props(device)[0]


def shared_memory_optin(device: torch.device) -> int:
    """Bytes of shared memory a block may opt into on a CUDA ``device`` (0 where torch does not say)."""
    return _props(device)[1]
