"""The README's real-model walkthrough on a checkpoint and tokenizer written here (issue 10, item 6):
a local Qwen3 directory without MTP weights, its chat template applied to the prompts
(``task.chat_template: true``), its own stop tokens, fresh MTP heads trained alone for
``train.mtp_warmup_steps`` before RL moves the policy."""

import json

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

import splitrl.workers.generation as generation_module
from _configs import demo_config
from splitrl.controller.controller import train
from splitrl.logging import read_metrics
from splitrl.tasks import build_char_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_hf_model(path):
    tok = build_char_tokenizer()  # 100 ids; a chat model's turn markers on top
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(path)  # stock HF: no MTP tensors
    GenerationConfig(eos_token_id=[im_end, tok.eos_token_id]).save_pretrained(path)
    return tok, im_end


def _backbone(path):
    return {k: v for k, v in load_file(str(path / "model.safetensors")).items() if not k.startswith("mtp.")}


def test_post_train_a_local_hf_checkpoint_with_chat_template_and_mtp_warmup(tmp_path, monkeypatch):
    hf = tmp_path / "qwen3-tiny"
    tok, im_end = _write_hf_model(hf)
    seen = []
    real_encode = generation_module.encode_prompt

    def spy(prompt, tokenizer, chat_template=None):
        ids = real_encode(prompt, tokenizer, chat_template)
        seen.append(tokenizer.decode(ids))
        return ids

    monkeypatch.setattr(generation_module, "encode_prompt", spy)
    out = tmp_path / "run"
    cfg = demo_config([
        f"model.pretrained_path={hf}", "tokenizer={kind: pretrained}", "model.mtp.mtp_num_layers=1",
        "train.mtp_warmup_steps=1", "task={kind: reverse_digits, chat_template: true}",
        "schedule.groups_per_step=2", "schedule.group_size=2", "schedule.min_groups_per_chunk=1", "schedule.generation_groups_per_call=2",
        "rollout.max_new_tokens=6", "schedule.num_steps=2", "checkpoint.every=1", "checkpoint.export_every=1", "buffer.max_staleness=0",
        "cluster.backend=local", "dataplane.kind=inprocess", "logging.progress_bar=false", "logging.tensorboard=false",
        f"output_dir={out}",
    ])
    train(cfg)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["train/mtp_warmup"] for r in rows] == [1.0, 0.0]

    # every prompt went through the chat template
    assert seen and all(s.startswith("<|im_start|>user\n") and s.endswith("<|im_start|>assistant\n") for s in seen)

    original = _backbone(hf)
    step1, step2 = (out / "checkpoints" / f"step_00000{k}" / "policy" for k in (1, 2))
    after_warmup = _backbone(step1)
    assert set(after_warmup) == set(original)
    assert all(torch.equal(after_warmup[k], original[k]) for k in original)  # warmup: the policy did not move
    assert "mtp.fc.weight" in load_file(str(step1 / "model.safetensors"))  # fresh heads, saved
    after_rl = _backbone(step2)
    assert any(not torch.equal(after_rl[k], original[k]) for k in original)  # then RL trains the policy

    # the checkpoint keeps the model's own stop tokens and its chat template
    gen = json.loads((step2 / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, im_end]
    saved = AutoTokenizer.from_pretrained(step2)
    assert saved.chat_template == CHAT_TEMPLATE and saved.convert_tokens_to_ids("<|im_end|>") == im_end
