"""The records that carry a rollout through the system (DESIGN.md §1, §4).

The controller only ever holds these light records (ids, rewards, versions, lengths); the bulk
token-aligned tensors of a sample (``input_ids``, ``generation_logprobs``, ...) live in the data
plane under the sample's id.

Data-plane fields of one sample (all 1-D, length ``L = prompt_len + response_len``, jagged):

| field | dtype | meaning |
| --- | --- | --- |
| ``input_ids`` | int64 | prompt tokens then response tokens |
| ``token_mask`` | float32 | 1 on generated (trainable) response tokens, 0 on the prompt |
| ``generation_logprobs`` | float32 | logprob of token t under the rollout policy (temperature-scaled), 0 on the prompt |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SampleMeta:
    """Light record of one sample (one prompt + one response).

    Attributes:
        sample_id: unique id; the data plane key of the sample's tensors.
        reward: scalar reward of the response (float).
        prompt_len: number of prompt tokens.
        response_len: number of generated tokens (EOS included when generated).
        truncated: True when generation hit the length limit before EOS / a stop string.
        policy_version: version of the weights that generated the sample.
        sample_mask: 1.0 if the sample counts in training, 0.0 if filtered (e.g. truncated and
            ``reward.mask_truncated`` is on).
        reward_timed_out: True when the answer check hit its time limit (reward is then 0).
        info: free-form extras (task metadata, response text, rollout acceptance counts ...).
    """

    sample_id: str
    reward: float
    prompt_len: int
    response_len: int
    truncated: bool = False
    policy_version: int = 0
    sample_mask: float = 1.0
    reward_timed_out: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Group:
    """The G samples generated from one prompt; GRPO baselines are computed per group.

    Attributes:
        group_id: unique id of the group (e.g. ``"p{prompt_index}-e{epoch}"``).
        prompt_index: position of the prompt in the run's deterministic prompt order.
        samples: the G :class:`SampleMeta` of the group.
        policy_version: the policy version that generated every sample of the group (weights
            never change inside one generation request, DESIGN §5).
        advantages: per-sample advantages, filled by the advantage stage (None before).
    """

    group_id: str
    prompt_index: int
    samples: list[SampleMeta]
    policy_version: int
    advantages: list[float] | None = None

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.samples]

    @property
    def num_tokens(self) -> int:
        return sum(s.prompt_len + s.response_len for s in self.samples)
