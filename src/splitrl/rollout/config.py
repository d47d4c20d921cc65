"""Configuration of the rollout engine (DESIGN.md §4 "Rollouts", §5 "Policies and logprobs")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

# a refusal of the run config and of the engine alike ({size}, {det}: the keys as each names them)
DETERMINISTIC_DRAFT_VOCAB = (
    "{size} with {det}=true: the drafts' set is ranked from the tokens this engine generated before, which a "
    "resumed run or another generation worker does not share, and acceptance decides which verify emits a token, "
    "so logprobs would differ in their last bits between them and the run would not be bit-reproducible; unset "
    "one of the two"
)


class GenerationConfig(BaseModel):
    """How rollouts are sampled.

    Attributes:
        temperature: 0 < T < inf. Tokens are drawn from softmax(logits / T) (after the filters below) and
            every returned logprob is of the *unfiltered* softmax(logits / T) (DESIGN §5). T = 0 is
            rejected: its logprobs are undefined; for greedy decoding use ``top_k=1``. T = inf is
            rejected too: it samples uniformly and ignores the model.
        top_p: nucleus filter, keep the smallest set of most likely tokens whose mass reaches
            ``top_p`` (1.0 = off). Applied after ``top_k``, on the top-k-renormalized distribution.
        top_k: keep the ``top_k`` most likely tokens (0 = off; tokens tied with the k-th are kept).
        max_new_tokens: response length limit; a row that reaches it ends with ``"length"``.
        stop_token_ids: tokens that end a row (EOS, end-of-turn ...); the stop token is part of the
            response and of its logprobs.
        stop_strings: texts that end a response (non-empty); applied by the generation worker, which cuts the
            response after the first token that completes one (the tokens up to there, and their
            logprobs, are exactly what was sampled).
        speculative: self-speculative decoding with the model's MTP heads as the draft; the output
            distribution is exactly the plain one. Requires a model with ``mtp_num_layers > 0``.
        num_draft_tokens: the most tokens drafted per verify forward (depths 1..n are used); default:
            every MTP depth of the model. With the speed rules on (not ``deterministic``) the engine
            also measures calls drafting fewer (n-1 .. 1) and drafts the fastest count per batch size
            (:class:`~splitrl.rollout.spec_policy.SpecPolicy`); the tokens are the same for every count.
        draft_vocab_size: the MTP heads draft from this many tokens only (default: the whole
            vocabulary): the ones this engine has seen most often in responses since it was built,
            then in prompts (:class:`~splitrl.rollout.drafter.DraftVocabulary`; counted on the host,
            not checkpointed, one count per generation worker; the set is re-ranked at the start of
            every call and the draft head's rows gathered from the current weights). A draft's
            output layer then reads ``draft_vocab_size`` rows instead of V (Qwen3: 151,936; SmolLM2:
            49,152), the larger part of a draft's cost on a real model. The tokens are exactly plain
            decoding's whatever the set (the verify decides every token); their logprobs are those
            of speculative decoding (the last bits may differ, see ``deterministic``). A token
            outside the set is never drafted: with few such tokens acceptance barely moves. The
            reduced draft vocabulary of EAGLE-3 (Li et al. 2025) and FR-Spec (Zhao et al. 2025),
            chosen here from the run's own tokens. A new engine's first call has no responses to
            rank: its set is the prompts' tokens, then the lowest ids. The counts never decay.
            Requires ``speculative``; refused with ``deterministic`` (the set, hence which verify
            emits a token and its logprob's last bits, depends on the engine's history, which a
            resume does not restore); at most the vocabulary size (checked by the engine).
        deterministic: with ``speculative``, decode every call speculatively from start to end
            instead of letting measured speed switch speculation off (no clock is read). The tokens
            are the same either way, but a token emitted by a verify forward and the same token
            emitted by a plain step get logprobs that differ in their last bits (the forwards run
            matrix products of other shapes: up to 3e-6 on the fp32 CPU tests), so with the
            speed-driven switch two runs of one config can differ there; with this on they are
            bit-identical, as plain runs are. Costs speed only where speculation is slower than
            plain decoding. No effect without ``speculative``.
        batch_size: most rows in one forward; larger requests run as several batches.
    """

    # validate_assignment: `config.temperature = -1` is refused like GenerationConfig(temperature=-1)
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    temperature: float = 1.0
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(256, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_strings: list[str] = Field(default_factory=list)
    speculative: bool = False
    num_draft_tokens: int | None = Field(None, ge=1)
    draft_vocab_size: int | None = Field(None, ge=1)
    deterministic: bool = False
    batch_size: int = Field(64, ge=1)

    @field_validator("temperature")
    @classmethod
    def _positive_temperature(cls, value: float) -> float:
        if not value > 0.0:
            raise ValueError(
                f"temperature must be > 0 (logprobs are of softmax(logits / T)), got {value}; use a T such as 1.0 "
                "(training also needs top_k != 1, else every sample of a group is the same response); for greedy "
                "responses pass `--greedy` to `splitrl generate` / `splitrl eval` (in Python: GenerationConfig("
                "top_k=1) with a T > 0)"
            )
        if value == float("inf"):
            # logits / inf = 0: every token equally likely whatever the model says, and every
            # logprob the constant -log(V), so the policy gradient is 0 and nothing is learned
            raise ValueError(
                "temperature must be finite, got inf: softmax(logits / inf) is uniform over the vocabulary "
                "(the model plays no part, every logprob is -log(vocab_size)); use a finite T such as 1.0"
            )
        return value

    @field_validator("stop_strings")
    @classmethod
    def _non_empty_stop_strings(cls, value: list[str]) -> list[str]:
        # "" is in every text: every response would be cut after its first token
        if any(s == "" for s in value):
            raise ValueError(
                f"stop_strings {value} has an empty string, which every text contains: every response would "
                "end after its first token; remove it (or give the text that should end a response)"
            )
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: list[int]) -> list[int]:
        bad = [t for t in value if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad}")
        return value
