"""GGUF checkpoints in: a ``.gguf`` file becomes a Hugging Face directory, once, in a cache.

``model.pretrained_path`` (and ``splitrl eval`` / ``generate``'s PATH) may name a ``.gguf`` file of
a family transformers reads and splitrl builds (``READABLE_FAMILIES``, from the family registry:
llama, qwen2, qwen3). transformers dequantizes it to fp32 on load (``from_pretrained(dir,
gguf_file=...)``, which needs the ``gguf`` package); the result and the file's tokenizer (its chat
template included) are written as a plain safetensors directory under

    $SPLITRL_CACHE_DIR/gguf/<first 16 hex digits of the file's SHA-256>/

(``SPLITRL_CACHE_DIR`` defaults to ``$XDG_CACHE_HOME/splitrl``, else ``~/.cache/splitrl``). The key
is the file's content, so a moved or renamed copy reuses the conversion and a changed file gets a
new one. A conversion is written to a temporary directory and renamed when whole, under a lock,
so concurrent processes (Ray workers, two runs) convert once and never read half a directory.
A cached conversion is checked each time it is reused (the sizes its ``CONVERTED`` file records,
the safetensors headers: no weights are read); a damaged one (a full disk, a cut copy of the
cache) is removed and converted again, with a warning. Everything else in splitrl then sees an
ordinary model directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from pathlib import Path

from splitrl.models.families import GGUF_ARCHITECTURES

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# the GGUF architectures transformers converts whose family splitrl builds: those of the family
# registry (splitrl.models.families) that name one
READABLE_FAMILIES = GGUF_ARCHITECTURES
# written last into a finished conversion: _FORMAT, the source file's name, then "<size> <name>"
# per file of the conversion (what a reuse checks, see _damage)
_DONE = "CONVERTED"
# the version of what a conversion writes; a cached conversion of another version is redone
_FORMAT = "splitrl-gguf 2"


def is_gguf(path: str | os.PathLike | None) -> bool:
    """True when ``path`` names a ``.gguf`` file (by its suffix; the file need not exist)."""
    return path is not None and str(path).lower().endswith(GGUF_SUFFIX)


def cache_root() -> Path:
    """``$SPLITRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/splitrl``, else ``~/.cache/splitrl``."""
    if os.environ.get("SPLITRL_CACHE_DIR"):
        return Path(os.environ["SPLITRL_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitrl"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _check_magic(path: Path) -> None:
    """The file exists and starts with the GGUF magic (raises ValueError naming the file)."""
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        raise ValueError(f"GGUF file {str(path)!r} {what}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")


# the metadata a conversion reads beside the architecture: the special tokens by id (transformers'
# GGUF tokenizer converter drops the EOS and padding tokens, see _convert) and the head size
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _read_header(path: Path) -> dict:
    """The file's metadata that a conversion needs, after checking that it parses and names a
    family we can build (the reader parses the whole header, vocabulary included, and every
    tensor's extent: seconds, so only before a conversion).

    Returns:
        ``{"architecture": str, "key_length": int | None, "bos_token": int | None, ...}`` (the
        special tokens as ids).

    Raises:
        ValueError: one line naming the file and what is wrong with it.
    """
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(f"reading {str(path)!r} needs the gguf package: python3 -m pip install gguf") from None
    try:
        fields = GGUFReader(str(path)).fields
    except Exception as e:  # the reader raises many types on a damaged file
        raise ValueError(
            f"{str(path)!r} cannot be read as GGUF ({type(e).__name__}: {e}); is the file whole?"
        ) from None

    def scalar(key: str):
        field = fields.get(key)
        if field is None or not field.data:
            return None
        value = field.parts[field.data[0]]
        return bytes(value).decode() if field.types and field.types[0].name == "STRING" else int(value[0])

    arch = scalar("general.architecture")
    if arch not in READABLE_FAMILIES:
        raise ValueError(
            f"{str(path)!r} holds a {arch!r} model; splitrl converts GGUF files of {', '.join(READABLE_FAMILIES)}"
        )
    header = {"architecture": arch, "key_length": scalar(f"{arch}.attention.key_length")}
    header.update({name: scalar(key) for name, key in _SPECIAL_TOKEN_KEYS.items()})
    return header


def _convert(src: Path, out: Path, header: dict) -> None:
    """Dequantize ``src`` to fp32 and write model + tokenizer to the empty directory ``out``.

    Two things transformers' GGUF loader gets wrong are set right from ``header``
    (:func:`_read_header`): the tokenizer's special tokens (its llama converter makes the BOS token
    the EOS token too and sets no padding token, so a rollout would stop on the wrong token) and,
    for qwen3, the head size (not read from the file, so Qwen3's default of 128 applied to every
    file). The result is checked against its config before it is kept.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from splitrl.models.checkpoint import verify_pretrained

    kw = {"gguf_file": src.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
        config = AutoConfig.from_pretrained(str(src.parent), **kw)
        if header.get("key_length") and getattr(config, "head_dim", None) != header["key_length"]:
            config.head_dim = header["key_length"]
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), config=config, dtype=torch.float32, **kw)
    except Exception as e:  # transformers raises ValueError/KeyError/... for what it cannot map
        reason = " ".join(f"{type(e).__name__}: {e}".split())  # one line
        raise ValueError(f"transformers cannot load {str(src)!r} ({reason})") from None
    for name in _SPECIAL_TOKEN_KEYS:
        token_id = header.get(name)
        if token_id is not None and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))
    # the llama converter asks for WordPiece's space clean-up, which transformers ignores for a BPE
    # tokenizer (with a warning at every load); off, decoding is the same and the warning goes
    tokenizer.clean_up_tokenization_spaces = False
    # the GGUF loader marks the model as quantized, and save_pretrained refuses such a model; the
    # weights are already dequantized, so the marker is dropped
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    try:
        verify_pretrained(out, key="converted")
    except ValueError as e:  # e.g. a config value transformers does not read from this file
        raise ValueError(f"{str(src)!r} converts to an inconsistent model, so it is not kept ({e})") from None
    files = "".join(f"{f.stat().st_size} {f.name}\n" for f in sorted(out.iterdir()) if f.is_file())
    (out / _DONE).write_text(f"{_FORMAT}\n{src.name}\n{files}")


def _finished(target: Path) -> bool:
    """``target`` holds a whole conversion of the current format."""
    done = target / _DONE
    try:
        return done.is_file() and done.read_text().split("\n", 1)[0] == _FORMAT
    except (OSError, UnicodeDecodeError):  # unreadable: converted again, as an unfinished one
        return False


def _damage(target: Path) -> str | None:
    """What is wrong with the finished conversion in ``target`` (:func:`_finished`), or None.

    Cheap, so it runs at every reuse: every file the ``CONVERTED`` file lists is there with the
    size it was written with (conversions from before it listed them skip this), ``config.json``
    is there, and every safetensors file holds the bytes its header promises
    (:func:`~splitrl.models.checkpoint.safetensors_header`, which reads the headers only).
    """
    from splitrl.models.checkpoint import safetensors_header

    for line in (target / _DONE).read_text().splitlines()[2:]:
        size, _, name = line.partition(" ")
        f = target / name
        if not size.isdigit() or not name or "/" in name:
            return f"its {_DONE} file is corrupt (line {line!r})"
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != int(size):
            return f"{name} is {f.stat().st_size} bytes, it was written with {size}"
    if not (target / "config.json").is_file():
        return "config.json is missing"
    weights = sorted(target.glob("*.safetensors"))
    if not weights:
        return "it holds no *.safetensors file"
    for f in weights:
        try:
            safetensors_header(f)
        except ValueError as e:  # the advice to copy the file again is not for a cache
            return str(e).removesuffix("; copy or download it again")
    return None


def gguf_model_dir(path: str | os.PathLike) -> Path:
    """The cached Hugging Face directory of the GGUF file ``path``, converting it on first use.

    A cached conversion is checked before it is reused (:func:`_damage`); a damaged one is
    removed and converted again, with a warning naming the directory.

    Args:
        path: a ``.gguf`` file of a llama, qwen2 or qwen3 model.

    Returns:
        ``cache_root()/gguf/<sha256[:16]>``: ``config.json``, ``model.safetensors`` (fp32), the
        tokenizer files and chat template.

    Raises:
        ValueError: one line naming the file and why it cannot be used (missing, not GGUF, an
            architecture outside ``READABLE_FAMILIES``, damaged, or the gguf package missing);
            where a damaged cached conversion could not be converted again (this includes
            an OSError), the line also names the cache directory and says it can be deleted; a
            first conversion that cannot write the cache (an OSError) names the directory and
            ``SPLITRL_CACHE_DIR``.
    """
    src = Path(path).expanduser().absolute()
    _check_magic(src)
    target = cache_root() / "gguf" / _sha256(src)[:16]
    damage = _damage(target) if _finished(target) else None
    if _finished(target) and damage is None:
        return target
    try:
        _convert_once(src, target)
    except (OSError, ValueError) as e:
        if damage is None:
            if isinstance(e, OSError):  # an unwritable or full cache: one line, not a traceback
                raise ValueError(
                    f"{str(src)!r}: cannot convert it into {target} ({type(e).__name__}: {e}); set "
                    "SPLITRL_CACHE_DIR to a writable directory with room for the fp32 model"
                ) from None
            raise
        reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(
            f"{str(src)!r}: its cached conversion {target} is damaged ({damage}) and converting the file again "
            f"failed ({reason}); the cache directory can be deleted (it is converted again on the next use)"
        ) from None
    return target


def _convert_once(src: Path, target: Path) -> None:
    """Convert ``src`` into ``target`` under the cache's lock, unless another process has just
    done so; a damaged or older conversion there is removed first (a damaged one with a warning).

    Raises:
        ValueError: from :func:`_read_header` and :func:`_convert`, naming ``src``.
        OSError: the cache directory cannot be written, or the old conversion removed.
    """
    header = _read_header(src)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same file
        if _finished(target):
            damage = _damage(target)
            if damage is None:
                return
            log.warning(
                "the cached conversion %s of %s is damaged (%s); removing it and converting the file again",
                target,
                src,
                damage,
            )
        tmp = target.parent / f"{target.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():  # damaged, or of an older format
            shutil.rmtree(target)
        tmp.mkdir()
        log.info("converting %s to a Hugging Face directory in %s (once per file)", src, target)
        try:
            _convert(src, tmp, header)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(path: str | os.PathLike | None) -> str | None:
    """``path`` itself, or for a ``.gguf`` file its converted directory (:func:`gguf_model_dir`)."""
    if not is_gguf(path):
        return None if path is None else str(path)
    return str(gguf_model_dir(path))


def resolve_model_files(config) -> None:
    """Point a run config's ``model.pretrained_path`` and ``tokenizer.path`` at the converted
    directory where they name a ``.gguf`` file (converting once); other paths are left alone.

    Args:
        config: a :class:`~splitrl.config.RunConfig` (changed in place), so that every process the
            run starts, and its saved ``run_config.json``, see an ordinary model directory.

    Raises:
        ValueError: from :func:`gguf_model_dir`, naming the key and the file.
    """
    for section, key in ((config.model, "pretrained_path"), (config.tokenizer, "path")):
        path = getattr(section, key)
        if is_gguf(path):
            where = "model.pretrained_path" if section is config.model else "tokenizer.path"
            try:
                setattr(section, key, str(gguf_model_dir(path)))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
