"""``splitrl train [--config FILE] [key.path=value ...]`` — the main job; ``splitrl config``,
``splitrl generate``, ``splitrl eval`` (:mod:`splitrl.cli_eval`), ``splitrl --version``.

Nothing heavy is imported before the config is validated: a wrong key fails in well under a
second (torch, transformers and the task libraries load afterwards)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

from splitrl.logging.console import guard_console


def _flag_hint(extra: list[str], argv: list[str]) -> str:
    """"; config keys are set as key=value: schedule.num_steps=8" for a config key typed as a flag in
    ``extra`` (``--num-steps 8``: a new user's trial; the value is looked up in ``argv``, where
    argparse took it as an override), else ""."""
    from splitrl.config import RunConfig
    from splitrl.config_help import config_keys, suggest_key

    valid = [k.path for k in config_keys(RunConfig)]
    for x in extra:
        if not x.startswith("--"):
            continue
        name, _, value = x[2:].partition("=")
        name = name.replace("-", "_")
        key = name if name in valid else suggest_key(name, valid)
        if key is None:
            continue
        after = argv[argv.index(x) + 1 : argv.index(x) + 2] if x in argv else []
        if not value and after and not after[0].startswith("-") and "=" not in after[0]:
            value = after[0]
        return f"; config keys are set as key=value: {key}={value or '...'}"
    return ""


def _unrecognized(command: argparse.ArgumentParser, bad: list[str], hint: str = "") -> None:
    """Exit 2 with the sub-command's usage, naming ``bad`` and, for a misspelt flag, the closest
    one of the sub-command (``--num-prompt`` → ``--num-prompts``: a new user's trial)."""
    import difflib

    flags = [o for action in command._actions for o in action.option_strings if o.startswith("--")]
    for x in bad:
        close = difflib.get_close_matches(x.partition("=")[0], flags, n=1) if x.startswith("--") else []
        if close:
            hint = f"; did you mean {close[0]}?" + hint
            break
    command.error(f"unrecognized arguments: {' '.join(bad)}{hint}")


def _print_reference(filter_text: str | None = None) -> int:
    """``splitrl config``: print every key of the run config (those whose path contains
    ``filter_text``, case ignored, when given) with its type, the run's default and its documentation."""
    from splitrl._lazy import deferred_import_checks
    from splitrl.config import RunConfig
    from splitrl.config_help import config_keys, format_reference

    with deferred_import_checks():  # the defaults, without importing the task libraries
        defaults = RunConfig().model_dump(mode="json")
    keys = config_keys(RunConfig, defaults)
    if filter_text:
        wanted = filter_text.lower()  # `splitrl config MTP` found nothing: keys are lower case
        keys = [k for k in keys if wanted in k.path.lower() and not k.type.startswith("section")]
        if not keys:
            print(f"no config key contains {filter_text!r}; run `splitrl config` for all of them")
            return 1
    print(format_reference(keys), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C while the config loads or torch imports (seconds), or during eval / generate;
        # a started run handles its own signals (it checkpoints, or a second one exits at once)
        sig = _terminated.signum or signal.SIGINT
        print(f"splitrl: {signal.Signals(sig).name}: stopped before anything was written", file=sys.stderr)
        return 128 + int(sig)


def _main(argv: list[str] | None) -> int:
    """Parse the command line and run its sub-command (the exit status)."""
    parser, sub = _build_parser()
    args, extra = parser.parse_known_args(argv)
    command = sub.choices[args.command]  # its usage line and flags name what was wrong
    if args.command == "config":
        if extra:
            _unrecognized(command, extra)
        return _print_reference(args.filter)
    if args.command != "train":  # generate / eval (splitrl.cli_eval)
        bad = [x for x in extra if x.startswith("-") or "=" not in x]
        if bad:
            _unrecognized(command, bad)
        args.overrides = list(args.overrides) + extra
        return args.run(args)
    unknown = [x for x in extra if x.startswith("-") or "=" not in x]
    if unknown:
        _unrecognized(command, unknown, _flag_hint(extra, sys.argv[1:] if argv is None else argv))
    args.overrides = list(args.overrides) + extra
    return _train(args)


def _build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``splitrl`` parser and its sub-commands (train, config, and those of :mod:`splitrl.cli_eval`)."""
    from splitrl import __version__
    from splitrl.cli_eval import OnlyOnce, add_eval_commands
    from splitrl.config_help import TRAIN_EPILOG

    parser = argparse.ArgumentParser(prog="splitrl", description="Asynchronous GRPO with MTP heads", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        allow_abbrev=False,  # `--conf` is a typo, not --config
        help="run GRPO (without --config: the CPU demo, preset cpu_demo)",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--config", action=OnlyOnce, help="YAML run config (see examples/)")
    t.add_argument("overrides", nargs="*", help="key.path=value, e.g. schedule.num_steps=50 model.mtp.mtp_num_layers=2")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    # overrides may stand before or after --config: argparse leaves the later ones unparsed
    c = sub.add_parser("config", allow_abbrev=False, help="print every config key with its type, default and meaning")
    c.add_argument("filter", nargs="?", help="only keys whose path contains this text, e.g. mtp")
    add_eval_commands(sub)
    return parser, sub


def _train(args: argparse.Namespace) -> int:
    """``splitrl train``: load the run config (the CPU demo without one), then print it or run it."""
    # before logging and the progress bar capture the streams: a console whose reader died
    # (``| tee log`` + Ctrl-C) must not stop the final checkpoint
    guard_console()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from splitrl.config import load_config
    from splitrl.presets import DEMO_PRESET

    # without a run config the CPU demo runs (its values are a preset, not the defaults), unless
    # the overrides name another preset
    demo = args.config is None and not any(o.partition("=")[0].strip() == "preset" for o in args.overrides)
    if demo and not args.print_config:
        logging.getLogger("splitrl").info(
            "no --config: the CPU demo (preset %s; --config FILE for a run of your own, see examples/*.yaml)",
            DEMO_PRESET,
        )
    try:
        config = load_config(args.config, args.overrides, preset=DEMO_PRESET if demo else None)
    except ValueError as e:
        print(f"splitrl: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        return _print_config(config)
    return _run(config)


def _print_config(config) -> int:
    """``splitrl train --print-config``: the resolved config as YAML, once the model's keys check out."""
    import yaml

    from splitrl.controller.preflight import model_hf_config

    try:  # the model's own keys too (transformers keeps a misspelt one silently)
        model_hf_config(config)
    except ValueError as e:
        print(f"splitrl: {e}", file=sys.stderr)
        return 2

    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return 0


def _run(config) -> int:
    """Run ``config`` to its end; every way it can stop is one line on stderr and an exit status."""
    try:
        from splitrl.controller.controller import CheckpointError, StallError, StepFailed, train
    except ValueError as e:  # a setting read at import: SPLITRL_* environment variables
        print(f"splitrl: {e}", file=sys.stderr)
        return 2

    from tqdm.contrib.logging import logging_redirect_tqdm

    # SIGTERM before the run's own handlers are up (start-up): stop like Ctrl-C
    try:
        old_sigterm = signal.signal(signal.SIGTERM, _terminated)
    except ValueError:  # not the main thread
        old_sigterm = None
    try:
        with logging_redirect_tqdm():  # log lines above the progress bar, not through it
            result = train(config)
    except KeyboardInterrupt:
        return _report_interrupt(config.output_dir)
    except StallError as e:
        _exit_stalled(e)
    except (StepFailed, CheckpointError) as e:
        print(f"splitrl: stopped: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk or lost permissions while writing metrics or logs
        return _report_unwritable(e)
    except ValueError as e:  # preflight: a data file, the tokenizer, a resume mismatch
        print(f"splitrl: {e}", file=sys.stderr)
        return 2
    finally:
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
    return _report_result(result)


def _report_interrupt(output_dir) -> int:
    """Ctrl-C / SIGTERM during start-up, or a second one after the run's handlers are gone (its
    shutdown, after the stop checkpoint was written): say what is on disk, not "nothing to save"."""
    from splitrl.controller.run_checkpoint import complete_checkpoints

    sig = _terminated.signum or signal.SIGINT
    saved = complete_checkpoints(output_dir)
    print(
        f"splitrl: {signal.Signals(sig).name}: stopped; "
        + (f"the newest checkpoint is {saved[-1]}" if saved else f"no checkpoint in {output_dir}"),
        file=sys.stderr,
    )
    return 128 + int(sig)


def _exit_stalled(e: Exception) -> NoReturn:
    print(f"splitrl: stopped: {e}", file=sys.stderr)
    # a hung worker thread cannot be joined: leave without waiting for it
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def _report_unwritable(e: OSError) -> int:
    if isinstance(e, (BrokenPipeError, ConnectionError)) and not e.filename:
        # not a file of the run: a pipe or socket to another process (torch's compile workers,
        # a data-plane peer) whose other end died; say where, since nothing else will
        import traceback

        frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        at = f" in {frame.filename}:{frame.lineno} ({frame.name})" if frame else ""
        print(
            f"splitrl: stopped: {type(e).__name__}: {e.strerror or e}{at}: the other end of a pipe or socket, "
            "another process of this run, has died (a signal sent to the whole process group, or the process "
            "crashed). Rerun the same command: it resumes from the newest intact checkpoint",
            file=sys.stderr,
        )
        return 1
    where = f" ({e.filename})" if e.filename else ""
    print(
        f"splitrl: stopped: cannot write the run's files: {e.strerror or e}{where}. Fix it and rerun the same "
        "command: it resumes from the newest intact checkpoint",
        file=sys.stderr,
    )
    return 1


def _report_result(result) -> int:
    """The run's one summary line; the exit status (after a signal the shell's 128 + its number)."""
    from splitrl.cli_eval import counted

    last = result.metrics[-1] if result.metrics else {}
    print(
        f"splitrl: {counted(result.steps_done, 'step')} in {result.output_dir}"
        + (f"; last reward {last.get('train/reward', float('nan')):.3f}" if last else "")
        + (" (stopped early; rerun the same command to resume)" if result.stopped_early else "")
    )
    # 130 after Ctrl-C (SIGINT), 143 after SIGTERM, as a shell reports a process they ended
    return 128 + result.interrupt_signal if result.interrupt_signal else 0


def _terminated(signum, frame) -> None:
    _terminated.signum = signum
    raise KeyboardInterrupt


_terminated.signum = None


if __name__ == "__main__":
    sys.exit(main())
