"""Every key of the run config, for people: the ``splitrl config`` reference and "did you mean".

Both are read off the pydantic models themselves — field types, the run's defaults, the first
sentence of each field's description or of its entry under ``Attributes:`` in the class
docstring — so they cannot drift from what :func:`splitrl.config.load_config` accepts.

This module imports no config (``splitrl.config`` imports it for error messages); the functions
take the root model class, and ``splitrl config`` (:mod:`splitrl.cli`) passes ``RunConfig``.
"""

from __future__ import annotations

import difflib
import enum
import inspect
import json
import re
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

REQUIRED = object()
"""Default of a field that has none (it must be given)."""

_ENTRY = re.compile(r"^(\w+(?:\s*/\s*\w+)*)\s*:\s*(.*)$")


@dataclass(frozen=True)
class KeyDoc:
    """One key of the config.

    Attributes:
        path: dotted key as written in overrides, e.g. ``model.mtp.mtp_num_layers``.
        type: the accepted type, e.g. ``int``, ``'auto' | 'ray' | 'local'``, ``section``.
        default: the run's default (JSON-able), :data:`REQUIRED`, or None for a section.
        doc: the first sentence of the field's documentation ('' when it has none).
        when: the condition under which the key exists (``task.kind=math_file``), or ''.
    """

    path: str
    type: str
    default: Any
    doc: str
    when: str = ""

    @property
    def is_section(self) -> bool:
        return self.type == "section"


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    masked = re.sub(r"\b(e\.g|i\.e|etc|vs)\.", lambda m: m.group(0).replace(".", "_"), text)
    m = re.search(r"(?<=[a-z0-9)`'\]])\.(\s|$)", masked)
    return text[: m.start() + 1] if m else text


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> first sentence of its entry under ``Attributes:`` in ``cls``'s docstring.

    An entry ``a / b: text`` documents both ``a`` and ``b``; continuation lines are indented deeper.
    """
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip().startswith("Attributes"))
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    entry_indent: int | None = None
    names: list[str] = []
    text: list[str] = []

    def flush() -> None:
        for n in names:
            out.setdefault(n, _first_sentence(" ".join(text)))

    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if entry_indent is None:
            entry_indent = indent
        if indent < entry_indent:
            break  # the section ended
        m = _ENTRY.match(line.strip()) if indent == entry_indent else None
        if m:
            flush()
            names = [n.strip() for n in m.group(1).split("/")]
            text = [m.group(2)]
        elif indent > entry_indent:
            text.append(line.strip())
        else:
            break
    flush()
    return out


def _strip(ann: Any) -> Any:
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    return ann


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _union_models(ann: Any) -> list[type[BaseModel]]:
    """The members of a union of config classes (a tagged union such as the task configs)."""
    ann = _strip(ann)
    if get_origin(ann) in (Union, types.UnionType):
        members = [_strip(a) for a in get_args(ann)]
        if members and all(_is_model(m) for m in members):
            return members
    return []


def _section_model(ann: Any) -> type[BaseModel] | None:
    """The config class of a nested section (``Model`` or ``Model | None``), else None."""
    ann = _strip(ann)
    if _is_model(ann):
        return ann
    if get_origin(ann) in (Union, types.UnionType):
        models = [a for a in get_args(ann) if _is_model(a)]
        rest = [a for a in get_args(ann) if not _is_model(a) and a is not type(None)]
        if len(models) == 1 and not rest:
            return models[0]
    return None


def type_name(ann: Any) -> str:
    """A short readable name of a field type: ``int | None``, ``'fp32' | 'bf16'``, ``list[int]``."""
    ann = _strip(ann)
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if ann is type(None):
        return "None"
    if ann is Any:
        return "any"
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return " | ".join(repr(m.value) for m in ann)
    return getattr(ann, "__name__", str(ann))


def _field_default(field: Any) -> Any:
    if field.is_required():
        return REQUIRED
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _tag(member: type[BaseModel]) -> tuple[str, Any] | None:
    for name in ("kind", "type"):
        f = member.model_fields.get(name)
        if f is not None and get_origin(_strip(f.annotation)) is Literal:
            return name, get_args(_strip(f.annotation))[0]
    return None


def config_keys(model_cls: type[BaseModel], defaults: dict[str, Any] | None = None) -> list[KeyDoc]:
    """Every key of ``model_cls`` and its sections, depth first, in field order.

    Args:
        model_cls: the root config class (``RunConfig``).
        defaults: the root's defaults as a JSON dict (``RunConfig().model_dump(mode="json")``),
            which may differ from the sections' own class defaults; None: the class defaults.

    A tagged union (``task``) lists each member's keys with ``when`` = ``task.kind=<tag>``; the
    run's defaults apply to the member the default selects.
    """
    out: list[KeyDoc] = []
    _walk(model_cls, defaults, "", "", out)
    return out


def _walk(cls: type[BaseModel], defaults: dict[str, Any] | None, prefix: str, when: str, out: list[KeyDoc]) -> None:
    docs: dict[str, str] = {}
    for klass in cls.__mro__:  # a field documented on a base class (TaskOptions) counts too
        if isinstance(klass, type) and issubclass(klass, BaseModel) and klass is not BaseModel:
            for name, text in attribute_docs(klass).items():
                docs.setdefault(name, text)
    # a section's own keys first, then its subsections, so that every key prints under its section
    fields = sorted(
        cls.model_fields.items(),
        key=lambda kv: _section_model(kv[1].annotation) is not None or bool(_union_models(kv[1].annotation)),
    )
    for name, field in fields:
        path = prefix + name
        doc = _first_sentence(field.description) if field.description else docs.get(name, "")
        default = defaults.get(name, REQUIRED) if defaults is not None else _field_default(field)
        section = _section_model(field.annotation)
        members = _union_models(field.annotation)
        if section is not None:
            optional = _strip(field.annotation) is not section  # ``Model | None``: may be off
            out.append(KeyDoc(path, "section | None" if optional else "section", None, doc, when))
            _walk(section, default if isinstance(default, dict) else None, path + ".", when, out)
        elif members:
            out.append(KeyDoc(path, "section", None, doc, when))
            for member in members:
                tag = _tag(member)
                cond = f"{path}.{tag[0]}={tag[1]}" if tag else ""
                chosen = isinstance(default, dict) and tag is not None and default.get(tag[0]) == tag[1]
                _walk(member, default if chosen else None, path + ".", cond, out)
        else:
            if isinstance(default, enum.Enum):
                default = default.value
            out.append(KeyDoc(path, type_name(field.annotation), default, doc, when))


def format_reference(keys: Iterable[KeyDoc]) -> str:
    """The text ``splitrl config`` prints: one line per key, ``path (type) = default  doc``."""
    lines = []
    for k in keys:
        when = f"  [when {k.when}]" if k.when else ""
        if k.type.startswith("section"):
            lines.append(f"\n{k.path}:{when}  {k.doc}".rstrip())
            continue
        default = "(required)" if k.default is REQUIRED else json.dumps(k.default)
        doc = f"  # {k.doc}" if k.doc else ""
        lines.append(f"  {k.path} ({k.type}) = {default}{doc}{when}")
    return "\n".join(lines).lstrip("\n") + "\n"


GENERIC_LEAF_LEN = 6


def suggest_key(path: str, valid: Iterable[str]) -> str | None:
    """The valid key closest to a misspelled or misplaced ``path``, or None.

    A key whose last part matches exactly wins (``mtp_num_layers`` → ``model.mtp.mtp_num_layers``);
    else the closest full path (difflib ratio ≥ 0.75); else the closest last part (≥ 0.75). A last
    part shorter than ``GENERIC_LEAF_LEN`` characters under a section that exists (``task.name``)
    is matched against that section's keys only: such names recur in many sections.
    """
    valid = sorted(set(valid))
    if path in valid:
        return None
    leaf = path.rsplit(".", 1)[-1]
    section = path.rsplit(".", 1)[0] + "." if "." in path else ""
    if section and any(v.startswith(section) for v in valid) and len(leaf) < GENERIC_LEAF_LEN:
        # a short, common name (name, path, kind) inside a real section: only that section's
        # own keys are suggested (task.name is not logging.wandb.name)
        own = [v for v in valid if v.startswith(section)]
        close = difflib.get_close_matches(path, own, n=1, cutoff=0.75)
        return close[0] if close else None
    same_leaf = [v for v in valid if v.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return max(same_leaf, key=lambda v: difflib.SequenceMatcher(None, path, v).ratio())
    close = difflib.get_close_matches(path, valid, n=1, cutoff=0.75)
    if close:
        return close[0]
    by_leaf: dict[str, str] = {}
    for v in valid:
        by_leaf.setdefault(v.rsplit(".", 1)[-1], v)
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[close[0]] if close else None


def _key_path(loc: tuple, model_cls: type[BaseModel]) -> str:
    """A pydantic error location as a dotted key: union tags (``task.math_file.path``) dropped."""
    parts: list[str] = []
    cls: Any = model_cls
    for item in loc:
        members = _union_models(cls) if cls is not None and not _is_model(cls) else []
        if members:
            tags = {str(t[1]): m for m in members if (t := _tag(m))}
            if str(item) in tags:
                cls = tags[str(item)]
                continue
        parts.append(str(item))
        field = cls.model_fields.get(str(item)) if _is_model(cls) else None
        if field is None:
            cls = None
        else:
            cls = _section_model(field.annotation) or (field.annotation if _union_models(field.annotation) else None)
    return ".".join(parts)


# pydantic's location tag of one member of a union of plain types (``float | Literal["auto"]``)
# a number in exponent notation that stayed text (quoted: "1e3"); unquoted ones read as numbers (config.py)
_YAML_TEXT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _number_hint(value: object) -> str:
    """" (YAML reads 1e3 as text ...)" for a number in exponent notation that YAML left a string."""
    if not (isinstance(value, str) and _YAML_TEXT_NUMBER.fullmatch(value.strip())):
        return ""
    number = float(value)
    plain = str(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)
    return f" (YAML reads {value} as text, not a number: write {plain})"


_SCALAR_UNION_MEMBER = re.compile(r"constrained-\w+|literal\[.*\]|bool|int|float|str|none|(list|dict|tuple|set)\[.*\]")


def _is_nan(value: object) -> bool:
    """``value`` is NaN or text that reads as NaN (pydantic turns "nan" into a float NaN, which no
    bound accepts)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return isinstance(value, float) and value != value  # NaN compares unequal to itself


def validator_words(err: dict[str, Any]) -> str:
    """A pydantic error's message without pydantic's "Value error, " prefix: our validators' own words."""
    return str(err.get("ctx", {}).get("error", err["msg"].removeprefix("Value error, ")))


# pydantic's error types of a number outside a bound (Field(ge=...), gt, le, lt)
_BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")


def explain_validation_error(error: ValidationError, model_cls: type[BaseModel]) -> str:
    """The message of a config error: one line per problem, named by its dotted key, unknown keys
    with the closest valid one ("did you mean model.mtp.mtp_num_layers?"), and where to look."""
    lines = []
    valid: list[str] | None = None
    keys: dict[str, KeyDoc] | None = None
    scalar_union: dict[str, int] = {}  # path -> index in lines of a union key's first member error
    for err in error.errors():
        loc = tuple(err["loc"])
        member = loc and isinstance(loc[-1], str) and _SCALAR_UNION_MEMBER.fullmatch(loc[-1])
        path = _key_path(loc[:-1] if member else loc, model_cls)
        msg = err["msg"]
        if member:
            # a key of several allowed forms (a number or "auto"): pydantic reports one error per
            # form, named by its internal tag ("loss.tis_cap.constrained-float"); one line per key
            if path in scalar_union:
                lines[scalar_union[path]] += f", or {msg.removeprefix('Input should be ')}"
                continue
            scalar_union[path] = len(lines)
        if err["type"] == "value_error":
            msg = validator_words(err)
        msg += _number_hint(err.get("input"))
        value = err.get("input")
        if _is_nan(value):
            msg += f" (got {value!r}, which is not a number)"
        if err["type"] in _BOUNDS:
            keys = keys if keys is not None else {k.path: k for k in config_keys(model_cls)}
            key = keys.get(path)
            if key is not None and key.default is None and "None" in key.type:
                # an optional key (null by default: "the whole vocabulary", "every MTP depth"), whose
                # bound alone would not say how to get the default back
                msg += f"; or leave it unset ({path}=null on the command line) for its default"
        if err["type"] == "model_type":
            # "Input should be a valid dictionary or instance of WandbConfig": a class name the
            # user never wrote; say what the key takes instead
            msg = (
                f"is a section: give a mapping of its keys (e.g. {path}='{{key: value}}' or {path}.<key>=value; "
                f"`splitrl config {path}` lists them), got {value!r}"
            )
        if err["type"] == "missing" and len(loc) > 1:
            # the key has a run default (`splitrl config` lists it), but a section given whole
            # starts from its class, which has none
            msg += (
                f"; a {loc[0]} section given whole (in a config file, or {loc[0]}={{...}}) replaces the run's "
                f"default {loc[0]} section, "
                f"so give {path} there too (`splitrl config {path}` shows the run's value), or set single keys "
                f"as dotted overrides ({loc[0]}.<key>=...), which keep the others"
            )
        if err["type"] == "extra_forbidden":
            valid = valid or [k.path for k in config_keys(model_cls)]
            hint = suggest_key(path, valid)
            msg = "unknown key" + (f"; did you mean {hint}?" if hint else "")
        lines.append(f"  {path}: {msg}" if path else f"  {msg}")
    return (
        "invalid config:\n" + "\n".join(lines)
        + "\n(every key with its type, default and meaning: `splitrl config`; examples: examples/*.yaml)"
    )


def _examples_dir() -> str:
    from pathlib import Path

    here = Path(__file__).resolve().parents[2] / "examples"  # a source checkout / editable install
    return f"examples/ (here: {here})" if here.is_dir() else "examples/ in the splitrl repository"


TRAIN_EPILOG = f"""\
examples:
  splitrl train                                   the CPU demo (preset cpu_demo)
  splitrl train --config examples/cpu_demo.yaml   the same + a held-out eval
  splitrl train schedule.num_steps=50 model.mtp.mtp_num_layers=2 buffer.max_staleness=0
  splitrl train --config run.yaml --print-config  the resolved config, without running

run configs to start from: {_examples_dir()}
every key with its type, default and meaning: splitrl config [FILTER]   (e.g. splitrl config mtp)
"""
