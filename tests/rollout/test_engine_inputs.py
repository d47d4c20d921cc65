"""Bad input to the rollout engine's Python API is refused with an error that names it, before
anything changes (a new user's trial, 2026-12-01): each of these used to be accepted silently,
or crashed deep inside, or moved the caller's model to a device it cannot run on."""

import copy

import numpy as np
import pytest
import torch
from _rollout_helpers import make_model
from transformers import Qwen3Config

from splitrl.models import ModelConfig, PolicyModel
from splitrl.models.config import SIZE_KEYS, TINY_BACKBONE
from splitrl.models.policy import check_defaulted_size
from splitrl.rollout import GenerationConfig, RolloutEngine

VOCAB = 64
PROMPTS = [[1, 2, 3], [4, 5]]


@pytest.fixture(scope="module")
def model():
    return make_model(vocab=VOCAB, depths=1)


def _tokens(engine, prompts=PROMPTS, seeds=(7, 8)):
    return [r.response_ids for r in engine.generate(prompts, list(seeds))]


# --------------------------------------------------------------------------- model config
@pytest.mark.parametrize(
    "family, backbone, billions",
    [
        ("qwen3", {}, "12.05"),
        ("qwen3", {"vocab_size": 64}, "10.81"),
        ("llama", {"vocab_size": 64}, "6.48"),
        ("qwen3_moe", {}, "0.89"),
        ("qwen2", {"vocab_size": 64}, "10.81"),
    ],
)
def test_a_backbone_that_transformers_defaults_make_huge_is_refused_before_it_is_built(family, backbone, billions):
    """Such a dict used to build transformers' full-size defaults (12 B parameters for {}) and the
    process was killed for memory with no message. Counted on the meta device: no memory."""
    with pytest.raises(ValueError, match=rf"model.backbone lacks .*hidden_size=\d+.* make a {billions} B-parameter"):
        PolicyModel.from_config(ModelConfig(family=family, backbone=backbone))


def test_a_backbone_that_stays_small_with_some_defaults_still_builds():
    """Runs whose backbone lacked a size key that kept it small (intermediate_size: transformers'
    22016) trained before the guard; they must still build, resume and evaluate. So must a large
    shape whose missing key changes its size little (a 0.6 B shape without vocab_size)."""
    no_ffn = {k: v for k, v in TINY_BACKBONE.items() if k != "intermediate_size"}
    model = PolicyModel.from_config(ModelConfig(backbone=no_ffn))
    assert model.config.intermediate_size == 22016 and model.config.hidden_size == TINY_BACKBONE["hidden_size"]
    shape = dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8
    )
    check_defaulted_size(ModelConfig(backbone=shape), Qwen3Config(**shape))  # 0.6 B: 1.4x the vocab-128 model
    # (with its kv heads: transformers' default, 32, serves no 4-head model, which the library refuses)
    sized = PolicyModel.from_config(ModelConfig(backbone={k: TINY_BACKBONE[k] for k in (*SIZE_KEYS, "num_key_value_heads")}))
    assert sized.config.hidden_size == TINY_BACKBONE["hidden_size"]


def test_preflight_refuses_the_huge_default_and_names_the_small_ones_it_lets_through(caplog):
    from _configs import demo_config
    from splitrl.controller.preflight import model_hf_config

    config = demo_config(["model.backbone={vocab_size: 64}"])
    with pytest.raises(ValueError, match="10.81 B-parameter"):
        model_hf_config(config)
    no_ffn = {k: TINY_BACKBONE[k] for k in (*SIZE_KEYS, "num_key_value_heads") if k != "intermediate_size"}
    with caplog.at_level("WARNING"):
        assert model_hf_config(demo_config([f"model.backbone={no_ffn}"])).intermediate_size == 22016
    assert (
        "model.backbone lacks intermediate_size: transformers' qwen3 defaults are used (intermediate_size=22016)"
        in caplog.text
    )


# --------------------------------------------------------------------------- generation config
@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", float("nan")), ("top_k", -3),
     ("max_new_tokens", 0), ("stop_token_ids", [-1])],
)  # fmt: skip
def test_setting_a_bad_value_on_a_config_is_refused_as_at_construction(field, value):
    cfg = GenerationConfig(max_new_tokens=6)
    before = cfg.model_dump()
    with pytest.raises(ValueError, match=field):
        setattr(cfg, field, value)
    assert cfg.model_dump() == before


def test_the_engine_revalidates_its_config_and_keeps_its_own_copy(model):
    # model_copy(update=...) skips pydantic's checks; the engine runs them again
    with pytest.raises(ValueError, match="temperature"):
        RolloutEngine(model, GenerationConfig().model_copy(update={"temperature": -1.0}), "cpu")
    with pytest.raises(TypeError, match="GenerationConfig"):
        RolloutEngine(model, {"max_new_tokens": 6}, "cpu")
    cfg = GenerationConfig(max_new_tokens=6, stop_token_ids=[1])
    engine = RolloutEngine(model, cfg, "cpu")
    want = _tokens(engine)
    cfg.max_new_tokens = 20  # the caller's object: the engine follows none of it
    cfg.stop_token_ids.append(VOCAB + 5)
    got = engine.generate(PROMPTS, [7, 8])
    assert [r.response_ids for r in got] == want and all(len(r.response_ids) <= 6 for r in got)


# --------------------------------------------------------------------------- device
@pytest.mark.parametrize("device", ["meta", "gpu", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_a_device_the_engine_cannot_decode_on_is_refused_and_the_model_stays(device):
    """device="meta" used to be accepted and moved the caller's model to meta (weights gone)."""
    model = make_model(vocab=VOCAB, depths=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="device"):
        RolloutEngine(model, GenerationConfig(max_new_tokens=4), device)
    after = model.state_dict()
    assert all(after[k].device.type == "cpu" and torch.equal(after[k], v) for k, v in before.items())


# --------------------------------------------------------------------------- weights
def test_non_finite_weights_are_refused_at_construction_and_in_a_sync(model):
    """NaN weights used to give token 0 at every step, NaN logprobs and 100 % acceptance."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.backbone.model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        RolloutEngine(broken, GenerationConfig(max_new_tokens=4), "cpu")

    engine = RolloutEngine(copy.deepcopy(model), GenerationConfig(max_new_tokens=6, speculative=True), "cpu")
    engine.load_state_dict(model.state_dict(), version=3)
    want = _tokens(engine)
    bad = {k: v.clone() for k, v in model.state_dict().items()}
    bad[next(k for k in bad if k.startswith("mtp."))].view(-1)[0] = float("inf")
    with pytest.raises(ValueError, match="non-finite.*keeps policy version 3"):
        engine.load_state_dict(bad, version=4)
    assert engine.policy_version == 3 and _tokens(engine) == want
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in engine.model.state_dict().items())
    with pytest.raises(TypeError, match="version"):
        engine.load_state_dict(model.state_dict(), version="x")


# --------------------------------------------------------------------------- prompts and seeds
@pytest.mark.parametrize(
    "prompts, seeds, match",
    [
        ([[1, 2.9]], [0], r"prompt 0's token 1 is 2.9 \(float\)"),  # was taken as [1, 2]
        ([[1, 2]], [1.5], r"seed 0 is 1.5"),  # was taken as seed 1
        ([[1, 2]], ["0"], r"seed 0 is '0'"),  # was taken as seed 0
        (["abc"], [0], "tokenize the text first"),
        ([1, 2, 3], [0, 1, 2], r"for one prompt pass \[\[id"),
        ([[1, 2]], None, "seeds must be a list of ints"),
        ("abc", [0, 1, 2], "prompts must be a list"),
    ],
)
def test_prompts_and_seeds_of_the_wrong_type_are_refused(model, prompts, seeds, match):
    engine = RolloutEngine(model, GenerationConfig(max_new_tokens=4), "cpu")
    want = _tokens(engine)
    with pytest.raises(TypeError, match=match):
        engine.generate(prompts, seeds)
    assert _tokens(engine) == want  # the engine is unharmed


def test_integer_tensors_and_numpy_ints_are_taken_as_the_same_ids_and_seeds(model):
    engine = RolloutEngine(model, GenerationConfig(max_new_tokens=5), "cpu")
    want = _tokens(engine, [[1, 2, 3]], [7])
    assert _tokens(engine, [torch.tensor([1, 2, 3])], [np.int64(7)]) == want
    assert _tokens(engine, torch.tensor([[1, 2, 3]]), torch.tensor([7])) == want
    assert _tokens(engine, [np.array([1, 2, 3], dtype=np.int32)], [np.uint8(7)]) == want
