""".gguf checkpoints in (splitrl.models.gguf): a tiny llama / qwen3 / qwen2 written here with the gguf
package's own writer (tests/models/_tiny_gguf.py) converts once into a cached Hugging Face
directory that computes exactly the model it was written from; damaged or foreign files are
refused with one line naming the file."""

import os

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is not installed (pyproject lists it; .ci/run installs it)")

from _tiny_gguf import BOS_ID, CHAT_TEMPLATE, EOS_ID, UNK_ID, reference_model, write_gguf  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import splitrl.models.gguf as gguf_module  # noqa: E402
from _configs import demo_config
from splitrl.models import MTPConfig, PolicyModel  # noqa: E402
from splitrl.models.checkpoint import verify_pretrained  # noqa: E402
from splitrl.models.gguf import gguf_model_dir, resolve_model_files  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPLITRL_CACHE_DIR", str(root))
    return root


def _ids(vocab, seed=0):
    return torch.randint(0, vocab, (3, 17), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen3", True), ("qwen2", True)])
def test_the_converted_directory_computes_the_model_the_file_was_written_from(tmp_path, cache, family, tied):
    ref = reference_model(tied=tied, family=family)
    path = write_gguf(tmp_path / "tiny.gguf", ref)
    out = gguf_model_dir(path)
    assert out.parent == cache / "gguf" and (out / "CONVERTED").is_file()
    model = PolicyModel.from_pretrained(str(out), mtp=MTPConfig(mtp_num_layers=0))
    cfg = model.config
    assert (cfg.model_type, cfg.tie_word_embeddings, cfg.head_dim, cfg.num_key_value_heads) == (family, tied, 12, 2)
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        got, want = model.logits(ids), ref(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_llama_q_and_k_are_unpermuted_on_load(tmp_path):
    """The reference test above would pass for a loader that ignored llama.cpp's rotary row order
    only if the order did not matter: a file written without it is another model."""
    ref = reference_model()
    model = PolicyModel.from_pretrained(str(gguf_model_dir(write_gguf(tmp_path / "raw.gguf", ref, permute=False))),
                                        mtp=MTPConfig(mtp_num_layers=0))  # fmt: skip
    ids = _ids(ref.config.vocab_size)
    with torch.no_grad():
        assert (model.logits(ids) - ref(ids).logits).abs().max() > 1e-2


def test_the_tokenizer_round_trips_and_keeps_the_files_special_tokens(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(gguf_model_dir(write_gguf(tmp_path / "tiny.gguf"))))
    text = "Hello world, the answer is 42 !\n  Ünïcödé ok . don 't"  # spaces before punctuation stay
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert 261 in ids  # "Ġthe": the merges are used, not only bytes
    # transformers' converter made <|im_start|> (BOS) the EOS token too, and set no padding token
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (BOS_ID, EOS_ID, EOS_ID, UNK_ID)
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template == CHAT_TEMPLATE
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(chat, add_special_tokens=False)["input_ids"][0] == BOS_ID  # a special token, not its characters
    assert (
        tok.decode(tok(chat, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        == "user\nhi\nassistant\n"
    )


def test_a_second_call_reuses_the_conversion_and_a_changed_file_gets_its_own(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    out = gguf_model_dir(path)
    stamp = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}

    def no_conversion(*args):
        raise AssertionError("converted again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_module, "_convert", no_conversion)
        mp.setattr(gguf_module, "_read_header", no_conversion)
        assert gguf_model_dir(path) == out
        moved = tmp_path / "elsewhere" / "renamed.gguf"  # the key is the content, not the name
        moved.parent.mkdir()
        os.replace(path, moved)
        assert gguf_model_dir(moved) == out
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == stamp
    other = gguf_model_dir(write_gguf(tmp_path / "other.gguf", reference_model(seed=1)))
    assert other != out and other.parent == out.parent


def test_a_conversion_of_an_older_format_is_redone(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    out = gguf_model_dir(path)
    (out / "CONVERTED").write_text("tiny.gguf\n")  # what the first version wrote
    (out / "tokenizer_config.json").write_text("{}")
    assert gguf_model_dir(path) == out
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id == EOS_ID


def _cut(name):
    def damage(out):
        f = out / name
        with f.open("r+b") as fh:
            fh.truncate(f.stat().st_size // 3)

    return damage


def _cut_under_an_old_marker(out):
    """A conversion of this format written before CONVERTED listed the sizes: the safetensors
    header check alone finds the cut."""
    (out / "CONVERTED").write_text("splitrl-gguf 2\ntiny.gguf\n")
    _cut("model.safetensors")(out)


@pytest.mark.parametrize(
    "damage",
    [
        _cut("model.safetensors"),
        _cut_under_an_old_marker,
        lambda out: (out / "tokenizer.json").unlink(),
        lambda out: (out / "config.json").unlink(),
    ],
    ids=["weights-cut", "weights-cut-old-marker", "tokenizer-missing", "config-missing"],
)
def test_a_damaged_cached_conversion_is_converted_again_with_a_warning(tmp_path, caplog, damage):
    """A new user's trial: after the cached model.safetensors was cut short, the conversion was
    reused and the load said the file "is truncated ...; copy or download it again" (a directory the
    user never downloaded). The entry is checked at reuse and converted again."""
    path = write_gguf(tmp_path / "tiny.gguf")
    out = gguf_model_dir(path)
    whole = {f.name: f.read_bytes() for f in out.iterdir() if f.name != "CONVERTED"}
    damage(out)
    with caplog.at_level("WARNING", logger="splitrl.models.gguf"):
        assert gguf_model_dir(path) == out
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and str(out) in warned[0] and "converting the file again" in warned[0]
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.name != "CONVERTED"} == whole
    verify_pretrained(out)
    caplog.clear()
    assert gguf_model_dir(path) == out and not caplog.records  # whole again: reused silently


@pytest.mark.parametrize("error", [ValueError("transformers cannot load 'x.gguf' (KeyError: 'y')"),
                                   OSError(28, "No space left on device")])  # fmt: skip
def test_a_failed_reconversion_names_the_file_and_the_cache_directory(tmp_path, monkeypatch, error):
    path = write_gguf(tmp_path / "tiny.gguf")
    convert = gguf_module._convert

    def fail(*args):
        raise error

    def damaged():
        monkeypatch.setattr(gguf_module, "_convert", convert)
        _cut("model.safetensors")(out := gguf_model_dir(path))
        monkeypatch.setattr(gguf_module, "_convert", fail)
        return out

    out = damaged()
    with pytest.raises(ValueError) as e:
        gguf_model_dir(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message and str(out) in message
    assert "is damaged (model.safetensors is" in message and "can be deleted" in message
    assert ("No space left on device" if isinstance(error, OSError) else "KeyError: 'y'") in message
    cfg = demo_config([f"model.pretrained_path={path}", f"output_dir={tmp_path / 'run'}"])
    out = damaged()  # the failed attempt removed the damaged entry: a later call is a first conversion
    with pytest.raises(ValueError, match=rf"^model.pretrained_path: '{path}': its cached conversion {out} is damaged"):
        resolve_model_files(cfg)  # what train's preflight reports
    # a first conversion that cannot write the cache: one line naming it and SPLITRL_CACHE_DIR
    # (an OSError ended eval / generate in a traceback)
    monkeypatch.setattr(gguf_module, "_convert", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    with pytest.raises(ValueError, match=r"cannot convert it into .*No space left on device.*SPLITRL_CACHE_DIR"):
        gguf_model_dir(path)


def test_generate_converts_a_damaged_cached_conversion_again(tmp_path, capsys):
    """The trial's command: `splitrl generate <the .gguf>` after the cached weights were cut short
    (it stopped with rc=2 and the advice to download the cache directory again)."""
    from splitrl.cli import main

    path = write_gguf(tmp_path / "tiny.gguf")
    _cut("model.safetensors")(gguf_model_dir(path))
    rc = main(["generate", str(path), "-p", "Hi", "--greedy", "--device", "cpu", "rollout.max_new_tokens=4"])
    assert rc == 0, capsys.readouterr().err


def _not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(100))
    return p, r"is not a GGUF file \(it starts with b'PK\\x03\\x04', not b'GGUF'\)"


def _truncated(at):
    def make(tmp_path):
        whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
        p = tmp_path / "model.gguf"
        p.write_bytes(whole[: at if at > 0 else len(whole) + at])
        return p, r"cannot be read as GGUF \(.*\); is the file whole\?"

    return make


def _arch(arch):
    def make(tmp_path):
        match = rf"holds a '{arch}' model; splitrl converts GGUF files of llama, qwen2, qwen3"
        return write_gguf(tmp_path / "model.gguf", arch=arch), match

    return make


def _missing(tmp_path):
    return tmp_path / "model.gguf", r"GGUF file '.*' does not exist"


@pytest.mark.parametrize(
    "make",
    [
        _not_gguf,
        _truncated(200),
        _truncated(-1000),
        _truncated(-1),
        _arch("gpt2"),
        _arch("falcon"),
        _arch("qwen3_moe"),
        _missing,
    ],
    ids=["bad-magic", "cut-in-header", "cut-in-tensors", "one-byte-short", "gpt2", "falcon", "qwen3_moe", "missing"],
)
def test_an_unusable_file_is_refused_in_one_line_naming_it(tmp_path, cache, make):
    path, match = make(tmp_path)
    with pytest.raises(ValueError, match=match) as e:
        gguf_model_dir(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    assert not (cache / "gguf").exists() or not [d for d in (cache / "gguf").iterdir() if d.is_dir()]  # nothing kept


def test_a_missing_gguf_is_refused_at_config_load(tmp_path):
    with pytest.raises(ValueError, match=r"model.pretrained_path='.*missing.gguf': no such GGUF file; check the path"):
        demo_config([f"model.pretrained_path={tmp_path / 'missing.gguf'}"])


def test_preflight_resolution_points_the_run_config_at_the_converted_directory(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    cfg = demo_config([f"model.pretrained_path={path}", f"tokenizer={{kind: pretrained, path: {path}}}",
                             f"output_dir={tmp_path / 'run'}"])  # fmt: skip
    assert cfg.model.pretrained_path == str(path)
    resolve_model_files(cfg)
    out = str(gguf_model_dir(path))
    assert cfg.model.pretrained_path == out and cfg.tokenizer.path == out
    resolve_model_files(cfg)  # idempotent: a directory is left alone
    assert cfg.model.pretrained_path == out

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(8))
    cfg = demo_config([f"model.pretrained_path={bad}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"^model.pretrained_path: '.*bad.gguf' cannot be read as GGUF"):
        resolve_model_files(cfg)
