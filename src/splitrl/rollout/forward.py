"""The decoder forward of the rollout engine, over the Hugging Face backbone's own modules.

Legend: B = rows, M = tokens per row, H = hidden size, V = vocabulary.

The layers are those of the backbone, of a family of the registry (:mod:`splitrl.models.families`,
which says what its layers must be): input RMSNorm, q/k/v projections (with their biases where the
layer has them, e.g. Qwen2), per-head q_norm / k_norm where the family has them (``qk_norm``:
Qwen3), rotary embedding from the backbone's ``rotary_emb``, attention, o_proj, residual,
post-attention RMSNorm, MLP, residual. Only the attention differs from
transformers': keys and values go to a preallocated :class:`~splitrl.rollout.kv.StaticKVCache`, so
a decode step has static shapes and can be captured in a CUDA graph. Every weight is read through
the modules at call time, so an in-place weight update (``copy_``) is seen by captured graphs.

Fused projections. A decode step at small batch is bound by the number of kernels it launches
(each small-M GEMM costs a few microseconds whatever its size), so q/k/v and the MLP's gate/up run
as one GEMM each. :func:`fuse_projections` moves the weights of those modules into one contiguous
tensor per group and leaves each module's parameter as a view of it (``param.data`` is replaced,
the ``Parameter`` object stays, so optimizers and ``state_dict`` see the same names and tensors): an
in-place update of q_proj.weight is an update of the fused tensor; biases (Qwen2's q/k/v) are fused
the same way, into one bias tensor. Each output element is the same dot product (plus the same bias)
as in the separate GEMMs.

Skinny products. On CUDA in bf16 / fp16, a linear layer of the decode step whose input has at
most :data:`~splitrl.rollout.skinny_gemm.MAX_ROWS` rows (the plain step up to 64 slots, a verify
or a draft up to 64 rows × queries) and too few output features to fill the chip (o_proj,
down_proj: :func:`~splitrl.rollout.skinny_gemm.preferred`) runs on
:func:`~splitrl.rollout.skinny_gemm.skinny_linear`, which splits the inner dimension over more
programs where cuBLAS's tiles left most of the chip idle; each output is the same fp32 sum of the
same products, rounded once, in another order (bf16 rounding). Prefills, larger steps, the wide
products, fp32 and CPUs keep ``torch.nn.functional.linear``; ``SPLITRL_SKINNY_GEMM=0`` turns it off.
The residual add and the RMSNorm that follow such a product run in its split-K reduction
(:func:`~splitrl.rollout.skinny_gemm.skinny_linear_add_rms_norm`; ``SPLITRL_SKINNY_EPILOGUE=0``: the
product alone), so a layer (:meth:`DecoderForward._layer`) returns its output together with the next
norm of it. The MLP's gate/up product and silu(gate) · up are one launch as well at the same row
counts (:func:`~splitrl.rollout.skinny_gemm.skinny_linear_silu_mul`; ``SPLITRL_SKINNY_GATED=0``:
cuBLAS and silu_mul). Where the gate/up product stays on cuBLAS (prefills, larger steps), silu(gate) ·
up of its output is one Triton kernel on CUDA in bf16 / fp16 (:func:`~splitrl.rollout.silu_mul.silu_mul`;
``SPLITRL_SILU_MUL=0``, fp32 and CPUs: the compiled ``fused.silu_mul``).

Attention input. A decode step's q/k norms, rotary embedding and cache write run as one Triton kernel
on CUDA in bf16 / fp16 (:func:`~splitrl.rollout.rope_write.norm_rope_write`; ``SPLITRL_ROPE_WRITE=0``:
the compiled torch function and one ``index_copy_``). Both round where the torch ops round; the
choice changes bf16 rounding only, as the products' shapes already do. Its programs take several
heads each from :data:`~splitrl.rollout.rope_write.GROUP_FROM_TOKENS` tokens (prefills, large steps).

Launches. On sm90+ GPUs the Triton kernels above (products, epilogues, rotary + cache write,
decode attention) of steps of up to 64 tokens are launched with programmatic dependent launch
(:mod:`splitrl.rollout.pdl`; ``SPLITRL_PDL=0``: plain launches), so that each starts while the one
before it drains; the values are the same bits.

Rotary table. The backbone's ``rotary_emb`` computes cos/sin from the positions with ~8 small ops
(a matmul, a transpose, a cat, cos, sin, scalings, casts) at every call: in every decode forward,
the verify and each MTP depth. :meth:`DecoderForward.sync_rope_table` calls that module once for
positions 0..M-1 (the cache length; every position a decode forward uses is a cache index) and a
forward gathers its rows by position (one index op). Each element of cos/sin is an elementwise
function of (inv_freq, position) — the matmul has an inner dimension of 1, a single product — so a
row of the table is the value the module computes for that position in any call (tests check it
bit for bit). RoPE types whose frequencies depend on the call's positions (dynamic, longrope) keep
calling the module.

The MTP depth forward follows ``MTPBlock.depth_forward`` (DESIGN §3):
h^k = norm(layer_k(fc(concat[enorm(Emb), hnorm(h^{k-1})]))), with the parts read through
:func:`mtp_parts` so that a per-depth layout of the norms and ``fc`` only changes that function.
"""

from __future__ import annotations

import torch
from torch import nn

from splitrl.models.policy import PolicyModel
from splitrl.rollout import env, rope_write, silu_mul, skinny_gemm
from splitrl.rollout.fused import Kernels, split_heads
from splitrl.rollout.kv import AttentionPlan, PrefillPlan, StaticKVCache, causal_attention

# the skinny-product kernel for few-row decode products on CUDA (module docstring); set at import
SKINNY_GEMM = env.flag("SPLITRL_SKINNY_GEMM") and skinny_gemm.AVAILABLE
# The fused pieces (module docstring), each measured faster than the launches it replaces
# (bench/RESULTS.md, rollout decoding; the gated one alone within the run-to-run spread, and on in
# the fastest configuration measured, with PDL); SPLITRL_SKINNY_EPILOGUE=0 / SPLITRL_SKINNY_GATED=0 /
# SPLITRL_ROPE_WRITE=0 turn one off.
SKINNY_EPILOGUE = env.flag("SPLITRL_SKINNY_EPILOGUE") and SKINNY_GEMM
SKINNY_GATED = env.flag("SPLITRL_SKINNY_GATED") and SKINNY_GEMM
ROPE_WRITE = env.flag("SPLITRL_ROPE_WRITE") and rope_write.AVAILABLE
# Backbone prefills on the rotary kernel + the flash kernel over the cache (DecoderForward._prefill_plan);
# SPLITRL_FAST_PREFILL=0: the torch functions, the prefix write and SDPA over repeated keys and values.
FAST_PREFILL = env.flag("SPLITRL_FAST_PREFILL") and ROPE_WRITE
# silu(gate) · up after a cuBLAS gate/up product on its Triton kernel (module docstring; measured
# faster than the compiled function, outputs bit-identical: bench/RESULTS.md); SPLITRL_SILU_MUL=0:
# the compiled function.
SILU_MUL = env.flag("SPLITRL_SILU_MUL") and silu_mul.AVAILABLE


def mtp_parts(model: PolicyModel, depth: int) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module, nn.Module]:
    """(enorm, hnorm, fc, decoder layer, final norm) of MTP depth ``depth`` (1-indexed)."""
    mtp = model.mtp
    assert mtp is not None
    d = mtp.depth_module(depth)  # each depth owns its norms, projection and layer (DESIGN §3)
    return d.pre_fc_norm_embedding, d.pre_fc_norm_hidden, d.fc, d.layer, d.norm


_FUSED = "_splitrl_fused"  # attribute of a module holding its fused (weight, bias) tensors


def _fuse(owner: nn.Module, names: tuple[str, ...]) -> None:
    """Put the weights (and biases) of ``owner``'s linear submodules ``names`` in one tensor each,
    rows in that order, and make every submodule's parameter a view of it. Idempotent."""
    mods = [getattr(owner, n) for n in names]
    ws = [m.weight for m in mods]
    has_bias = [m.bias is not None for m in mods]
    if any(has_bias) and not all(has_bias):
        return  # mixed: keep them separate
    fused = getattr(owner, _FUSED, None)
    if fused is not None and _views_of(ws, fused[0]):
        if fused[1] is None or _views_of([m.bias for m in mods], fused[1]):
            return  # weights and biases (Qwen2's q/k/v) are still views of the fused tensors
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in ws], dim=0)
        bias = torch.cat([m.bias.detach() for m in mods], dim=0) if all(has_bias) else None
        row = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = weight[row : row + n]
            if bias is not None:
                m.bias.data = bias[row : row + n]
            row += n
    setattr(owner, _FUSED, (weight, bias))


def _views_of(ws: list[torch.Tensor], fused: torch.Tensor) -> bool:
    """The tensors ``ws`` are consecutive row blocks of ``fused`` (still fused: no ``.to()`` or
    ``load_state_dict(assign=True)`` has replaced them since)."""
    if fused.device != ws[0].device or fused.dtype != ws[0].dtype:
        return False
    offset = fused.data_ptr()
    for w in ws:
        if w.data_ptr() != offset or not w.is_contiguous():
            return False
        offset += w.numel() * w.element_size()
    return sum(w.shape[0] for w in ws) == fused.shape[0]


def fuse_projections(model: PolicyModel) -> None:
    """Fuse q/k/v and (dense SwiGLU) gate/up of every decoder layer, MTP layers included."""
    layers = list(model.backbone.model.layers)
    if model.mtp is not None:
        layers += [mtp_parts(model, k)[3] for k in range(1, model.num_mtp_depths + 1)]
    for layer in layers:
        _fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        mlp = layer.mlp
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            _fuse(mlp, ("gate_proj", "up_proj"))


def _triton_operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x and ``weight`` are operands the skinny kernels take: CUDA, bf16 / fp16, one dtype, K contiguous."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
    )


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product of x [..., K] with ``weight`` [N, K] runs on the skinny-product kernel
    (module docstring)."""
    return (
        SKINNY_GEMM
        and _triton_operands(x, weight)
        and skinny_gemm.preferred(x.numel() // x.shape[-1], weight.shape[0], x.shape[-1])
    )


def _gated(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether silu(gate) · up of x [..., K] and the fused gate/up ``weight`` [2F, K] is one
    skinny-kernel launch (module docstring)."""
    return SKINNY_GATED and _triton_operands(x, weight) and skinny_gemm.gated_preferred(x.numel() // x.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear``, on the skinny-product kernel where it applies (module docstring)."""
    if _skinny(x, weight):
        return skinny_gemm.skinny_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _module_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Linear`` through :func:`linear`; any other module is called."""
    if type(module) is nn.Linear:
        return linear(x, module.weight, module.bias)
    return module(x)


def _fused_linear(owner: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight, bias = getattr(owner, _FUSED)
    return linear(x, weight, bias)


def check_supported(model: PolicyModel) -> None:
    """Raise ValueError for backbones whose layers this forward does not reproduce: a family outside
    the registry, layers unlike its entry, sliding-window layers, a dynamic RoPE."""
    family = model.family  # ValueError outside the registry
    layers = list(model.backbone.model.layers)
    if model.mtp is not None:
        layers += [mtp_parts(model, k)[3] for k in range(1, model.num_mtp_depths + 1)]
    for layer in layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm") != family.qk_norm or hasattr(attn, "k_norm") != family.qk_norm:
            raise ValueError(
                f"{type(attn).__name__} {'has' if hasattr(attn, 'q_norm') else 'lacks'} q_norm / k_norm, but the "
                f"family registry says qk_norm={family.qk_norm} for {family.name!r} (splitrl.models.families)"
            )
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in types) or getattr(cfg, "use_sliding_window", False):
        raise ValueError(
            "the rollout engine supports full-attention layers only (no sliding window); "
            f"got layer_types={sorted(set(types))}"
        )
    rope = getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) == "dynamic":
        raise ValueError("dynamic RoPE scaling depends on the sequence length; the rollout engine needs a static RoPE")


def _static_rope(model: PolicyModel) -> bool:
    """The rotary module's cos/sin at a position do not depend on the other positions of the call."""
    rope = model.rotary_emb
    rope_type = getattr(rope, "rope_type", "default")
    return isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"


class DecoderForward:
    """Prefill and cached decode through the backbone (and the MTP depths) of ``model``."""

    def __init__(self, model: PolicyModel, compiled: bool = False):
        check_supported(model)
        self.model = model
        self.layers = list(model.backbone.model.layers)
        self.final_norm = model.backbone.model.norm
        # the norm each layer's output goes through: the next layer's input norm, the final norm last
        self.next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.final_norm]
        self.k = Kernels(compiled, model.output_weight.device, model.output_weight.dtype)
        self.silu = model.config.hidden_act == "silu"
        self.qk_norm = model.family.qk_norm  # per-head q/k RMSNorm before the rotary embedding
        fuse_projections(model)
        self.rope_table: torch.Tensor | None = None  # [M, 2, d]: cos, sin by position (see module doc)
        self._rope_key: tuple | None = None
        self._rope_freqs: torch.Tensor | None = None

    # ------------------------------------------------------------------------------ rotary
    def _rope_source(self, length: int) -> tuple:
        """What the table's values depend on besides the frequencies' values: the frequency tensor
        (object, storage, dtype), the scaling, the compute dtype and device, the length."""
        rope = self.model.rotary_emb
        inv = rope.inv_freq
        w = self.model.output_weight
        return (id(inv), inv.data_ptr(), inv.dtype, float(getattr(rope, "attention_scaling", 1.0)),
                w.dtype, w.device, length)  # fmt: skip

    @torch.no_grad()
    def sync_rope_table(self, length: int) -> bool:
        """Make :attr:`rope_table` the module's cos/sin of positions 0..``length``-1 (a no-op when
        nothing it depends on changed). A table of the same shape is refreshed in place (captured
        CUDA graphs read its storage). Returns True when the table is a new tensor (graphs that
        read the old one must be recaptured)."""
        if not _static_rope(self.model):
            replaced = self.rope_table is not None
            self.rope_table = None
            return replaced
        key = self._rope_source(length)
        inv = self.model.rotary_emb.inv_freq
        # the values are compared, not the version counter: a model made under inference_mode
        # has inference tensors, which have none (d/2 numbers, once per generate call)
        if key == self._rope_key and torch.equal(inv, self._rope_freqs):
            return False
        w = self.model.output_weight
        pos = torch.arange(length, device=w.device)[None]
        cos, sin = self.model.rotary_emb(w.new_empty(0), pos)  # the module reads x's dtype and device only
        table = torch.stack([cos[0], sin[0]], dim=1)
        old = self.rope_table
        replaced = not (
            old is not None and old.shape == table.shape and old.dtype == table.dtype and old.device == table.device
        )
        if replaced:
            self.rope_table = table
        else:
            old.copy_(table)
        self._rope_key = key
        self._rope_freqs = inv.detach().clone()
        return replaced

    def _table_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The rope table if it serves x's dtype and device, else None (the module is called)."""
        table = self.rope_table
        return table if table is not None and table.dtype == x.dtype and table.device == x.device else None

    def rope(self, x: torch.Tensor, positions_BQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, Q, d] in x's dtype at ``positions_BQ``: rows of the table (one gather), or
        the rotary module where there is no table. Positions must be < the table's length."""
        table = self._table_for(x)
        if table is None:
            return self.model.rotary_emb(x, positions_BQ)
        cos, sin = table[positions_BQ].unbind(2)
        return cos, sin

    def _rope_prefix(self, x: torch.Tensor, B: int, M: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, M, d] of positions 0..M-1 (a view of the table when it has them)."""
        table = self._table_for(x)
        if table is None or M > table.shape[0]:
            return self.model.rotary_emb(x, torch.arange(M, device=x.device).expand(B, M))
        cos, sin = table[:M].unbind(1)
        return cos.expand(B, M, -1), sin.expand(B, M, -1)

    # ------------------------------------------------------------------------------ one layer
    def _layer(
        self,
        layer: nn.Module,
        h: torch.Tensor,
        x: torch.Tensor,
        next_norm: nn.Module,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: StaticKVCache,
        index: int,
        *,
        prefill_slots: torch.Tensor | None = None,
        plan: AttentionPlan | PrefillPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer on the residual stream h, whose input norm x = input_layernorm(h)
        the caller computed; ``next_norm``: the RMSNorm applied to this layer's output (the next
        layer's input norm, or the final norm), so that the residual add and that norm are one
        fused op (on the skinny path, the epilogue of the layer's last product).

        Returns (h', next_norm(h')), h' = the layer's output [B, M, H].
        """
        attn = layer.self_attn
        B, M, _ = h.shape
        d = attn.head_dim
        qk_norm = self.qk_norm
        prefill = isinstance(plan, PrefillPlan)  # a backbone prefill on CUDA (:meth:`_prefill_plan`)
        if prefill or (hasattr(attn, _FUSED) and prefill_slots is None):
            # decode: split, norms, rotary and keys + values stacked (one cache write) in one function
            nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
            qkv = _fused_linear(attn, x)
            if prefill or (ROPE_WRITE and qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16)):
                # ... or in one kernel that also writes the cache (splitrl.rollout.rope_write)
                qw, kw = (attn.q_norm.weight, attn.k_norm.weight) if qk_norm else (None, None)
                eps = attn.q_norm.variance_epsilon if qk_norm else 0.0
                q = rope_write.norm_rope_write(
                    qkv, nq, nk, d, qw, kw, eps, cos, sin, cache.kv[:, index], plan.flat_index
                )
            else:
                if qk_norm:
                    eps = attn.q_norm.variance_epsilon
                    q, kv = self.k.qkv_norm_rope(qkv, nq, nk, d, attn.q_norm.weight, attn.k_norm.weight, eps, cos, sin)
                else:
                    q, kv = self.k.qkv_rope(qkv, nq, nk, d, cos, sin)
                cache.write_kv(index, plan, kv)
            # a prefill's queries read the entries just written, in place, on the flash kernel
            o = cache.attend_prefill(index, q, plan, attn.scaling) if prefill else cache.attend(index, q, plan, attn.scaling)
        else:
            if hasattr(attn, _FUSED):
                nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
                q, k, v = split_heads(_fused_linear(attn, x), nq, nk, d)
            else:
                q = attn.q_proj(x).view(B, M, -1, d)
                k = attn.k_proj(x).view(B, M, -1, d)
                v = attn.v_proj(x).view(B, M, -1, d)
            if qk_norm:
                eps = attn.q_norm.variance_epsilon
                q, k = self.k.qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, eps, cos, sin)
            else:
                q, k = self.k.qk_rope(q, k, cos, sin)
            if prefill_slots is not None:
                cache.write_prefix(index, prefill_slots, k, v)
                o = causal_attention(q, k, v, attn.scaling)
            else:
                cache.write(index, plan, k, v)
                o = cache.attend(index, q, plan, attn.scaling)
        h, x = self._add_norm(attn.o_proj, o, h, layer.post_attention_layernorm)
        mlp = layer.mlp
        # dense SwiGLU (also the dense layers of an MoE family); MoE blocks route in their own forward
        if self.silu and hasattr(mlp, _FUSED):
            weight, bias = getattr(mlp, _FUSED)
            if _gated(x, weight):
                act = skinny_gemm.skinny_linear_silu_mul(x, weight, bias)
            else:
                gate_up = linear(x, weight, bias)
                if SILU_MUL and silu_mul.applies(gate_up):
                    act = silu_mul.silu_mul(gate_up)
                else:
                    act = self.k.silu_mul(*gate_up.chunk(2, dim=-1))
            return self._add_norm(mlp.down_proj, act, h, next_norm)
        if self.silu and hasattr(mlp, "down_proj"):
            return self._add_norm(mlp.down_proj, self.k.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)), h, next_norm)
        return self.k.add_rms_norm(mlp(x), h, next_norm.weight, next_norm.variance_epsilon)

    def _add_norm(self, proj: nn.Module, x: torch.Tensor, h: torch.Tensor, norm: nn.Module):
        """(h + proj(x), norm(h + proj(x))): the skinny product with its add + norm epilogue where
        it applies, else the product and the fused add + norm."""
        if SKINNY_EPILOGUE and type(proj) is nn.Linear and _skinny(x, proj.weight):
            return skinny_gemm.skinny_linear_add_rms_norm(
                x, proj.weight, h, norm.weight, norm.variance_epsilon, proj.bias
            )
        return self.k.add_rms_norm(_module_linear(proj, x), h, norm.weight, norm.variance_epsilon)

    def _stack(self, h, x, cos, sin, cache, **kw) -> torch.Tensor:
        """The backbone's layers on h (x: the first layer's input norm of h), then its final norm."""
        for i, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
            h, x = self._layer(layer, h, x, next_norm, cos, sin, cache, i, **kw)
        return x

    def _input_norm(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        norm = layer.input_layernorm
        return self.k.rms_norm(h, norm.weight, norm.variance_epsilon)

    # ------------------------------------------------------------------------------ backbone
    def head_logits(self, hidden: torch.Tensor, temperature: float, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Logits / T of ``hidden`` [..., H]: the output layer in the model dtype, then fp32, then
        / T (the ops of PolicyModel.forward). At T = 1 the head's output is returned as is: the
        compiled sampler upcasts it inside its first kernel instead of in a copy of its own.
        ``weight``: rows of the output layer to use instead of all of it ([V', H]; the drafts'
        :class:`~splitrl.rollout.drafter.DraftVocabulary`)."""
        logits = nn.functional.linear(hidden, self.model.output_weight if weight is None else weight)
        return logits.float() / temperature if temperature != 1.0 else logits

    def _prefill_plan(self, h: torch.Tensor, slots_B: torch.Tensor, cache: StaticKVCache) -> PrefillPlan | None:
        """The cache's :class:`~splitrl.rollout.kv.PrefillPlan` where a prefill's layers run on the
        rotary kernel and the flash kernel reads the cache in place: CUDA, bf16 / fp16, a flash
        (position-major) cache, fused q/k/v. Else None: the torch functions, the prefix write and
        the attention over the projections' own keys and values (CPU, fp32: the exactness tests'
        path). Both compute the same values up to bf16 rounding."""
        if not (FAST_PREFILL and cache.flash and h.is_cuda and h.dtype in (torch.bfloat16, torch.float16)):
            return None
        if not all(hasattr(layer.self_attn, _FUSED) for layer in self.layers):
            return None
        return cache.prefill_plan(slots_B, h.shape[1])

    def backbone_prefill(
        self, ids_BM: torch.Tensor, slots_B: torch.Tensor, cache: StaticKVCache, slots_ascending: bool = False
    ) -> torch.Tensor:
        """h⁰ [B, M, H] (after the final norm) of right-padded prompts at positions 0..M-1,
        writing their keys and values to slots ``slots_B``. ``slots_ascending``: the caller's
        promise that the slots are in non-decreasing order, as the flash sequences that read the
        cache in place need (:meth:`_prefill_plan`); without it the prefill attends over the
        projections' own keys and values."""
        B, M = ids_BM.shape
        h = self.model.embed_tokens(ids_BM)
        cos, sin = self._rope_prefix(h, B, M)
        plan = self._prefill_plan(h, slots_B, cache) if slots_ascending else None
        return self._stack(h, self._input_norm(self.layers[0], h), cos, sin, cache, prefill_slots=slots_B, plan=plan)

    def backbone_decode(
        self, ids_BQ: torch.Tensor, positions_BQ: torch.Tensor, cache: StaticKVCache, length: int
    ) -> torch.Tensor:
        """h⁰ [B, Q, H] of Q new tokens per slot 0..B-1 (causal among them and over the cache)."""
        emb_weight = self.plain_embedding
        if emb_weight is not None:  # the lookup and the first layer's input norm: one fused function
            norm = self.layers[0].input_layernorm
            h, normed = self.k.embed_rms_norm(ids_BQ, emb_weight, norm.weight, norm.variance_epsilon)
        else:
            h = self.model.embed_tokens(ids_BQ)
            normed = self._input_norm(self.layers[0], h)
        cos, sin = self.rope(h, positions_BQ)
        plan = cache.plan(positions_BQ, positions_BQ, positions_BQ, length, causal=True, kernels=self.k)  # all layers
        return self._stack(h, normed, cos, sin, cache, plan=plan)

    # ------------------------------------------------------------------------------ MTP
    @property
    def plain_embedding(self) -> torch.Tensor | None:
        """The embedding table when ``embed_tokens`` is a plain lookup (an ``nn.Embedding`` without
        ``max_norm``: its forward is ``F.embedding(ids, weight)``), else None."""
        emb = self.model.embed_tokens
        return emb.weight if type(emb) is nn.Embedding and emb.max_norm is None else None

    def _mtp_input(self, depth: int, embeds, hidden) -> torch.Tensor:
        """fc(cat[enorm(E), hnorm(h)]): ``embeds`` is E [B, Q, H], or a list of int64 token tensors
        [B, Qi] (concatenated along positions, then embedded); ``hidden`` is h [B, Q, H], or a list
        of parts [B, Qi, H] concatenated along positions. The lookup, the concatenations and both
        norms are one fused function (:func:`~splitrl.rollout.fused.mtp_input`)."""
        enorm, hnorm, fc, _, _ = mtp_parts(self.model, depth)
        emb_weight = None
        if isinstance(embeds, (list, tuple)):
            emb_weight = self.plain_embedding
            if emb_weight is None:  # a custom embedding module: its own forward
                embeds = self.model.embed_tokens(torch.cat(list(embeds), dim=1) if len(embeds) > 1 else embeds[0])
        hidden = list(hidden) if isinstance(hidden, (list, tuple)) else [hidden]
        x = self.k.mtp_input(
            embeds, hidden, enorm.weight, enorm.variance_epsilon, hnorm.weight, hnorm.variance_epsilon, emb_weight
        )
        return fc(x)

    def mtp_prefill(
        self,
        depth: int,
        embeds_BMH: torch.Tensor,
        hidden_BMH: torch.Tensor,
        slots_B: torch.Tensor,
        cache: StaticKVCache,
    ) -> torch.Tensor:
        """h^k [B, M, H] at positions 0..M-1 (valid entries must be a prefix of each row)."""
        _, _, _, layer, norm = mtp_parts(self.model, depth)
        x = self._mtp_input(depth, embeds_BMH, hidden_BMH)
        B, M, _ = x.shape
        cos, sin = self._rope_prefix(x, B, M)
        return self._layer(
            layer, x, self._input_norm(layer, x), norm, cos, sin, cache, depth - 1, prefill_slots=slots_B
        )[1]

    def mtp_decode(
        self,
        depth: int,
        embeds_BQH: torch.Tensor,
        hidden_BQH: torch.Tensor,
        positions_BQ: torch.Tensor,
        write_pos_BQ: torch.Tensor,
        limit_BQ: torch.Tensor,
        cache: StaticKVCache,
        length: int,
        slots_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h^k [B, Q, H] of entries at ``positions_BQ`` (>= 0), written at ``write_pos_BQ``,
        reading cache indices <= ``limit_BQ`` and their own; rows are slots 0..B-1 or ``slots_B``.
        ``embeds_BQH`` and ``hidden_BQH`` may be lists of parts (see :meth:`_mtp_input`)."""
        _, _, _, layer, norm = mtp_parts(self.model, depth)
        x = self._mtp_input(depth, embeds_BQH, hidden_BQH)
        cos, sin = self.rope(x, positions_BQ)
        plan = cache.plan(write_pos_BQ, write_pos_BQ, limit_BQ, length, slots_B, kernels=self.k)
        return self._layer(layer, x, self._input_norm(layer, x), norm, cos, sin, cache, depth - 1, plan=plan)[1]
