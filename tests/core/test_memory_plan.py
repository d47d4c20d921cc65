"""The memory planner's arithmetic (splitrl.train.memory_plan), on shapes alone: parameter counts
against built models, bytes a parameter, the estimate's terms for hand-computed shapes, and the
choices it makes for the Qwen3 shapes on one H200 (139 GiB)."""

import pytest
import torch
from _utils import make_model, make_worker
from transformers import AutoModelForCausalLM, Qwen3Config

from splitrl.models import MTPConfig, PolicyModel
from splitrl.train import MemoryConfig, SpeedConfig
from splitrl.train.memory_plan import (
    GiB,
    ModelShape,
    estimate_peak,
    host_available_memory,
    plan_memory,
    state_layout,
)
from splitrl.train.speed import decoder_layers

H200 = int(139 * GiB)
QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
SHAPES = {
    "0.6b": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "1.7b": dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "4b": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, tie_word_embeddings=True),
    "8b": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, tie_word_embeddings=False),
}  # fmt: skip


def shape(name: str, D: int = 1) -> ModelShape:
    return ModelShape.from_hf_config(SHAPES[name], MTPConfig(mtp_num_layers=D))


def h200_plan(name: str, **kw) -> "object":
    base = dict(precision="bf16", available_bytes=H200, device="cuda:0", compiled=True, max_tokens=16384)
    return plan_memory(shape(name), **{**base, **kw})


# ------------------------------------------------------------------------------ parameter counts
def test_parameter_counts_of_the_qwen3_shapes_by_hand():
    """Qwen3-0.6B: embedding 151936·1024 = 155,582,464; a layer = q 1024·2048 + k, v 1024·1024 each
    + o 2048·1024 + q/k norms 2·128 + MLP 3·1024·3072 + 2 norms 2·1024 = 15,730,944; 28 layers and
    the final norm: 440,467,456 -> 596,049,920 (the 596 M of the Findings). An MTP depth adds
    3 norms + fc 2·1024·1024 + a layer = 17,831,168. The 4B and 8B shapes likewise (8B: untied head)."""
    p = shape("0.6b").parameter_count()
    assert (p.embedding, p.layers, p.output_head, p.mtp) == (155_582_464, 440_467_456, 0, 17_831_168)
    assert p.backbone == 596_049_920 and p.total == 613_881_088 == p.trainable
    p4 = shape("4b").parameter_count()
    assert (p4.backbone, p4.mtp, p4.total) == (4_022_468_096, 114_045_696, 4_136_513_792)
    p8 = shape("8b").parameter_count()
    assert (p8.output_head, p8.backbone, p8.mtp, p8.total) == (622_329_856, 8_190_735_360, 226_513_152, 8_417_248_512)
    assert p8.largest == 151936 * 4096


def _built_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied tensors once


@pytest.mark.parametrize(
    "family, backbone, mtp",
    [
        ("qwen3", {}, dict(mtp_num_layers=2)),
        (
            "qwen3",
            {"tie_word_embeddings": False, "attention_bias": True},
            dict(mtp_num_layers=2, mtp_use_repeated_layer=True),
        ),
        ("llama", {"attention_bias": True, "mlp_bias": True}, dict(mtp_num_layers=1)),
        ("qwen2", {}, dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.0)),
        ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [0]}, dict(mtp_num_layers=2)),
        ("qwen3_moe", {}, dict(mtp_num_layers=0)),
    ],
    ids=["qwen3", "qwen3-untied-biased-repeated", "llama-biases", "qwen2-frozen-mtp", "moe-step2", "moe-no-mtp"],
)
def test_parameter_count_from_shapes_equals_the_built_model(family, backbone, mtp):
    """Every family the policy builds: the count from the config's numbers equals the model's own."""
    from splitrl.models import ModelConfig

    cfg = ModelConfig(family=family, mtp=MTPConfig(**mtp))
    cfg.backbone.update(backbone)
    if family == "qwen3_moe":
        cfg.backbone.update(num_hidden_layers=4)
    model = PolicyModel.from_config(cfg)
    counted = ModelShape.from_hf_config(model.config, cfg.mtp).parameter_count()
    assert counted.total == _built_count(model)
    assert counted.mtp == sum(p.numel() for _, p in model.mtp_named_parameters())
    assert counted.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counted.largest == max(p.numel() for p in model.parameters())


def test_parameter_count_of_the_8b_shape_equals_the_model_on_the_meta_device():
    hf = Qwen3Config(**{k: v for k, v in SHAPES["8b"].items() if k != "model_type"})
    with torch.device("meta"):
        model = PolicyModel(AutoModelForCausalLM.from_config(hf), MTPConfig(mtp_num_layers=1))
    assert shape("8b").parameter_count().total == _built_count(model) == 8_417_248_512


# ------------------------------------------------------------------------------ bytes a parameter
@pytest.mark.parametrize(
    "precision, offload, copy, device, frozen, host",
    [
        ("bf16", "none", True, 18, 6, 0),  # fp32 master 4 + bf16 copy 2 + fp32 grad 4 + AdamW 8
        ("bf16", "none", False, 18, 6, 0),  # autocast: 16 + its per-microbatch casts 2
        ("fp32", "none", True, 16, 4, 0),
        ("bf16", "cpu", True, 6, 2, 12),  # device: bf16 copy + fp32 grad; host: master + AdamW
        ("fp32", "cpu", True, 8, 4, 12),
    ],
)
def test_bytes_a_parameter(precision, offload, copy, device, frozen, host):
    lay = state_layout(precision, offload=offload, compute_weight_copy=copy)
    assert (lay.device_trainable, lay.device_frozen, lay.host_trainable) == (device, frozen, host)
    assert lay.moments_on_device == (0 if offload == "cpu" else 8)


def test_fsdp2_shards_the_state_and_offload_refuses_several_ranks():
    assert state_layout("bf16", world_size=4).device_trainable == 4.0
    with pytest.raises(ValueError, match="offload=cpu runs on one process"):
        state_layout("bf16", offload="cpu", world_size=2)


# ------------------------------------------------------------------------------ the estimate
def test_activation_bytes_a_token_by_hand():
    """0.6B shape + 1 depth, bf16 (a = 2, f = 4): an eager Qwen3 layer keeps
    2(f+2a)H + (f+4a)n_q + (f+3a)n_kv + 4aI = 16·1024 + 12·2048 + 10·1024 + 8·3072 = 75,776 bytes a
    token, a compiled one 4aH + 4a·n_q + 3a·n_kv + 3aI = 49,152, a checkpointed one its input aH =
    2,048; outside the layers (f+2a)H + D(3f+6a)H + 128 + 32(1+D) = 8,192 + 24,576 + 192."""
    s = shape("0.6b")
    assert s.layer_activation_bytes(compute_bytes=2, compiled=False) == 75_776
    assert s.layer_activation_bytes(compute_bytes=2, compiled=True) == 49_152
    outside = 8_192 + 24_576 + 192
    assert s.activation_bytes_per_token(compute_bytes=2, checkpointing=False, compiled=False) == 29 * 75_776 + outside
    assert s.activation_bytes_per_token(compute_bytes=2, checkpointing=False, compiled=True) == 29 * 49_152 + outside
    assert s.activation_bytes_per_token(compute_bytes=2, checkpointing=True, compiled=True) == 29 * 2_048 + outside
    # a dense [S, S] mask: k / v expanded to the query heads (n_kv 1024 -> n_q 2048: +10 bytes a kv element)
    dense = s.layer_activation_bytes(compute_bytes=2, compiled=False, dense_mask=True)
    assert dense - 75_776 == 10 * 1024


def test_the_4b_estimate_term_by_term():
    """Qwen3-4B shape + 1 depth, bf16, compiled layers, 16,384 tokens, checkpointing:
    state 18 · 4,136,513,792; saved 16,384 · (2·2560·37 + 8·2560 + 24·2560 + 192) = 16,384 · 271,552;
    transient: the head's 4096 x 151936 bf16 logits and gradient (2·2·4096·151936) + its fp32
    weight gradient and casts (10 · 151936 · 2560) = 6,378,881,024 (above one layer's 16,384 ·
    (95,232 + 117,760)); the first step's backward runs without the AdamW moments (8 bytes a
    parameter), its finish with them."""
    est = estimate_peak(shape("4b"), 16384, state_layout("bf16"), checkpointing=True, compiled=True)
    assert est.state == 18 * 4_136_513_792
    assert est.activations == 16384 * 271_552
    assert est.transient == 2 * 2 * 4096 * 151936 + 10 * 151936 * 2560 == 6_378_881_024
    assert est.peak == est.state + est.activations + est.transient == 85_285_237_248  # 79.4 GiB
    # its finish, with the moments just allocated and the norm's 2^24-element pieces, is higher here
    assert est.first_step_peak == max(est.peak - 8 * 4_136_513_792, est.state + 16 * 2**24)
    plain = estimate_peak(shape("4b"), 16384, state_layout("bf16"), checkpointing=False, compiled=True)
    assert plain.activations == 16384 * (37 * 117_760 + 82_112)
    assert plain.peak == 153_568_506_368  # 143.0 GiB: it ran out of memory on the H200 (Findings)


def test_offload_moves_the_optimizer_state_off_the_device():
    """8B shape + 1 depth: 18 B/param = 151.5 GB on the device without offload (more than an H200),
    6 B/param = 50.5 GB with it; the host holds 12 B/param plus two staging buckets of each kind."""
    s, bucket = shape("8b"), 4 * 151936 * 4096
    on = estimate_peak(s, 16384, state_layout("bf16"), checkpointing=True, compiled=True)
    off = estimate_peak(
        s, 16384, state_layout("bf16", offload="cpu"), checkpointing=True, compiled=True, offload_bucket_bytes=bucket
    )
    assert on.state == 18 * 8_417_248_512 > H200
    assert off.state == 6 * 8_417_248_512
    assert off.host == 12 * 8_417_248_512 + 2 * bucket * 1.5
    assert off.first_step_peak == off.peak  # no moments on the device
    # on a CPU device the two are one memory
    cpu = estimate_peak(s, 1024, state_layout("bf16", offload="cpu"), checkpointing=True, device_type="cpu")
    assert cpu.host == 0 and cpu.state == 6 * 8_417_248_512 + 12 * 8_417_248_512


# ------------------------------------------------------------------------------ the choices
def test_the_4b_shape_on_an_h200_needs_checkpointing_at_16k_tokens_and_the_0p6b_does_not():
    four = h200_plan("4b")
    assert four.activation_checkpointing and four.fits
    assert four.max_tokens_per_microbatch == 16384
    assert "do not fit without checkpointing" in four.reason
    small = h200_plan("0.6b")
    assert not small.activation_checkpointing and small.fits
    assert small.estimate.peak == 38_988_904_960  # 36.3 GiB, see test_activation_bytes_a_token_by_hand
    assert not h200_plan("1.7b").activation_checkpointing


def test_auto_budget_takes_the_largest_that_fits():
    """auto + auto: the largest multiple of 1024 up to max_auto_tokens whose estimate fits; without
    checkpointing if that reaches min_tokens_without_checkpointing, else with it."""
    four = h200_plan("4b", max_tokens="auto")
    assert not four.activation_checkpointing and four.max_tokens_per_microbatch == 11264
    assert four.estimate.peak <= four.usable_bytes
    bigger = estimate_peak(shape("4b"), 11264 + 1024, four.layout, checkpointing=False, compiled=True)
    assert bigger.peak > four.usable_bytes
    # asking for at least 16 k tokens without checkpointing turns it on and takes the 32 k cap
    ck = h200_plan("4b", max_tokens="auto", min_tokens_without_checkpointing=16384)
    assert ck.activation_checkpointing and ck.max_tokens_per_microbatch == 32768 and ck.fits
    small = h200_plan("0.6b", max_tokens="auto")
    assert (small.activation_checkpointing, small.max_tokens_per_microbatch) == (False, 32768)
    forced = h200_plan("4b", max_tokens="auto", checkpointing=True)
    assert forced.activation_checkpointing and forced.max_tokens_per_microbatch == 32768


def test_8b_fits_one_h200_only_with_offload():
    assert not h200_plan("8b").fits and not h200_plan("8b", max_tokens="auto").fits
    plan = h200_plan("8b", offload="cpu", max_tokens="auto")
    assert plan.fits and plan.max_tokens_per_microbatch >= 8192
    assert h200_plan("8b", offload="cpu").activation_checkpointing  # 16 k tokens need it


def test_a_forced_setting_is_kept_and_reported():
    plan = h200_plan("4b", checkpointing=False)
    assert not plan.activation_checkpointing and not plan.fits
    assert "THE ESTIMATE DOES NOT FIT" in plan.summary()
    none = plan_memory(shape("0.6b"), precision="bf16", available_bytes=None, max_tokens="auto")
    assert (none.activation_checkpointing, none.max_tokens_per_microbatch, none.fits) == (False, 8192, True)


def test_the_log_lines():
    plan = h200_plan("4b")
    line = plan.summary()
    for part in ("4.137 B parameters", "18 bytes a parameter", "estimated peak 79.4 GiB", "of 125.1 GiB usable",
                 "139.0 GiB", "activation checkpointing on", "16384 tokens"):  # fmt: skip
        assert part in line, (part, line)
    ok, low = plan.compare(int(0.9 * plan.estimate.peak), step=2)
    assert not low and "90 % of the estimate" in ok
    bad, low = plan.compare(int(1.3 * plan.estimate.peak), step=2)
    assert low and "LOW by 30 %" in bad
    first, _ = plan.compare(plan.estimate.first_step_peak, step=1)
    assert "100 % of the estimate" in first and "AdamW moments" in first


def test_host_memory_is_read():
    free, source = host_available_memory()
    assert free is None or free > 0
    assert source


# ------------------------------------------------------------------------------ the worker applies it
def _checkpointed(worker) -> bool:
    flags = {layer.gradient_checkpointing for layer in decoder_layers(worker.model)}
    assert len(flags) == 1
    return flags.pop()


def _worker(max_tokens, speed=None, memory_gib=60 / 1024):
    from splitrl.train import MicrobatchConfig, OptimConfig, TrainConfig, TrainWorker

    cfg = TrainConfig(
        device="cpu",
        speed=speed or SpeedConfig(),
        memory=MemoryConfig(device_memory_gib=memory_gib),
        microbatch=MicrobatchConfig(max_tokens_per_microbatch=max_tokens),
        optim=OptimConfig(lr=1e-3),
    )
    return TrainWorker(make_model(D=1), cfg)


def test_the_worker_checkpoints_when_the_plan_says_so():
    """auto follows the plan (a tiny model against a made-up 60 MiB device: 64 k-token
    microbatches need checkpointing, 1 k do not); a forced setting wins; an ``auto`` budget is
    resolved in the worker's config."""
    big, small = _worker(65536), _worker(1024)
    assert big.memory_plan.activation_checkpointing and _checkpointed(big)
    assert not small.memory_plan.activation_checkpointing and not _checkpointed(small)
    assert not _checkpointed(_worker(65536, SpeedConfig(activation_checkpointing=False)))
    assert _checkpointed(_worker(1024, SpeedConfig(activation_checkpointing=True)))
    auto = _worker("auto")
    budget = auto.config.microbatch.max_tokens_per_microbatch
    assert isinstance(budget, int) and budget == auto.memory_plan.max_tokens_per_microbatch
    assert auto.memory_plan.fits
    # the plan of a worker with the defaults (host memory on CPU) keeps tiny models as they were
    assert not _checkpointed(make_worker(make_model(D=1)))
    with pytest.raises(ValueError):
        SpeedConfig(activation_checkpointing="sometimes")
