"""A generation worker: samples groups, scores them next to generation and puts their tensors in
the data plane; the controller gets back light :class:`~splitrl.types.Group` records (DESIGN §4).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import torch

from splitrl.dataplane import DataPlane
from splitrl.models import ModelConfig, PolicyModel
from splitrl.models.hf_files import rollout_stop_token_ids
from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout.sampling import sample_seed
from splitrl.rollout.text import cut_at_stop_string, decode_response
from splitrl.tasks import RewardScorer, encode_prompt, make_task
from splitrl.tasks.tokenizer import TokenizerConfig
from splitrl.types import Group, SampleMeta


def load_tokenizer(config: TokenizerConfig, model_path: str | None = None):
    """Build the tokenizer. Raises ValueError when a pretrained one has no directory."""
    if config.kind == "char":
        from splitrl.tasks import build_char_tokenizer

        return build_char_tokenizer(config.charset)
    from transformers import AutoTokenizer

    from splitrl.models.gguf import resolve_model_path

    path = config.path or model_path
    if path is None:
        raise ValueError("tokenizer.kind='pretrained' needs tokenizer.path (or model.pretrained_path)")
    return AutoTokenizer.from_pretrained(resolve_model_path(path))


def sample_id(prompt_index: int, sample_index: int, version: int) -> str:
    return f"p{prompt_index}-s{sample_index}-v{version}"


class GenerationWorker:
    """Owns a rollout engine, a task and its scorer.

    Args:
        model_config: the policy's architecture (weights arrive by :meth:`load_weights`).
        generation: sampling rules; the tokenizer's EOS is added to ``stop_token_ids``.
        task_config: the task (prompts by index, scorer).
        tokenizer_config: the tokenizer.
        data_plane: where the samples' tensors go.
        run_seed: seed of the run (per-sample seeds derive from it).
        reward_timeout_s: time limit of one answer check.
        mask_truncated: samples cut at the length limit get ``sample_mask = 0``.
        device / dtype: where and in which dtype rollouts run.
        torch_threads: intra-op threads of this process (None: torch's default).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        generation: GenerationConfig,
        task_config,
        tokenizer_config: TokenizerConfig,
        data_plane: DataPlane,
        run_seed: int = 0,
        reward_timeout_s: float = 5.0,
        mask_truncated: bool = False,
        device: str = "cpu",
        dtype: str = "fp32",
        torch_threads: int | None = None,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.tokenizer = load_tokenizer(tokenizer_config, model_config.pretrained_path)
        vocab = model_config.backbone.get("vocab_size") if model_config.pretrained_path is None else None
        if vocab is not None and vocab < len(self.tokenizer):
            raise ValueError(
                f"model vocab_size={vocab} is smaller than the tokenizer's {len(self.tokenizer)} tokens; "
                f"set model.backbone.vocab_size >= {len(self.tokenizer)}"
            )
        stop = rollout_stop_token_ids(generation, self.tokenizer, model_config.pretrained_path)
        self.generation = generation.model_copy(update={"stop_token_ids": stop})
        model = PolicyModel.from_config(model_config)
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        self.engine = RolloutEngine(model, self.generation, device=device)
        self.task = make_task(task_config)
        self.scorer = RewardScorer(self.task, timeout_s=reward_timeout_s)
        self.scorer.start()
        self.data_plane = data_plane
        self.run_seed = run_seed
        self.mask_truncated = mask_truncated
        # weights received through the weight-sync group, waiting for the next call
        self._staging_lock = threading.Lock()
        self._staged_version: int | None = None
        self._staging: torch.Tensor | None = None

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version if self._staged_version is None else self._staged_version

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """Weight sync from the trainer (MTP tensors included), through Ray's object store or
        in-process; returns the new version."""
        ref = next(self.engine.model.parameters())
        self.engine.load_state_dict(
            {k: v.to(device=ref.device, dtype=ref.dtype) for k, v in state_dict.items()}, version
        )
        return version

    def weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """CPU copies of the engine's weights (MTP included) and their policy version: what
        generation samples with (for checks and debugging; a sync never needs it)."""
        self._apply_staged_weights()
        return {
            k: v.detach().cpu().clone() for k, v in self.engine.model.state_dict().items()
        }, self.engine.policy_version

    def weight_layout(self):
        """The :class:`~splitrl.distributed.weight_sync.WeightLayout` a sync into this engine carries."""
        from splitrl.distributed.weight_sync import WeightLayout

        return WeightLayout.of(self.engine.weight_tensors())

    def join_weight_sync(
        self, host: str, port: int, rank: int, world_size: int, layout, bucket_bytes: int, timeout_s: float
    ) -> str:
        """Join the weight-sync group as ``rank`` (>= 1; rank 0 is train rank 0); blocks until
        every member joins. Allocates the staging buffer (one more copy of the engine's weights,
        in its dtype, on its device). Returns the backend (``nccl`` / ``gloo``).

        Raises:
            ValueError: ``layout`` is not this engine's (another model config).
        """
        from splitrl.distributed.weight_sync import WeightSyncGroup

        if self.weight_layout() != layout:
            raise ValueError(
                "weight sync: this generation worker's model differs from the others'; every worker builds the same model config"
            )
        device = self._ensure_staging(bucket_bytes)
        self._sync_group = WeightSyncGroup(host, port, rank, world_size, device.type, timeout_s=timeout_s)
        # the receive runs on a stream of its own: the generation kernels queued meanwhile on
        # the engine's stream do not wait for the broadcast
        self._sync_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        return self._sync_group.backend

    def _ensure_staging(self, bucket_bytes: int) -> torch.device:
        """Allocate the staging buffer once (one more copy of the engine's weights, in its
        dtype, on its device); returns the device."""
        device = next(self.engine.model.parameters()).device
        if self._staging is None:
            self._sync_layout, self._sync_bucket_bytes = self.weight_layout(), bucket_bytes
            self._staging = torch.empty(
                self._sync_layout.staging_nbytes(bucket_bytes), dtype=torch.uint8, device=device
            )
        return device

    def stage_weights(self, source: torch.nn.Module, version: int, bucket_bytes: int) -> int:
        """Colocated weight sync: copy the trainer's ``source`` (in this process, on this
        device; FSDP2 shards gathered tensor by tensor, so every train rank calls this at once)
        into the staging buffer, beside a generation call that may be running; the engine
        switches to them at the start of its next call. Returns the bytes staged.

        Raises:
            ValueError: the trainer's tensors do not match the engine's (nothing is staged).
        """
        from splitrl.distributed.weight_sync import stage_weights

        with self._staging_lock:
            self._staged_version = None
            device = self._ensure_staging(bucket_bytes)
            n = stage_weights(self._sync_layout, source, self._staging, self._sync_bucket_bytes)
            if device.type == "cuda":
                # the trainer may change its weights as soon as this returns
                torch.cuda.current_stream(device).synchronize()
            self._staged_version = version
        return n

    def receive_weights(self, version: int) -> int:
        """Split weight sync: receive the buckets broadcast by train rank 0 into the
        staging buffer, beside generation (Ray runs this call in a concurrency group of its
        own); the engine switches to them at the start of its next call (MTP tensors included).
        Returns ``version``."""
        import contextlib

        from splitrl.distributed.weight_sync import receive_weights

        with self._staging_lock:
            self._staged_version = None
            stream = self._sync_stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                receive_weights(self._sync_group, self._sync_layout, self._staging, self._sync_bucket_bytes)
            if stream is not None:
                stream.synchronize()
            self._staged_version = version
        return version

    def _apply_staged_weights(self) -> None:
        """Copy weights staged by :meth:`receive_weights` / :meth:`stage_weights` into the engine
        (in place, between two calls: never inside a sample)."""
        if self._staged_version is None:
            # nothing staged, or a receive in progress: this call was issued before that sync
            # finished, so it runs with the weights it was issued under
            return
        from splitrl.distributed.weight_sync import apply_staged

        with self._staging_lock:
            if self._staged_version is None:
                return
            apply_staged(self._sync_layout, self._staging, self.engine.weight_tensors(), self._sync_bucket_bytes)
            self.engine.weights_updated(self._staged_version)
            self._staged_version = None

    def _decode(self, ids: list[int]) -> str:
        return decode_response(self.tokenizer, ids)

    def prompt_of(self, prompt_index: int):
        n = self.task.num_prompts
        return self.task.get_prompt(prompt_index % n if n else prompt_index)

    def generate_groups(
        self, prompt_indices: list[int], group_size: int, on_group: Callable[[Group], None] | None = None
    ) -> tuple[list[Group], dict[str, float]]:
        """Generate, score and store ``group_size`` samples for each prompt index.

        Each group is scored and put in the data plane as soon as its last sample finishes (the
        engine refills slots as samples end), and handed to ``on_group`` right then.

        Returns:
            (groups in the order of ``prompt_indices``, rollout metrics of the call).
        """
        metrics: dict[str, float] = {}
        groups: list[Group | None] = [None] * len(prompt_indices)
        for g, group in self._finished_groups(prompt_indices, group_size, metrics):
            groups[g] = group
            if on_group is not None:
                on_group(group)
        return groups, metrics  # type: ignore[return-value]

    def generate_groups_stream(self, prompt_indices: list[int], group_size: int) -> Iterator[Group | dict[str, float]]:
        """:meth:`generate_groups` as a generator, for a Ray streaming call (``num_returns=
        "streaming"``): yields each group as soon as its last sample finishes (in finishing
        order), then the call's rollout metrics (a dict) as the last item. A Ray worker's groups
        reach the controller while its call still generates, as an in-process worker's do
        through ``on_group``."""
        metrics: dict[str, float] = {}
        for _, group in self._finished_groups(prompt_indices, group_size, metrics):
            yield group
        yield metrics

    def _finished_groups(
        self, prompt_indices: list[int], group_size: int, metrics: dict[str, float]
    ) -> Iterator[tuple[int, Group]]:
        """Yield ``(position in prompt_indices, group)`` as each group finishes; fill ``metrics``
        with the call's rollout metrics once the last one has."""
        self._apply_staged_weights()
        t0 = time.perf_counter()
        version = self.engine.policy_version
        prompts = [self.prompt_of(i) for i in prompt_indices]
        prompt_ids = [encode_prompt(p, self.tokenizer, self.task.config.chat_template) for p in prompts]
        max_pos = getattr(self.engine.model.config, "max_position_embeddings", None)
        for i, ids in zip(prompt_indices, prompt_ids):
            if max_pos is not None and len(ids) + self.generation.max_new_tokens > max_pos:
                # preflight checks a generated task's first prompts only; name this one, not its batch slot
                raise ValueError(
                    f"prompt {i} of the task ({len(ids)} tokens) + rollout.max_new_tokens="
                    f"{self.generation.max_new_tokens} exceeds the model's max_position_embeddings={max_pos}; "
                    "lower rollout.max_new_tokens or make the task's prompts shorter"
                )
        flat_ids, seeds, owners = [], [], []
        for g, (i, ids) in enumerate(zip(prompt_indices, prompt_ids)):
            for j in range(group_size):
                flat_ids.append(ids)
                seeds.append(sample_seed(self.run_seed, i, j))
                owners.append((g, j))
        results: list = [None] * len(flat_ids)
        pending = [group_size] * len(prompt_indices)
        timeouts = errors = 0
        score_s = 0.0
        for k, res in self.engine.generate_stream(flat_ids, seeds):
            results[k] = res
            g = owners[k][0]
            pending[g] -= 1
            if pending[g]:
                continue
            t_score = time.perf_counter()
            group, n_timeouts, n_errors = self._finish_group(
                prompt_indices[g], prompts[g], prompt_ids[g], results[g * group_size : (g + 1) * group_size], version
            )
            score_s += time.perf_counter() - t_score
            timeouts += n_timeouts
            errors += n_errors
            yield g, group
        gen_s = time.perf_counter() - t0 - score_s
        stats = results[0].stats if results else None
        metrics.update(
            {
                "generated_tokens": float(sum(len(r.response_ids) for r in results)),
                "generation_s": gen_s,
                "scoring_s": score_s,
                "reward_timeouts": float(timeouts),
                "reward_errors": float(errors),
                "drafted_tokens": float(sum(r.drafted_tokens for r in results)),
                "accepted_tokens": float(sum(r.accepted_tokens for r in results)),
                "speculative_active": float(stats.speculative_active) if stats else 0.0,
                "num_drafts": float(stats.num_drafts) if stats else 0.0,
            }
        )
        if stats is not None and stats.draft_vocab_size:
            metrics["draft_vocab_covered"] = float(stats.draft_vocab_covered)
            metrics["draft_vocab_generated"] = float(stats.generated_tokens)
        if stats is not None and stats.speculative_active:
            for k, (a, r) in enumerate(zip(stats.accepted_per_depth, stats.reached_per_depth), start=1):
                metrics[f"accepted_depth_{k}"] = float(a)
                metrics[f"reached_depth_{k}"] = float(r)

    def _finish_group(self, prompt_index: int, prompt, p_ids: list[int], results: list, version: int):
        """Cut stop strings, score, put the samples' tensors in the data plane; returns
        (group, reward timeouts, reward errors)."""
        stops = self.generation.stop_strings
        for r in results:
            n = cut_at_stop_string(r.response_ids, self._decode, stops)
            if n is not None:
                r.response_ids, r.logprobs, r.finish_reason = r.response_ids[:n], r.logprobs[:n], "stop"
        texts = [self._decode(r.response_ids) for r in results]
        rewards = self.scorer.score([prompt] * len(results), texts)
        group = Group(
            group_id=f"p{prompt_index}-v{version}", prompt_index=prompt_index, samples=[], policy_version=version
        )
        ids_out, tm_out, lp_out, sids = [], [], [], []
        P = len(p_ids)
        for j, (res, text, rew) in enumerate(zip(results, texts, rewards)):
            R = len(res.response_ids)
            sid = sample_id(prompt_index, j, version)
            sids.append(sid)
            ids_out.append(torch.tensor(p_ids + res.response_ids, dtype=torch.long))
            tm_out.append(torch.cat([torch.zeros(P), torch.ones(R)]))
            lp_out.append(torch.cat([torch.zeros(P), torch.tensor(res.logprobs, dtype=torch.float32)]))
            truncated = res.finish_reason == "length"
            group.samples.append(
                SampleMeta(
                    sample_id=sid,
                    reward=float(rew.reward),
                    prompt_len=P,
                    response_len=R,
                    truncated=truncated,
                    policy_version=version,
                    sample_mask=0.0 if (truncated and self.mask_truncated) else 1.0,
                    reward_timed_out=rew.timed_out,
                    info={"response": text, "reward_error": rew.error},
                )
            )
        self.data_plane.put(sids, {"input_ids": ids_out, "token_mask": tm_out, "generation_logprobs": lp_out})
        timeouts = sum(r.timed_out for r in rewards)
        errors = sum(r.error is not None and not r.timed_out for r in rewards)
        return group, timeouts, errors

    def evaluate(
        self,
        task_config,
        prompt_indices: list[int],
        num_samples: int,
        seed: int,
        correct_threshold: float,
        greedy: bool,
    ) -> dict[str, tuple]:
        """Held-out evaluation with the current weights (DESIGN §5 rollouts, same engine rules).

        Args:
            task_config: the evaluated task (None: the training task).
            prompt_indices: this worker's share of the held-out prompts.
            num_samples: sampled responses per prompt; ``greedy`` adds one greedy (top_k=1) each.

        Returns:
            ``{"sampled": (samples, drafted, accepted), "greedy": (...)}`` (``greedy`` only when
            asked), as :func:`splitrl.evaluation.sample_and_score` returns them; the controller
            merges the workers' shares with :func:`splitrl.evaluation.summarize`.
        """
        from splitrl.evaluation import sample_and_score

        self._apply_staged_weights()
        task, scorer = self.task, self.scorer
        if task_config is not None and task_config != self.task.config:
            if getattr(self, "_eval_task_config", None) != task_config:
                if getattr(self, "_eval_scorer", None) is not None:
                    self._eval_scorer.close()
                self._eval_task = make_task(task_config)
                self._eval_scorer = RewardScorer(self._eval_task, timeout_s=self.scorer.timeout_s)
                self._eval_scorer.start()
                self._eval_task_config = task_config
            task, scorer = self._eval_task, self._eval_scorer
        model = self.engine.model
        device = next(model.parameters()).device
        runs = {"sampled": (self.generation, num_samples)}
        if greedy:
            runs["greedy"] = (self.generation.model_copy(update={"top_k": 1}), 1)
        return {
            name: sample_and_score(
                model,
                self.tokenizer,
                task,
                gen,
                prompt_indices,
                num_samples=n,
                seed=seed,
                device=device,
                correct_threshold=correct_threshold,
                scorer=scorer,
            )
            for name, (gen, n) in runs.items()
        }

    def close(self) -> None:
        self.scorer.close()
        if getattr(self, "_sync_group", None) is not None:
            self._sync_group.close()
        if getattr(self, "_eval_scorer", None) is not None:
            self._eval_scorer.close()

    def ping(self) -> int:
        return self.policy_version
