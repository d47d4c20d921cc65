"""Saving / loading policies (DESIGN §3 "Checkpoints"), through transformers' real loading path."""

import json

import pytest
import torch
from _utils import make_batch, make_loss, make_model, make_worker
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from splitrl.models import ModelConfig, MTPConfig, PolicyModel
from splitrl.models.checkpoint import export_deepseek_v3


def _outputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=g)
    seg = torch.tensor([[0] * 12, [0] * 5 + [1] * 7, [0] * 9 + [-1] * 3])
    with torch.no_grad():
        return model(ids, seg, mtp_loss_mask=torch.ones(3, 12), with_entropy=True)


QWEN3_NEXT_EXTRAS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")


def _expected_mtp_names(keys, num_modules):
    """The checkpoint names DESIGN §3 prescribes, built from the backbone's own layer-0 tensor names:
    Qwen3-Next's exactly for one stored depth module, ``mtp.layers.{i}.*`` for every name when more."""
    layer = sorted(k[len("model.layers.0.") :] for k in keys if k.startswith("model.layers.0."))
    if num_modules == 1:
        return {f"mtp.{x}.weight" for x in QWEN3_NEXT_EXTRAS} | {f"mtp.layers.0.{n}" for n in layer}
    return {f"mtp.layers.{i}.{x}.weight" for i in range(num_modules) for x in QWEN3_NEXT_EXTRAS} | {
        f"mtp.layers.{i}.{n}" for i in range(num_modules) for n in layer
    }


@pytest.mark.parametrize(
    "family,D,repeated",
    [("qwen3", 2, False), ("qwen3", 3, True), ("llama", 1, False), ("qwen3", 3, False), ("qwen2", 2, False)],
)
def test_save_load_round_trip_is_exact(tmp_path, family, D, repeated):
    model = make_model(D=D, repeated=repeated, family=family, seed=3)
    w = make_worker(model)
    w.train(make_batch(8), make_loss())  # trained weights, not the init
    model.save_pretrained(tmp_path)
    num_modules = 1 if repeated else D
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        mtp_keys = {k for k in keys if k.startswith("mtp.")}
        assert mtp_keys == _expected_mtp_names(keys, num_modules)  # a repeated module is stored once
        # every stored tensor is its depth's own
        for i in range(num_modules):
            depth = model.mtp.depths[i]
            pre = "mtp." if num_modules == 1 else f"mtp.layers.{i}."
            assert torch.equal(st.get_tensor(pre + "fc.weight"), depth.fc.weight.detach())
            assert torch.equal(st.get_tensor(pre + "norm.weight"), depth.norm.weight.detach())
            assert torch.equal(
                st.get_tensor(f"mtp.layers.{i}.self_attn.q_proj.weight"), depth.layer.self_attn.q_proj.weight.detach()
            )
            if model.family.qkv_bias:  # trained away from their zero init, stored per depth
                bias = depth.layer.self_attn.k_proj.bias.detach()
                stored = st.get_tensor(f"mtp.layers.{i}.self_attn.k_proj.bias")
                assert bias.abs().max() > 0 and torch.equal(stored, bias)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == num_modules
    loaded = PolicyModel.from_pretrained(str(tmp_path))
    assert loaded.mtp_config == model.mtp_config
    for (n, p), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
    a, b = _outputs(model), _outputs(loaded)
    assert torch.equal(a.logprobs, b.logprobs)
    for x, y in zip(a.mtp_loss_sums, b.mtp_loss_sums):
        assert torch.equal(x, y)


# the tiny shape of the stock Hugging Face directories these tests write
_STOCK_SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_stock_hugging_face_directory_loads_through_from_pretrained(tmp_path, family):
    if family == "qwen3":
        cfg = Qwen3Config(
            **_STOCK_SHAPE,
            head_dim=8,
            tie_word_embeddings=False,
        )
        hf = Qwen3ForCausalLM(cfg)
    elif family == "llama":
        cfg = LlamaConfig(
            **_STOCK_SHAPE,
        )
        hf = LlamaForCausalLM(cfg)
    else:  # Qwen2.5's shape: tied embeddings, q/k/v biases (drawn here: transformers starts them at 0)
        cfg = Qwen2Config(
            **_STOCK_SHAPE,
            tie_word_embeddings=True,
        )
        hf = Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path)  # a plain Hugging Face checkpoint, no MTP tensors
    model = PolicyModel.from_config(ModelConfig(pretrained_path=str(tmp_path), mtp=MTPConfig(mtp_num_layers=1)))
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        out = model(ids, mtp_loss_mask=torch.ones(2, 7))
    torch.testing.assert_close(out.logprobs[:, 1:], ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    assert model.mtp is not None and len(out.mtp_loss_sums) == 1
    # and back: the stock class reads our directory (ignoring mtp.*), same backbone outputs
    model.save_pretrained(tmp_path / "ours")
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_mismatched_mtp_shape_raises_clear_error(tmp_path):
    make_model(D=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mtp_num_layers=3"):
        PolicyModel.from_pretrained(str(tmp_path), mtp=MTPConfig(mtp_num_layers=3))
    with pytest.raises(ValueError, match="no config.json"):
        PolicyModel.from_pretrained(str(tmp_path / "missing"))


@pytest.mark.parametrize("repeated", [False, True])
def test_deepseek_v3_export_layout_is_per_depth(tmp_path, repeated):
    model = make_model(D=2, repeated=repeated)
    make_worker(model).train(make_batch(8), make_loss())  # depth modules trained apart
    export_deepseek_v3(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 2
    L = model.config.num_hidden_layers
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        for k in (1, 2):
            pre = f"model.layers.{L + k - 1}."
            for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
                assert f"{pre}{name}.weight" in keys
            depth = model.mtp.depths[0 if repeated else k - 1]
            for ds, ours in (
                ("enorm", depth.pre_fc_norm_embedding),
                ("hnorm", depth.pre_fc_norm_hidden),
                ("eh_proj", depth.fc),
                ("shared_head.norm", depth.norm),
                ("self_attn.q_proj", depth.layer.self_attn.q_proj),
                ("mlp.down_proj", depth.layer.mlp.down_proj),
            ):
                assert torch.equal(st.get_tensor(f"{pre}{ds}.weight"), ours.weight.detach()), (k, ds)
        same = torch.equal(
            st.get_tensor(f"model.layers.{L}.eh_proj.weight"), st.get_tensor(f"model.layers.{L + 1}.eh_proj.weight")
        )
        assert same == repeated


def test_worker_state_round_trip_resumes_identically():
    w = make_worker(make_model(D=1))
    w.train(make_batch(8, seed=0), make_loss())
    state = w.state_dict()
    w2 = make_worker(make_model(D=1, seed=99))
    w2.load_state_dict(state)
    m1 = w.train(make_batch(8, seed=1), make_loss())
    m2 = w2.train(make_batch(8, seed=1), make_loss())
    assert m1 == m2
    for (n, p), (_, p2) in zip(w.model.named_parameters(), w2.model.named_parameters()):
        assert torch.equal(p, p2), n


def test_every_depth_owns_its_modules_and_a_repeated_depth_is_one_module():
    model = make_model(D=3, seed=1)
    assert len(model.mtp.depths) == 3
    ids = [{id(p) for p in model.mtp.depth_module(k).parameters()} for k in (1, 2, 3)]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2]) and not (ids[0] & ids[2])
    for k in (1, 2, 3):
        assert model.mtp.layer_for_depth(k) is model.mtp.depths[k - 1].layer
    make_worker(model).train(make_batch(8), make_loss())
    # trained apart: the input norms (initialized to ones) now differ per depth
    w = [model.mtp.depth_module(k).pre_fc_norm_hidden.weight.detach() for k in (1, 2, 3)]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])

    rep = make_model(D=3, repeated=True)
    assert len(rep.mtp.depths) == 1
    assert all(rep.mtp.depth_module(k) is rep.mtp.depths[0] for k in (1, 2, 3))
    one = sum(p.numel() for p in rep.mtp.depths[0].parameters())
    assert sum(p.numel() for p in rep.mtp.parameters()) == one
    assert sum(p.numel() for p in model.mtp.parameters()) == 3 * one
    with pytest.raises(IndexError):
        rep.mtp.depth_module(4)


def _stock_qwen3_dir(path, mtp_tensors, mtp_num_hidden_layers, seed=0):
    """A directory as another tool would write it: stock Qwen3 weights plus ``mtp.*`` tensors added
    to the same safetensors file, ``mtp_num_hidden_layers`` in config.json, no splitrl keys."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        **_STOCK_SHAPE,
        head_dim=8,
        tie_word_embeddings=True,
    )
    hf = Qwen3ForCausalLM(cfg)
    hf.save_pretrained(path)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    sd.update({k: v.contiguous() for k, v in mtp_tensors(sd).items()})
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((path / "config.json").read_text())
    c["mtp_num_hidden_layers"] = mtp_num_hidden_layers
    (path / "config.json").write_text(json.dumps(c))
    return sd


def _random_mtp(sd, layers, shared_extras):
    """Random MTP tensors named as Qwen3-Next names them (decoder layer i from ``model.layers.0``'s shapes)."""
    g = torch.Generator().manual_seed(7)
    H = sd["model.norm.weight"].shape[0]
    out = {}
    extras = {
        "pre_fc_norm_embedding.weight": (H,),
        "pre_fc_norm_hidden.weight": (H,),
        "fc.weight": (H, 2 * H),
        "norm.weight": (H,),
    }
    if shared_extras:
        out.update({f"mtp.{n}": torch.randn(s, generator=g) for n, s in extras.items()})
    for i in range(layers):
        for k, v in sd.items():
            if k.startswith("model.layers.0."):
                out[f"mtp.layers.{i}.{k[len('model.layers.0.') :]}"] = torch.randn(v.shape, generator=g)
    return out


def test_qwen3_next_layout_directory_loads_and_saves_back_the_same_names(tmp_path):
    src = tmp_path / "qwen3_next"
    sd = _stock_qwen3_dir(src, lambda sd: _random_mtp(sd, 1, shared_extras=True), 1)
    stored = {k: v for k, v in sd.items() if k.startswith("mtp.")}
    model = PolicyModel.from_pretrained(str(src))
    assert model.num_mtp_depths == 1 and len(model.mtp.depths) == 1
    d = model.mtp.depths[0]
    for name, mod in (
        ("fc", d.fc),
        ("pre_fc_norm_embedding", d.pre_fc_norm_embedding),
        ("pre_fc_norm_hidden", d.pre_fc_norm_hidden),
        ("norm", d.norm),
    ):
        assert torch.equal(mod.weight.detach(), stored[f"mtp.{name}.weight"]), name
    assert torch.equal(d.layer.mlp.up_proj.weight.detach(), stored["mtp.layers.0.mlp.up_proj.weight"])
    model.save_pretrained(tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), framework="pt") as st:
        ours = {k: st.get_tensor(k) for k in st.keys() if k.startswith("mtp.")}
    assert ours.keys() == stored.keys()
    for k in stored:
        assert torch.equal(ours[k], stored[k]), k
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["mtp_num_hidden_layers"] == 1


def test_shared_depth_checkpoint_is_converted_by_copying_into_every_depth(tmp_path, caplog):
    """splitrl checkpoints before per-depth modules (and Qwen3-Next with several MTP layers) share
    fc / input norms / final norm across depths: each depth module gets a copy, exactly."""
    src = tmp_path / "shared"
    sd = _stock_qwen3_dir(src, lambda sd: _random_mtp(sd, 2, shared_extras=True), 2)
    with caplog.at_level("WARNING"):
        model = PolicyModel.from_pretrained(str(src))
    assert "copied into each of the 2 depth modules" in caplog.text
    assert model.num_mtp_depths == 2 and not model.mtp.repeated
    for i in range(2):
        d = model.mtp.depths[i]
        assert torch.equal(d.fc.weight.detach(), sd["mtp.fc.weight"])
        assert torch.equal(d.norm.weight.detach(), sd["mtp.norm.weight"])
        assert torch.equal(d.pre_fc_norm_hidden.weight.detach(), sd["mtp.pre_fc_norm_hidden.weight"])
        assert torch.equal(d.layer.self_attn.k_proj.weight.detach(), sd[f"mtp.layers.{i}.self_attn.k_proj.weight"])
    assert model.mtp.depths[0].fc.weight.data_ptr() != model.mtp.depths[1].fc.weight.data_ptr()
    model.save_pretrained(tmp_path / "ours")  # written back in the per-depth layout
    again = PolicyModel.from_pretrained(str(tmp_path / "ours"))
    for (n, p), (n2, p2) in zip(model.named_parameters(), again.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
