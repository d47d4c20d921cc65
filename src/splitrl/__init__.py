"""splitrl: asynchronous GRPO post-training with an exact split (streamed) train step and MTP heads.

Layout (DESIGN.md §4): ``models`` (policy + MTP heads), ``loss`` (GRPO loss, MTP loss, logprobs),
``train`` (microbatch builder, split train step), ``distributed`` (process groups, FSDP2),
``dataplane`` (TransferQueue / in-process), ``rollout`` (generation), ``tasks`` (prompts, rewards),
``controller`` (buffer, advantages, single controller), ``logging``, ``cli``.
"""

__version__ = "0.1.0"
