"""Backbone shapes no model can have (a new user's trial): each is one config error line before
anything is written to output_dir, from the CLI and from the library alike
(splitrl.models.backbone_checks); and the MoE family's own backbone keys are in the resolved config."""

import json
import logging

import pytest

from _configs import demo_config
from splitrl.cli import main
from splitrl.controller.preflight import check_resume_config
from splitrl.controller.run_checkpoint import RUN_CONFIG
from splitrl.models import ModelConfig, PolicyModel
from splitrl.models.backbone_checks import backbone_hf_config, check_backbone_shape
from splitrl.models.config import TINY_BACKBONE, TINY_MOE
from splitrl.models.families import FAMILIES, SUPPORTED_FAMILIES

RUN = ["train", "cluster.backend=local", "schedule.num_steps=1"]
MOE = "model.family=qwen3_moe"
SIZE = ": a size of the model must be a positive integer"

REFUSED = [
    # MoE: crashed in step 1 after config.yaml / metrics were written, or trained on NaN metrics
    ([MOE, "model.backbone.num_experts_per_tok=8"], "model.backbone.num_experts_per_tok must be between 1 and num_experts (4); got 8"),
    ([MOE, "model.backbone.moe_intermediate_size=0"], "model.backbone.moe_intermediate_size=0" + SIZE + "; set moe_intermediate_size >= 1"),
    ([MOE, "model.backbone.num_experts=0"], "model.backbone.num_experts=0" + SIZE + "; set num_experts >= 1; for a model without experts use a dense family"),
    ([MOE, "model.backbone.num_local_experts=0"], "model.backbone.num_local_experts=0: a size of the model"),  # transformers' other name
    ([MOE, "model.backbone.num_experts_per_tok=0"], "model.backbone.num_experts_per_tok=0: a size of the model must be a positive integer"),
    ([MOE, "model.backbone.decoder_sparse_step=0"], "model.backbone.decoder_sparse_step=0: a size of the model"),
    ([MOE, "model.backbone.decoder_sparse_step=3"], "model.backbone: none of the 2 layers is a mixture of experts (decoder_sparse_step=3"),
    ([MOE, "model.backbone.mlp_only_layers=[0, 1]"], "model.backbone: none of the 2 layers is a mixture of experts"),
    # dense: tracebacks from the preflight or a worker, or a run that trained silently
    (["model.backbone.num_hidden_layers=0"], "model.backbone.num_hidden_layers=0: a size of the model must be a positive integer; set num_hidden_layers >= 1"),
    (["model.backbone.head_dim=0"], "model.backbone.head_dim=0: a size of the model must be a positive integer"),
    (["model.backbone.hidden_size=-5"], "model.backbone.hidden_size=-5: a size of the model must be a positive integer"),
    (["model.backbone.hidden_size=0"], "model.backbone.hidden_size=0: a size of the model must be a positive integer"),
    (["model.backbone.intermediate_size=0"], "model.backbone.intermediate_size=0: a size of the model must be a positive integer"),
    (["model.backbone.num_key_value_heads=0"], "model.backbone.num_key_value_heads=0: a size of the model"),
    (["model.family=llama", "model.backbone.num_attention_heads=0"], "model.backbone.num_attention_heads=0: a size"),  # before llama divides by it
    (["model.family=qwen2", "model.backbone.head_dim=16.5"], "model.backbone.head_dim=16.5" + SIZE),  # not a Qwen2Config field: transformers takes any
    (["model.backbone.rms_norm_eps=-1.0"], "model.backbone.rms_norm_eps=-1.0 must be a small positive number"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,line", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_a_backbone_shape_no_model_can_have_is_one_config_error_before_any_file(tmp_path, capsys, overrides, line):
    """`splitrl train` exits 2 with one line, and output_dir is as it was: absent (not created),
    or an existing empty one still empty (no config.yaml, metrics.jsonl, tensorboard/)."""
    out = tmp_path / "run"
    assert main([*RUN, f"output_dir={out}", *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("splitrl: " + line), err
    assert not out.exists()
    out.mkdir()
    assert main([*RUN, f"output_dir={out}", *overrides]) == 2
    assert line in capsys.readouterr().err and not list(out.iterdir())
    assert main(["train", "--print-config", *overrides]) == 2  # --print-config checks the model too
    assert line in capsys.readouterr().err


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_the_library_refuses_them_too(family):
    """PolicyModel.from_config raises the same ValueError (one check, shared with the preflight)."""
    for key, value in [("hidden_size", 0), ("num_hidden_layers", -1), ("intermediate_size", 0)]:
        with pytest.raises(ValueError, match=rf"^model.backbone.{key}={value}: a size of the model must be a positive"):
            PolicyModel.from_config(ModelConfig(family=family, backbone={**TINY_BACKBONE, key: value}))
    PolicyModel.from_config(ModelConfig(family=family))  # control: the tiny default builds


def test_a_misspelt_backbone_key_is_refused_by_the_library_as_by_the_cli(capsys):
    """from_config silently dropped `hidden_sise` (transformers keeps any keyword as an attribute);
    the CLI already refused `hidden_sizee`. Both now raise the one check's message."""
    backbone = {
        "vocab_size": 22, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 2, "hidden_sise": 64,
    }  # fmt: skip
    with pytest.raises(ValueError) as e:
        PolicyModel.from_config(ModelConfig(backbone=backbone))
    assert str(e.value) == (
        "model.backbone.hidden_sise is not a key of the qwen3 config (did you mean 'hidden_size'?); "
        "unknown keys: ['hidden_sise']"
    )
    assert main(["train", "--print-config", "model.backbone.hidden_sise=64"]) == 2
    assert capsys.readouterr().err.strip() == f"splitrl: {e.value}"


def test_a_checkpoints_config_is_checked_with_its_own_words():
    """A pretrained_path's config.json: the same checks, naming the file instead of a key to set."""
    cls = FAMILIES["qwen3_moe"].config_class()
    key = "model.pretrained_path='m' (config.json)"
    with pytest.raises(ValueError, match=r"^model.pretrained_path='m' \(config.json\): num_hidden_layers=0: a size .* fix config.json"):
        check_backbone_shape(cls(**{**TINY_BACKBONE, **TINY_MOE, "num_hidden_layers": 0}), key)
    with pytest.raises(ValueError, match=r": num_experts_per_tok must be between 1 and num_experts \(4\); got 6 .*fix config.json"):
        check_backbone_shape(cls(**{**TINY_BACKBONE, **TINY_MOE, "num_experts_per_tok": 6}), key)
    check_backbone_shape(cls(**{**TINY_BACKBONE, **TINY_MOE}), key)  # control


def test_every_family_names_sizes_its_config_has():
    """Family.size_keys are attributes of each config (a misspelt one would check nothing), and
    config_aliases is transformers' attribute_map."""
    for family in FAMILIES.values():
        cfg = family.config_class()(**{**TINY_BACKBONE, **family.backbone_defaults})
        assert all(isinstance(getattr(cfg, k), int) for k in family.size_keys), family.name
        assert dict(family.config_aliases) == dict(family.config_class().attribute_map)
    assert backbone_hf_config(ModelConfig(family="qwen3_moe")).num_experts == TINY_MOE["num_experts"]


def test_the_moe_familys_own_keys_are_in_the_resolved_config(capsys):
    """--print-config (and so config.yaml and run_config.json, dumps of the same config) showed
    only the standard keys; the model was built with 4 experts, 2 a token, ... from TINY_MOE."""
    assert main(["train", MOE, "--print-config"]) == 0
    out = capsys.readouterr().out
    for key, value in TINY_MOE.items():
        assert f"\n    {key}: {str(value).lower()}\n" in out, key
    backbone = ModelConfig(family="qwen3_moe", backbone={**TINY_BACKBONE, "num_experts_per_tok": 1}).backbone
    assert backbone == {**TINY_BACKBONE, **TINY_MOE, "num_experts_per_tok": 1}  # the user's value kept
    assert list(backbone)[: len(TINY_BACKBONE)] == list(TINY_BACKBONE)  # the given keys first, as given
    # transformers' other name for num_experts: no second, contradicting default beside it
    given = ModelConfig(family="qwen3_moe", backbone={**TINY_BACKBONE, "num_local_experts": 8})
    assert "num_experts" not in given.backbone and backbone_hf_config(given).num_experts == 8
    assert ModelConfig().backbone == TINY_BACKBONE  # a dense family has none
    assert ModelConfig(family="qwen3_moe", pretrained_path="/x").backbone == TINY_BACKBONE  # read from the directory


def test_a_moe_run_saved_before_the_keys_were_shown_still_resumes(tmp_path, caplog):
    """A run_config.json written without the family's backbone keys is the same model."""
    from splitrl.controller.run_checkpoint import write_complete

    cfg = demo_config([f"output_dir={tmp_path}", MOE])
    saved = cfg.model_dump(mode="json")
    for key in TINY_MOE:
        del saved["model"]["backbone"][key]
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    (ckpt / RUN_CONFIG).write_text(json.dumps(saved))
    write_complete(ckpt, 1)
    with caplog.at_level(logging.WARNING):
        check_resume_config(cfg, ckpt)
    assert "differ" not in caplog.text
    other = demo_config([f"output_dir={tmp_path}", MOE, "model.backbone.num_experts=8"])
    with pytest.raises(ValueError, match=r"model.backbone.num_experts: checkpoint 4, this run 8"):
        check_resume_config(other, ckpt)


def test_the_older_rope_keys_are_taken():
    """rope_theta / rope_scaling are keys every Qwen3 / Llama config file has had; transformers 5
    folds them into rope_parameters. The unknown-key check refused them (CLI and library)."""
    model = PolicyModel.from_config(ModelConfig(backbone={**TINY_BACKBONE, "rope_theta": 500_000.0}))
    assert model.config.rope_parameters["rope_theta"] == 500_000.0
