"""The train worker's state: full state dicts, sharded checkpoints, the restored optimizer settings.

:class:`WorkerState` is a mixin of :class:`splitrl.train.worker.TrainWorker`; it reads the
worker's ``model``, ``optimizer``, ``scheduler``, ``scaler``, ``offload``, ``checkpointer``,
``_configured_optim``, ``steps_finished``, ``updates_applied`` and ``_step`` (no state of its own).
"""

from __future__ import annotations

import torch


class WorkerState:
    """State dicts and checkpoints of :class:`~splitrl.train.worker.TrainWorker` (those that
    read or write the state refuse to run while a step is open)."""

    def state_dict(self) -> dict:
        """Full (unsharded, CPU) model + optimizer state, LR schedule, loss scaler, counters.

        Collective under data parallelism: every rank must call it.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        if self._step is not None:
            raise RuntimeError("state_dict() during an open step; finish or abort it first")
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=opts)
        # on CPU these are the live tensors: snapshot them, or later steps would change the copy
        model_sd, optim_sd = _snapshot(model_sd), _snapshot(optim_sd)
        return {"model": model_sd, "optimizer": optim_sd, **self._extra_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (collective under data parallelism)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if self._step is not None:
            raise RuntimeError("load_state_dict() during an open step; finish or abort it first")
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=opts,
        )
        self._load_extra_state(state)
        if self.offload is not None:
            self.offload.invalidate()

    # ------------------------------------------------------------------------------ sharded checkpoints
    def _extra_state(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "steps_finished": self.steps_finished,
            "updates_applied": self.updates_applied,
        }

    def _load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_configured_optim()
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.steps_finished = int(state["steps_finished"])
        self.updates_applied = int(state["updates_applied"])

    def _apply_configured_optim(self) -> None:
        """Put this run's learning rate, betas, eps and weight decay over those a checkpoint restored.

        The optimizer and schedule state of a checkpoint carry the settings of the run that wrote
        it, so a resumed run given a new learning rate trained on with the old one (a new user's
        trial: the resume warning named the change, ``train/lr`` did not move). The current LR is
        recomputed as LambdaLR does (base LR · factor(steps done)): unchanged settings give the
        restored values bit for bit, so a resumed run still equals the uninterrupted one.
        """
        steps = self.scheduler.last_epoch
        for group, conf, factor in zip(self.optimizer.param_groups, self._configured_optim, self.scheduler.lr_lambdas):
            group.update(betas=conf["betas"], eps=conf["eps"], weight_decay=conf["weight_decay"], initial_lr=conf["lr"])
            group["lr"] = conf["lr"] * factor(steps)
        self.scheduler.base_lrs = [conf["lr"] for conf in self._configured_optim]
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def save_checkpoint(self, directory: str, *, blocking: bool = False) -> float:
        """Start writing this rank's shards of the model and optimizer, and the LR schedule,
        loss scaler and counters, into ``directory`` (collective; see :mod:`splitrl.train.checkpoint`).

        Returns once the tensors are staged in CPU memory (the files follow in the background;
        :meth:`checkpoint_written` / :meth:`wait_checkpoint`); training may go on at once.

        Returns:
            seconds the call blocked.

        Raises:
            RuntimeError: a step is open, or the previous checkpoint is still being written.
        """
        if self._step is not None:
            raise RuntimeError("save_checkpoint() during an open step; finish or abort it first")
        return self.checkpointer.save(directory, self._extra_state(), blocking=blocking)

    def checkpoint_written(self) -> bool:
        """Whether the files of the last :meth:`save_checkpoint` are on disk (does not block).

        Raises:
            Exception: the background write failed (an ``OSError`` for a full disk, ...).
        """
        return self.checkpointer.done()

    def wait_checkpoint(self) -> None:
        """Block until the last :meth:`save_checkpoint` is on disk (raises its write's error)."""
        self.checkpointer.wait()

    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, from any number of ranks (collective).

        Raises:
            RuntimeError: a step is open.
            FileNotFoundError: ``directory`` holds no sharded trainer state.
        """
        if self._step is not None:
            raise RuntimeError("load_checkpoint() during an open step; finish or abort it first")
        self._load_extra_state(self.checkpointer.load(directory))
        if self.offload is not None:
            self.offload.invalidate()

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded CPU tensors of the policy under ``PolicyModel`` names (for weight sync and saving)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _snapshot(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _snapshot(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_snapshot(v) for v in tree)
    return tree
