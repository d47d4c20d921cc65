"""A tiny llama checkpoint written as a GGUF file by the ``gguf`` package's own writer, with the
Hugging Face model it was written from (the reference the converted directory must equal).

The file is laid out as llama.cpp's converter lays out a llama model, so transformers' GGUF
loader reads it as it reads a downloaded one:

- tensors under llama.cpp's names (``token_embd``, ``blk.{i}.attn_q`` ..., ``output_norm``,
  ``output`` only when the head is not tied), fp32;
- ``attn_q`` / ``attn_k`` rows permuted per head the way llama.cpp's converter does (its rotary
  layout pairs dimension i with i + 1, Hugging Face's i with i + head_dim/2); transformers undoes
  that on load (``LlamaTensorProcessor._reverse_permute_weights``), so writing the unpermuted
  weights would load a different model;
- a byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``, as SmolLM2 and Llama 3 ship):
  three special tokens, the 256 byte symbols, a few merges, so every string round-trips.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # unk, bos, eos (= pad)
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"), ("Ġa", "n")]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a float32 value, so the reference and the file (which stores float32) agree exactly
RMS_EPS = float(np.float32(1e-5))
SHAPE = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=12, max_position_embeddings=128, rope_theta=10000.0)  # fmt: skip


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for the bytes 0..255, in byte order
    (printable Latin-1 bytes stand for themselves, the others for code points from 256 up)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in kept:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges "a b"): specials (type 3, control), bytes and merged pieces (1)."""
    tokens = SPECIALS + byte_symbols() + [a + b for a, b in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def reference_model(tied: bool = False, seed: int = 0, family: str = "llama"):
    """The Hugging Face llama (or qwen3, qwen2) the GGUF is written from; norms and qwen2's q/k/v
    biases random too, so a tensor that loads wrong (or not at all) changes the logits."""
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]  # fmt: skip
    cfg = config_cls(vocab_size=len(vocabulary()[0]), rms_norm_eps=RMS_EPS, tie_word_embeddings=tied,
                     bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, **SHAPE)  # fmt: skip
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.1) + (1.0 if "norm" in name else 0.0))
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection [n_head * head_dim, H] in llama.cpp's rotary layout (per head,
    the halves [0, d/2) and [d/2, d) interleaved); transformers' loader inverts exactly this."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str | Path, model=None, *, arch: str | None = None, permute: bool | None = None,
               chat_template: str | None = CHAT_TEMPLATE, name: str = "tiny llama") -> Path:  # fmt: skip
    """Write ``model`` (default: :func:`reference_model`) to ``path`` as llama.cpp would.

    ``arch`` (default: the model's family) other than that writes the same tensors under another
    ``general.architecture`` (to test refusals). ``permute``: the q/k permutation (default: for
    llama only: llama.cpp keeps qwen3's NeoX rotary layout); flipping it writes a file that
    loads as another model.
    """
    import gguf

    model = model or reference_model()
    cfg = model.config
    arch = arch or cfg.model_type
    permute = cfg.model_type == "llama" if permute is None else permute
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tokens, types, merges = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_pad_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def put(gguf_name: str, hf_name: str) -> None:
        w.add_tensor(gguf_name, np.ascontiguousarray(sd[hf_name], dtype=np.float32))

    put("token_embd.weight", "model.embed_tokens.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for heads, proj in ((cfg.num_attention_heads, "q"), (cfg.num_key_value_heads, "k")):
            t = sd[f"{p}self_attn.{proj}_proj.weight"]
            w.add_tensor(
                f"blk.{i}.attn_{proj}.weight", np.ascontiguousarray(llama_cpp_permute(t, heads) if permute else t)
            )
        for g, h in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"),
                     ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"),
                     ("ffn_norm", "post_attention_layernorm")):  # fmt: skip
            put(f"blk.{i}.{g}.weight", f"{p}{h}.weight")
        if cfg.model_type == "qwen3":
            put(f"blk.{i}.attn_q_norm.weight", f"{p}self_attn.q_norm.weight")
            put(f"blk.{i}.attn_k_norm.weight", f"{p}self_attn.k_norm.weight")
        if cfg.model_type == "qwen2":  # q/k/v biases, in the NeoX rotary layout as the weights
            for proj in ("q", "k", "v"):
                put(f"blk.{i}.attn_{proj}.bias", f"{p}self_attn.{proj}_proj.bias")
    put("output_norm.weight", "model.norm.weight")
    if not cfg.tie_word_embeddings:
        put("output.weight", "lm_head.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
