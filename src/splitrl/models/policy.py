"""The policy: a Hugging Face causal LM backbone plus the MTP block of DESIGN.md §3.

Legend: B = rows, S = positions, H = hidden size, V = vocabulary, D = MTP depths.

Rows may be packed: ``segment_ids`` [B, S] numbers the samples of a row (0, 1, ...; -1 marks
padding). Attention is causal within a sample, positions restart at 0 for every sample, and no
prediction (main or MTP) crosses from one sample into the next.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from splitrl.models.attention import packed_attention_mask
from splitrl.models.backbone_checks import backbone_hf_config
from splitrl.models.checkpoint import _mtp_mismatch, read_mtp_tensors, save_pretrained, verify_pretrained
from splitrl.models.config import SIZE_KEYS, TINY_BACKBONE, ModelCapabilities, ModelConfig, MTPConfig
from splitrl.models.families import Family, family_of
from splitrl.models.gguf import resolve_model_path
from splitrl.models.head import distill_kl, target_logprobs
from splitrl.models.moe import router_statistics
from splitrl.models.mtp import MTPBlock, mtp_state_from_checkpoint, warm_start_from_backbone

log = logging.getLogger(__name__)

# a backbone whose missing size keys (transformers' full-size defaults) make it more than
# DEFAULTED_SIZE_FACTOR times the model those keys give in the tiny default, and larger than
# DEFAULTED_SIZE_FLOOR parameters, is refused; one that gives every size key is built at any size
DEFAULTED_SIZE_FACTOR = 10
DEFAULTED_SIZE_FLOOR = 100_000_000


def _meta_parameter_count(hf_cfg) -> int:
    with torch.device("meta"):  # shapes only: no memory, ~25 ms
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_cfg).parameters())


def check_defaulted_size(config: ModelConfig, hf_cfg) -> list[str]:
    """Refuse a backbone that transformers' defaults for its missing size keys make large.

    ``ModelConfig(backbone={})`` used to build ``Qwen3Config()``'s 12 B parameters, and the
    process was killed for memory with no message. Only a backbone that lacks a key of
    ``SIZE_KEYS`` is counted (on the meta device): it is refused when the defaults make it more
    than ``DEFAULTED_SIZE_FACTOR`` times the model with those keys from ``TINY_BACKBONE`` and over
    ``DEFAULTED_SIZE_FLOOR`` parameters. So a 0.6 B shape without ``vocab_size`` still builds
    (1.4x), and so does the tiny one without ``intermediate_size`` (8.5 M), while ``{}`` (12 B)
    and ``{vocab_size: 64}`` (10.8 B) do not.

    Args:
        config: the model config (``backbone`` as the user gave it).
        hf_cfg: the transformers config built from it.

    Returns:
        The keys of ``SIZE_KEYS`` the backbone lacks (empty for a ``pretrained_path``) when
        the model is not refused.

    Raises:
        ValueError: the keys and the defaults they got, the two sizes, and how to fix it.
    """
    if config.pretrained_path is not None:
        return []
    missing = [k for k in SIZE_KEYS if k not in config.backbone]
    if not missing:
        return missing
    count = _meta_parameter_count(hf_cfg)
    if count <= DEFAULTED_SIZE_FLOOR:
        return missing
    meant = _meta_parameter_count(type(hf_cfg)(**config.backbone_kwargs(), **{k: TINY_BACKBONE[k] for k in missing}))
    if count > DEFAULTED_SIZE_FACTOR * meant:
        used = ", ".join(f"{k}={getattr(hf_cfg, k)}" for k in missing)
        raise ValueError(
            f"model.backbone lacks {', '.join(missing)}: transformers' {config.family} defaults ({used}) make a "
            f"{count / 1e9:.2f} B-parameter model ({meant / 1e6:.1f} M with the tiny default's values). Give them in "
            f"model.backbone (every one of {', '.join(SIZE_KEYS)}; the tiny default is "
            "splitrl.models.config.TINY_BACKBONE), or load a model with pretrained_path"
        )
    return missing


@dataclass
class PolicyOutput:
    """What one forward returns (everything fp32).

    Attributes:
        logprobs: [B, S] logprob of token t (predicted from t-1) under softmax(logits / T);
            0 where t is the first token of a sample or padding.
        entropy: [B, S] entropy of the distribution that predicts token t (zeros unless asked).
        mtp_loss_sums: D scalars, Σ_t ℓ_k(t)·mask_k(t) — raw sums of the MTP objective
            (``mtp_objective``: ℓ = CE on the target token, or KL(p̄ ‖ q_k)), differentiable when
            the MTP branch trains (λ > 0 and grad enabled).
        mtp_hit_sums: D scalars, Σ_t [argmax = target]·mask_k(t) (not differentiable).
        mtp_counts: D scalars, Σ_t mask_k(t).
        moe_aux: MoE backbones: L_aux of this forward's rows (:mod:`splitrl.models.moe`), fp32
            scalar, differentiable; None otherwise.
        moe_load_max: MoE backbones: busiest expert's share of assignments (no gradient).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mtp_loss_sums: list[torch.Tensor] = field(default_factory=list)
    mtp_hit_sums: list[torch.Tensor] = field(default_factory=list)
    mtp_counts: list[torch.Tensor] = field(default_factory=list)
    moe_aux: torch.Tensor | None = None
    moe_load_max: torch.Tensor | None = None


# FSDP2 finds the tensors of a module's output by pytree flattening; registering the dataclass
# lets it hook the root's backward on our outputs.
torch.export.register_dataclass(PolicyOutput)


def _shift_left(x: torch.Tensor, n: int, value: float = 0) -> torch.Tensor:
    """x[:, t + n] at position t, ``value`` past the row end; same shape as x ([B, S] or [B, S, H])."""
    n = min(n, x.shape[1])
    pad = (0, 0, 0, n) if x.dim() == 3 else (0, n)
    return F.pad(x[:, n:], pad, value=value)


def _logprobs_at(
    select_N: torch.Tensor, hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, **kw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``target_logprobs`` at the selected positions only, scattered back to [N] (0 elsewhere)."""
    return _head_at(target_logprobs, select_N, (hidden_NH,), weight_VH, targets_N, **kw)


def _distill_at(
    select_N: torch.Tensor,
    student_NH: torch.Tensor,
    teacher_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``distill_kl`` at the selected positions only, scattered back to [N] (0 elsewhere)."""
    return _head_at(distill_kl, select_N, (student_NH, teacher_NH), weight_VH, targets_N, **kw)


def _head_at(fn, select_N: torch.Tensor, hiddens: tuple[torch.Tensor, ...], weight_VH, targets_N, **kw) -> tuple:
    """``fn(*hiddens[idx], weight, targets[idx])`` at the selected positions, scattered to [N].

    With nothing selected, one position is still computed and multiplied by 0: the output head
    must take part in every backward (FSDP2 reduce-scatters per microbatch on every rank).
    """
    idx = select_N.nonzero().squeeze(-1)
    scale = 1.0
    if idx.numel() == 0:
        idx = torch.zeros(1, dtype=torch.long, device=select_N.device)
        scale = 0.0
    outs = fn(*(h[idx] for h in hiddens), weight_VH, targets_N[idx], **kw)
    full = []
    for o in outs:
        z = o.new_zeros(select_N.shape[0])
        full.append(z.index_put((idx,), o * scale))
    return tuple(full)  # type: ignore[return-value]


def _one_sample_per_row_right_padded(segment_ids_BS: torch.Tensor) -> bool:
    valid = segment_ids_BS >= 0
    return bool((segment_ids_BS <= 0).all()) and bool((valid[:, 1:] <= valid[:, :-1]).all())


def positions_from_segments(segment_ids_BS: torch.Tensor) -> torch.Tensor:
    """Position ids [B, S] that restart at 0 for each sample of a packed row (padding: 0)."""
    B, S = segment_ids_BS.shape
    idx = torch.arange(S, device=segment_ids_BS.device).expand(B, S)
    starts = torch.ones_like(segment_ids_BS, dtype=torch.bool)
    starts[:, 1:] = segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    pos = idx - start_idx
    return torch.where(segment_ids_BS >= 0, pos, torch.zeros_like(pos))


def build_attention_mask(segment_ids_BS: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """4D mask [B, 1, S, S]: causal within a sample; a padding position attends only to itself.

    ``sdpa`` takes a boolean mask (True = attend); ``eager`` adds a float mask to the scores.
    """
    S = segment_ids_BS.shape[1]
    q = segment_ids_BS[:, :, None]
    k = segment_ids_BS[:, None, :]
    causal = torch.ones(S, S, dtype=torch.bool, device=segment_ids_BS.device).tril()
    allowed = (q == k) & causal
    allowed |= torch.eye(S, dtype=torch.bool, device=segment_ids_BS.device)  # no empty softmax rows
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    zero = torch.zeros((), dtype=dtype, device=segment_ids_BS.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


class PolicyModel(nn.Module):
    """Causal LM backbone + D MTP depths.

    Args:
        backbone: a transformers ``*ForCausalLM`` of a family of :data:`splitrl.models.families.FAMILIES`.
        mtp: the MTP knobs; D = 0 builds no MTP module at all.
        capabilities: flags that travel unchanged to the microbatch builder.

    Raises:
        ValueError: unsupported backbone family.
    """

    def __init__(
        self,
        backbone: PreTrainedModel,
        mtp: MTPConfig | None = None,
        capabilities: ModelCapabilities | None = None,
    ) -> None:
        super().__init__()
        family_of(backbone.config)  # ValueError for a family splitrl does not build
        self.backbone = backbone
        self.mtp_config = mtp or MTPConfig()
        self.capabilities = capabilities or ModelCapabilities()
        self.mtp: MTPBlock | None = None
        # packed rows on CUDA: per-sample causal attention without a dense [S, S] mask
        # (``flex`` or ``varlen``, see ``splitrl.models.attention``); ``dense`` builds the mask
        self.packed_attention = "flex"
        D = self.mtp_config.mtp_num_layers
        if D > 0:
            inner = backbone.model
            self.mtp = MTPBlock(
                backbone.config,
                D,
                self.mtp_config.mtp_use_repeated_layer,
                layer_cls=type(inner.layers[0]),
                norm_cls=type(inner.norm),
            )
            self.mtp.apply(backbone._init_weights)
            if self.mtp_config.mtp_loss_scaling_factor == 0.0:
                # λ = 0: heads run for metrics only and stay out of the optimizer (DESIGN §3).
                for p in self.mtp.parameters():
                    p.requires_grad_(False)

    # ----------------------------------------------------------------------------------- build
    @classmethod
    def from_config(cls, config: ModelConfig) -> "PolicyModel":
        """Random-init model (or a local pretrained one when ``config.pretrained_path`` is set)."""
        if config.pretrained_path is not None:
            return load_pretrained(
                config.pretrained_path,
                mtp=config.mtp,
                capabilities=config.capabilities,
                attn_implementation=config.attn_implementation,
            )
        hf_cfg = backbone_hf_config(config)  # the keys and sizes, checked as the run's preflight does
        check_defaulted_size(config, hf_cfg)
        hf_cfg._attn_implementation = config.attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            backbone = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
            model = cls(backbone, config.mtp, config.capabilities)
        return model

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "PolicyModel":
        """Load a local directory (ours, or a stock Hugging Face one); see :func:`load_pretrained`."""
        return load_pretrained(path, **kwargs)

    def save_pretrained(self, path: str) -> None:
        """Write config.json + model.safetensors with the MTP tensors under ``mtp.`` (DESIGN §3)."""
        save_pretrained(self, path)

    # ------------------------------------------------------------------------------- accessors
    @property
    def config(self):
        return self.backbone.config

    @property
    def family(self) -> Family:
        """The backbone's entry in the family registry."""
        return family_of(self.config)

    @property
    def num_mtp_depths(self) -> int:
        return self.mtp_config.mtp_num_layers

    @property
    def is_moe(self) -> bool:
        return self.family.moe and (getattr(self.config, "num_experts", 0) or 0) > 0

    @property
    def moe_aux_loss_coef(self) -> float:
        """The router load-balancing loss weight (backbone config ``router_aux_loss_coef``); 0 for dense backbones."""
        return float(getattr(self.config, "router_aux_loss_coef", 0.0) or 0.0) if self.is_moe else 0.0

    @property
    def mtp_trains(self) -> bool:
        return self.num_mtp_depths > 0 and self.mtp_config.mtp_loss_scaling_factor > 0

    def mtp_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if n.startswith("mtp.")]

    def main_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if not n.startswith("mtp.")]

    @property
    def output_weight(self) -> torch.Tensor:
        return self.backbone.get_output_embeddings().weight

    @property
    def embed_tokens(self) -> nn.Module:
        return self.backbone.get_input_embeddings()

    @property
    def rotary_emb(self) -> nn.Module:
        return self.backbone.model.rotary_emb

    # --------------------------------------------------------------------------------- forward
    def _attention_mask(self, segment_ids, dtype, one_sample_per_row: bool | None):
        attn_impl = self.config._attn_implementation
        if attn_impl == "sdpa":
            if one_sample_per_row is None:
                one_sample_per_row = _one_sample_per_row_right_padded(segment_ids)  # host sync on GPU
            if one_sample_per_row:
                # plain causal attention is exact here (a real token never sees the padding after
                # it) and lets SDPA pick its fused causal kernels instead of a dense [S, S] mask
                return None
            if segment_ids.is_cuda and self.packed_attention != "dense":
                return packed_attention_mask(segment_ids, self.packed_attention)
        return build_attention_mask(segment_ids, attn_impl, dtype)

    def _backbone_hidden(self, input_ids, segment_ids, position_ids, one_sample_per_row: bool | None = None):
        """(embeddings [B, S, H], h⁰ [B, S, H] after the final norm, the attention mask used,
        the routers' logits — one [B·S, E] per MoE layer; empty for dense backbones)."""
        embeds = self.embed_tokens(input_ids)
        mask = self._attention_mask(segment_ids, embeds.dtype, one_sample_per_row)
        backbone_positions = position_ids
        if mask is None:
            # transformers reads a position-id reset as the start of a packed sample and then
            # builds a dense mask (much slower attention: bench/RESULTS.md); padding after the sample
            # keeps counting so that no reset is seen. Padding positions are never read.
            S = position_ids.shape[1]
            backbone_positions = torch.where(
                segment_ids >= 0, position_ids, torch.arange(S, device=position_ids.device).expand_as(position_ids)
            )
        moe = {"output_router_logits": True} if self.is_moe else {}
        base = self.backbone.model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=backbone_positions, use_cache=False, **moe
        )
        hidden0 = base.last_hidden_state  # after the final norm: the tensor lm_head reads
        return embeds, hidden0, mask, tuple(getattr(base, "router_logits", None) or ())

    def logits(
        self, input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, S, V] of the main head; position t predicts token t + 1.

        This materializes the whole [B, S, V] tensor: use it to inspect small batches. Training
        and logprobs go through :meth:`forward`, which never does.
        """
        if segment_ids is None:
            segment_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            position_ids = positions_from_segments(segment_ids)
        _, hidden0, _, _ = self._backbone_hidden(input_ids, segment_ids, position_ids)
        return self.backbone.get_output_embeddings()(hidden0)

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        mtp_loss_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        logprob_mask: torch.Tensor | None = None,
        one_sample_per_row: bool | None = None,
        main_grad: bool = True,
    ) -> PolicyOutput:
        """Logprobs of the given tokens and, when D > 0, the per-depth MTP raw sums.

        Args:
            input_ids: [B, S] int64.
            segment_ids: [B, S] int64 sample number within the row, -1 = padding
                (default: one sample per row, no padding).
            position_ids: [B, S] int64 (default: restart at 0 for each segment).
            mtp_loss_mask: [B, S] float, *unshifted* ``token_mask * sample_mask`` (DESIGN §3); the
                shifts are applied here, once. Required when D > 0.
            temperature: T of the sampling distribution; main logprobs are of logits / T. The
                MTP cross-entropy is at T = 1; the distillation term compares p̄ and q_k at T.
            with_entropy: also compute the (differentiable) entropy at each position.
            logprob_mask: [B, S]; when given, logprobs and entropy are computed only where it is
                nonzero (0 elsewhere), so the output head skips prompt and padding positions.
            one_sample_per_row: the caller knows that every row holds one sample, right-padded
                (True) or that rows are packed (False); None: read it from ``segment_ids`` (a
                device-to-host sync on GPU).
            main_grad: False runs the backbone and the main head without autograd (an MTP
                warm-up step with detached heads, whose policy gradient would be dropped); the
                MTP branch records its graph as usual.

        Returns:
            :class:`PolicyOutput`.

        Raises:
            ValueError: shapes disagree, or ``mtp_loss_mask`` is missing while D > 0.
        """
        B, S = input_ids.shape
        if segment_ids is None:
            segment_ids = torch.zeros_like(input_ids)
        if segment_ids.shape != input_ids.shape:
            raise ValueError(f"segment_ids {tuple(segment_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = positions_from_segments(segment_ids)
        D = self.num_mtp_depths
        if D > 0 and mtp_loss_mask is None:
            raise ValueError("mtp_loss_mask [B, S] is required when the model has MTP heads (mtp_num_layers > 0)")

        grad = torch.is_grad_enabled()
        with torch.set_grad_enabled(grad and main_grad):
            embeds, hidden0, mask, router_logits = self._backbone_hidden(
                input_ids, segment_ids, position_ids, one_sample_per_row
            )
            weight = self.output_weight
            H = hidden0.shape[-1]
            same_next = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] >= 0)
            need = same_next if logprob_mask is None else same_next & (logprob_mask[:, 1:] > 0)
            lp, ent, _ = _logprobs_at(
                need.reshape(-1),
                hidden0[:, :-1].reshape(-1, H),
                weight,
                input_ids[:, 1:].reshape(-1),
                temperature=temperature,
                with_entropy=with_entropy,
            )
        logprobs = F.pad(lp.view(B, S - 1), (1, 0))
        entropy = F.pad(ent.view(B, S - 1), (1, 0))
        out = PolicyOutput(logprobs=logprobs, entropy=entropy)
        if router_logits:
            out.moe_aux, out.moe_load_max = router_statistics(
                router_logits, segment_ids >= 0, self.config.num_experts, self.config.num_experts_per_tok
            )
        if D == 0:
            return out

        detach = self.mtp_config.mtp_detach_heads
        distill = self.mtp_config.mtp_objective == "distill"
        position_embeddings = self.rotary_emb(hidden0, position_ids)
        with torch.set_grad_enabled(grad and self.mtp_trains):
            h_prev = hidden0.detach() if detach else hidden0
            emb_src = embeds.detach() if detach else embeds
            w_mtp = weight.detach() if detach else weight
            mtp_mask = mtp_loss_mask.to(torch.float32)
            # every depth runs even when a row is shorter than k + 2 (all its targets masked):
            # data-parallel ranks must run the same modules (FSDP2 gathers / reduce-scatters)
            for k in range(1, D + 1):
                emb_k = _shift_left(emb_src, k)  # Emb(x_{t+k}); zeros past the row end
                h_k = self.mtp.depth_forward(
                    k,
                    emb_k,
                    h_prev,
                    attention_mask=mask,
                    position_embeddings=position_embeddings,
                    position_ids=position_ids,
                )
                # target x_{t+k+1}, counted where it is in the same sample and mtp_loss_mask is 1
                targets = _shift_left(input_ids, k + 1)
                seg_target = _shift_left(segment_ids, k + 1, value=-2)
                valid = (seg_target == segment_ids) & (segment_ids >= 0)
                m = _shift_left(mtp_mask, k + 1) * valid
                m_flat = m.reshape(-1)
                if distill:
                    # p̄: the main head at t + k (it predicts x_{t+k+1}), detached (DESIGN §3)
                    teacher = _shift_left(hidden0.detach(), k).reshape(-1, H)
                    loss_k, hit_k = _distill_at(
                        m_flat > 0, h_k.reshape(-1, H), teacher, w_mtp, targets.reshape(-1), temperature=temperature
                    )
                else:
                    lp_k, _, hit_k = _logprobs_at(m_flat > 0, h_k.reshape(-1, H), w_mtp, targets.reshape(-1))
                    loss_k = -lp_k
                out.mtp_loss_sums.append((loss_k * m_flat).sum())
                out.mtp_hit_sums.append((hit_k * m_flat).sum())
                out.mtp_counts.append(m_flat.sum())
                h_prev = h_k
        return out


def load_pretrained(
    path: str | os.PathLike,
    *,
    mtp: MTPConfig | None = None,
    capabilities: ModelCapabilities | None = None,
    attn_implementation: str = "sdpa",
):
    """Load a local Hugging Face directory through transformers' own ``from_pretrained``.

    Args:
        path: directory with ``config.json`` and safetensors weights (ours, or a stock HF one).
        mtp: MTP knobs; default: those saved in the directory, else no MTP.
        capabilities: default: those saved, else none.
        attn_implementation: ``sdpa`` or ``eager``.

    Returns:
        A :class:`PolicyModel` in fp32. MTP tensors found in the directory are loaded exactly;
        a directory without them (a plain HF model) gets heads started as ``mtp.mtp_init`` says
        (default: random init; :func:`~splitrl.models.mtp.warm_start_from_backbone`). A directory
        whose depths share ``fc``, the input norms and the final norm (splitrl checkpoints
        written before per-depth modules, or Qwen3-Next with ``mtp_num_hidden_layers`` > 1) is
        converted exactly: the shared tensors are copied into every depth module (a warning
        says so), and a later save writes the per-depth layout.

    Raises:
        ValueError: missing directory or config, missing / truncated / corrupt weight files
            (:func:`verify_pretrained`), or stored MTP tensors that do not fit the requested MTP
            shape (e.g. a different number of depths).
    """
    path = Path(resolve_model_path(path))
    verify_pretrained(path, key="pretrained_path")
    hf_cfg = AutoConfig.from_pretrained(str(path))
    saved = getattr(hf_cfg, "splitrl", None) or {}
    if mtp is None:
        if "mtp" in saved:
            mtp = MTPConfig(**saved["mtp"])
        else:
            # a Qwen3-Next-layout checkpoint written elsewhere: as many depths as stored layers
            mtp = MTPConfig(mtp_num_layers=int(getattr(hf_cfg, "mtp_num_hidden_layers", 0) or 0))
    if capabilities is None:
        capabilities = ModelCapabilities(**saved["capabilities"]) if "capabilities" in saved else ModelCapabilities()
    # the stock class does not know the mtp.* tensors (read below): tell it they are expected
    # to be left over, instead of reporting each as UNEXPECTED
    cls = AutoModelForCausalLM._model_mapping[type(hf_cfg)]
    saved_ignore = cls._keys_to_ignore_on_load_unexpected
    cls._keys_to_ignore_on_load_unexpected = list(saved_ignore or []) + [r"^mtp\."]
    try:
        backbone = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation=attn_implementation
        )
    finally:
        cls._keys_to_ignore_on_load_unexpected = saved_ignore
    model = PolicyModel(backbone, mtp, capabilities)
    stored = read_mtp_tensors(path)
    if model.mtp is None:
        if stored:
            log.warning("%s holds MTP tensors but mtp_num_layers=0: the heads are not loaded", path)
        return model
    if not stored:
        if mtp.mtp_init == "random":
            log.warning(
                "%s has no MTP tensors: the %d MTP depth(s) start from random init; train them first with "
                "train.mtp_warmup_steps (a resumed run loads its trained heads from the checkpoint next)",
                path,
                mtp.mtp_num_layers,
            )
        else:
            warm_start_from_backbone(model.mtp, backbone, mtp.mtp_init)
            log.warning(
                "%s has no MTP tensors: the %d MTP depth(s) start from the backbone's last layer (mtp_init=%s); "
                "train them first with train.mtp_warmup_steps (a resumed run loads its trained heads from the "
                "checkpoint next)",
                path,
                mtp.mtp_num_layers,
                mtp.mtp_init,
            )
        return model
    stored, layout = mtp_state_from_checkpoint(stored, model.mtp.num_modules)
    expected = set(model.mtp.state_dict())
    if set(stored) != expected:
        raise ValueError(_mtp_mismatch(path, mtp, set(stored), expected, hf_cfg))
    if layout == "shared":
        log.warning(
            "%s stores MTP depths that share fc / pre_fc_norm_* / norm (the layout before per-depth MTP "
            "modules): copied into each of the %d depth modules; saving writes the per-depth layout",
            path,
            model.mtp.num_modules,
        )
    model.mtp.load_state_dict(stored, strict=True)
    return model
