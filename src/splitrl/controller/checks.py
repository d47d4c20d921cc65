"""Preflight checks that need the model's config, the tokenizer or the task, but no worker.

Each raises a ``ValueError`` that names the config key to change, so that a run with a bad
model, tokenizer, prompt set or output directory stops in seconds with one message instead of
inside a worker's traceback after the cluster has started. :func:`splitrl.controller.controller.preflight`
runs them in order.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import tempfile
from pathlib import Path
from typing import Any

from splitrl.config import RunConfig

log = logging.getLogger(__name__)

# a procedural task has no end: this many of its first prompts are checked
PROCEDURAL_PROMPTS_CHECKED = 64


def check_output_dir(output_dir: str) -> None:
    """Create ``output_dir`` (and its parents), write a probe file there, and check that the
    run's own entries in it, where they exist, are of their kind (``checkpoints/`` and
    ``tensorboard/`` directories; ``metrics.jsonl``, ``metrics.png``, ``config.yaml`` files).

    Raises:
        ValueError: ``output_dir=...: cannot create / write ... (<OS reason>)``, or names the entry
            of the wrong kind (a file named ``checkpoints`` failed only at the first checkpoint,
            after the steps before it had trained).
    """
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"output_dir={output_dir!r}: cannot create it ({e.strerror or e}); choose a directory you can write to"
        ) from None
    try:
        with tempfile.TemporaryFile(dir=out) as f:
            f.write(b"splitrl")
            f.flush()
    except OSError as e:
        raise ValueError(
            f"output_dir={output_dir!r}: cannot write there ({e.strerror or e}); choose a directory you can write to"
        ) from None
    from splitrl.controller.run_checkpoint import checkpoint_root
    from splitrl.logging.logger import CONFIG_FILE, METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR

    for path, is_dir in [(checkpoint_root(out), True), (out / TENSORBOARD_DIR, True), (out / METRICS_FILE, False),
                         (out / PLOT_FILE, False), (out / CONFIG_FILE, False)]:
        if path.exists() and path.is_dir() != is_dir:
            raise ValueError(
                f"output_dir={output_dir!r}: {path} is a {'directory' if path.is_dir() else 'file'}, but the run writes "
                f"its {path.name} there as a {'directory' if is_dir else 'file'}; move it away, or choose another output_dir"
            )


def model_hf_config(config: RunConfig) -> Any:
    """The transformers config of the run's policy, after checking what a worker would only find
    when it builds the model.

    From ``model.backbone``: every key must be one the family's config knows (transformers keeps a
    misspelt one silently) and transformers must accept the values. From ``model.pretrained_path``:
    the weight files must be whole and fit the config and ``model.mtp`` (see
    :func:`splitrl.models.checkpoint.verify_pretrained`), and the family must be supported. Both:
    the attention head counts must divide, and a backbone that lacks size keys must not come out
    large by transformers' defaults (see :func:`splitrl.models.policy.check_defaulted_size`).

    Raises:
        ValueError: naming ``model.backbone`` / ``model.pretrained_path``.
    """
    from splitrl.models.policy import _FAMILY_CONFIGS

    m = config.model
    if m.pretrained_path is not None:
        from transformers import AutoConfig

        from splitrl.models.checkpoint import verify_pretrained
        from splitrl.models.config import SUPPORTED_FAMILIES
        from splitrl.models.gguf import resolve_model_path

        path = resolve_model_path(m.pretrained_path)  # a .gguf file: its converted directory
        verify_pretrained(path, mtp=m.mtp)
        hf_cfg = AutoConfig.from_pretrained(path)
        key = f"model.pretrained_path={m.pretrained_path!r} (config.json)"
        if hf_cfg.model_type not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"{key}: model_type {hf_cfg.model_type!r} is not supported; use a {' or '.join(SUPPORTED_FAMILIES)} "
                "model (their decoder layers and RMSNorm are reused by the MTP heads)"
            )
    else:
        key = "model.backbone"
        cls = _FAMILY_CONFIGS[m.family]
        # transformers keeps any keyword as an attribute: a misspelt key would be ignored silently
        known = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters) | set(cls.attribute_map)
        known.add("head_dim")  # not a Qwen3-MoE config argument, but its attention reads it when set
        unknown = sorted(set(m.backbone) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{key}.{unknown[0]} is not a key of the {m.family} config{hint}; unknown keys: {unknown}")
        try:
            hf_cfg = cls(**m.backbone_kwargs())  # as built
        except Exception as e:  # noqa: BLE001 - transformers' own validators raise several kinds
            raise ValueError(f"{key} is rejected by transformers' {m.family} config: {e}") from None
        from splitrl.models.policy import check_defaulted_size

        missing = check_defaulted_size(m, hf_cfg)
        if missing:  # allowed (the model stays near the size given), but not what the file says
            log.warning(
                "%s lacks %s: transformers' %s defaults are used (%s); give them to silence this",
                key, ", ".join(missing), m.family, ", ".join(f"{k}={getattr(hf_cfg, k)}" for k in missing),
            )
    heads = getattr(hf_cfg, "num_attention_heads", None)
    kv = getattr(hf_cfg, "num_key_value_heads", None) or heads
    if heads is not None and kv is not None and (kv < 1 or heads % kv != 0):
        raise ValueError(
            f"{key}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} "
            "(each key/value head serves a whole group of query heads); make num_key_value_heads a divisor "
            "of num_attention_heads"
        )
    head_dim = getattr(hf_cfg, "head_dim", None)
    hidden = getattr(hf_cfg, "hidden_size", None)
    if head_dim is None and heads and hidden is not None and hidden % heads != 0:
        raise ValueError(
            f"{key}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; set head_dim or "
            "change one of the two"
        )
    return hf_cfg


# files one of which a Hugging Face tokenizer directory holds (transformers builds an empty
# tokenizer, without an error, from a directory that has none)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_checked_tokenizer(config: RunConfig) -> Any:
    """The run's tokenizer, loaded as the workers load it.

    Raises:
        ValueError: naming ``tokenizer.path`` / ``model.pretrained_path``: the directory has no
            tokenizer files, or transformers cannot load it.
    """
    from splitrl.workers.generation import load_tokenizer

    tc = config.tokenizer
    where = tc.path or config.model.pretrained_path
    key = "tokenizer.path" if tc.path else "model.pretrained_path (tokenizer.path unset)"
    if tc.kind == "pretrained" and where is None:
        raise ValueError(
            "tokenizer.kind=pretrained needs a tokenizer directory, and neither tokenizer.path nor "
            "model.pretrained_path is set: set tokenizer.path (or model.pretrained_path, whose tokenizer is used), "
            "or use tokenizer.kind=char"
        )
    if tc.kind == "pretrained" and where is not None and Path(where).is_dir():
        if not any((Path(where) / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(
                f"tokenizer.kind=pretrained: {key}={where!r} has no tokenizer files (one of {list(_TOKENIZER_FILES)}); "
                "set tokenizer.path to the model's tokenizer directory"
            )
    try:
        return load_tokenizer(tc, config.model.pretrained_path)
    except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise several kinds for a bad directory
        raise ValueError(f"tokenizer.kind={tc.kind}: cannot load a tokenizer from {key}={where!r} ({e})") from None


def check_vocab(config: RunConfig, tokenizer: Any, hf_cfg: Any) -> None:
    """The model's embedding must have a row for every id the tokenizer can produce, and every
    ``rollout.stop_token_ids`` entry must be an id the model can sample.

    Raises:
        ValueError: naming ``rollout.stop_token_ids``, ``model.backbone.vocab_size`` (random init)
            or the tokenizer/model paths.
    """
    vocab = getattr(hf_cfg, "vocab_size", None)
    if vocab is None:
        return
    beyond = [t for t in config.rollout.stop_token_ids if t >= vocab]
    if beyond:
        raise ValueError(
            f"rollout.stop_token_ids {beyond} are not below the model's vocab_size={vocab}: they can never be "
            "sampled, so they would never stop a response; use ids the model has"
        )
    n = len(tokenizer)
    if n <= vocab:
        return
    if config.model.pretrained_path is None:
        raise ValueError(
            f"model.backbone.vocab_size={vocab} is smaller than the tokenizer's {n} tokens "
            f"(tokenizer.kind={config.tokenizer.kind}); set model.backbone.vocab_size >= {n}"
        )
    raise ValueError(
        f"the tokenizer has {n} tokens but model.pretrained_path={config.model.pretrained_path!r} has "
        f"vocab_size={vocab}; use the model's own tokenizer (tokenizer.kind=pretrained, tokenizer.path unset "
        "or pointing at the model's tokenizer)"
    )


def fit_prompts_to_context(config: RunConfig, task: Any, tokenizer: Any, hf_cfg: Any) -> Any:
    """Prompt tokens + ``rollout.max_new_tokens`` must fit the model's ``max_position_embeddings``.

    A data file (``task.kind=math_file``): every row is checked; rows that do not fit are left
    out (added to ``task.skip_rows``), counted and named in one warning. A generated task: its
    first :data:`PROCEDURAL_PROMPTS_CHECKED` prompts are checked and one that does not fit is an
    error (its settings make such prompts; there is no row to leave out).

    Returns:
        The task config to run with (``config.task`` itself when nothing was dropped).

    Raises:
        ValueError: ``rollout.max_new_tokens`` alone does not fit, a generated prompt does not fit,
            or no row of a data file fits.
    """
    from splitrl.tasks import MathFileTask, render_prompt

    max_pos = getattr(hf_cfg, "max_position_embeddings", None)
    if max_pos is None:
        return config.task
    new = config.rollout.max_new_tokens
    context = (
        f"the model's max_position_embeddings={max_pos} "
        f"({'config.json of model.pretrained_path' if config.model.pretrained_path else 'model.backbone'})"
    )
    limits = f"prompt tokens + rollout.max_new_tokens={new} exceed {context}"
    if new >= max_pos:
        raise ValueError(f"no prompt fits: rollout.max_new_tokens={new} leaves no room in {context}; lower it")
    n = task.num_prompts
    count = n if isinstance(task, MathFileTask) else min(PROCEDURAL_PROMPTS_CHECKED, n or PROCEDURAL_PROMPTS_CHECKED)
    prompts = [task.get_prompt(i) for i in range(count)]
    has_template = bool(getattr(tokenizer, "chat_template", None))
    option = getattr(task.config, "chat_template", None)  # the task's chat_template (None: auto)
    templated = has_template if option is None else option
    # tokenized as encode_prompt does (special tokens once), in one batch call
    encoded = tokenizer(
        [render_prompt(p, tokenizer) if templated else p.text for p in prompts], add_special_tokens=not templated
    )
    lengths = [len(ids) for ids in encoded["input_ids"]]
    empty = [p for p, k in zip(prompts, lengths) if k == 0]
    if empty:
        raise ValueError(
            f"prompt {empty[0].index} of the task ({empty[0].text[:60]!r}) encodes to no tokens; check the tokenizer "
            f"(tokenizer.kind={config.tokenizer.kind}) and the task's prompt column"
        )
    too_long = [(p, k) for p, k in zip(prompts, lengths) if k + new > max_pos]
    if not too_long:
        return config.task
    if not isinstance(task, MathFileTask):
        p, k = too_long[0]
        raise ValueError(
            f"prompt {p.index} of the task ({k} tokens: {p.text[:60]!r}): {limits}; lower "
            "rollout.max_new_tokens, make the task's prompts shorter, or raise the model's context"
        )
    if len(too_long) == len(prompts):
        raise ValueError(
            f"no row of task.path={config.task.path!r} fits: {limits} for every row (shortest prompt "
            f"{min(lengths)} tokens); lower rollout.max_new_tokens"
        )
    rows = sorted(p.metadata["row"] for p, _ in too_long)
    shown = ", ".join(f"{task.row_label(p.metadata['row'])} ({k} tokens)" for p, k in too_long[:10])
    log.warning(
        "task.path=%r: %d of %d rows left out (%s): %s%s",
        config.task.path,
        len(rows),
        len(prompts) + len(config.task.skip_rows),
        limits,
        shown,
        "" if len(rows) <= 10 else f" and {len(rows) - 10} more",
    )
    return config.task.model_copy(update={"skip_rows": sorted(set(config.task.skip_rows) | set(rows))})
