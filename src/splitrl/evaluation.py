"""Scoring a policy on a task's held-out prompts, and sampling from it: what ``splitrl eval`` and
``splitrl generate`` run, with the rollout engine the training run uses.

A sample is generated exactly as in training (same engine, prompt rendering, stop tokens and stop
strings, per-sample seeds derived from (seed, prompt index, sample index)) and scored by the task
under the same per-check time limit.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained
on Code", eq. 1): with n samples of a prompt of which c are correct,
pass@k = 1 − C(n − c, k) / C(n, k), averaged over prompts; computed as the product
1 − Π_{i=n−c+1}^{n} (1 − k / i), which needs no large binomials.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitrl.models.hf_files import rollout_stop_token_ids
from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout.sampling import sample_seed
from splitrl.rollout.text import cut_at_stop_string, decode_response
from splitrl.tasks import RewardScorer, Task, TaskPrompt, encode_prompt


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from ``n`` samples with ``c`` correct (Chen et al. 2021, eq. 1).

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@dataclass
class EvalSample:
    """One scored sample: its prompt, response text, reward and how it ended."""

    prompt_index: int
    sample_index: int
    prompt: str
    answer: str
    response: str
    reward: float
    correct: bool
    response_len: int
    finish_reason: str
    reward_timed_out: bool = False


@dataclass
class EvalResult:
    """Metrics (keys carry the prefix, e.g. ``eval/pass@4``) and every sample."""

    metrics: dict[str, float]
    samples: list[EvalSample] = field(default_factory=list)


# The most samples one ``splitrl generate`` / ``splitrl eval`` call draws (prompts × samples per
# prompt): ``generate -n 100000000`` (a typo for 10?) would run for days; a larger job is several
# calls (``--seed`` gives other samples).
MAX_SAMPLES_PER_CALL = 1_000_000
# How many samples :func:`stream_samples` hands the engine at once: the memory it holds is that of
# this many samples, however many are asked for (a call of up to this many is one engine request).
STREAM_CHUNK_SAMPLES = 4096


def _cut_and_decode(r: Any, decode: Any, stop_strings: list[str]) -> str:
    n = cut_at_stop_string(r.response_ids, decode, stop_strings)
    if n is not None:  # the same cut the generation workers make
        r.response_ids, r.logprobs, r.finish_reason = r.response_ids[:n], r.logprobs[:n], "stop"
    return decode(r.response_ids)


def _generate(engine: RolloutEngine, tokenizer: Any, prompt_ids: list[list[int]], seeds: list[int],
              stop_strings: Sequence[str], progress: bool = False) -> tuple[list[Any], list[str]]:
    from tqdm.auto import tqdm

    # as RolloutEngine.generate does, with a bar on stderr as samples finish when ``progress`` (a
    # large eval printed nothing for minutes)
    results: list[Any] = [None] * len(prompt_ids)
    with tqdm(total=len(prompt_ids), unit="sample", desc="generating", leave=False, file=sys.stderr,
              disable=not progress) as bar:  # fmt: skip
        for i, r in engine.generate_stream(prompt_ids, seeds):
            results[i] = r
            bar.update()
    decode = lambda ids: decode_response(tokenizer, ids)  # noqa: E731
    return results, [_cut_and_decode(r, decode, list(stop_strings)) for r in results]


def make_engine(model: Any, tokenizer: Any, generation: GenerationConfig, device: str | None = None):
    """A :class:`RolloutEngine` stopping where the rollouts stop (``stop_token_ids`` + EOS)."""
    stop = rollout_stop_token_ids(generation, tokenizer)
    return RolloutEngine(model, generation.model_copy(update={"stop_token_ids": stop}), device=device)


def generate_samples(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    generation: GenerationConfig,
    *,
    num_samples: int = 1,
    seed: int = 0,
    device: str | None = None,
    progress: bool = False,
) -> list[list[str]]:
    """``num_samples`` responses to each prompt text (the chat template applied when the tokenizer
    has one). Sample j of prompt i uses the seed ``sample_seed(seed, i, j)``, so the output is
    reproducible. ``progress``: a progress bar on stderr. Returns one list of texts per prompt
    (all of them in memory: :func:`stream_samples` hands them over as they finish)."""
    texts: list[list[str]] = [[] for _ in prompts]
    for i, _, text in stream_samples(model, tokenizer, prompts, generation, num_samples=num_samples, seed=seed,
                                     device=device, progress=progress):
        texts[i].append(text)
    return texts


def stream_samples(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    generation: GenerationConfig,
    *,
    num_samples: int = 1,
    seed: int = 0,
    device: str | None = None,
    progress: bool = False,
    chat_template: bool | None = None,
) -> Iterator[tuple[int, int, str]]:
    """(prompt number i, sample number j, text) for ``num_samples`` responses to each prompt, in
    prompt-major order, each as soon as it and every sample before it are done, so a caller can
    write results while the rest are generated. The engine gets :data:`STREAM_CHUNK_SAMPLES`
    samples at a time, so the memory held stays bounded however many are asked for. Seeds as in
    :func:`generate_samples`. ``chat_template``: as the task option (:func:`~splitrl.tasks.encode_prompt`:
    True the tokenizer's template, False the plain text, None the template when there is one).

    Raises:
        ValueError: (before anything is generated) ``num_samples`` < 1, a prompt has characters
            the tokenizer cannot spell, or ``chat_template=True`` and the tokenizer has none.
    """
    from tqdm.auto import tqdm

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    ids = [encode_prompt(TaskPrompt(index=i, text=p, answer=""), tokenizer, chat_template) for i, p in enumerate(prompts)]
    unk = getattr(tokenizer, "unk_token_id", None)
    for p, row in zip(prompts, ids):
        if unk is not None and unk in row:
            # the model would see <unk> where the user typed text: refuse, as training's preflight does
            spelt = set(tokenizer.convert_ids_to_tokens(range(len(tokenizer))))
            odd = sorted({c for c in p if c not in spelt})
            which = f" ({', '.join(map(repr, odd))})" if odd and len(spelt) < 1000 else ""  # a character tokenizer
            raise ValueError(
                f"prompt {p!r} has characters the tokenizer cannot spell{which} (they would become its unknown "
                "token); use only characters of the tokenizer's vocabulary (for a character tokenizer: "
                "tokenizer.charset)"
            )
    engine = make_engine(model, tokenizer, generation, device)
    decode = lambda ids: decode_response(tokenizer, ids)  # noqa: E731
    stop_strings = list(generation.stop_strings)
    total = len(prompts) * num_samples
    with tqdm(total=total, unit="sample", desc="generating", leave=False, file=sys.stderr,
              disable=not progress) as bar:  # fmt: skip
        for first in range(0, total, STREAM_CHUNK_SAMPLES):
            owners = [divmod(k, num_samples) for k in range(first, min(first + STREAM_CHUNK_SAMPLES, total))]
            finished: list[Any] = [None] * len(owners)
            ready = 0  # samples of this chunk handed over, in order
            for k, r in engine.generate_stream([ids[i] for i, _ in owners],
                                               [sample_seed(seed, i, j) for i, j in owners]):  # fmt: skip
                finished[k] = r
                bar.update()
                while ready < len(owners) and finished[ready] is not None:
                    text = _cut_and_decode(finished[ready], decode, stop_strings)
                    finished[ready] = None  # handed over: not kept
                    yield (*owners[ready], text)
                    ready += 1


def sample_and_score(
    model: Any,
    tokenizer: Any,
    task: Task,
    generation: GenerationConfig,
    prompt_indices: Sequence[int],
    *,
    num_samples: int = 1,
    seed: int = 0,
    device: str | None = None,
    correct_threshold: float = 1.0,
    reward_timeout_s: float = 5.0,
    scorer: RewardScorer | None = None,
    progress: bool = False,
) -> tuple[list[EvalSample], int, int]:
    """Generate and score ``num_samples`` responses per prompt index (see :func:`evaluate`).

    ``scorer``: a started :class:`RewardScorer` of ``task`` to reuse (a generation worker's);
    default: one started and closed for this call. ``progress``: a progress bar on stderr.

    Returns:
        (samples in prompt-major order, drafted tokens, accepted tokens) — the counts are 0
        without speculative decoding.

    Raises:
        ValueError: no prompt indices, or ``num_samples`` < 1.
    """
    if not prompt_indices:
        raise ValueError("evaluation needs at least one prompt index")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    engine = make_engine(model, tokenizer, generation, device)
    prompts = [task.get_prompt(i) for i in prompt_indices]
    ids = [encode_prompt(p, tokenizer, getattr(task.config, "chat_template", None)) for p in prompts]
    owners = [(g, j) for g in range(len(prompts)) for j in range(num_samples)]
    flat = [ids[g] for g, _ in owners]
    seeds = [sample_seed(seed, prompt_indices[g], j) for g, j in owners]
    results, texts = _generate(engine, tokenizer, flat, seeds, generation.stop_strings, progress)
    owned = scorer is None
    if owned:
        scorer = RewardScorer(task, timeout_s=reward_timeout_s)
        scorer.start()
    try:
        rewards = scorer.score([prompts[g] for g, _ in owners], texts)
    finally:
        if owned:
            scorer.close()
    samples = [
        EvalSample(
            prompt_index=prompt_indices[g], sample_index=j, prompt=prompts[g].text, answer=prompts[g].answer,
            response=text, reward=float(rew.reward), correct=float(rew.reward) >= correct_threshold,
            response_len=len(res.response_ids), finish_reason=res.finish_reason, reward_timed_out=rew.timed_out,
        )
        for (g, j), res, text, rew in zip(owners, results, texts, rewards)
    ]
    drafted = sum(getattr(r, "drafted_tokens", 0) for r in results)
    accepted = sum(getattr(r, "accepted_tokens", 0) for r in results)
    return samples, drafted, accepted


def summarize(
    samples: Sequence[EvalSample],
    num_samples: int,
    ks: Sequence[int] = (1,),
    prefix: str = "eval/",
    drafted: int = 0,
    accepted: int = 0,
) -> dict[str, float]:
    """The metrics of scored samples (any order; ``num_samples`` per prompt index).

    Returns ``{prefix}reward_mean``, ``{prefix}pass@{k}`` for each k <= ``num_samples``,
    ``{prefix}response_length_mean`` (tokens), ``{prefix}truncation_rate`` (share cut at
    ``max_new_tokens``), ``{prefix}reward_timeout_rate``, ``{prefix}num_prompts``,
    ``{prefix}num_samples``, and ``{prefix}acceptance_rate`` (percent) when tokens were drafted.

    Raises:
        ValueError: no samples, or a prompt without exactly ``num_samples`` samples.
    """
    if not samples:
        raise ValueError("summarize needs at least one sample")
    by_prompt: dict[int, list[EvalSample]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_index, []).append(s)
    wrong = {i: len(v) for i, v in by_prompt.items() if len(v) != num_samples}
    if wrong:
        raise ValueError(f"every prompt needs {num_samples} samples; got {wrong}")
    n_total = len(samples)
    metrics = {
        f"{prefix}reward_mean": sum(s.reward for s in samples) / n_total,
        f"{prefix}response_length_mean": sum(s.response_len for s in samples) / n_total,
        f"{prefix}truncation_rate": sum(s.finish_reason == "length" for s in samples) / n_total,
        f"{prefix}reward_timeout_rate": sum(s.reward_timed_out for s in samples) / n_total,
        f"{prefix}num_prompts": float(len(by_prompt)),
        f"{prefix}num_samples": float(num_samples),
    }
    correct = [sum(s.correct for s in group) for group in by_prompt.values()]
    for k in sorted(set(ks)):
        if 1 <= k <= num_samples:
            metrics[f"{prefix}pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in correct) / len(correct)
    if drafted:
        metrics[f"{prefix}acceptance_rate"] = 100.0 * accepted / drafted
    return metrics


def evaluate(
    model: Any,
    tokenizer: Any,
    task: Task,
    generation: GenerationConfig,
    prompt_indices: Sequence[int],
    *,
    num_samples: int = 1,
    ks: Sequence[int] = (1,),
    seed: int = 0,
    device: str | None = None,
    correct_threshold: float = 1.0,
    reward_timeout_s: float = 5.0,
    prefix: str = "eval/",
    scorer: RewardScorer | None = None,
    progress: bool = False,
) -> EvalResult:
    """Generate ``num_samples`` responses for each of the task's ``prompt_indices`` and score them.

    Args:
        model: a :class:`~splitrl.models.PolicyModel`.
        tokenizer: the policy's tokenizer.
        task: prompts by index and the scorer.
        generation: sampling rules (``top_k=1`` for greedy decoding).
        prompt_indices: which prompts (use indices the training run never drew: see
            :func:`splitrl.eval_config.heldout_indices`).
        num_samples: n, samples per prompt.
        ks: the k of each pass@k; those above n are left out.
        seed: seeds of the samples (``sample_seed(seed, prompt index, sample index)``).
        correct_threshold: a sample is correct when its reward >= this (rewards lie in [0, 1]).
        scorer: a started scorer of ``task`` to reuse (default: one for this call).
        progress: show a progress bar of the samples on stderr (the CLI does).

    Returns:
        :class:`EvalResult`: the metrics of :func:`summarize` and every sample.

    Raises:
        ValueError: no prompt indices, or ``num_samples`` < 1.
    """
    samples, drafted, accepted = sample_and_score(
        model, tokenizer, task, generation, prompt_indices, num_samples=num_samples, seed=seed, device=device,
        correct_threshold=correct_threshold, reward_timeout_s=reward_timeout_s, scorer=scorer, progress=progress,
    )
    return EvalResult(summarize(samples, num_samples, ks, prefix, drafted, accepted), samples)
