"""Preflight checks that need the model but no worker (issue 6, item 10): each bad setting stops
the run before any worker starts, with a message naming the key to change."""

import json
import logging

import pytest
from safetensors.torch import load_file, save_file

from _configs import demo_config, demo_model_config
from splitrl.controller.controller import preflight
from splitrl.models import PolicyModel
from splitrl.models.policy import load_pretrained
from splitrl.tasks import make_task

LOCAL = ["cluster.backend=local", "logging.tensorboard=false"]


def _cfg(tmp_path, *extra):
    return demo_config(LOCAL + [f"output_dir={tmp_path / 'run'}", *extra])


# --------------------------------------------------------------- kind: model/tokenizer mismatch
def test_tokenizer_larger_than_vocab_is_refused_in_preflight(tmp_path):
    """Kind: a tokenizer with ids the embedding has no row for (found only inside a worker)."""
    with pytest.raises(ValueError, match=r"model.backbone.vocab_size=10 is smaller than the tokenizer's 22 tokens"):
        preflight(_cfg(tmp_path, "model.backbone.vocab_size=10"))
    with pytest.raises(ValueError, match=r"rollout.stop_token_ids \[22\] are not below the model's vocab_size=22"):
        preflight(_cfg(tmp_path, "rollout.stop_token_ids=[2, 22]"))


@pytest.mark.parametrize(
    "override,match",
    [
        (
            "model.backbone.num_key_value_heads=3",
            r"model.backbone: num_attention_heads=4 is not a multiple of num_key_value_heads=3",
        ),
        ("model.family=llama", None),  # control: the demo backbone is fine for llama too
        ("model.family=qwen2", None),  # and for qwen2 (head_dim: not a Qwen2Config key, read when set)
    ],
)
def test_head_counts_that_do_not_divide_are_refused_in_preflight(tmp_path, override, match):
    """Kind: attention shapes that only fail in the first forward, inside a worker."""
    if match is None:
        assert preflight(_cfg(tmp_path, override)) == 0
        return
    with pytest.raises(ValueError, match=match):
        preflight(_cfg(tmp_path, override))


def test_misspelt_backbone_key_is_refused_in_preflight(tmp_path):
    """Kind: transformers keeps any keyword as an attribute, so a misspelt key was ignored and the
    model built with the default value."""
    with pytest.raises(
        ValueError,
        match=r"model.backbone.num_hiden_layers is not a key of the qwen3 config \(did you mean 'num_hidden_layers'\?\)",
    ):
        preflight(_cfg(tmp_path, "model.backbone.num_hiden_layers=3"))


def test_backbone_transformers_rejects_is_named(tmp_path):
    """Kind: transformers' own config validation (llama: hidden_size / heads) surfaced as a
    non-ValueError traceback."""
    cfg = _cfg(
        tmp_path,
        "model.family=llama",
        "model.backbone.num_attention_heads=3",
        "model.backbone.num_key_value_heads=1",
        "model.backbone.head_dim=null",
    )
    with pytest.raises(ValueError, match=r"model.backbone"):
        preflight(cfg)


# ------------------------------------------------------------- kind: damaged pretrained weights
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    PolicyModel.from_config(demo_model_config()).save_pretrained(str(path))
    return path


def test_draft_vocabulary_over_the_model_vocabulary_is_refused_in_preflight(tmp_path, saved_model):
    """Kind: a size only the loaded model can check (a pretrained model's vocabulary), which the
    generation worker refused after Ray and the workers had started."""
    spec = ["rollout.speculative=true"]
    with pytest.raises(ValueError, match=r"rollout.draft_vocab_size=23 exceeds the model's vocab_size=22; set"):
        preflight(_cfg(tmp_path, f"model.pretrained_path={saved_model}", *spec, "rollout.draft_vocab_size=23"))
    with pytest.raises(ValueError, match=r"rollout.draft_vocab_size=23 exceeds model.backbone.vocab_size=22"):
        preflight(_cfg(tmp_path, *spec, "rollout.draft_vocab_size=23"))
    assert not (tmp_path / "run").exists()
    assert preflight(_cfg(tmp_path, f"model.pretrained_path={saved_model}", *spec, "rollout.draft_vocab_size=22")) == 0


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_intact_pretrained_directory_passes(tmp_path, saved_model):
    assert preflight(_cfg(tmp_path, f"model.pretrained_path={saved_model}")) == 0


def test_pretrained_tokenizer_directory_without_tokenizer_files_is_refused(tmp_path, saved_model):
    """Kind: transformers builds an empty tokenizer (1 token, every text -> []) from a directory
    without tokenizer files; every prompt would then be empty."""
    with pytest.raises(ValueError, match=r"model.pretrained_path \(tokenizer.path unset\)=.* has no tokenizer files"):
        preflight(_cfg(tmp_path, f"model.pretrained_path={saved_model}", "tokenizer.kind=pretrained"))
    # no directory at all: one sentence naming both keys (was "... from model.pretrained_path
    # (tokenizer.path unset)=None (tokenizer.kind='pretrained' needs ...)")
    with pytest.raises(ValueError, match=r"^tokenizer.kind=pretrained needs a tokenizer directory.*set tokenizer.path"):
        preflight(_cfg(tmp_path, "tokenizer.kind=pretrained"))
    with pytest.raises(ValueError, match=r"tokenizer.path=.* has no tokenizer files"):
        preflight(
            _cfg(
                tmp_path,
                f"model.pretrained_path={saved_model}",
                "tokenizer.kind=pretrained",
                f"tokenizer.path={tmp_path}",
            )
        )
    # control: the same directory with the demo tokenizer saved into it
    from _configs import DEMO_CHARSET
    from splitrl.tasks import build_char_tokenizer

    d = _copy(saved_model, tmp_path / "with_tokenizer")
    build_char_tokenizer(DEMO_CHARSET).save_pretrained(str(d))
    assert preflight(_cfg(tmp_path, f"model.pretrained_path={d}", "tokenizer.kind=pretrained")) == 0


@pytest.mark.parametrize("damage", ["truncated", "corrupt_header", "no_weights", "missing_tensor", "missing_shard"])
def test_damaged_pretrained_weights_are_refused_in_preflight(tmp_path, saved_model, damage):
    """Kind: missing / truncated / corrupt weight files, found 30-50 s later in a worker (or, for a
    missing tensor, never: transformers initializes it at random with a log line)."""
    d = _copy(saved_model, tmp_path / "policy")
    weights = d / "model.safetensors"
    if damage == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 1000])
        match = r"model.safetensors is truncated: \d+ bytes, its header needs \d+"
    elif damage == "corrupt_header":
        data = bytearray(weights.read_bytes())
        data[8:24] = b"\xff" * 16
        weights.write_bytes(bytes(data))
        match = r"corrupt safetensors header"
    elif damage == "no_weights":
        weights.unlink()
        match = r"holds no weights"
    elif damage == "missing_tensor":
        sd = load_file(str(weights))
        del sd["model.layers.1.mlp.down_proj.weight"]
        save_file(sd, str(weights), metadata={"format": "pt"})
        match = r"1 backbone tensor\(s\) are missing .*model.layers.1.mlp.down_proj.weight"
    else:
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}})
        )
        match = r"lists weight files that are missing: \['model-00001-of-00002.safetensors'\]"
    with pytest.raises(ValueError, match=r"model.pretrained_path='.*policy'.*" + match):
        preflight(_cfg(tmp_path, f"model.pretrained_path={d}"))
    with pytest.raises(ValueError, match=match):  # the workers' own load refuses it the same way
        load_pretrained(d)


def test_pretrained_directory_that_does_not_fit_the_model_knobs_is_refused_in_preflight(tmp_path, saved_model):
    """Kind: a checkpoint whose MTP depths or family the run cannot build, found at worker start."""
    with pytest.raises(ValueError, match=r"model.pretrained_path=.*MTP tensors in .* do not fit mtp_num_layers=2"):
        preflight(_cfg(tmp_path, f"model.pretrained_path={saved_model}", "model.mtp.mtp_num_layers=2"))
    d = _copy(saved_model, tmp_path / "policy")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.pretrained_path=.*model_type 'gpt2' is not supported"):
        preflight(_cfg(tmp_path, f"model.pretrained_path={d}"))


# ------------------------------------------------------------------- kind: prompt vs context
def test_generated_prompt_longer_than_context_is_refused_in_preflight(tmp_path):
    """Kind: prompt + max_new_tokens beyond max_position_embeddings, found at generation time and
    reported as 'prompt 0' of a batch."""
    with pytest.raises(
        ValueError,
        match=r"prompt 0 of the task \(\d+ tokens.*rollout.max_new_tokens=250 exceed the model's max_position_embeddings=256",
    ):
        preflight(_cfg(tmp_path, "rollout.max_new_tokens=250"))
    with pytest.raises(ValueError, match=r"no prompt fits: rollout.max_new_tokens=300 leaves no room"):
        preflight(_cfg(tmp_path, "rollout.max_new_tokens=300"))


def test_overlong_data_rows_are_left_out_counted_and_named(tmp_path, caplog):
    """Kind: one overlong row of a data file crashed the run at the step that reached it; it is
    left out in preflight (warned, counted, its line named) and every process serves the rest."""
    rows = [
        ("What is 1+1?", "2"),
        ("x" * 199 + "?", "0"),
        ("What is 2+3?", "5"),
        ("", None),
        ("y" * 300, "1"),
        ("What is 3+3?", "6"),
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join("\n" if a is None else json.dumps({"problem": p, "answer": a}) + "\n" for p, a in rows))
    cfg = _cfg(
        tmp_path,
        "task.kind=math_file",
        f"task.path={data}",
        "tokenizer.charset=null",
        "model.backbone.vocab_size=100",
        "rollout.max_new_tokens=56",  # 200 + 56 = 256 fits exactly; 300 + 56 does not
        "model.backbone.max_position_embeddings=256",
    )
    with caplog.at_level(logging.WARNING):
        assert preflight(cfg) == 0
    assert cfg.task.skip_rows == [3]  # file order, blank line not counted: the "y" * 300 row
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert (
        "1 of 5 rows left out" in warning
        and "line 5 (300 tokens)" in warning
        and "exceed the model's max_position_embeddings=256" in warning
    )
    task = make_task(cfg.task)  # what the generation workers build from the run's config
    assert task.num_prompts == 4
    assert [task.get_prompt(i).answer for i in range(4)] == ["2", "0", "5", "6"]
    assert preflight(cfg) == 0 and cfg.task.skip_rows == [3]  # a second preflight (resume) agrees
    # nothing fits: an error, not an empty task
    cfg = _cfg(
        tmp_path,
        "task.kind=math_file",
        f"task.path={data}",
        "tokenizer.charset=null",
        "model.backbone.vocab_size=100",
        "rollout.max_new_tokens=250",
    )
    with pytest.raises(ValueError, match=r"no row of task.path=.* fits"):
        preflight(cfg)


def test_a_run_over_a_file_with_an_overlong_row_trains_every_other_row(tmp_path, monkeypatch):
    """Kind: the overlong row crashed the run when its step came ("prompt 0 ... exceeds"); the
    run now trains on the rows that fit, each of them, and none other."""
    from splitrl.controller.controller import train
    from splitrl.workers import generation

    rows = [("1+1", "2"), ("y" * 300, "1"), ("2+3", "5"), ("3+3", "6")]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in rows))
    seen: list[str] = []
    real = generation.GenerationWorker.generate_groups

    def recording(self, indices, group_size, on_group=None):
        seen.extend(self.prompt_of(i).text for i in indices)
        return real(self, indices, group_size, on_group)

    cfg = _cfg(
        tmp_path,
        "task.kind=math_file",
        f"task.path={data}",
        "tokenizer.charset=null",
        "model.backbone.vocab_size=100",
        "schedule.num_steps=3",
        "schedule.groups_per_step=2",
        "schedule.group_size=2",
        "schedule.min_groups_per_chunk=1",
        "schedule.generation_groups_per_call=1",
        "rollout.max_new_tokens=4",
        "buffer.max_staleness=0",
        "logging.progress_bar=false",
        "reward.timeout_s=10",
    )
    monkeypatch.setattr(generation.GenerationWorker, "generate_groups", recording)
    res = train(cfg)
    assert res.steps_done == 3
    assert sorted(seen) == sorted(["1+1", "2+3", "3+3", "1+1", "2+3", "3+3"])  # 6 prompts: the 3 rows, twice


def test_settings_that_leave_part_of_the_run_idle_are_warned_about(tmp_path, caplog):
    """Kind: a setting silently does nothing (a new user's trial): the policy never trained, or no
    evaluation ran, with no word about it."""
    with caplog.at_level(logging.WARNING):
        preflight(_cfg(tmp_path, "schedule.num_steps=3", "train.mtp_warmup_steps=3", "eval.eval_every=5"))
    assert "only the MTP heads train in this run" in caplog.text
    assert "this run never evaluates" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # control: warm-up shorter than the run, evaluation at the end
        preflight(
            _cfg(tmp_path, "schedule.num_steps=3", "train.mtp_warmup_steps=2", "eval.eval_every=5", "eval.at_end=true")
        )
    assert "only the MTP heads" not in caplog.text and "never evaluates" not in caplog.text


# --------------------------------------------------------------- kind: a model that cannot fit
def test_a_model_that_cannot_fit_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """Kind: ``model.backbone.hidden_size=100000`` started Ray and both workers, then died after
    65 s on an 80 GB allocation (the MTP depth's fc, 2·H² = 20 B parameters) with a 152-line
    traceback (issue 25 item 3). The count comes from the shapes: no model is built. fp32: 16
    bytes a parameter; 20.349 B parameters -> 312.8 GiB with the activations of 1024 tokens."""
    from splitrl.train import memory_plan

    def no_build(*args, **kwargs):
        raise AssertionError("the preflight built a model")

    monkeypatch.setattr(PolicyModel, "from_config", no_build)
    monkeypatch.setattr(memory_plan, "host_available_memory", lambda: (16 * 2**30, "available on the host (MemAvailable)"))
    with pytest.raises(ValueError) as err:
        preflight(_cfg(tmp_path, "model.backbone.hidden_size=100000"))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("model.backbone: the policy has 20.349 B parameters (backbone 233.1 M, MTP 20.116 B)")
    assert "needs 312.8 GiB (16 bytes a parameter" in msg and "this machine has 16.0 GiB available" in msg
    assert "hidden_size=100000" in msg and "model.mtp.mtp_num_layers=1" in msg
    assert not (tmp_path / "run").exists()  # a refused run leaves no output_dir behind
    # the same model fits a (made-up) machine with the memory
    monkeypatch.setattr(memory_plan, "host_available_memory", lambda: (400 * 2**30, "available on the host (MemAvailable)"))
    from splitrl.controller.preflight import check_memory, model_hf_config

    cfg = _cfg(tmp_path, "model.backbone.hidden_size=100000")
    check_memory(cfg, model_hf_config(cfg))


def test_offload_with_several_train_workers_is_refused_when_the_config_loads(tmp_path):
    """Kind: refused late. `--print-config` and every other command took the combination; only the
    run's preflight refused it (a new user's trial)."""
    with pytest.raises(ValueError, match=r"train.optim.offload=cpu steps the optimizer of one process.*"
                       r"cluster.num_train_workers=2.*set cluster.num_train_workers=1, or train.optim.offload=none"):
        _cfg(tmp_path, "cluster.backend=ray", "train.optim.offload=cpu", "cluster.num_train_workers=2")
