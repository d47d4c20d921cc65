"""What makes a saved ``policy/`` directory usable by plain Hugging Face code, without splitrl.

``save_pretrained`` writes the weights (``model.safetensors``, MTP tensors included) and
``config.json``. A user of transformers also needs the tokenizer and the sampling rules the policy
was trained with, so a checkpoint's ``policy/`` gets two more things here:

- the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json``, ...), written by the
  tokenizer's own ``save_pretrained``: the character tokenizer of the CPU demo is a
  ``PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel model, so
  ``AutoTokenizer.from_pretrained(policy_dir)`` gives the same ids; a pretrained tokenizer is
  written back as it was loaded (its chat template included);
- ``generation_config.json``: sampling (``do_sample``, ``temperature``, ``top_k``, ``top_p``),
  ``max_new_tokens``, and as ``eos_token_id`` every token that ended a rollout (the rollout's
  ``stop_token_ids``, the tokenizer's EOS and a pretrained model's own ``eos_token_id``), with its
  ``stop_strings``.

Then ``AutoModelForCausalLM.from_pretrained(policy_dir).generate(**AutoTokenizer...(prompt))``
samples the way the rollouts did (the MTP heads are left out by the stock class; splitrl's
:class:`~splitrl.models.PolicyModel` loads them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from splitrl.rollout.config import GenerationConfig


def model_eos_token_ids(model_path: str | os.PathLike | None) -> list[int]:
    """``eos_token_id`` of a model directory's ``generation_config.json`` as a list (chat models
    list their end-of-turn token there, e.g. Qwen3's ``<|im_end|>``); [] when there is none."""
    if model_path is None:
        return []
    f = Path(model_path) / "generation_config.json"
    if not f.is_file():
        return []
    eos = json.loads(f.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def rollout_stop_token_ids(
    generation: GenerationConfig, tokenizer: Any, model_path: str | os.PathLike | None = None
) -> list[int]:
    """The tokens that end a rollout: ``generation.stop_token_ids``, the tokenizer's EOS, then
    the ``eos_token_id`` of ``model_path``'s ``generation_config.json`` (a pretrained model's own
    stop tokens). Order kept, no duplicates."""
    stop = list(generation.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        stop.append(eos)
    stop += model_eos_token_ids(model_path)
    return list(dict.fromkeys(stop))


def hf_generation_config(generation: GenerationConfig, tokenizer: Any, model_path: str | os.PathLike | None = None):
    """A ``transformers.GenerationConfig`` that samples as the rollouts do.

    ``top_k=0`` means no top-k filter in both libraries (transformers' own default is 50, so it
    is written explicitly). ``eos_token_id`` is a list when several tokens stop a rollout.

    Raises:
        ValueError: transformers rejects the combination (it validates on construction).
    """
    from transformers import GenerationConfig as HFGenerationConfig

    stop = rollout_stop_token_ids(generation, tokenizer, model_path)
    kwargs: dict[str, Any] = {
        "do_sample": True,
        "temperature": generation.temperature,
        "top_k": generation.top_k,
        "top_p": generation.top_p,
        "max_new_tokens": generation.max_new_tokens,
    }
    if stop:
        kwargs["eos_token_id"] = stop[0] if len(stop) == 1 else stop
    for name in ("pad_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            kwargs[name] = value
    if generation.stop_strings:
        kwargs["stop_strings"] = list(generation.stop_strings)
    return HFGenerationConfig(**kwargs)


def write_inference_files(
    policy_dir: str | os.PathLike,
    tokenizer: Any,
    generation: GenerationConfig,
    model_path: str | os.PathLike | None = None,
) -> None:
    """Write the tokenizer and ``generation_config.json`` into ``policy_dir`` (created if needed),
    beside the weights ``save_pretrained`` wrote (see the module docstring). ``model_path``: the
    pretrained directory the run started from (its stop tokens are kept)."""
    path = Path(policy_dir)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    hf_generation_config(generation, tokenizer, model_path).save_pretrained(str(path))
