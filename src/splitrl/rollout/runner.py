"""The model runner of the rollout engine: the device state of the slots, the static caches, the
step functions, their CUDA graphs and the refills' prefill buckets (see :mod:`splitrl.rollout.engine`).

Legend: S = slots (rows held at once, ``batch_size``), B = slots of one decode step (a bucket),
L = cache prefix a step reads (a bucket), W = response buffer width, V = vocabulary, D = drafts.

Everything here runs on the device without a host synchronization (so that it can be captured
as a CUDA graph), except the captures, the plain-step timings and the host side of a refill. The
scheduler (:mod:`splitrl.rollout.scheduler`) decides what runs; this module runs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from splitrl.models.policy import PolicyModel
from splitrl.rollout import kv
from splitrl.rollout.config import GenerationConfig
from splitrl.rollout.drafter import DraftVocabulary, MTPDrafter
from splitrl.rollout.forward import DecoderForward
from splitrl.rollout.fused import stop_mask
from splitrl.rollout.kv import StaticKVCache
from splitrl.rollout.sampling import column_keys, seed_words

log = logging.getLogger(__name__)

# Refills of at most this many tokens (rows x padded prompt length) run as CUDA graphs, one per
# (rows, length) bucket: an eager prefill is host-bound below it (bench/RESULTS.md, rollout decoding,
# the profile of eager prefills).
GRAPH_PREFILL_TOKENS = 8192
# At most this many prefill graphs per engine (each holds its activations in the graph pool);
# refills of other shapes run eagerly.
MAX_PREFILL_GRAPHS = 48
# Decode-step buckets: rows (slots 0..B-1) and cache prefix lengths.
_ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def row_bucket(n: int, cap: int) -> int:
    for b in _ROW_BUCKETS:
        if b >= n:
            return min(b, cap)
    return min(cap, -(-n // 64) * 64)


def step_kind(drafts: int, max_drafts: int) -> str:
    """The kind of a decode step with ``drafts`` drafts a verify (0: a plain step), of a runner that
    drafts at most ``max_drafts``: ``"plain"``, ``"spec"`` (all of them) or ``"spec<drafts>"``."""
    if not 0 <= drafts <= max_drafts:
        raise ValueError(f"drafts={drafts} is outside 0..{max_drafts}, the drafts this runner's buffers hold")
    if drafts == 0:
        return "plain"
    return "spec" if drafts == max_drafts else f"spec{drafts}"


def drafts_of(kind: str, max_drafts: int) -> int:
    """The drafts a verify of step kind ``kind`` makes (:func:`step_kind`'s inverse)."""
    if kind == "plain":
        return 0
    return max_drafts if kind == "spec" else int(kind[4:])


def length_bucket(n: int, cap: int, start: int = 64) -> int:
    b = start
    while b < n:
        b = b * 3 // 2 if (b & (b - 1)) == 0 else b * 4 // 3  # 64, 96, 128, 192, 256, 384, ...
    return min(b, cap)


def _prefill_views(flat: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """(ids [rows, width], lens, slots, seed_lo, seed_hi [rows]) of a refill's packed int64 inputs."""
    ids, rest = flat[: rows * width].view(rows, width), flat[rows * width :]
    return (ids, *rest.view(4, rows).unbind(0))


class SlotState:
    """Device state of every slot (one sample each); see :mod:`splitrl.rollout.engine`'s docstring."""

    SMALL = ("tokens", "pos", "counter", "seed_lo", "seed_hi", "done", "stopped", "drafted", "accepted")

    def __init__(self, slots: int, width: int, D: int, hidden: int, dtype: torch.dtype, device: torch.device):
        def z(*shape, dt=torch.int64):
            return torch.zeros(shape, dtype=dt, device=device)

        self.tokens = z(slots)  # x_n: emitted, not yet fed to the backbone
        self.pos = z(slots)  # position of x_n (= tokens fed so far)
        self.counter = z(slots)  # response tokens emitted so far
        self.seed_lo, self.seed_hi = z(slots), z(slots)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)  # empty slots are done
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.out_tokens = z(slots, width)
        self.out_logprobs = z(slots, width, dt=torch.float32)
        self.drafted, self.accepted = z(slots), z(slots)
        self.reached_depth, self.accepted_depth = z(slots, D), z(slots, D)
        self.drafts = z(slots, D)
        self.carry = torch.zeros(max(D - 1, 0), slots, hidden, dtype=dtype, device=device)
        self.width = width

    def small(self) -> list[torch.Tensor]:
        """Everything a decode step changes besides caches and response buffers."""
        extra = [self.reached_depth, self.accepted_depth, self.drafts, self.carry]
        return [getattr(self, n) for n in self.SMALL] + extra

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.small()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.small(), saved):
            t.copy_(s)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.small()[:-1] + [self.out_tokens, self.out_logprobs]:
            t[dst] = t[src]
        self.carry[:, dst] = self.carry[:, src]


class DeviceTimer:
    """Seconds of the device work queued inside ``with`` (CUDA events; the wall clock on CPU).

    With ``synchronize=False`` the CUDA reading (``seconds``) waits for the end event only when
    read, so it can be read after a synchronization that happens anyway."""

    def __init__(self, device: torch.device, synchronize: bool = True):
        self.cuda = device.type == "cuda"
        self.sync = synchronize
        self._seconds = 0.0

    def __enter__(self) -> DeviceTimer:
        if self.cuda:
            if self.sync:
                torch.cuda.synchronize()
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            if self.sync:
                self.end.synchronize()
        else:
            self._seconds = time.perf_counter() - self.t0

    @property
    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self._seconds


class ModelRunner:
    """Runs the engine's device work: buffers, decode steps (plain and speculative), refills.

    Args:
        model: the policy, already on ``device`` and in eval mode.
        fwd: the decoder forward over ``model``.
        config: the engine's (validated) sampling rules.
        num_drafts: D, the most tokens a verify drafts (0: plain decoding only); the buffers hold
            D, and a call may draft fewer (``drafts`` of the step and refill methods, 1..D).
        device: where everything runs.

    Attributes:
        use_cuda_graphs: capture decode steps and small refills as CUDA graphs (CUDA only).
        prefill_buckets: pad refills to (rows, length) buckets, as their CUDA graphs need (tests
            turn it on for the CPU).
        cache, mtp_cache, state, drafter: the static KV caches, the slots' device state and the
            MTP drafter (allocated by :meth:`ensure_buffers`; ``mtp_cache`` and ``drafter`` with
            MTP drafts only).
        sink: the slot a padded refill's extra rows write to (None: no padding).
        graphs: captured CUDA graphs by key, (kind, B, L) for steps (kinds: :func:`step_kind`) and
            ("prefill", rows, P, drafts) for refills.
        captures, setup_s: CUDA graphs captured and seconds of setup (captures and plain-step
            timings) so far.
    """

    def __init__(
        self, model: PolicyModel, fwd: DecoderForward, config: GenerationConfig, num_drafts: int, device: torch.device
    ):
        self.model, self.fwd, self.config, self.num_drafts, self.device = model, fwd, config, num_drafts, device
        # MoE layers route with data-dependent shapes, which a captured graph cannot replay
        self.use_cuda_graphs = device.type == "cuda" and not getattr(model, "is_moe", False)
        self.stop_ids = torch.tensor(sorted(set(config.stop_token_ids)), dtype=torch.int64, device=device)
        self.cache: StaticKVCache | None = None
        self.mtp_cache: StaticKVCache | None = None
        self.state: SlotState | None = None
        self.drafter: MTPDrafter | None = None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (kind, B, L) steps, ("prefill", rows, P, drafts) refills
        # refills padded to (rows, length) buckets, as their CUDA graphs need (tests turn it on for the CPU)
        self.prefill_buckets = self.use_cuda_graphs
        self._prefill_inputs: dict[tuple, torch.Tensor] = {}  # a prefill graph's packed input buffer
        self._prefill_graphs = 0
        self.sink: int | None = None  # the slot a padded refill's extra rows write to
        self._pool = self._prefill_pool = None  # CUDA graph memory pools: decode steps, prefills
        self._step_times: dict[tuple[int, int], float] = {}
        self.captures = 0
        self._small_buckets_warmed: set[str] = set()  # step kinds whose 1- and 2-row graphs exist (graph())
        self.setup_s = 0.0  # seconds of graph captures and plain-step timings so far
        self._columns = column_keys(model.config.vocab_size, device)  # before any graph capture
        # the drafts' token set: outlives the drafter, which a larger cache replaces
        size = config.draft_vocab_size
        self.draft_vocab = DraftVocabulary(model.output_weight, size) if num_drafts and size else None

    # ----------------------------------------------------------------------------- buffers
    def ensure_buffers(self, max_prompt: int) -> None:
        cfg, D = self.config, self.num_drafts
        need = max_prompt + cfg.max_new_tokens + 2 * D + 3  # the last index is the scratch entry
        if self.cache is not None and self.cache.max_len >= need:
            if self.fwd.sync_rope_table(self.cache.max_len):  # in place if only the values changed
                self._drop_graphs()  # a new table (dtype / device moved): captured graphs read the old one
            return
        M = -(-need // 64) * 64
        mcfg = self.model.config
        S = cfg.batch_size
        dtype = self.model.output_weight.dtype
        head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
        self._drop_graphs()
        self._step_times.clear()
        self.cache = self.mtp_cache = self.state = None  # free before allocating
        # refills padded to a row bucket write their extra rows to one more slot, never decoded
        self.sink = S if self.prefill_buckets and any(row_bucket(n, S) > n for n in range(1, S + 1)) else None
        slots = S + (self.sink is not None)
        self.cache = StaticKVCache(
            mcfg.num_hidden_layers, slots, mcfg.num_key_value_heads, M, head_dim, dtype, self.device
        )
        if D:
            # the MTP queries' masks are not a causal block: head-major, read by the Triton kernel with
            # per-query limits on CUDA (the masked path elsewhere)
            self.mtp_cache = StaticKVCache(
                D, slots, mcfg.num_key_value_heads, M, head_dim, dtype, self.device, flash=False,
                query_kernel=kv.query_kernel_default(self.device, head_dim),
            )  # fmt: skip
            c = self.config
            self.drafter = MTPDrafter(
                self.fwd, D, self.mtp_cache, c.temperature, c.top_k, c.top_p, vocabulary=self.draft_vocab
            )
        self.state = SlotState(slots, cfg.max_new_tokens + D + 1, D, mcfg.hidden_size, dtype, self.device)
        # cos/sin of every cache index, gathered by position in the decode forwards
        self.fwd.sync_rope_table(M)

    def _drop_graphs(self) -> None:
        self.graphs.clear()
        self._prefill_inputs.clear()
        self._prefill_graphs = 0
        # a pool whose graphs are all gone is freed: capturing into its handle again trips an
        # allocator assertion (use_count > 0), so new graphs take new pools
        self._pool = self._prefill_pool = None

    # ----------------------------------------------------------------------------- device steps
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fwd.head_logits(hidden, self.config.temperature)

    def _sample(self, logits: torch.Tensor, seed_lo, seed_hi, counter) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their logprobs, any leading shape (seeds and counters broadcast to it)."""
        cfg = self.config
        shape = logits.shape[:-1]
        flat = logits.reshape(-1, logits.shape[-1])
        lo, hi, c = (t.expand(shape).reshape(-1) for t in (seed_lo, seed_hi, counter))
        y, lp = self.fwd.k.draw_with_logprobs(flat, lo, hi, c, cfg.top_k, cfg.top_p, self._columns)
        return y.view(shape), lp.view(shape)

    def _write_outputs(self, B: int, start: torch.Tensor, tokens_BQ: torch.Tensor, logprobs_BQ: torch.Tensor) -> None:
        st = self.state
        flat = self.fwd.k.output_index(start, st.width, tokens_BQ.shape[1])
        st.out_tokens.view(-1).index_copy_(0, flat, tokens_BQ.reshape(-1))
        st.out_logprobs.view(-1).index_copy_(0, flat, logprobs_BQ.reshape(-1))

    def plain_step(self, B: int, L: int) -> None:
        st = self.state
        tok, pos, cnt = st.tokens[:B], st.pos[:B], st.counter[:B]
        h = self.fwd.backbone_decode(tok[:, None], pos[:, None], self.cache, L)
        y, lp = self._sample(self._logits(h[:, 0]), st.seed_lo[:B], st.seed_hi[:B], cnt)
        self._write_outputs(B, cnt, y[:, None], lp[:, None])  # a done row writes past its length
        self.fwd.k.plain_commit(
            tok, pos, cnt, st.done[:B], st.stopped[:B], y, self.stop_ids, self.config.max_new_tokens
        )

    def spec_step(self, B: int, L: int, drafts: int | None = None) -> None:
        """One verify of slots 0..B-1 with ``drafts`` drafts a row (default: all D), then the next drafts."""
        st, k = self.state, self.fwd.k
        d = self.num_drafts if drafts is None else drafts
        tok, pos, cnt, done = st.tokens[:B], st.pos[:B], st.counter[:B], st.done[:B]
        drafts_Bd = st.drafts[:B, :d]  # a strided view when d < D
        ids, positions, counters = k.verify_inputs(tok, drafts_Bd, pos, cnt)  # [B, d+1] each
        h = self.fwd.backbone_decode(ids, positions, self.cache, L)
        t, lp = self._sample(self._logits(h), st.seed_lo[:B, None], st.seed_hi[:B, None], counters)
        self._write_outputs(B, cnt, t, lp)  # entries past the emitted ones are rewritten later
        a, n, stopped, fin = k.spec_accept(drafts_Bd, t, cnt, done, self.stop_ids, self.config.max_new_tokens)
        new_drafts, new_carry = self.drafter.step(
            h, t, a, pos, n, st.carry[: d - 1, :B], st.seed_lo[:B], st.seed_hi[:B], L,
            drafts_out=drafts_Bd if d == self.num_drafts else None, num_drafts=d,
        )  # fmt: skip
        # reads the state before the commit below (pos: the verify's first position); the new drafts go
        # into st.drafts (the old ones were last read by spec_accept above)
        if d != self.num_drafts:
            drafts_Bd.copy_(new_drafts)
        k.spec_commit(
            tok, pos, cnt, done, st.stopped[:B], st.drafted[:B], st.accepted[:B],
            st.reached_depth[:B, :d], st.accepted_depth[:B, :d], t, a, n, stopped, fin,
        )  # fmt: skip
        st.carry[: d - 1, :B] = new_carry

    def _step_fn(self, kind: str, B: int, L: int):
        """A step of kind ``kind`` (:func:`step_kind`) on bucket (B, L), as a function of nothing."""
        drafts = drafts_of(kind, self.num_drafts)
        if drafts == 0:
            return lambda: self.plain_step(B, L)
        return lambda: self.spec_step(B, L, drafts)

    def run_steps(self, kind: str, B: int, L: int, n: int) -> None:
        if not self.use_cuda_graphs:
            fn = self._step_fn(kind, B, L)
            for _ in range(n):
                fn()
            return
        graph = self.graph(kind, B, L)
        for _ in range(n):
            graph.replay()

    def graph(self, kind: str, B: int, L: int) -> torch.cuda.CUDAGraph:
        key = (kind, B, L)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        if B > 2 and kind not in self._small_buckets_warmed:
            # the compiled step kernels specialize a bucket of 1 row (and Dynamo's automatic dynamic
            # shapes the samplers at their next row count): compile those now, with the first large
            # bucket, not in the middle of a later call whose tail happens to reach one or two rows
            # (after a train step a speculative call's first 1-row tail compiled 24 graphs: 23.6 s)
            self._small_buckets_warmed.add(kind)
            for small in (1, 2):
                self.graph(kind, small, L)
        with self._setup_time():
            fn = self._step_fn(kind, B, L)
            saved = self.state.snapshot()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = self._capture(fn, fn, self._pool)  # the warm-up's writes are undone below
            self.state.restore(saved)
        self.graphs[key] = graph
        self.captures += 1
        return graph

    def _capture(self, warmup, body, pool) -> torch.cuda.CUDAGraph:
        """A CUDA graph of ``body()`` in memory pool ``pool``, after ``warmup()`` ran twice on a
        side stream (lazy initializations and compilations stay outside the capture)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            warmup()
            warmup()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: with placement=colocated the train step runs in another thread of this
        # process; under the default "global" mode its allocations invalidated the capture
        # (cudaErrorStreamCaptureInvalidated on 2 H200s, async s=1)
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            body()
        return graph

    @contextmanager
    def _setup_time(self) -> Iterator[None]:
        """Count the enclosed seconds (the engine's device work included) into :attr:`setup_s` (each
        call reports its share as ``stats.setup_s``).
        Waits for the engine's stream only: with placement=colocated the train half of the process
        queues work on the same device, which is not the engine's setup."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            stream.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if stream is not None:
                stream.synchronize()
            self.setup_s += time.perf_counter() - start

    def plain_step_time(self, B: int, L: int, reps: int = 3) -> float:
        """Seconds of one plain step of bucket (B, L), timed on the device (CUDA events after a
        synchronize; the wall clock on CPU), on the live state, which is restored afterwards."""
        key = (B, L)
        if key in self._step_times:
            return self._step_times[key]
        if self.use_cuda_graphs:
            self.graph("plain", B, L)
        with self._setup_time():
            saved = self.state.snapshot()
            with DeviceTimer(self.device) as timer:
                self.run_steps("plain", B, L, reps)
            self.state.restore(saved)
        self._step_times[key] = timer.seconds / reps
        return self._step_times[key]

    # ----------------------------------------------------------------------------- prefill
    def prefill(self, slots: list[int], prompts: list[list[int]], seeds: list[int], drafts: int) -> None:
        """Prefill ``prompts`` into ``slots`` and emit their first tokens (and ``drafts`` drafts a row,
        0..D: the call's, see :func:`step_kind`).

        On CUDA a refill of at most ``GRAPH_PREFILL_TOKENS`` runs as a CUDA graph of its bucket
        (rows: the decode row buckets, prompt length: 16, 24, 32, 48, 64, 96, ...; at most
        ``MAX_PREFILL_GRAPHS`` of them): the extra rows repeat the first row's inputs and write to
        a slot of their own that is never decoded (so no slot receives two rows' values, which
        the device may round differently), and the prompts are right-padded (causal: a prompt
        never reads its padding; its cache entries lie past the prompt and are written by
        decoding before any read). Other refills run eagerly, unpadded."""
        D, n = self.num_drafts, len(prompts)
        P = max(len(p) for p in prompts)
        key, rows, width = None, n, P
        if self.prefill_buckets:
            b_rows, b_width = self._prefill_bucket(n, P)
            k = ("prefill", b_rows, b_width, drafts)
            if k in self.graphs or (
                b_rows * b_width <= GRAPH_PREFILL_TOKENS and self._prefill_graphs < MAX_PREFILL_GRAPHS
            ):
                key, rows, width = k, b_rows, b_width
        pad = rows - n
        ids = torch.zeros(rows, width + D, dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        ids[n:] = ids[0]
        lens = torch.tensor([len(p) for p in prompts] + [len(prompts[0])] * pad, dtype=torch.int64)
        if any(b <= a for a, b in zip(slots, slots[1:])):
            raise ValueError(f"prefill slots must be distinct and ascending (the cache is read in place); got {slots}")
        sl = torch.tensor(list(slots) + [self.sink] * pad, dtype=torch.int64)
        lo, hi = seed_words(list(seeds) + [seeds[0]] * pad, torch.device("cpu"))
        host = torch.cat([ids.view(-1), lens, sl, lo, hi])  # one copy to the device
        graph = self._prefill_graph(key, host, drafts) if key is not None and self.use_cuda_graphs else None
        if graph is None:
            self.prefill_device(*_prefill_views(host.to(self.device), rows, width + D), drafts)
            return
        self._prefill_inputs[key].copy_(host)  # the graph's input buffer (the device function writes ids)
        graph.replay()

    def _prefill_graph(self, key: tuple, host: torch.Tensor, drafts: int) -> torch.cuda.CUDAGraph | None:
        """The graph of bucket ``key``, captured now if new; None if the capture fails (refills run
        eagerly from then on: the same computation, slower)."""
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        try:
            return self._capture_prefill(key, host, drafts)
        except Exception as err:  # noqa: BLE001 - any failure: the eager prefill is not wrong
            log.warning("CUDA-graph capture of a prefill failed (%s); refills run eagerly from now on", err)
            self._prefill_graphs = MAX_PREFILL_GRAPHS
            if not any(k[0] == "prefill" for k in self.graphs):
                self._prefill_pool = None  # freed with the failed graph (see _drop_graphs)
            return None

    def _capture_prefill(self, key: tuple, host: torch.Tensor, drafts: int) -> torch.cuda.CUDAGraph:
        """Capture the prefill of bucket ``key`` on the packed inputs ``host`` (its warm-up runs
        prefill them)."""
        _, rows, width, _ = key
        with self._setup_time():
            buf = host.to(self.device)
            views = _prefill_views(buf, rows, width + self.num_drafts)

            def warmup() -> None:
                buf.copy_(host)  # the device function writes into ids
                self.prefill_device(*views, drafts)

            if self._prefill_pool is None:  # not the steps' pool: a failed capture here cannot free theirs
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph = self._capture(warmup, lambda: self.prefill_device(*views, drafts), self._prefill_pool)
        self._prefill_inputs[key] = buf
        self.graphs[key] = graph
        self.captures += 1
        self._prefill_graphs += 1
        return graph

    def _prefill_bucket(self, n: int, P: int) -> tuple[int, int]:
        """(rows, prompt length) of a refill's graph: row bucket of ``n`` (``n`` without a sink
        slot), length bucket of ``P`` (capped so that the padded prompt and the drafts stay inside
        the cache, before its scratch entry)."""
        cap = self.cache.max_len - 1 - self.num_drafts
        rows = n if self.sink is None else row_bucket(n, self.config.batch_size)
        return rows, max(P, length_bucket(P, cap, start=16))

    def prefill_device(
        self, ids: torch.Tensor, lens: torch.Tensor, sl: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, drafts: int
    ) -> None:
        """The device work of a prefill (no host synchronization: CUDA-graph capturable).

        Args:
            ids: int64 [n, P + D], right-padded prompts (overwritten: the first token at each
                prompt's end, for the drafter).
            lens: int64 [n] prompt lengths; sl: int64 [n] slots; lo, hi: [n] seed words.
            drafts: drafts a row (0: none, a plain call's refill; else 1..D).
        """
        st, cfg, D = self.state, self.config, self.num_drafts
        n, P = ids.shape[0], ids.shape[1] - D
        rows = torch.arange(n, device=ids.device)
        # the scheduler refills free slots in order and pads with the sink, the last slot
        h = self.fwd.backbone_prefill(ids[:, :P], sl, self.cache, slots_ascending=True)
        zero = torch.zeros(n, dtype=torch.int64, device=ids.device)
        y, lp = self._sample(self._logits(h[rows, lens - 1]), lo, hi, zero)
        stop = stop_mask(y, self.stop_ids)
        st.tokens[sl], st.pos[sl], st.counter[sl] = y, lens, zero + 1
        st.seed_lo[sl], st.seed_hi[sl] = lo, hi
        st.done[sl] = stop | (cfg.max_new_tokens <= 1)
        st.stopped[sl] = stop
        st.out_tokens[sl, 0], st.out_logprobs[sl, 0] = y, lp
        for t in (st.drafted, st.accepted, st.reached_depth, st.accepted_depth):
            # not ``t[sl] = 0``: that copies a CPU scalar tensor to the device, which a CUDA graph
            # capture refuses (it made every prefill capture fail; bench/RESULTS.md)
            t.index_fill_(0, sl, 0)
        if drafts:
            ids[rows, lens] = y
            new_drafts, carry = self.drafter.prefill(h, ids, lens, sl, lo, hi, num_drafts=drafts)
            st.drafts[sl, :drafts] = new_drafts
            st.carry[: drafts - 1, sl] = carry
