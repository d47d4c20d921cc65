"""A data-parallel train worker as an actor: reads its samples from the data plane by id and
drives the split step of :class:`~splitrl.train.TrainWorker` (DESIGN §4).

The controller never ships token tensors to it: a chunk arrives as sample ids plus one advantage
and one sample mask per id; the tensors come from the data plane, worker-to-worker.
"""

from __future__ import annotations

import os
import time

import torch
from pydantic import BaseModel

from splitrl.dataplane import DataPlane
from splitrl.loss import make_loss
from splitrl.models import ModelConfig, PolicyModel
from splitrl.train import TrainBatch, TrainConfig, TrainWorker
from splitrl.train.microbatch import MicrobatchConfig, build_microbatches

TOKEN_FIELDS = ["input_ids", "token_mask", "generation_logprobs"]


class TrainActor:
    """One rank of the trainer.

    Args:
        model_config: how to build the policy (every rank builds the same one, same seed).
        train_config: worker config.
        loss_config: the options of the loss of every step (any registered kind, see
            :mod:`splitrl.loss.registry`), as ``RunConfig.trainer_loss_config()`` resolves them.
        data_plane: where the samples are.
        rank / world_size / master_port: torch.distributed rendezvous; with world_size 1 no
            process group is created.
        torch_threads: intra-op threads of this process (None: torch's default).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        train_config: TrainConfig,
        loss_config: BaseModel,
        data_plane: DataPlane,
        rank: int = 0,
        world_size: int = 1,
        master_port: int | None = None,
        torch_threads: int | None = None,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        if world_size > 1:
            from splitrl.distributed.utils import init_loopback_process_group

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(master_port)
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            # the workers of one host meet on loopback (the rendezvous store would listen on
            # every interface otherwise)
            init_loopback_process_group(backend, rank, world_size, master_port)
        self.rank = rank
        self.loss = make_loss(loss_config)
        self.data_plane = data_plane
        model = PolicyModel.from_config(model_config)
        self.reference: PolicyModel | None = None
        if self.loss.needs_reference_logprobs:
            # the frozen initial policy, for KL to the reference (DESIGN §5)
            self.reference = PolicyModel.from_config(
                model_config.model_copy(update={"mtp": model_config.mtp.model_copy(update={"mtp_num_layers": 0})})
            )
            self.reference.requires_grad_(False).eval()
        self.worker = TrainWorker(model, train_config)
        if self.reference is not None:
            self.reference.to(self.worker.device)
        self.busy_s = 0.0

    # ---------------------------------------------------------------------------- step calls
    def begin(self, expected_num_tokens: int | None = None) -> None:
        self.worker.begin_train_step(self.loss, expected_num_tokens=expected_num_tokens)

    def train_chunk(self, sample_ids: list[str], advantages: list[float], sample_mask: list[float]) -> dict:
        """Fetch the samples, build the chunk and run it (``train_microbatch``)."""
        t0 = time.perf_counter()
        try:
            batch = self._fetch(sample_ids, advantages, sample_mask)
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait for this one
            self.worker.train_microbatch(None, error=e)
            raise
        out = self.worker.train_microbatch(batch)
        self.busy_s += time.perf_counter() - t0
        return out

    def _fetch(self, sample_ids: list[str], advantages: list[float], sample_mask: list[float]) -> TrainBatch:
        if sample_ids:
            fields = self.data_plane.get(sample_ids, TOKEN_FIELDS)
        else:
            fields = {k: [] for k in TOKEN_FIELDS}
        batch = TrainBatch(
            input_ids=fields["input_ids"],
            token_mask=[t.float() for t in fields["token_mask"]],
            advantages=torch.tensor(advantages, dtype=torch.float32),
            sample_mask=torch.tensor(sample_mask, dtype=torch.float32),
            generation_logprobs=[t.float() for t in fields["generation_logprobs"]],
            sample_ids=list(sample_ids),
        )
        if self.reference is not None:
            batch.reference_logprobs = reference_logprobs(
                self.reference, batch, self.worker.config.microbatch, self.loss.temperature, self.worker.device
            )
        return batch

    def finish(self) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.worker.finish_train_step()
        self.busy_s += time.perf_counter() - t0
        metrics["timing/train_busy_s"] = self.busy_s
        self.busy_s = 0.0
        return metrics

    def abort(self) -> None:
        self.worker.abort_train_step()
        self.busy_s = 0.0

    # ---------------------------------------------------------------------------- weights
    def policy_state_dict(self, to_cpu: bool = True) -> dict[str, torch.Tensor]:
        """Full policy tensors (MTP included) under ``PolicyModel`` names (collective).

        ``to_cpu=False`` (one rank, generation in the same process) hands over the live device
        tensors: the receiver copies them, and no step runs during a sync.
        """
        if not to_cpu and not self.worker.distributed:
            return {k: v.detach() for k, v in self.worker.model.state_dict().items()}
        return self.worker.full_model_state_dict()

    def stage_weights_into(self, workers: list, version: int, bucket_bytes: int) -> int:
        """In-process weight sync (``cluster.backend: local``): stage this rank's policy into the
        :class:`~splitrl.workers.generation.GenerationWorker` objects of this process, on the
        device, beside their generation calls; each engine takes them at its next call. Runs on
        this actor's thread (no train call runs meanwhile). Returns the bytes staged per worker.
        """
        n = 0
        for w in workers:
            n = w.stage_weights(self.worker.model, version, bucket_bytes)
        return n

    # ------------------------------------------------------------------ weight-sync group (split)
    def open_weight_sync(self, loopback: bool, layout) -> tuple[str, int]:
        """Rank 0: check that the generation engines' ``layout`` (a
        :class:`~splitrl.distributed.weight_sync.WeightLayout`) matches this policy, then listen
        for the weight-sync group's store on 127.0.0.1 (``loopback``) or this node's IP. Returns
        (host, port) for the generation workers.

        Raises:
            ValueError: the layouts differ (nothing is opened).
        """
        from splitrl.distributed.weight_sync import listen_socket, unique_tensors

        layout.check_sender(unique_tensors(self.worker.model.state_dict(keep_vars=True)))
        if loopback:
            host = "127.0.0.1"
        else:
            import ray

            host = ray.util.get_node_ip_address()
        self._sync_sock, port = listen_socket(host)
        return host, port

    def join_weight_sync(
        self, host: str, port: int, world_size: int, layout, bucket_bytes: int, timeout_s: float
    ) -> str:
        """Every rank: remember the layout (each takes part in the FSDP2 gathers of a sync);
        rank 0 also builds the weight-sync group as its rank 0 (blocks until the generation
        workers join). Returns the group's backend (``nccl`` / ``gloo``; ``none`` on other ranks)."""
        from splitrl.distributed.weight_sync import WeightSyncGroup

        self._sync_layout, self._sync_bucket_bytes = layout, bucket_bytes
        self._sync_group = None
        if self.rank != 0:
            return "none"
        sock, self._sync_sock = self._sync_sock, None
        device = "cuda" if self.worker.device.type == "cuda" else "cpu"
        self._sync_group = WeightSyncGroup(host, port, 0, world_size, device, listen_sock=sock, timeout_s=timeout_s)
        return self._sync_group.backend

    def broadcast_weights(self) -> int:
        """Send the policy (MTP included) to the generation workers through the weight-sync
        group (every rank calls it: FSDP2 shards are gathered tensor by tensor). Returns bytes."""
        from splitrl.distributed.weight_sync import send_weights

        return send_weights(self._sync_group, self._sync_layout, self.worker.model, self._sync_bucket_bytes)

    def state_dict(self) -> dict:
        return self.worker.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.worker.load_state_dict(state)

    def save_checkpoint(self, path: str, blocking: bool = False) -> float:
        """Start writing this rank's shards into the checkpoint directory ``path`` (collective;
        returns after the staging copy, seconds blocked). See :mod:`splitrl.train.checkpoint`."""
        return self.worker.save_checkpoint(path, blocking=blocking)

    def checkpoint_written(self) -> bool:
        """Whether this rank's files of the last checkpoint are on disk (never blocks; raises
        the background write's error)."""
        return self.worker.checkpoint_written()

    def load_checkpoint(self, path: str) -> None:
        """Load a sharded checkpoint written by any number of ranks (collective)."""
        self.worker.load_checkpoint(path)

    def save_pretrained(self, path: str) -> None:
        """Write the policy as a Hugging Face directory with MTP heads (rank 0 writes; collective)."""
        from splitrl.models.checkpoint import checkpoint_tensors, save_pretrained

        sd = self.worker.full_model_state_dict()
        if self.rank == 0:
            tied = getattr(self.worker.model.config, "tie_word_embeddings", False)
            save_pretrained(self.worker.model, path, state_dict=checkpoint_tensors(sd, tied))

    def ping(self) -> int:
        return self.rank


@torch.no_grad()
def reference_logprobs(
    model: PolicyModel, batch: TrainBatch, mb_config: MicrobatchConfig, temperature: float, device
) -> list[torch.Tensor]:
    """Logprobs [L_i] of each sample's tokens under ``model`` (the frozen reference policy)."""
    out = [torch.zeros(n) for n in batch.lengths]
    if not len(batch):
        return out
    starts = 0
    for mb in build_microbatches(batch, mb_config):
        mbd = mb.to(device)
        lp = model(mbd.input_ids, mbd.segment_ids, mbd.position_ids, temperature=temperature).logprobs.float().cpu()
        for r in range(mb.input_ids.shape[0]):
            for local in mb.sample_index[r].unique().tolist():
                if local < 0:
                    continue
                sel = mb.sample_index[r] == local
                out[starts + local] = lp[r][sel]
        starts += mb.num_samples
    return out
