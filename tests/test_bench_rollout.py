"""bench/bench_rollout.py refuses bad flags up front (usage error, exit 2) instead of a traceback
after minutes of setup (found by a new user: --init-range -1, --hbm-tb-s 0, --profile <dir>)."""

import pytest

from _bench import load_bench


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--init-range", "-1"], "--init-range must be a positive number, got -1.0"),
        (["--hbm-tb-s", "0"], "--hbm-tb-s must be a positive number, got 0.0"),
        (["--profile", "{tmp}"], "is a directory; give a file path"),
        (["--attention"], "--attention times the CUDA kernels: add --device cuda"),
        (["--temperature", "0"], "--temperature must be > 0 (for greedy decoding use --top-k 1), got 0.0"),
        (["--batch-sizes", "32,1,32"], "a batch size is listed twice in '32,1,32'"),  # a new user's: timed twice
        # settings of a part that does not run were silently ignored (a new user's trial)
        (["--ragged-batch", "5", "--ragged-max-new", "7"], "--ragged-max-new, --ragged-batch: read only with --ragged"),
        (["--mtp-objective", "ce"], "--mtp-objective: read only with --speculative"),
        (["--train-mtp-steps", "5", "--mtp-samples", "3"], "--train-mtp-steps, --mtp-samples: read only with"),
        (["--ragged", "3", "--ragged-mean-len", "1000", "--ragged-max-new", "4"], "must not exceed --ragged-max-new (4)"),
        # the default was shown as if given (a new user's trial): now named, with what to pass
        (
            ["--ragged", "3", "--ragged-max-new", "16"],
            "--ragged-mean-len (default 120) must not exceed --ragged-max-new (16): pass --ragged-mean-len 16 or less",
        ),
        (["--baselines", "hf-eager,hf-eager"], "each at most once"),
        (["--baselines", "hf-eager,"], "--baselines takes a comma list"),
        # a new user's --prompt-len 100000000 ran out of memory after the model was built
        (["--prompt-len", "100000000"], "the KV cache of 32 rows x 100000064 tokens (--batch-sizes"),
        (
            ["--ragged", "4", "--ragged-batch", "100000000"],
            "the KV cache of 100000000 rows x 576 tokens (--ragged-batch",
        ),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as err:
        load_bench("bench_rollout").parse_args(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_good_flags_parse(tmp_path):
    args = load_bench("bench_rollout").parse_args(
        ["--init-range", "0.5", "--hbm-tb-s", "3.35", "--profile", str(tmp_path / "p.txt")]
    )
    assert args.init_range == 0.5 and args.hbm_tb_s == 3.35


@pytest.mark.parametrize(
    "argv, message",
    [
        # --ragged profiles one call of bench_rollout's slots: --batch-sizes was silently ignored
        (["--ragged", "64", "--batch-sizes", "8"], "leave out --batch-sizes"),
        (["--ragged", "64", "--new-tokens", "8"], "leave out --batch-sizes and --new-tokens"),  # was ignored
        (["--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
        (["--kinds", "plain,greedy"], "--kinds takes a comma list of plain, speculative"),
        (["--kinds", "plain,plain"], "each at most once"),
        (["--kinds", "plain,"], "--kinds takes a comma list"),  # a trailing comma was taken silently
        (["--kinds", "plain", "--num-draft-tokens", "1"], "--num-draft-tokens: read only when --kinds includes"),
        (["--kinds", "plain", "--train-mtp-steps", "5"], "--train-mtp-steps: read only when --kinds includes"),
        # bench_rollout's own checks, reported with this script's usage (it printed bench_rollout's)
        (["--mtp-samples", "0"], "--mtp-samples must be >= 1, got 0"),
        (["--prompt-len", "100000000"], "the KV cache of 32 rows x 100000128 tokens"),
    ],
)
def test_profile_rollout_refuses_bad_flags_with_its_own_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        load_bench("profile_rollout").parse_args(argv)
    assert err.value.code == 2
    err_text = capsys.readouterr().err
    assert message in err_text
    assert err_text.startswith("usage: ") and "--kinds" in err_text and "--baselines" not in err_text


def test_profile_rollout_defaults_and_ragged_parse():
    parse = load_bench("profile_rollout").parse_args
    assert parse([]).batch_sizes == "1,32" and parse([]).new_tokens == 128
    args = parse(["--ragged", "8", "--kinds", "plain"])
    assert args.ragged == 8 and args.bench.ragged == 8 and args.kinds == ["plain"]


def test_roofline_only_where_a_bandwidth_applies():
    """A CPU run prints no roofline (4.3 TB/s, the cuda default, is the H200's) unless given one."""
    parse = load_bench("bench_rollout").parse_args
    assert parse(["--device", "cpu"]).hbm_tb_s is None
    assert parse(["--device", "cpu", "--hbm-tb-s", "0.2"]).hbm_tb_s == 0.2


def test_profile_timeline_counts_kernels_gaps_and_per_forward_time(tmp_path):
    """bench/profile_rollout.py's trace summary: busy time, the idle gaps over 20 us and the kernel
    they follow (overlapping kernels leave no gap), and time / launches per forward."""
    import json

    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 100},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 100, "dur": 10},
        {"cat": "kernel", "name": "gemm", "ts": 510, "dur": 100},  # 400 us idle after the copy
        {"cat": "kernel", "name": "norm", "ts": 600, "dur": 30},  # overlaps gemm: no gap
        {"cat": "kernel", "name": "norm", "ts": 640, "dur": 10},  # 10 us: under the threshold
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host events are ignored
    ]}  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    lines = load_bench("profile_rollout").timeline(str(path), forwards=2, top=5)
    assert lines[0] == "  GPU span 0.7 ms, kernels 0.2 ms (38% busy); 1 gap > 20 us totalling 0.4 ms", lines
    assert lines[1] == "  gaps after (ms): Memcpy DtoH 0.40"
    assert lines[3].split() == ["100.0", "1.00", "gemm"] and lines[4].split() == ["20.0", "1.00", "norm"]
    assert lines[5].split() == ["5.0", "0.50", "Memcpy", "DtoH"]


def test_the_mtp_warm_up_lifts_held_out_acceptance_and_leaves_the_backbone():
    """The bench's MTP warm-up (the heads fit to the model's own outputs, the backbone frozen) must
    raise the held-out acceptance above the untrained heads' (0 steps, same init): distilled, both
    depths by a clear margin (tiny CPU model, 300 steps: rejection rule 12 -> 22 %, coupled 7 -> 13 %);
    with the sampled-token loss, depth 1 less so (12 -> 16 %). It must not move a backbone weight: a
    speedup measured with a changed backbone would not be plain decoding's model."""
    import torch

    br = load_bench("bench_rollout")

    def run(steps, objective="distill"):
        args = br.parse_args([
            "--speculative", "--init-range", "0.3", "--prompt-len", "8", "--new-tokens", "24", "--mtp-samples", "96",
            "--mtp-objective", objective, "--train-mtp-steps", str(steps),
        ])  # fmt: skip
        torch.manual_seed(0)
        model = br.build_model(args, torch.float32)
        before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
        acceptance, samples = br.train_mtp_heads(model, args)
        assert samples == 96 and sorted(acceptance) == [1, 2]
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(0 <= coupled <= rejection <= 100 for coupled, rejection in acceptance.values())
        return acceptance

    untrained, distilled, ce = run(0), run(300), run(300, "ce")
    for k in (1, 2):
        assert distilled[k][0] > untrained[k][0] + 3, (k, untrained, distilled)
        assert distilled[k][1] > untrained[k][1] + 6, (k, untrained, distilled)
    assert ce[1][1] > untrained[1][1] + 2, (untrained, ce)


@pytest.mark.parametrize(
    "extra, line",
    [
        # a new user's 1-token responses crashed the warm-up (no depth had a target)
        (["--prompt-len", "1", "--new-tokens", "1", "--train-mtp-steps", "3"], "give no depth a token to predict"),
        (
            ["--prompt-len", "4", "--new-tokens", "4", "--train-mtp-steps", "0"],
            "MTP warm-up skipped (--train-mtp-steps 0)",
        ),
        # more samples than the cached-token cap allows: said, not silently fewer
        (
            ["--prompt-len", "8", "--new-tokens", "8", "--train-mtp-steps", "1", "--mtp-samples", "300"],
            "on 256 of the model's own samples (capped from 300: at most 4,096 cached tokens)",
        ),
    ],
)
def test_the_warm_up_line_says_what_happened(extra, line, capsys, monkeypatch):
    """Odd warm-up settings end in a line that says what the heads are, not a traceback; the CPU
    defaults are the small ones (the cuda ones ran past 5 minutes on a CPU)."""
    br = load_bench("bench_rollout")
    assert (br.parse_args([]).train_mtp_steps, br.parse_args([]).mtp_samples) == (200, 256)
    if "--mtp-samples" in extra:  # the cap is what is tested: keep the sampling itself small
        monkeypatch.setattr(br, "_own_samples", lambda model, args, n: _fake_samples(model, args, n))
        monkeypatch.setattr(br, "MAX_CACHED_TOKENS", 2**12)  # 1 M tokens of samples took 50 s on 2 cores
    br.main(["--speculative", "--batch-sizes", "1", "--repeats", "1", "--no-graph-column"] + extra)
    out = capsys.readouterr().out
    assert line in out, out


def test_the_ragged_speculative_lines_say_whether_the_rule_switched_off(capsys):
    """Kind: output that means nothing. With the rules on, a call the rule never switched off
    printed "switched off at iteration None", and the header "CPU (1 threads)" (a new user's trial)."""
    import re

    import torch

    threads = torch.get_num_threads()
    try:
        load_bench("bench_rollout").main(
            ["--threads", "1", "--speculative", "--batch-sizes", "1", "--prompt-len", "8", "--new-tokens", "8",
             "--repeats", "1", "--no-graph-column", "--train-mtp-steps", "0",
             "--ragged", "8", "--ragged-max-new", "16", "--ragged-mean-len", "8"]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "iteration None" not in out and "device CPU (1 thread)," in out, out
    ruled = next(line for line in out.splitlines() if "+ spec, rules on" in line)
    assert re.search(r"(never switched off|switched off at iteration \d+|a plain call)", ruled), ruled


def test_profile_rollout_says_one_draft_a_verify(capsys):
    """Kind: grammar. `--num-draft-tokens 1` labelled the call "(1 drafts a verify)"; its single
    decode chunk "1 decode chunks" (a new user's trial)."""
    import torch

    threads = torch.get_num_threads()
    try:
        load_bench("profile_rollout").main(
            ["--threads", "1", "--batch-sizes", "1", "--prompt-len", "4", "--new-tokens", "4",
             "--train-mtp-steps", "0", "--kinds", "speculative", "--num-draft-tokens", "1"]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("== batch 1"))
    assert line.startswith("== batch 1, speculative (1 draft a verify): walls "), line
    assert "; 1 decode chunk (rows, cache, steps): " in line, line


@pytest.mark.parametrize(
    "script, argv, env",
    [
        ("bench_switches", ["--help"], {"SPLITRL_SILU_MUL": "2"}),  # through bench_rollout, as profile_rollout
        ("bench_skinny_gemm", ["--rows", "1"], {"SPLITRL_GATED_TILES": "1,2"}),
    ],
)
def test_a_bad_switch_value_is_one_line_not_a_traceback(script, argv, env):
    """Kind: an error as a traceback. A bad SPLITRL_* value was a 21-line traceback through the
    bench's imports, even for --help (a new user's trial); now `<script>: <message>` and exit 2, as
    `splitrl train` says it (bench/shapes.py: check_switches)."""
    import os
    import subprocess
    import sys

    from _bench import ROOT

    name, value = next(iter(env.items()))
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{script}.py"), *argv],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [res.stderr.strip()], res.stderr  # one line
    assert res.stderr.startswith(f"{script}.py: {name}={value!r}: write "), res.stderr
    assert res.stdout == ""


def _fake_samples(model, args, n):
    import torch

    return torch.randint(0, model.config.vocab_size, (n, args.prompt_len + args.new_tokens))


def test_card_bandwidth_is_the_measured_copy_of_known_cards_only():
    """bench_rollout's roofline bandwidth from the CUDA device name: the copy measured on an H200 and
    on an H100 (bench/RESULTS.md); none for another card (the user passes --hbm-tb-s)."""
    br = load_bench("bench_rollout")
    assert br.card_bandwidth("NVIDIA H200") == 4.3
    assert br.card_bandwidth("NVIDIA H100 80GB HBM3") == 3.0
    assert br.card_bandwidth("NVIDIA A100-SXM4-80GB") is None


@pytest.mark.parametrize(
    "variant, message",
    [
        ("noname", "a variant is 'name:owner.attr=value,...'"),
        ("a:pdl.EARLY=2", "write owner.attr=0 or owner.attr=1"),
        ("a:nowhere.X=1", "is not a switch; the switches: engine.look_ahead"),
        ("a:pdl.NOT_A_FLAG=1", "is not a switch"),
        ("a:pdl.early=0", "is not a switch"),  # a function of the module
        ("a:engine.look_ahaed=0", "is not a switch"),
        ("a:look_ahead=0", "is not a switch; the switches: engine.look_ahead"),  # the owner left out
        ("a:skinny_gemm.MAX_ROWS=512", "is not a switch"),  # an int, but not a threshold to vary
        ("a:skinny_gemm.GATED_ROWS=-1", "write skinny_gemm.GATED_ROWS=<an integer >= 0>"),
        ("a:rope_write.GROUP_FROM_TOKENS=many", "GROUP_FROM_TOKENS=<an integer >= 0>"),
        ("a:skinny_gemm.GATED_ROWS=\u0663", "GATED_ROWS=<an integer >= 0>"),  # an Arabic-Indic 3
        ("a:pdl.EARLY=0,pdl.EARLY=1", "variant 'a' sets pdl.EARLY twice"),
        ("a:pdl.SUPPORTED=1", "is not a switch"),  # what the machine can do, not a choice
        ("a:skinny_gemm.AVAILABLE=1", "is not a switch"),
        ("x,y:pdl.EARLY=0", "no ',' or '=' in the name"),
        ("a:pdl.EARLY=0,", "variant 'a' has an empty switch (a stray ',')"),  # was taken silently
        ("a:,pdl.EARLY=0", "variant 'a' has an empty switch"),
        ("a:skinny_gemm.GATED_WIDE_ROWS=x", "GATED_WIDE_ROWS=<an integer >= 0>"),
    ],
)
def test_bench_switches_refuses_a_bad_variant(variant, message, capsys):
    """bench/bench_switches.py: a mistyped switch is a usage error naming it, before any model is built
    (a typo would otherwise measure the baseline twice under two names)."""
    with pytest.raises(SystemExit) as err:
        load_bench("bench_switches").main(["--variant", variant, "--variant", "b:"])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_switches_refuses_duplicate_names_and_bad_numbers(capsys):
    """Two variants of one name (one result would replace the other), and lengths or bandwidths that
    mean nothing: usage errors naming the flag."""
    bench = load_bench("bench_switches")
    for argv, message in (
        (["--variant", "a:", "--variant", "a:engine.look_ahead=1"], "--variant names must differ"),
        (["--variant", "a:", "--variant", "b:", "--rounds", "0"], "--rounds must be >= 1"),
        (["--variant", "a:", "--variant", "b:", "--hbm-tb-s", "0"], "--hbm-tb-s must be a positive number"),
        # a traceback from the CUDA graph pool after the model was built, before
        (["--variant", "a:", "--variant", "b:engine.use_cuda_graphs=1"], "engine.use_cuda_graphs=1 needs --device cuda"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err


def test_bench_switches_resets_a_flag_the_variant_does_not_name(monkeypatch):
    """A module flag one variant sets does not carry over into the next: a variant that does not name
    it runs with its value from before the bench (found by a new user's trial: 'b:' ran with a's
    pdl.EARLY=0)."""
    bench = load_bench("bench_switches")
    from splitrl.rollout import pdl

    monkeypatch.setattr(pdl, "EARLY", True)
    _, a = bench.parse_variant("a:pdl.EARLY=0")
    _, b = bench.parse_variant("b:")
    defaults = {("pdl", "EARLY"): True}
    bench.apply(a, defaults, None)
    assert pdl.EARLY is False
    bench.apply(b, defaults, None)
    assert pdl.EARLY is True


def test_bench_switches_sets_an_integer_threshold(monkeypatch):
    """A threshold of INT_SWITCHES takes an integer, and a variant that does not name it gets its
    value from before the bench."""
    bench = load_bench("bench_switches")
    from splitrl.rollout import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "GATED_ROWS", 64)
    _, a = bench.parse_variant("a:skinny_gemm.GATED_ROWS=256")
    assert a == {("skinny_gemm", "GATED_ROWS"): 256}
    bench.apply(a, {("skinny_gemm", "GATED_ROWS"): 64}, None)
    assert skinny_gemm.GATED_ROWS == 256
    bench.apply({}, {("skinny_gemm", "GATED_ROWS"): 64}, None)
    assert skinny_gemm.GATED_ROWS == 64


def test_bench_switches_checks_the_cache_for_its_own_batch_sizes(capsys):
    """The KV cache check ran on bench_rollout's default batch sizes (32 rows), and printed
    bench_rollout's usage; --batch-sizes 100000000 then ran until killed (a new user's trial)."""
    bench = load_bench("bench_switches")
    # sizes no host holds (the first would fit a host of 64 GiB at 50,000,000 tokens)
    for sizes, says in (("1", "1 rows x 10000000001 tokens"), ("100000000", "100000000 rows x")):
        prompt = "10000000000" if sizes == "1" else "4"
        with pytest.raises(SystemExit):
            bench.main(
                ["--prompt-len", prompt, "--new-tokens", "1", "--batch-sizes", sizes, "--variant", "a:", "--variant", "b:"]
            )
        err = capsys.readouterr().err
        assert says in err and "--rounds" in err and "--ragged" not in err, err[:300]  # its own usage


def test_bench_switches_names_an_installed_splitrl_without_the_threshold(monkeypatch):
    """A threshold the installed splitrl lacks (an older install than the script) is refused with
    the install to fix, not an AttributeError mid-run."""
    bench = load_bench("bench_switches")
    from splitrl.rollout import decode_attention

    monkeypatch.delattr(decode_attention, "HEADS_FIRST_PROGRAMS")
    with pytest.raises(ValueError, match=r"has no HEADS_FIRST_PROGRAMS.*pip install -e \."):
        bench.parse_variant("a:decode_attention.HEADS_FIRST_PROGRAMS=1")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--attention", "32", "--context", "5-3"], "--context takes N or FIRST-LAST"),
        (["--attention", "32", "--context", "400"], "--cache-len (320 (the default)) must hold"),
        (["--rows", "1,1"], "--rows lists a value twice"),  # a new user's trial: timed twice
        (["--gated-sweep", "32", "--rows", "32"], "--gated-sweep is read only with --gated"),  # was ignored
        (["--rope-rows", "8"], "--rope-rows is read only with --fused"),  # was ignored
        (["--rows", "1", "--sweep", "32"], "--sweep rows must be among --rows"),  # was ignored
        (["--rows", "512"], "--rows takes a comma list of positive integers each <= 256"),
        (["--attention", "0"], "--attention takes a comma list"),
        (["--context", "192"], "read only with --attention"),
        (["--silu", "256,256"], "--silu lists a value twice"),
        (["--silu", "0"], "--silu takes a comma list of positive integers"),
    ],
)
def test_bench_skinny_gemm_refuses_bad_lists_before_any_device_work(capsys, argv, says):
    """bench_skinny_gemm's row and context lists are usage errors (exit 2, what to write), checked
    before its CUDA check, so that a typo costs no device run."""
    with pytest.raises(SystemExit) as exc:
        load_bench("bench_skinny_gemm").main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_bench_switches_runs_two_variants_on_the_cpu(capsys):
    """The A/B bench end to end on the tiny model: one line a batch with each variant's tokens/s, its
    ratio to the first and its samples identical to the first's (chunks queued ahead change nothing)."""
    load_bench("bench_switches").main(
        ["--batch-sizes", "2", "--rounds", "1", "--prompt-len", "4", "--new-tokens", "6",
         "--variant", "before:engine.look_ahead=0", "--variant", "ahead:engine.look_ahead=1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("batch 2:"))
    assert "before" in line and "ahead" in line and "(1.000x, same tokens 2/2)" in line
    assert line.count("same tokens 2/2") == 2
