"""A saved ``policy/`` directory is usable by plain transformers, without splitrl (issue 10, item 3).

Guards against: a checkpoint whose tokenizer exists only in our source (the character tokenizer
rebuilt from a charset in the run config), and a checkpoint that loses the stop tokens the rollouts
used (an HF user's ``generate`` would then run to the length limit).
"""

import json
import subprocess
import sys
import textwrap

import torch
from transformers import AutoTokenizer

from _configs import DEMO_CHARSET, demo_model_config
from splitrl.models import PolicyModel
from splitrl.models.hf_files import hf_generation_config, rollout_stop_token_ids, write_inference_files
from splitrl.rollout import GenerationConfig
from splitrl.tasks import build_char_tokenizer

PROMPTS = ["desc 5,2,7=", "asc 0,9,3=", "desc 1,1,8=7"]

# Runs in a fresh interpreter that cannot import splitrl at all: only transformers reads the files.
_STANDALONE = textwrap.dedent(
    """
    import sys, importlib.abc
    class _NoSplitrl(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "splitrl" or name.startswith("splitrl."):
                raise ImportError("splitrl must not be needed to load a policy/ directory")
    sys.meta_path.insert(0, _NoSplitrl())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    torch.set_num_threads(1)
    path, prompts, out = sys.argv[1], sys.argv[2].split("|"), sys.argv[3]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(path)
    ids = [tok(p)["input_ids"] for p in prompts]
    with torch.no_grad():
        logits = [model(torch.tensor([i])).logits[0] for i in ids]
    torch.save({"ids": ids, "logits": logits, "gen": gen.to_dict(), "decoded": [tok.decode(i) for i in ids],
                "tokenizer_class": type(tok).__name__, "eos": tok.eos_token_id, "pad": tok.pad_token_id}, out)
    """
)


def _standalone_load(path, out):
    res = subprocess.run(
        [sys.executable, "-c", _STANDALONE, str(path), "|".join(PROMPTS), str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_policy_dir_loads_with_auto_classes_same_ids_and_logits(tmp_path):
    torch.manual_seed(0)
    model = PolicyModel.from_config(demo_model_config()).eval()
    tokenizer = build_char_tokenizer(DEMO_CHARSET)
    generation = GenerationConfig(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=8, stop_token_ids=[6],
                                  stop_strings=["=="])
    model.save_pretrained(tmp_path)
    write_inference_files(tmp_path, tokenizer, generation)

    got = _standalone_load(tmp_path, tmp_path / "out.pt")
    ours = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert got["ids"] == ours
    assert got["decoded"] == PROMPTS
    assert (got["eos"], got["pad"]) == (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 0)
    # same logits as splitrl's own forward (PolicyModel.logits, not the HF class's forward); fp32,
    # same kernels: agreement to rounding
    with torch.no_grad():
        for ids, hf_logits in zip(ours, got["logits"]):
            ref = model.logits(torch.tensor([ids]))[0]
            assert hf_logits.shape == ref.shape == (len(ids), model.config.vocab_size)
            torch.testing.assert_close(hf_logits, ref, rtol=1e-5, atol=1e-5)
    gen = got["gen"]
    # every token that ended a rollout ends an HF generate: the user's stop token, then EOS
    assert gen["eos_token_id"] == [6, 2]
    assert (gen["do_sample"], gen["temperature"], gen["top_k"], gen["top_p"], gen["max_new_tokens"]) == (
        True, 0.7, 5, 0.9, 8)
    assert gen["pad_token_id"] == 0 and gen["stop_strings"] == ["=="]


def test_stop_tokens_and_generation_config_values():
    tok = build_char_tokenizer(DEMO_CHARSET)
    assert rollout_stop_token_ids(GenerationConfig(), tok) == [2]
    assert rollout_stop_token_ids(GenerationConfig(stop_token_ids=[2, 7, 7]), tok) == [2, 7]
    g = hf_generation_config(GenerationConfig(top_k=0), tok)
    # transformers' own default top_k is 50: ours (0 = off) must be written explicitly
    assert g.top_k == 0 and g.eos_token_id == 2 and g.bos_token_id == 1


def test_pretrained_tokenizer_is_written_back_with_its_chat_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    tok.save_pretrained(tmp_path / "src")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "src")
    write_inference_files(tmp_path / "policy", loaded, GenerationConfig())
    again = AutoTokenizer.from_pretrained(tmp_path / "policy")
    assert again.chat_template == tok.chat_template
    msgs = [{"role": "user", "content": "604>"}]
    assert again.apply_chat_template(msgs, tokenize=False) == "[user]604>[assistant]"
    cfg = json.loads((tmp_path / "policy" / "generation_config.json").read_text())
    assert cfg["eos_token_id"] == 2
