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
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from splitrl.models.config import MTPConfig
from splitrl.models.families import FAMILIES
from splitrl.models.mtp import MTPBlock, mtp_checkpoint_names, mtp_state_from_checkpoint

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


_SAFETENSORS_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def safetensors_header(file: Path) -> dict[str, dict]:
    """The tensor entries (``{name: {dtype, shape, data_offsets}}``) of a safetensors file, after
    checking that the file holds every byte its header promises.

    The format is an 8-byte little-endian header length, a JSON header, then the data; a copy cut
    short (an interrupted download or copy) has a header that points past the end of the file.

    Raises:
        ValueError: naming the file: unreadable, truncated, or a header that is not the format's.
    """
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError(f"{file} is not a safetensors file or is truncated ({size} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ValueError(f"{file}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} has a corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} has a corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        try:
            start, stop = entry["data_offsets"]
            nbytes = _SAFETENSORS_ITEMSIZE.get(entry["dtype"], 0)
            for d in entry["shape"]:
                nbytes *= int(d)
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{file} has a corrupt safetensors header (entry {name!r}: {entry!r})") from None
        if entry["dtype"] in _SAFETENSORS_ITEMSIZE and stop - start != nbytes:
            raise ValueError(
                f"{file} has a corrupt safetensors header ({name!r} holds {stop - start} bytes, its shape needs {nbytes})"
            )
        end = max(end, stop)
    if 8 + n + end > size:
        raise ValueError(
            f"{file} is truncated: {size} bytes, its header needs {8 + n + end}; copy or download it again"
        )
    return header


def verify_pretrained(
    path: str | os.PathLike, key: str = "model.pretrained_path", mtp: MTPConfig | None = None
) -> None:
    """Check a Hugging Face model directory without loading its weights: ``config.json`` parses,
    every weight file is there and whole, and the backbone's tensors are all stored with the
    shapes the config gives. Cheap (file headers and a meta-device model), so it runs in preflight
    and before every load.

    Args:
        path: the directory.
        key: the config key that named it (used in messages).
        mtp: when given, stored MTP tensors must also fit these knobs (as
            :func:`splitrl.models.policy.load_pretrained` requires).

    Raises:
        ValueError: naming ``key``, the file and what is wrong.
    """
    path = Path(path)
    where = f"{key}={str(path)!r}"
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{where} is not a Hugging Face model directory (no config.json); check the path")
    try:
        hf_cfg = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds for a bad config.json
        raise ValueError(f"{where}: config.json cannot be read ({type(e).__name__}: {e})") from None
    index = path / f"{WEIGHTS_NAME}.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: {index.name} is corrupt ({e})") from None
        missing_files = [n for n in names if not (path / n).is_file()]
        if missing_files:
            raise ValueError(f"{where}: {index.name} lists weight files that are missing: {missing_files[:4]}")
    files = _weight_files(path)
    if not files:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"{where} holds no weights (no *.safetensors or pytorch_model*.bin)")
        import zipfile

        for b in bins:  # torch.save archives are zip files; a cut-off one has no central directory
            if not zipfile.is_zipfile(b):
                raise ValueError(f"{where}: {b.name} is truncated or corrupt (not a readable torch archive)")
        return
    stored: dict[str, list[int]] = {}
    for f in files:
        try:
            stored.update({k: v["shape"] for k, v in safetensors_header(f).items()})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    policy = _meta_policy(hf_cfg, mtp)
    if policy is None:
        return
    expected = {k: tuple(v.shape) for k, v in policy.backbone.state_dict().items()}
    if getattr(hf_cfg, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    # checkpoints of the bare backbone (no lm_head, no ``model.`` prefix) load too
    renamed = {("model." + k if "model." + k in expected and k not in expected else k): v for k, v in stored.items()}
    missing = sorted(k for k in expected if k not in renamed)
    if missing:
        raise ValueError(
            f"{where}: {len(missing)} backbone tensor(s) are missing from the weight files (e.g. {missing[:4]}); "
            "they would start from random init. Copy the complete checkpoint"
        )
    wrong = [(k, renamed[k], list(shape)) for k, shape in expected.items() if list(renamed[k]) != list(shape)]
    if wrong:
        k, got, want = wrong[0]
        raise ValueError(
            f"{where}: {len(wrong)} tensor(s) do not fit config.json (e.g. {k} is {got}, config.json gives {want})"
        )
    stored_mtp = {k[len("mtp.") :]: v for k, v in stored.items() if k.startswith("mtp.")}
    if policy.mtp is not None and stored_mtp:
        # checkpoint names to in-memory names (shared-depth layouts are converted on load)
        stored_mtp = set(mtp_state_from_checkpoint(stored_mtp, policy.mtp.num_modules)[0])
    if policy.mtp is not None and stored_mtp and stored_mtp != set(policy.mtp.state_dict()):
        raise ValueError(f"{where}: " + _mtp_mismatch(path, mtp, stored_mtp, set(policy.mtp.state_dict()), hf_cfg))


def _meta_policy(hf_cfg, mtp: MTPConfig | None):
    """The backbone and MTP block ``hf_cfg`` and ``mtp`` describe (as ``PolicyModel`` builds
    them), on the meta device (no memory, no init), for their tensor names and shapes; None for
    a model type this package cannot build."""
    try:
        cls = AutoModelForCausalLM._model_mapping[type(hf_cfg)]
    except KeyError:
        return None
    if getattr(hf_cfg, "model_type", None) not in FAMILIES:
        return None
    with torch.device("meta"):
        backbone = cls(hf_cfg)
        block = None
        if mtp is not None and mtp.mtp_num_layers > 0:
            inner = backbone.model
            block = MTPBlock(
                hf_cfg, mtp.mtp_num_layers, mtp.mtp_use_repeated_layer, type(inner.layers[0]), type(inner.norm)
            )
    return SimpleNamespace(backbone=backbone, mtp=block)


def _mtp_mismatch(path, mtp: MTPConfig, stored: set[str], expected: set[str], hf_cfg) -> str:
    missing = sorted(expected - stored)[:4]
    extra = sorted(stored - expected)[:4]
    return (
        f"MTP tensors in {path} do not fit mtp_num_layers={mtp.mtp_num_layers}, "
        f"mtp_use_repeated_layer={mtp.mtp_use_repeated_layer} (missing e.g. {missing}, unexpected e.g. "
        f"{extra}); set the MTP knobs to those the checkpoint was saved with "
        f"(config.json: mtp_num_hidden_layers={getattr(hf_cfg, 'mtp_num_hidden_layers', None)})"
    )


def read_mtp_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All ``mtp.*`` tensors of a directory's safetensors files (sharded or not), prefix stripped."""
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.startswith("mtp."):
                    out[k[len("mtp.") :]] = st.get_tensor(k)
    return out


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
