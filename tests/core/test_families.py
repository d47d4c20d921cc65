"""The family registry (splitrl.models.families): each entry describes the model it builds, and
no module outside it names a family."""

import ast
from pathlib import Path

import pydantic
import pytest
import torch

from splitrl.models import ModelConfig, MTPConfig, PolicyModel
from splitrl.models.families import FAMILIES, GGUF_ARCHITECTURES, SUPPORTED_FAMILIES, get_family
from splitrl.models.gguf import READABLE_FAMILIES

SRC = Path(__file__).resolve().parents[2] / "src" / "splitrl"


@pytest.mark.parametrize("name", SUPPORTED_FAMILIES)
def test_each_entry_describes_the_model_it_builds(name):
    family = FAMILIES[name]
    model = PolicyModel.from_config(ModelConfig(family=name, mtp=MTPConfig(mtp_num_layers=1)))
    assert model.family is family and type(model.config) is family.config_class()
    assert model.config.model_type == name and model.is_moe == family.moe
    for key, value in family.backbone_defaults.items():
        assert getattr(model.config, key) == value
    layers = [*model.backbone.model.layers, model.mtp.layer_for_depth(1)]  # the MTP layer is the family's too
    for layer in layers:
        attn = layer.self_attn
        assert hasattr(attn, "q_norm") == hasattr(attn, "k_norm") == family.qk_norm
        assert all((getattr(attn, p).bias is not None) == family.qkv_bias for p in ("q_proj", "k_proj", "v_proj"))
    from splitrl.rollout.forward import DecoderForward

    DecoderForward(model)  # the rollout engine takes it (check_supported)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    out = model(ids, mtp_loss_mask=torch.ones(2, 9))
    assert torch.isfinite(out.logprobs).all() and len(out.mtp_loss_sums) == 1


def test_unknown_families_are_refused_with_the_list():
    with pytest.raises(pydantic.ValidationError, match="qwen2"):
        ModelConfig(family="gpt2")
    listed = r"backbone family 'gpt2' is not supported; use one of qwen3, llama, qwen3_moe, qwen2"
    with pytest.raises(ValueError, match=listed):
        get_family("gpt2")


def test_gguf_reads_the_registry_families_that_have_an_architecture():
    assert READABLE_FAMILIES == GGUF_ARCHITECTURES == ("llama", "qwen2", "qwen3")
    assert {f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture} <= set(FAMILIES)


def test_the_rollout_forward_refuses_layers_unlike_the_registry(monkeypatch):
    """A registry entry that says the wrong thing about q/k norms would decode silently wrong
    tokens; the engine refuses such a model instead."""
    import dataclasses

    from splitrl.models import families as families_mod
    from splitrl.rollout.forward import check_supported

    model = PolicyModel.from_config(ModelConfig(family="qwen3"))
    wrong = dict(families_mod.FAMILIES, qwen3=dataclasses.replace(FAMILIES["qwen3"], qk_norm=False))
    monkeypatch.setattr(families_mod, "FAMILIES", wrong)
    with pytest.raises(ValueError, match="q_norm / k_norm, but the family registry says qk_norm=False for 'qwen3'"):
        check_supported(model)


# where a family's name may still be written as a string: the registry, the model config's default
# family, the CPU demo's config
ALLOWED = {"models/families.py", "models/config.py", "config.py"}


def test_no_module_outside_the_registry_names_a_family():
    """Adding a family is one registry entry: code that compares with a family's name ("qwen3",
    "llama", ...) belongs in splitrl.models.families, as a field other modules read."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FAMILIES:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "family names outside splitrl.models.families:\n" + "\n".join(found)
