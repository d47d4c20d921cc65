"""The checks of a backbone's transformers config that a model built from it would only fail
inside a worker (or not at all, training on nothing): shared by the library
(:meth:`splitrl.models.PolicyModel.from_config`) and the run's preflight
(:func:`splitrl.controller.preflight.model_hf_config`), so both refuse the same configs with the
same one-line ``ValueError``.

- :func:`backbone_hf_config`: ``ModelConfig.backbone`` → the family's transformers config: every
  key must be one the family's config knows (transformers keeps a misspelt one silently), its
  sizes positive integers, and transformers must accept it; then :func:`check_backbone_shape`.
- :func:`check_backbone_shape`: any config of a supported family (a ``pretrained_path``'s too):
  every size of ``Family.size_keys`` >= 1, head counts that divide, ``rms_norm_eps`` > 0, and for
  a mixture of experts 1 <= ``num_experts_per_tok`` <= ``num_experts`` with at least one MoE layer.

Imports transformers only when called (through :meth:`Family.config_class`).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from splitrl.models.config import ModelConfig
from splitrl.models.families import FAMILIES, family_of, get_family, other_names

KEY = "model.backbone"


def backbone_hf_config(config: ModelConfig) -> Any:
    """The transformers config that ``config.backbone`` (over the family's ``backbone_defaults``)
    builds, once it is checked (:func:`check_backbone_shape`). ``config.pretrained_path`` is not
    read.

    Raises:
        ValueError: one line naming ``model.backbone.<key>`` and its value: a key the family's
            config does not know (with the closest one that it does), a size that is not a
            positive integer, values transformers rejects, or a shape no model can have.
    """
    family = get_family(config.family)
    cls = family.config_class()
    # transformers keeps any keyword as an attribute: a misspelt key would be ignored silently
    known = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters) | set(cls.attribute_map)
    known.update(family.undeclared_config_keys)  # e.g. head_dim: read by the attention, not a config argument
    if "rope_parameters" in known:  # transformers 5 folds the older rope keys into rope_parameters
        known.update(("rope_theta", "rope_scaling"))
    unknown = sorted(set(config.backbone) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{KEY}.{unknown[0]} is not a key of the {config.family} config{hint}; unknown keys: {unknown}"
        )
    # the sizes as given, before transformers divides by them (llama's head_dim = hidden_size / heads)
    for name, value in config.backbone.items():
        # a size under either of its names (num_experts <-> num_local_experts)
        size = next((n for n in (name, *other_names(cls.attribute_map, name)) if n in family.size_keys), None)
        if size is not None and value is not None and not _positive_int(value):
            raise ValueError(_size_message(f"{KEY}.{name}", value, size, given=True))
    try:
        hf_cfg = cls(**config.backbone_kwargs())  # as built
    except Exception as e:  # noqa: BLE001 - transformers' own validators raise several kinds
        raise ValueError(f"{KEY} is rejected by transformers' {config.family} config: {e}") from None
    check_backbone_shape(hf_cfg, KEY, given=config.backbone)
    return hf_cfg


def check_backbone_shape(hf_cfg: Any, key: str, given: Mapping[str, Any] | None = None) -> None:
    """Refuse a transformers config of a supported family whose shape no model can have, or that
    would train on nothing.

    Args:
        hf_cfg: the config (built from ``model.backbone``, or a checkpoint's ``config.json``).
        key: what the message names: ``model.backbone`` (a key of it: ``model.backbone.<k>``),
            or e.g. ``model.pretrained_path='...' (config.json)`` (``<key>: <k>=<value>``).
        given: the backbone dict as the user wrote it (None for a checkpoint's config): the
            messages name its keys and say what to set.

    Raises:
        ValueError: one line naming the key, its value and what to write instead.
    """
    family = family_of(hf_cfg)
    user = given is not None

    def at(k: str) -> str:
        name = k
        if user and k not in given:  # given under transformers' other name (num_local_experts)
            name = next((a for a in other_names(getattr(type(hf_cfg), "attribute_map", {}) or {}, k) if a in given), k)
        return f"{key}.{name}" if user else f"{key}: {name}"

    for k in family.size_keys:
        value = getattr(hf_cfg, k, None)
        if value is not None and not _positive_int(value):
            raise ValueError(_size_message(at(k), value, k, given=user))
    heads = getattr(hf_cfg, "num_attention_heads", None)
    kv = getattr(hf_cfg, "num_key_value_heads", None) or heads
    if heads is not None and kv is not None and (kv < 1 or heads % kv != 0):
        raise ValueError(
            f"{key}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} "
            "(each key/value head serves a whole group of query heads); make num_key_value_heads a divisor "
            "of num_attention_heads"
        )
    head_dim = getattr(hf_cfg, "head_dim", None)
    hidden = getattr(hf_cfg, "hidden_size", None)
    if head_dim is None and heads and hidden is not None and hidden % heads != 0:
        raise ValueError(
            f"{key}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; set head_dim or "
            "change one of the two"
        )
    eps = getattr(hf_cfg, "rms_norm_eps", None)
    if isinstance(eps, (int, float)) and not eps > 0:  # NaN too
        raise ValueError(
            f"{at('rms_norm_eps')}={eps!r} must be a small positive number (the RMSNorm divides by "
            f"sqrt(mean(x²) + rms_norm_eps): a negative or zero one makes NaN); "
            + ("set it to e.g. 1e-6" if user else "fix config.json or use another model")
        )
    if family.moe:
        _check_experts(hf_cfg, key, at, user)


def _check_experts(hf_cfg: Any, key: str, at, user: bool) -> None:
    """A routed layer picks ``num_experts_per_tok`` of ``num_experts``; at least one layer must be
    routed (the router loss and its statistics read the MoE layers' router logits)."""
    E, k = hf_cfg.num_experts, hf_cfg.num_experts_per_tok
    if k > E:
        raise ValueError(
            f"{at('num_experts_per_tok')} must be between 1 and num_experts ({E}); got {k} (each token is routed to "
            "num_experts_per_tok of the layer's experts); "
            + (
                f"set num_experts_per_tok <= {E}, or raise num_experts"
                if user
                else "fix config.json or use another model"
            )
        )
    L = hf_cfg.num_hidden_layers
    step = hf_cfg.decoder_sparse_step
    dense = list(getattr(hf_cfg, "mlp_only_layers", None) or [])
    if not any((i + 1) % step == 0 and i not in dense for i in range(L)):
        raise ValueError(
            f"{key}: none of the {L} layers is a mixture of experts (decoder_sparse_step={step} routes the layers "
            f"whose number, from 1, is a multiple of {step}; mlp_only_layers={dense} lists those kept dense), so nothing trains the routers; set "
            f"decoder_sparse_step <= num_hidden_layers and leave a layer out of mlp_only_layers, or use {_dense()}"
        )


def _dense() -> str:
    """``a dense family (model.family: qwen3, llama or ...)``: the registry's families without experts."""
    names = [f.name for f in FAMILIES.values() if not f.moe]
    return f"a dense family (model.family: {', '.join(names[:-1])} or {names[-1]})"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _size_message(where: str, value: Any, size: str, *, given: bool) -> str:
    """``<where>=<value>: ... must be a positive integer``, with what to write instead."""
    if not given:
        return (
            f"{where}={value!r}: a size of the model must be a positive integer; fix config.json or use another model"
        )
    name = where.rpartition(".")[2]
    out = f"{where}={value!r}: a size of the model must be a positive integer; set {name} >= 1"
    if size == "num_experts":
        out += f"; for a model without experts use {_dense()}"
    return out
