"""Rollout throughput: splitrl plain and speculative vs Hugging Face ``generate`` (eager, and static
cache + compile), at fixed lengths and in a ragged, EOS-driven scenario; optional profile.

Random-init models (no hub access). Fixed-length rows have no stop tokens: every row decodes
``--new-tokens`` tokens. tokens/s = generated tokens / wall time of the whole call (prefill
included), best of ``--repeats`` calls after a warm-up call on the same engine (CUDA-graph capture
happens in the warm-up). HBM roofline: one decode step reads every backbone weight once
(2 bytes each in bf16) and the KV cache of every row (2 · layers · kv_heads · head_dim · 2 bytes per
cached token, at the mean context prompt + new/2), at ``--hbm-tb-s`` (by default the copy bandwidth
measured on the card the run finds: 4.3 TB/s on an H200, 3.0 on an H100 SXM; no roofline on others);
roofline tokens/s = batch / (bytes per step / bandwidth).

Speculation is measured with MTP heads trained on the model's own outputs: ``--mtp-samples``
sequences the engine sampled from the model, ``--train-mtp-steps`` of AdamW on the MTP parameters
only (the backbone frozen, its hidden states computed once), distilling the backbone's own
distribution at each target into the heads (``--mtp-objective ce``: the sampled token instead, as
splitrl's MTP loss does in training), and printed with the acceptance reached on held-out samples.
Speculative and plain decoding emit the same tokens (DESIGN §5), so a speedup is a pure speed figure.

Reading the output:
- ``plain`` / ``no-graph`` / ``spec`` tok/s: generated tokens / wall time of a call (best of
  ``--repeats``); ``no-graph`` is plain decoding with CUDA graphs off (on a CPU there are none:
  the same path run again, so the two columns differ by noise only). ``%roof``: share of the HBM
  roofline (on CUDA, or with ``--hbm-tb-s``). ``step reads``: the bytes of that roofline's step.
- ``spec Nx plain``: speculative over plain tokens/s in the same run. ``acceptance``: accepted
  drafts / drafted (per depth: of the drafts that depth made). ``switch-off rule estimate``: the
  engine's in-call estimate of that ratio (below 1 a run switches speculation off); ``N drafts a
  verify``: speculation drafting fewer tokens than the MTP depths (one kind the measured choice
  tries); ``with the rules on``: what a run gets once the measured choice between calls has tried
  every kind (plain, and 1 .. D drafts a verify) and the in-call rule is on. ``(N s)``: the row's
  wall time, setup included.
- ``MTP warm-up``: per depth, on held-out samples (teacher-forced), the acceptance standard
  speculative sampling would reach with these heads (``rejection rule``) against ours (``coupled
  Gumbel rule``), which keeps a sample's tokens the same with speculation on or off (DESIGN.md §5,
  ``splitrl.rollout.engine``).
- On a shared CPU a single figure can be off by several times (other jobs): compare kinds within
  one run, and raise ``--repeats``.

    python bench/bench_rollout.py                                   # tiny model, CPU
    python bench/bench_rollout.py --device cuda --preset qwen3-0.6b --batch-sizes 1,32,256 \\
        --prompt-len 128 --new-tokens 128 --speculative --baselines hf-eager,hf-static --ragged 1024 --check

Measured figures, with their dates and commands, are in bench/RESULTS.md (the history: HF
baselines, profiles, ``--attention``, which shows why few long one-query rows stay on the flash
call; ``SPLITRL_DECODE_ATTENTION=flash`` runs it everywhere).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py, beside this script (tests load it by path)
from shapes import QWEN3_SHAPES, check_switches  # noqa: E402

check_switches()  # a bad SPLITRL_* value: one line and exit 2, before the imports below read it

from splitrl.models import ModelConfig, MTPConfig, PolicyModel  # noqa: E402
from splitrl.rollout import GenerationConfig, RolloutEngine, kv  # noqa: E402
from splitrl.rollout.runner import row_bucket  # noqa: E402
from splitrl.rollout.spec_policy import SLOW_SPECULATION_WARNING  # noqa: E402

PRESETS = {
    "tiny": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
    # the shape of Qwen3-0.6B (596 M parameters), as in bench/RESULTS.md's GPU figures
    "qwen3-0.6b": dict(QWEN3_SHAPES["qwen3-0.6b"], rope_theta=1_000_000.0),
}


# the ragged scenario's settings (read only with --ragged)
RAGGED_DEFAULTS = {"ragged_max_new": 512, "ragged_batch": 256, "ragged_mean_len": 120.0}


def _batch_sizes(text: str) -> str:
    """``--batch-sizes``: kept as the text (printed in the command line), checked to be distinct positive ints."""
    try:
        sizes = [int(b) for b in text.split(",")]
        ok = all(b >= 1 for b in sizes)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,8,32, got {text!r}")
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"a batch size is listed twice in {text!r}; list each once")
    return text


def parse_args(argv: list[str], errors: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The bench's settings from ``argv``; a mistake is a usage error of ``errors`` (the parser of a
    script that builds ``argv`` for this one, so that its own usage is printed), else of this bench."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--mtp-depths", type=int, default=2, help="MTP depths (drafted tokens when speculative)")
    p.add_argument("--init-range", type=float, default=0.02, help="init std; larger gives peakier distributions")
    p.add_argument("--batch-sizes", default="1,8,32", type=_batch_sizes, help="comma list of positive ints")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--speculative", action="store_true", help="also measure speculative decoding")
    p.add_argument(
        "--train-mtp-steps",
        type=int,
        default=None,
        help="MTP warm-up steps before speculation (default 600 on cuda, 200 on cpu; 0: untrained heads)",
    )
    p.add_argument(
        "--mtp-samples", type=int, default=None,
        help="the model's own samples the MTP warm-up trains on (default 2048 on cuda, 256 on cpu)",
    )  # fmt: skip
    p.add_argument(
        "--mtp-objective", default="distill", choices=["distill", "ce"],
        help="MTP warm-up loss: the backbone's distribution at each target (distill) or the sampled token (ce)",
    )  # fmt: skip
    p.add_argument("--no-graph-column", action="store_true", help="skip the eager (no CUDA graph) column")
    p.add_argument("--baselines", default="", help="comma list of hf-eager, hf-static")
    p.add_argument("--ragged", type=int, default=0, help="samples of the ragged EOS-driven scenario (0: skip)")
    p.add_argument("--ragged-max-new", type=int, default=RAGGED_DEFAULTS["ragged_max_new"])
    p.add_argument("--ragged-batch", type=int, default=RAGGED_DEFAULTS["ragged_batch"])
    p.add_argument(
        "--ragged-mean-len", type=float, default=RAGGED_DEFAULTS["ragged_mean_len"], help="target mean response length"
    )
    p.add_argument("--repeats", type=int, default=2, help="timed calls per setting (best is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    p.add_argument(
        "--hbm-tb-s",
        type=float,
        default=None,
        help="HBM bandwidth for the roofline (TB/s); default the measured copy bandwidth of an H200 (4.3) or "
        "H100 (3.0), no roofline on other devices",
    )
    p.add_argument("--check", action="store_true", help="first check fp32 exactness on the device")
    p.add_argument(
        "--profile", default="", help="write a torch.profiler summary of plain (and speculative) decode here"
    )
    p.add_argument(
        "--attention", action="store_true",
        help="also time one layer's decode attention (flash call vs our Triton kernel) per batch size (CUDA)",
    )  # fmt: skip
    args = p.parse_args(argv)
    _check_args(errors or p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A user mistake is a usage error (exit 2) before any model is built, not a traceback (or a
    ZeroDivisionError, an empty table) after minutes of setup."""
    cuda = args.device == "cuda"
    # settings of a part that does not run would be silently ignored
    ragged = [f"--{k.replace('_', '-')}" for k, v in RAGGED_DEFAULTS.items() if getattr(args, k) != v]
    if ragged and not args.ragged:
        p.error(f"{', '.join(ragged)}: read only with --ragged N (the ragged scenario), which is off")
    mtp = [flag for flag, given in (("--train-mtp-steps", args.train_mtp_steps is not None),
                                    ("--mtp-samples", args.mtp_samples is not None),
                                    ("--mtp-objective", args.mtp_objective != "distill")) if given]  # fmt: skip
    if mtp and not args.speculative:
        p.error(f"{', '.join(mtp)}: read only with --speculative (the MTP warm-up before speculative decoding)")
    if args.train_mtp_steps is None:  # a CPU takes minutes for the GPU's warm-up
        args.train_mtp_steps = 600 if cuda else 200
    if args.mtp_samples is None:
        args.mtp_samples = 2048 if cuda else 256
    for name in ("prompt_len", "new_tokens", "repeats", "ragged_max_new", "ragged_batch", "mtp_samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("mtp_depths", "train_mtp_steps", "ragged", "top_k"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.hbm_tb_s is None and args.device == "cuda" and torch.cuda.is_available():
        # a device-to-device copy measured on each card (bench/RESULTS.md); a CPU run, or another
        # card, gets no roofline unless given one
        args.hbm_tb_s = card_bandwidth(torch.cuda.get_device_name())
    for name in ("init_range", "hbm_tb_s") if args.hbm_tb_s is not None else ("init_range",):
        if not 0 < getattr(args, name) < float("inf"):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if not 0 < args.ragged_mean_len < float("inf"):
        p.error(f"--ragged-mean-len must be a positive number of tokens, got {args.ragged_mean_len}")
    if args.ragged and args.ragged_mean_len > args.ragged_max_new:
        default = "default " if args.ragged_mean_len == RAGGED_DEFAULTS["ragged_mean_len"] else ""
        p.error(
            f"--ragged-mean-len ({default}{args.ragged_mean_len:g}) must not exceed --ragged-max-new "
            f"({args.ragged_max_new}): pass --ragged-mean-len {args.ragged_max_new} or less, "
            "or a larger --ragged-max-new"
        )
    if not args.temperature > 0:  # the engine's message is about runs, not this bench
        p.error(f"--temperature must be > 0 (for greedy decoding use --top-k 1), got {args.temperature}")
    try:  # the engine's own rules for the sampling settings
        GenerationConfig(temperature=args.temperature, top_k=args.top_k)
    except ValueError as e:
        p.error(f"--temperature / --top-k: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
    if args.speculative and args.mtp_depths < 1:
        p.error("--speculative drafts with the MTP heads: set --mtp-depths >= 1")
    baselines = [b.strip() for b in args.baselines.split(",")] if args.baselines.strip() else []
    unknown = [b for b in baselines if b not in ("hf-eager", "hf-static")]
    if unknown or len(set(baselines)) != len(baselines):
        p.error(
            f"--baselines takes a comma list of hf-eager, hf-static, each at most once; got {args.baselines!r}"
            + (f" (unknown {unknown})" if unknown else "")
        )
    args.baselines = ",".join(baselines)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU is visible here; use --device cpu")
    if args.attention and args.device != "cuda":
        p.error("--attention times the CUDA kernels: add --device cuda")
    _check_cache_fits(p, args)
    if args.profile and Path(args.profile).is_dir():
        p.error(f"--profile {args.profile} is a directory; give a file path (the summary is appended to it)")
    if args.profile and not Path(args.profile).resolve().parent.is_dir():
        p.error(f"--profile {args.profile}: its directory does not exist; give a path in an existing directory")


# copy bandwidth (bytes read + written) measured on the cards this workplace lends (bench/RESULTS.md)
CARD_TB_S = {"H200": 4.3, "H100": 3.0}


def card_bandwidth(name: str) -> float | None:
    """The roofline bandwidth (TB/s) of a CUDA device named ``name``, None for a card not measured."""
    return next((tb for card, tb in CARD_TB_S.items() if card in name), None)


def _check_cache_fits(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The largest run's KV cache (slots x (prompt + new tokens) x layers x 2 x kv heads x head dim,
    the backbone's and the MTP depths') must fit in the device's memory: a huge --prompt-len
    otherwise ran out of memory after minutes of setup, or swapped the machine."""
    c = PRESETS[args.preset]
    elt = 4 if (args.dtype or ("bfloat16" if args.device == "cuda" else "float32")) == "float32" else 2
    per_token = (c["num_hidden_layers"] + args.mtp_depths) * 2 * c["num_key_value_heads"] * c["head_dim"] * elt
    runs = [(max(int(b) for b in args.batch_sizes.split(",")), args.prompt_len + args.new_tokens, "--batch-sizes")]
    if args.ragged:
        runs.append((args.ragged_batch, args.prompt_len + args.ragged_max_new, "--ragged-batch"))
    if args.device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for slots, length, flag in runs:
        need = slots * length * per_token
        if need > 0.8 * memory:
            p.error(
                f"the KV cache of {slots} rows x {length} tokens ({flag}, --prompt-len + new tokens) needs "
                f"{need / 2**30:.1f} GiB, over 80 % of the {memory / 2**30:.0f} GiB here; lower them"
            )


def build_model(args: argparse.Namespace, dtype: torch.dtype) -> PolicyModel:
    backbone = dict(
        PRESETS[args.preset],
        max_position_embeddings=max(4096, args.prompt_len + max(args.new_tokens, args.ragged_max_new)),
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=args.init_range,
    )
    cfg = ModelConfig(backbone=backbone, mtp=MTPConfig(mtp_num_layers=args.mtp_depths))
    return PolicyModel.from_config(cfg).to(device=args.device, dtype=dtype)


def _attention_path(args: argparse.Namespace, model: PolicyModel) -> str:
    """What reads the backbone's KV cache in decode steps, as the header says it."""
    from splitrl.rollout import decode_attention

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if not (kv.FLASH_DECODE and kv._flash_runs(args.device, model.output_weight.dtype, head_dim)):
        return "masked SDPA"
    if kv.DECODE_KERNEL == "flash":
        return "flash varlen call"
    return (
        f"Triton kernel (the flash call for one-query steps of < {decode_attention.FEW_PROGRAMS} row x kv-head "
        f"programs over {decode_attention.LONG_ROW} entries)"
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _percent(tokens_per_s: float, roof: float | None) -> str:
    """``tokens_per_s`` as a share of the roofline, 6 characters ("   n/a" without one)."""
    return "   n/a" if roof is None else f"{100 * tokens_per_s / roof:>5.1f}%"


def roofline(model: PolicyModel, batch: int, context: float, bandwidth: float | None) -> tuple[float, float | None]:
    """(bytes one decode step reads, roofline tokens/s, None without a ``bandwidth`` in bytes/s) for
    ``batch`` rows at mean ``context``."""
    c = model.config
    elt = next(model.parameters()).element_size()
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp.")) * elt
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = batch * context * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * elt
    step = weights + kv
    return step, (batch / (step / bandwidth) if bandwidth else None)


def prompts_for(model: PolicyModel, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def measure_engine(engine: RolloutEngine, prompts, seeds, repeats: int):
    engine.generate(prompts, seeds)  # warm-up: CUDA graphs are captured here
    best = None
    for _ in range(repeats):
        engine.generate(prompts, seeds)
        if best is None or engine.last_stats.tokens_per_s > best.tokens_per_s:
            best = engine.last_stats
    return best


def measure_hf(model: PolicyModel, prompts, new_tokens: int, static: bool, repeats: int, device: str) -> float:
    """tokens/s of transformers' ``generate`` on the backbone (greedy: sampling costs the same)."""
    hf = model.backbone
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    if static:
        kwargs["cache_implementation"] = "static"  # transformers compiles the decode step
    hf.generate(ids, **kwargs)
    best = 0.0
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        sync(device)
        best = max(best, (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - t0))
    return best


# held-out samples of the MTP warm-up, on which its acceptance is measured
HELD_OUT = 64
MAX_CACHED_TOKENS = 2**20  # the warm-up's own samples, prompts included, held at once


@torch.no_grad()
def _own_samples(model: PolicyModel, args: argparse.Namespace, n: int) -> torch.Tensor:
    """int64 [n, prompt + new] sequences the engine samples from the model (random prompts; no stop
    tokens, so every row has the full length)."""
    cfg = GenerationConfig(
        temperature=args.temperature, top_k=args.top_k, max_new_tokens=args.new_tokens, batch_size=256,
        stop_token_ids=[],
    )  # fmt: skip
    prompts = prompts_for(model, n, args.prompt_len, seed=1)
    results = RolloutEngine(model, cfg, args.device).generate(prompts, list(range(10_000, 10_000 + n)))
    return torch.tensor([p + r.response_ids for p, r in zip(prompts, results)], device=args.device)


class _MTPWarmUp:
    """The frozen backbone's embeddings and h^0 of sequences (computed once), and the MTP depths'
    teacher-forced outputs on them (DESIGN §3: depth k at position t reads Emb(x_{t+k}) and h^{k-1}_t
    and predicts x_{t+k+1}, which the backbone predicts at position t+k). ``top_k``: the filter the
    samples were drawn with (the target distribution and the acceptance rules apply it)."""

    def __init__(self, model: PolicyModel, seqs: torch.Tensor, prompt_len: int, temperature: float, top_k: int):
        from splitrl.models.policy import build_attention_mask

        self.model, self.seqs, self.P, self.T, self.top_k = model, seqs, prompt_len, temperature, top_k
        N, S = seqs.shape
        self.D = model.num_mtp_depths
        self.W = model.output_weight
        self.pos = torch.arange(S, device=seqs.device)
        # every row is one sample (plain causal): one [1, 1, S, S] mask, broadcast over rows
        self._mask = build_attention_mask(
            torch.zeros(1, S, dtype=torch.int64, device=seqs.device), model.config._attn_implementation, self.W.dtype
        )
        self.emb = torch.empty(N, S, model.config.hidden_size, dtype=self.W.dtype, device=seqs.device)
        self.h0 = torch.empty_like(self.emb)
        with torch.no_grad():
            for i in range(0, N, 64):
                x = seqs[i : i + 64]
                self.emb[i : i + len(x)] = model.embed_tokens(x)
                self.h0[i : i + len(x)] = model.backbone.model(
                    inputs_embeds=self.emb[i : i + len(x)], attention_mask=self.mask(len(x)),
                    position_ids=self.pos.expand(len(x), S),
                ).last_hidden_state  # fmt: skip

    def mask(self, B: int) -> torch.Tensor:
        return self._mask.expand(B, *self._mask.shape[1:])

    def positions(self, k: int) -> slice:
        """Positions t >= 0 whose depth-k target x_{t+k+1} is a response token (empty when the
        sequence is too short for depth k)."""
        return slice(max(0, self.P - k - 1), max(0, self.seqs.shape[1] - k - 1))

    def has_targets(self) -> bool:
        """Whether some depth has a response token to predict (a 1-token response has none)."""
        return any(self.positions(k).stop > self.positions(k).start for k in range(1, self.D + 1))

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 ``logits`` after the sampling's top-k (a no-op for top_k 0)."""
        from splitrl.rollout.sampling import filter_logits

        return filter_logits(logits.float(), self.top_k, 1.0)

    def targets(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        """int64 [rows, targets]: the sampled x_{t+k+1} at :meth:`positions`."""
        sl = self.positions(k)
        return self.seqs[rows, sl.start + k + 1 : sl.stop + k + 1]

    def depths(self, rows: torch.Tensor):
        """Yields (k, depth-k logits / T, backbone logits / T at the same targets) for ``rows``:
        [rows, targets, V] each, in the weights' dtype, unfiltered; depths with no target are left out."""
        emb, h0 = self.emb[rows], self.h0[rows]
        B, S, _ = emb.shape
        pos = self.pos.expand(B, S)
        rope = self.model.rotary_emb(h0, pos)
        prev = h0
        for k in range(1, self.D + 1):
            emb_k = torch.nn.functional.pad(emb[:, k:], (0, 0, 0, k))  # Emb(x_{t+k})
            prev = self.model.mtp.depth_forward(
                k, emb_k, prev, attention_mask=self.mask(B), position_embeddings=rope, position_ids=pos
            )
            sl = self.positions(k)
            if sl.stop <= sl.start:
                continue
            with torch.no_grad():
                p = h0[:, sl.start + k : sl.stop + k] @ self.W.T / self.T
            yield k, prev[:, sl] @ self.W.T / self.T, p


def train_mtp_heads(model: PolicyModel, args: argparse.Namespace) -> tuple[dict[int, tuple[float, float]], int]:
    """Fit the MTP heads to the model's own outputs, the backbone frozen, and return the held-out
    acceptance per depth (:func:`mtp_acceptance`) and the number of training samples.

    ``--mtp-samples`` sequences are sampled from the model by the engine (plus ``HELD_OUT`` more).
    ``--mtp-objective distill`` (default) minimizes the cross-entropy of each depth's distribution
    against the backbone's own distribution at the same target, E_p[-log q]; ``ce`` minimizes it
    against the sampled token, -log q(x), as splitrl's MTP loss does in training (DESIGN §3). Here p
    is the distribution the samples were drawn from (logits / T after ``--top-k``), so the two
    losses have the same expectation; the sampled token is a far noisier estimate of it, so with the
    same data the heads get further with ``distill`` (bench/RESULTS.md, rollout decoding).
    AdamW (lr 2e-3, no weight decay), 20 warm-up steps then a cosine decay, batches of 32 sequences
    (fewer for responses over 128 tokens: the fp32 logits of a batch stay ~4 k tokens a depth).
    """
    n = min(args.mtp_samples, max(32, MAX_CACHED_TOKENS // (args.prompt_len + args.new_tokens)))
    seqs = _own_samples(model, args, n + HELD_OUT)
    data = _MTPWarmUp(model, seqs, args.prompt_len, args.temperature, args.top_k)
    if not data.has_targets():
        return {}, n
    params = [p for name, p in model.named_parameters() if name.startswith("mtp.")]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    steps = args.train_mtp_steps
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1)))
    )
    from tqdm.auto import tqdm

    gen = torch.Generator(args.device).manual_seed(0)  # the same batches every run
    bar = tqdm(range(steps), desc="MTP warm-up", unit="step", leave=False, file=sys.stderr, disable=None)
    for _ in bar:
        rows = torch.randint(0, n, (min(n, max(1, 4096 // args.new_tokens), 32),), device=args.device, generator=gen)
        loss = 0.0
        for k, q_logits, p_logits in data.depths(rows):
            log_q = q_logits.float().log_softmax(-1)
            if args.mtp_objective == "distill":
                loss = loss - (data.filtered(p_logits).softmax(-1) * log_q).sum(-1).mean()
            else:
                loss = loss - log_q.gather(-1, data.targets(rows, k)[..., None]).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    for p in params:
        p.requires_grad_(False)
    return mtp_acceptance(data, torch.arange(n, n + HELD_OUT, device=args.device)), n


@torch.no_grad()
def mtp_acceptance(data: _MTPWarmUp, rows: torch.Tensor) -> dict[int, tuple[float, float]]:
    """Teacher-forced acceptance (%) of each MTP depth on ``rows``: {k: (coupled, rejection)}.

    coupled: P(race winner of q = race winner of p) under the same Gumbel noise, the rule of our
    engine, which keeps a sample's tokens the same with speculation on or off (DESIGN §5);
    rejection: E[sum min(p, q)], what standard speculative sampling would accept. Both after the
    sampling's top-k, as the engine drafts and verifies. Depth k >= 2 is conditioned on the earlier
    drafts being right (its inputs are the true tokens)."""
    from splitrl.rollout.sampling import STREAM_TARGET, race_sample, seed_words

    totals: dict[int, list[float]] = {}
    chunk = max(1, min(16, 2048 // (data.seqs.shape[1] - data.P)))
    for i in range(0, len(rows), chunk):
        for k, q_logits, p_logits in data.depths(rows[i : i + chunk]):
            q, p = data.filtered(q_logits).flatten(0, 1), data.filtered(p_logits).flatten(0, 1)
            m = q.shape[0]
            lo, hi = seed_words(list(range(i * 10_000, i * 10_000 + m)), q.device)
            c = torch.full((m,), k, dtype=torch.int64, device=q.device)
            same = race_sample(q, lo, hi, c, STREAM_TARGET) == race_sample(p, lo, hi, c, STREAM_TARGET)
            t = totals.setdefault(k, [0.0, 0.0, 0])
            t[0] += float(same.sum())
            t[1] += float(torch.minimum(p.softmax(-1), q.softmax(-1)).sum())
            t[2] += m
    return {k: (100 * a / m, 100 * r / m) for k, (a, r, m) in totals.items()}


def describe_warm_up(
    args: argparse.Namespace, acceptance: dict[int, tuple[float, float]], samples: int, seconds: float
) -> str:
    """The warm-up's line of the output: what it trained on and the held-out acceptance reached."""
    steps = f"{args.train_mtp_steps} step{'s' if args.train_mtp_steps != 1 else ''}"
    cap = f"{MAX_CACHED_TOKENS / 2**20:g} M" if MAX_CACHED_TOKENS >= 2**20 else f"{MAX_CACHED_TOKENS:,}"
    capped = f" (capped from {args.mtp_samples}: at most {cap} cached tokens)" if samples < args.mtp_samples else ""
    if not acceptance:
        return (
            f"MTP warm-up: responses of {args.new_tokens} token(s) after {args.prompt_len}-token prompts give no "
            "depth a token to predict; speculation runs with untrained heads"
        )
    per_depth = lambda i: "/".join(f"{acceptance[k][i]:.1f}" for k in sorted(acceptance))  # noqa: E731
    return (
        f"MTP warm-up: {steps} ({args.mtp_objective}) on {samples} of the model's own samples{capped}; "
        f"acceptance per depth on {HELD_OUT} held-out samples (teacher-forced) at T={args.temperature}: coupled "
        f"Gumbel rule (ours) {per_depth(0)} %, rejection rule E[sum min(p,q)] {per_depth(1)} % ({seconds:.0f} s)"
    )


@torch.no_grad()
def check_exactness(args: argparse.Namespace) -> None:
    """fp32 on the device: logprobs equal PolicyModel.forward's teacher-forced ones, and speculative
    decoding emits the plain tokens (greedy and sampled)."""
    model = build_model(args, torch.float32)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 24))] for _ in range(6)]
    seeds = list(range(6))
    common = dict(max_new_tokens=24, batch_size=4)
    sampled = GenerationConfig(temperature=0.8, **common)
    results = RolloutEngine(model, sampled, args.device).generate(prompts, seeds)
    worst = 0.0
    for prompt, res in zip(prompts, results):
        ids = torch.tensor([prompt + res.response_ids], device=args.device)
        ref = model(ids, mtp_loss_mask=torch.zeros(ids.shape, device=args.device), temperature=0.8).logprobs[
            0, len(prompt) :
        ]
        worst = max(worst, float((ref.cpu() - torch.tensor(res.logprobs)).abs().max()))
    print(f"check (fp32, {args.device}): max |logprob - teacher-forced| = {worst:.2e}", end="")
    for name, cfg in (("greedy", GenerationConfig(top_k=1, **common)), ("sampled T=0.8", sampled)):
        plain = RolloutEngine(model, cfg, args.device).generate(prompts, seeds)
        spec = RolloutEngine(model, cfg.model_copy(update={"speculative": True}), args.device).generate(prompts, seeds)
        same = sum(p.response_ids == s.response_ids for p, s in zip(plain, spec))
        print(f"; {name} speculative == plain for {same}/{len(plain)} rows", end="")
    print(flush=True)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def profile_decode(
    model: PolicyModel, args: argparse.Namespace, batch: int, path: str, speculative: bool = False
) -> None:
    """Kernel time vs wall time of plain (or speculative, rules off) decode at ``batch`` after
    warm-up, with the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    cfg = GenerationConfig(
        temperature=args.temperature, max_new_tokens=args.new_tokens, batch_size=batch, speculative=speculative
    )
    engine = RolloutEngine(model, cfg, args.device)
    engine.speculative_switch_off = False
    prompts = prompts_for(model, batch, args.prompt_len)
    seeds = list(range(batch))
    engine.generate(prompts, seeds)
    sync(args.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, seeds)
        sync(args.device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    table = events.table(sort_by="self_device_time_total", row_limit=15)
    summary = (
        f"profile {'speculative' if speculative else 'plain'} decode batch {batch}: wall {wall * 1e3:.1f} ms, GPU kernel time {kernel_us / 1e3:.1f} ms "
        f"({100 * kernel_us / 1e6 / wall:.0f}% busy), {engine.last_stats.num_forwards} decode steps"
        + (f", acceptance {engine.last_stats.acceptance_rate:.1f}%" if speculative else "")
    )
    print(summary, flush=True)
    with open(path, "a") as f:
        f.write(summary + "\n" + table + "\n\n")


def time_attention(model: PolicyModel, args: argparse.Namespace) -> None:
    """One layer's decode attention, us per call (20 calls in a CUDA graph, replayed 10 times),
    for Q = 1 (plain) and Q = 1 + D (a verify), the flash varlen call against our Triton kernel,
    at the mean context of the run, 2,048 and 8,192 entries (every row that long; the kernel's
    switch to the flash call for few long rows, ``decode_attention.preferred``, is bypassed so that
    both are timed)."""
    from splitrl.rollout import decode_attention

    c = model.config
    Hk, H = c.num_key_value_heads, c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // H
    kernels = ["flash"] + (["triton"] if decode_attention.AVAILABLE else [])
    saved = kv.DECODE_KERNEL, decode_attention.FEW_PROGRAMS
    decode_attention.FEW_PROGRAMS = 0  # time the kernel everywhere
    contexts = [int(args.prompt_len + args.new_tokens / 2), 2048, 8192]
    try:
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            for L in contexts:
                cache = kv.StaticKVCache(1, batch, Hk, L + 8, d, next(model.parameters()).dtype, args.device)
                if not cache.flash:  # else both columns would time the masked path under these names
                    print(
                        "attention timing needs a flash cache (CUDA sm80+, fp16 / bf16, head dim a multiple of 8 "
                        "up to 256, SPLITRL_FLASH_DECODE not 0); this run has none",
                        flush=True,
                    )
                    return
                cache.k.normal_()
                cache.v.normal_()
                cells = []
                for Q in sorted({1, 1 + args.mtp_depths}):
                    for name in kernels:
                        kv.DECODE_KERNEL = name
                        pos = (
                            torch.full((batch, 1), L - 1, device=args.device)
                            - (Q - 1)
                            + torch.arange(Q, device=args.device)
                        )
                        q = torch.randn(batch, Q, H, d, dtype=cache.k.dtype, device=args.device)
                        plan = cache.plan(pos, pos, pos, L, causal=True)
                        us = _graph_time(lambda: cache.attend(0, q, plan, d**-0.5))
                        cells.append(f"Q={Q} {name} {us:6.1f}")
                print(f"attention batch {batch:>4}, {L:>5} entries a row: " + ", ".join(cells) + " us", flush=True)
    finally:
        kv.DECODE_KERNEL, decode_attention.FEW_PROGRAMS = saved


def _graph_time(fn, calls: int = 20, replays: int = 10) -> float:
    """Microseconds per ``fn()`` call, from CUDA events around replays of a graph of ``calls`` calls."""
    for _ in range(3):
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def ragged_stop_ids(model: PolicyModel, args: argparse.Namespace) -> list[int]:
    """Stop tokens whose mean probability under the model (softmax(logits / T) averaged over the
    positions of 16 sampled sequences) sums to ~1 / ``--ragged-mean-len``, so a sampled token stops
    with that probability on average and the per-context variation gives a long tail. (Counting
    tokens in a probe does not work for a random-init model: its distribution is nearly flat over
    152 k tokens, so a probe sees each token about once and the chosen set stops almost nothing.)"""
    probe = RolloutEngine(
        model, GenerationConfig(temperature=args.temperature, max_new_tokens=256, batch_size=16), args.device
    ).generate(prompts_for(model, 16, args.prompt_len, seed=7), list(range(16)))
    probe_prompts = prompts_for(model, 16, args.prompt_len, seed=7)
    mean_p = torch.zeros(model.config.vocab_size, dtype=torch.float64, device=args.device)
    positions = 0
    with torch.no_grad():
        for prompt, r in zip(probe_prompts, probe):
            ids = torch.tensor([prompt + r.response_ids], device=args.device)
            logits = model.backbone(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            mean_p += (logits / args.temperature).softmax(-1).sum(0).double()
            positions += logits.shape[0]
    mean_p /= positions
    target = 1.0 / args.ragged_mean_len
    stops, mass = [], 0.0
    values, order = mean_p.sort(descending=True)
    for p_t, t in zip(values.tolist(), order.tolist()):
        if mass + p_t > target:
            continue
        stops.append(t)
        mass += p_t
        if mass > 0.98 * target:
            break
    return stops


def ragged_scenario(model: PolicyModel, args: argparse.Namespace, spec_ok: bool) -> None:
    """1,024-ish samples whose lengths are set by stop tokens (:func:`ragged_stop_ids`): continuous
    batching, with and without speculation, against static batches of the same slots."""
    n, S = args.ragged, args.ragged_batch
    stops = ragged_stop_ids(model, args)
    prompts = prompts_for(model, n, args.prompt_len, seed=8)
    seeds = list(range(20_000, 20_000 + n))
    base = dict(temperature=args.temperature, max_new_tokens=args.ragged_max_new, stop_token_ids=stops, batch_size=S)
    lines = []
    runs = [("continuous", False, False)]
    if spec_ok:  # speculation measured as is, then as a run gets it (the switch-off rule on)
        runs += [("continuous + spec", True, False), ("+ spec, rules on", True, True)]
    for name, spec, rules in runs:
        engine = RolloutEngine(model, GenerationConfig(speculative=spec, **base), args.device)
        engine.speculative_switch_off = rules
        # warm-up: the same call, so that every (rows, length) bucket's CUDA graph is captured before
        # the timed call (a warm-up of S prompts left the tail's buckets to it: seconds of captures)
        engine.generate(prompts, seeds)
        if rules:  # the rule's second call is plain (it measures both kinds), the third the faster
            engine.generate(prompts, seeds)
        sync(args.device)
        t0 = time.perf_counter()
        res = engine.generate(prompts, seeds)
        sync(args.device)
        wall = time.perf_counter() - t0
        toks = sum(len(r.response_ids) for r in res)
        extra = ""
        if spec:
            st = engine.last_stats
            est = "n/a" if st.speculative_speedup is None else f"{st.speculative_speedup:.2f}x"
            off = st.switched_off_at_iteration
            # with the rules on, where the rule switched speculation off; a plain call was never on
            switch = "" if not rules or not st.speculative_active else (
                ", never switched off" if off is None else f", switched off at iteration {off}"
            )  # fmt: skip
            extra = (
                ("" if st.speculative_active else ", a plain call")
                + f", acceptance {st.acceptance_rate:.1f}%, switch-off rule estimate {est}"
                + switch
            )
        lines.append(f"  splitrl {name:<18} {toks / wall:>10.0f} tok/s ({wall:.2f} s){extra}")
        if not spec:
            lengths = sorted(len(r.response_ids) for r in res)
    # static batching with the same engine: each batch of S waits for its longest sample
    engine = RolloutEngine(model, GenerationConfig(**base), args.device)
    for _ in range(2):  # the first pass captures the batches' CUDA graphs; the second is timed
        sync(args.device)
        t0 = time.perf_counter()
        toks = 0
        for b in range(0, n, S):
            toks += sum(len(r.response_ids) for r in engine.generate(prompts[b : b + S], seeds[b : b + S]))
        sync(args.device)
        wall = time.perf_counter() - t0
    lines.append(f"  splitrl static batches of {S:<4} {toks / wall:>8.0f} tok/s ({wall:.2f} s)")
    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
    print(
        f"ragged: {n} sample{'s' * (n != 1)}, prompt {args.prompt_len}, {len(stops)} stop id{'s' * (len(stops) != 1)}, "
        f"max_new {args.ragged_max_new}, "
        f"slots {S}; response length mean {sum(lengths) / n:.0f}, p50 {q(0.5)}, p90 {q(0.9)}, p99 {q(0.99)}, "
        f"max {lengths[-1]}"
    )
    print("\n".join(lines), flush=True)


def _quiet_speculation_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(SLOW_SPECULATION_WARNING)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # the table reports the speedups; every other warning (e.g. a failed CUDA-graph capture) shows
    policy_log = logging.getLogger("splitrl.rollout.spec_policy")
    if _quiet_speculation_warning not in policy_log.filters:  # main() may run more than once
        policy_log.addFilter(_quiet_speculation_warning)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    )
    print(f"command: python bench/bench_rollout.py {shlex.join(argv)}", flush=True)
    if args.check:
        check_exactness(args)
    model = build_model(args, dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    n_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    threads = torch.get_num_threads()
    cpu = f"CPU ({threads} thread{'s' * (threads != 1)})"
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu
    print(
        f"device {device_name}, {dtype}, preset {args.preset} ({n_params / 1e6:.1f} M backbone params, "
        f"D={args.mtp_depths}), prompt {args.prompt_len} + {args.new_tokens} new tokens, "
        f"T={args.temperature}, top_k={args.top_k}, torch {torch.__version__}, decode attention {_attention_path(args, model)}, "
        + (f"roofline at {args.hbm_tb_s} TB/s" if args.hbm_tb_s is not None else "no roofline (--hbm-tb-s)"),
        flush=True,
    )
    if args.speculative and args.train_mtp_steps:
        t0 = time.perf_counter()
        acceptance, samples = train_mtp_heads(model, args)
        print(describe_warm_up(args, acceptance, samples, time.perf_counter() - t0), flush=True)
    elif args.speculative:
        print("MTP warm-up skipped (--train-mtp-steps 0): speculation runs with the untrained heads", flush=True)
    baselines = [b for b in args.baselines.split(",") if b]
    context = args.prompt_len + args.new_tokens / 2
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = args.hbm_tb_s * 1e12 if args.hbm_tb_s is not None else None
    cols = ["plain"] + ([] if args.no_graph_column else ["no-graph"]) + (["spec"] if args.speculative else [])
    print(f"{'batch':>5} {'roofline':>9} " + " ".join(f"{c + ' tok/s (%roof)':>24}" for c in cols) + "  notes")
    common = dict(temperature=args.temperature, top_k=args.top_k, max_new_tokens=args.new_tokens, stop_token_ids=[])
    for batch in batch_sizes:
        t_start = time.perf_counter()
        step_bytes, roof = roofline(model, batch, context, bandwidth)
        prompts, seeds = prompts_for(model, batch, args.prompt_len), list(range(batch))
        figures, notes = {}, []
        plain_engine = RolloutEngine(model, GenerationConfig(batch_size=batch, **common), args.device)
        plain = measure_engine(plain_engine, prompts, seeds, args.repeats)
        figures["plain"] = plain.tokens_per_s
        if not args.no_graph_column:
            plain_engine.use_cuda_graphs = False
            figures["no-graph"] = measure_engine(plain_engine, prompts, seeds, 1).tokens_per_s
        if args.speculative:
            spec_cfg = GenerationConfig(batch_size=batch, speculative=True, **common)
            spec_engine = RolloutEngine(model, spec_cfg, args.device)
            spec_engine.speculative_switch_off = False  # measure speculation; the rule's estimate is printed
            spec = measure_engine(spec_engine, prompts, seeds, args.repeats)
            figures["spec"] = spec.tokens_per_s
            per_depth = "/".join("n/a" if math.isnan(r) else f"{r:.0f}" for r in spec.acceptance_rate_per_depth)
            accepted = (
                "n/a (nothing drafted)" if math.isnan(spec.acceptance_rate)
                else f"{spec.acceptance_rate:.1f}% (per depth {per_depth})"
            )  # fmt: skip
            # the in-call rule decides after SWITCH_MIN_ITERATIONS verifies: a shorter call has no estimate
            est = f"{spec.speculative_speedup:.2f}x" if spec.speculative_speedup is not None else "n/a (call too short)"
            off = spec.switched_off_at_iteration
            notes.append(
                f"spec {spec.tokens_per_s / plain.tokens_per_s:.2f}x plain, acceptance {accepted}, "
                f"switch-off rule estimate {est}" + (f", switched off at iteration {off}" if off is not None else "")
            )
            for fewer in range(spec_engine.num_drafts - 1, 0, -1):  # the kinds the measured choice also tries
                fewer_cfg = spec_cfg.model_copy(update={"num_draft_tokens": fewer})
                fewer_engine = RolloutEngine(model, fewer_cfg, args.device)
                fewer_engine.speculative_switch_off = False
                few = measure_engine(fewer_engine, prompts, seeds, args.repeats)
                notes.append(
                    f"{fewer} draft{'s' if fewer > 1 else ''} a verify: {few.tokens_per_s:.0f} tok/s = "
                    f"{few.tokens_per_s / plain.tokens_per_s:.2f}x plain, acceptance {few.acceptance_rate:.1f}%"
                )
                del fewer_engine
            del spec_engine
            # what a run gets: the in-call rule and the measured choice between calls decide
            ruled = RolloutEngine(model, spec_cfg, args.device)
            bucket = row_bucket(batch, batch)
            ruled.generate(prompts, seeds)  # warm-up
            for _ in range(3 * len(ruled.policy.kinds())):  # each kind once (a compiling call is no sample)
                if ruled.policy.measured_all(bucket):
                    break
                ruled.generate(prompts, seeds)
            ruled.generate(prompts, seeds)  # the choice
            last = ruled.last_stats
            kind = (
                f"speculative calls of {last.num_drafts} draft{'s' * (last.num_drafts != 1)}"
                if last.speculative_active else "plain calls"
            )  # fmt: skip
            notes.append(
                f"with the rules on: {kind}, "
                f"{last.tokens_per_s:.0f} tok/s = {last.tokens_per_s / plain.tokens_per_s:.2f}x plain"
            )
            del ruled
        cells = " ".join(f"{figures[c]:>13.0f} ({_percent(figures[c], roof)})    " for c in cols)
        print(
            f"{batch:>5} {'n/a' if roof is None else f'{roof:.0f}':>9} {cells}  step reads {step_bytes / 1e9:.2f} GB"
            + "".join("; " + note for note in notes)
            + f" ({time.perf_counter() - t_start:.0f} s)",
            flush=True,
        )
    try:  # a failing extra must not cost the figures after it
        if args.attention:
            time_attention(model, args)
    except Exception as err:  # noqa: BLE001
        print(f"attention timing failed: {err!r}", flush=True)
    try:
        if args.profile:
            for batch in batch_sizes:
                profile_decode(model, args, batch, args.profile)
                if args.speculative:
                    profile_decode(model, args, batch, args.profile, speculative=True)
    except Exception as err:  # noqa: BLE001
        print(f"profile failed: {err!r}", flush=True)
    try:
        if args.ragged:
            ragged_scenario(model, args, args.speculative)
    except Exception as err:  # noqa: BLE001
        print(f"ragged scenario failed: {err!r}", flush=True)
    # transformers' generate last (its compilation takes minutes): same model, prompts and lengths
    for b in baselines:
        for batch in batch_sizes:
            t0 = time.perf_counter()
            prompts = prompts_for(model, batch, args.prompt_len)
            tps = measure_hf(model, prompts, args.new_tokens, b == "hf-static", 1, args.device)
            _, roof = roofline(model, batch, context, bandwidth)
            print(
                f"{b:>9} batch {batch:>4}: {tps:>9.0f} tok/s ({_percent(tps, roof).strip()} of roofline) "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
