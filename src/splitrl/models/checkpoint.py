"""Saving and loading policies as local Hugging Face directories, MTP heads included (DESIGN §3).

Stock transformers classes drop unknown tensors on load, so the MTP tensors are written and read
explicitly: they sit in ``model.safetensors`` next to the backbone's, under ``mtp.*`` (Qwen3-Next
names; with several depth modules indexed by depth, see :mod:`splitrl.models.mtp`), and
``config.json`` carries ``mtp_num_hidden_layers`` (the number of stored depth modules) plus our
knobs under ``splitrl``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from splitrl.models.config import ModelCapabilities, MTPConfig
from splitrl.models.mtp import mtp_checkpoint_names, mtp_state_from_checkpoint

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"


def _full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()}


def checkpoint_tensors(policy_sd: dict[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """``PolicyModel`` state-dict names to checkpoint names: ``backbone.*`` become the Hugging
    Face names, ``mtp.depths.*`` the Qwen3-Next-style names of :func:`mtp_checkpoint_names`; with
    tied embeddings ``lm_head.weight`` is left out, as transformers does."""
    out = {k[len("backbone.") :]: v.contiguous() for k, v in policy_sd.items() if k.startswith("backbone.")}
    if tie_word_embeddings:
        out.pop("lm_head.weight", None)
    block = {k[len("mtp.") :]: v for k, v in policy_sd.items() if k.startswith("mtp.")}
    out.update({f"mtp.{k}": v.contiguous() for k, v in mtp_checkpoint_names(block).items()})
    return out


def policy_state_dict(model) -> dict[str, torch.Tensor]:
    """CPU copies of the policy's tensors under checkpoint names (see :func:`checkpoint_tensors`)."""
    return checkpoint_tensors(_full_state_dict(model), getattr(model.backbone.config, "tie_word_embeddings", False))


def save_pretrained(model, path: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` to ``path`` (created if needed).

    Args:
        model: a :class:`~splitrl.models.PolicyModel`.
        state_dict: tensors to write instead of ``policy_state_dict(model)`` (e.g. a full state
            dict gathered from FSDP2 shards).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = policy_state_dict(model) if state_dict is None else state_dict
    save_file(sd, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    model.backbone.config.save_pretrained(str(path))
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    mtp = model.mtp_config
    cfg["mtp_num_hidden_layers"] = 0 if model.mtp is None else model.mtp.num_modules
    cfg["splitrl"] = {"mtp": mtp.model_dump(), "capabilities": model.capabilities.model_dump()}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _weight_files(path: Path) -> list[Path]:
    index = path / f"{WEIGHTS_NAME}.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def read_mtp_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All ``mtp.*`` tensors of a directory's safetensors files (sharded or not), prefix stripped."""
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.startswith("mtp."):
                    out[k[len("mtp.") :]] = st.get_tensor(k)
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
        a directory without them (a plain HF model) leaves freshly initialized heads. A directory
        whose depths share ``fc``, the input norms and the final norm (splitrl checkpoints
        written before per-depth modules, or Qwen3-Next with ``mtp_num_hidden_layers`` > 1) is
        converted exactly: the shared tensors are copied into every depth module (a warning
        says so), and a later save writes the per-depth layout.

    Raises:
        ValueError: missing directory or config, or stored MTP tensors that do not fit the
            requested MTP shape (e.g. a different number of depths).
    """
    from splitrl.models.policy import PolicyModel

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json); check pretrained_path")
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
        log.warning("%s has no MTP tensors: the %d MTP depth(s) start from random init", path, mtp.mtp_num_layers)
        return model
    stored, layout = mtp_state_from_checkpoint(stored, model.mtp.num_modules)
    expected = set(model.mtp.state_dict())
    if set(stored) != expected:
        missing = sorted(expected - set(stored))[:4]
        extra = sorted(set(stored) - expected)[:4]
        raise ValueError(
            f"MTP tensors in {path} do not fit mtp_num_layers={mtp.mtp_num_layers}, "
            f"mtp_use_repeated_layer={mtp.mtp_use_repeated_layer} (missing e.g. {missing}, unexpected e.g. "
            f"{extra}); set the MTP knobs to those the checkpoint was saved with "
            f"(config.json: mtp_num_hidden_layers={getattr(hf_cfg, 'mtp_num_hidden_layers', None)})"
        )
    if layout == "shared":
        log.warning(
            "%s stores MTP depths that share fc / pre_fc_norm_* / norm (the layout before per-depth MTP "
            "modules): copied into each of the %d depth modules; saving writes the per-depth layout",
            path,
            model.mtp.num_modules,
        )
    model.mtp.load_state_dict(stored, strict=True)
    return model


def export_deepseek_v3(model, path: str | os.PathLike) -> None:
    """Write the DeepSeek-V3 MTP layout for engines that read that one (DESIGN §3).

    Depth k (1-indexed) becomes ``model.layers.{L+k-1}`` with ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm``, ``shared_head.head`` and ``embed_tokens`` (copies of the backbone's), plus
    the depth's decoder-layer tensors; ``num_nextn_predict_layers`` = D. Each depth's tensors come
    from its own depth module; a repeated module is copied into every depth.
    """
    if model.mtp is None:
        raise ValueError("export_deepseek_v3 needs a model with MTP heads (mtp_num_layers > 0)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = _full_state_dict(model.backbone)
    L = model.config.num_hidden_layers
    emb = sd["model.embed_tokens.weight"]
    head = sd.get("lm_head.weight", emb)
    for k in range(1, model.num_mtp_depths + 1):
        pre = f"model.layers.{L + k - 1}."
        depth_sd = _full_state_dict(model.mtp.depth_module(k))
        sd[pre + "enorm.weight"] = depth_sd["pre_fc_norm_embedding.weight"]
        sd[pre + "hnorm.weight"] = depth_sd["pre_fc_norm_hidden.weight"]
        sd[pre + "eh_proj.weight"] = depth_sd["fc.weight"]
        sd[pre + "shared_head.norm.weight"] = depth_sd["norm.weight"]
        sd[pre + "shared_head.head.weight"] = head.clone()
        sd[pre + "embed_tokens.weight"] = emb.clone()
        for name, t in depth_sd.items():
            if name.startswith("layer."):
                sd[pre + name[len("layer.") :]] = t
    sd = {k: v.contiguous() for k, v in sd.items()}
    save_file(sd, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    model.backbone.config.save_pretrained(str(path))
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for stale in ("mtp_num_hidden_layers", "splitrl"):  # this layout is not ours / Qwen3-Next's
        cfg.pop(stale, None)
    cfg["num_nextn_predict_layers"] = model.num_mtp_depths
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
