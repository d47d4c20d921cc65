"""Saving / loading policies (DESIGN §3 "Checkpoints"), through transformers' real loading path."""

import json

import pytest
import torch
from _utils import make_batch, make_loss, make_model, make_worker
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from splitrl.models import ModelConfig, MTPConfig, PolicyModel
from splitrl.models.checkpoint import export_deepseek_v3


def _outputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=g)
    seg = torch.tensor([[0] * 12, [0] * 5 + [1] * 7, [0] * 9 + [-1] * 3])
    with torch.no_grad():
        return model(ids, seg, mtp_loss_mask=torch.ones(3, 12), with_entropy=True)


@pytest.mark.parametrize("family,D,repeated", [("qwen3", 2, False), ("qwen3", 3, True), ("llama", 1, False)])
def test_save_load_round_trip_is_exact(tmp_path, family, D, repeated):
    model = make_model(D=D, repeated=repeated, family=family, seed=3)
    w = make_worker(model)
    w.train(make_batch(8), make_loss())  # trained weights, not the init
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
    mtp_keys = {k for k in keys if k.startswith("mtp.")}
    assert {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight", "mtp.norm.weight"} <= mtp_keys
    layers = {k.split(".")[2] for k in mtp_keys if k.startswith("mtp.layers.")}
    assert layers == ({"0"} if repeated else {str(i) for i in range(D)})  # a repeated layer is stored once
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == (1 if repeated else D)
    loaded = PolicyModel.from_pretrained(str(tmp_path))
    assert loaded.mtp_config == model.mtp_config
    for (n, p), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
    a, b = _outputs(model), _outputs(loaded)
    assert torch.equal(a.logprobs, b.logprobs)
    for x, y in zip(a.mtp_ce_sums, b.mtp_ce_sums):
        assert torch.equal(x, y)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_stock_hugging_face_directory_loads_through_from_pretrained(tmp_path, family):
    if family == "qwen3":
        cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
        hf = Qwen3ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
        hf = LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path)  # a plain Hugging Face checkpoint, no MTP tensors
    model = PolicyModel.from_config(
        ModelConfig(pretrained_path=str(tmp_path), mtp=MTPConfig(mtp_num_layers=1))
    )
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        out = model(ids, mtp_loss_mask=torch.ones(2, 7))
    torch.testing.assert_close(out.logprobs[:, 1:], ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    assert model.mtp is not None and len(out.mtp_ce_sums) == 1
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


def test_deepseek_v3_export_layout(tmp_path):
    model = make_model(D=2, repeated=True)
    export_deepseek_v3(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 2
    L = model.config.num_hidden_layers
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        for k in (L, L + 1):
            for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
                assert f"model.layers.{k}.{name}.weight" in keys
            assert torch.equal(st.get_tensor(f"model.layers.{k}.eh_proj.weight"), model.mtp.fc.weight.detach())
            assert torch.equal(
                st.get_tensor(f"model.layers.{k}.self_attn.q_proj.weight"), model.mtp.layers[0].self_attn.q_proj.weight.detach()
            )


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
