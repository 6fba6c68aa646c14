"""What a config error says besides the key: where it was set, and what was probably meant.

A key is located at `file:line` (its line in the YAML file) or at the `key=value` override that
set it (the last one wins, as in `apply_overrides`). An unknown key is answered with the rollouts
name when it is a TRL name (training/trl_names.py, docs/from-trl.md), else with a close match
among the config's own keys (a typo). Torch-free: config errors answer before torch loads.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel

from training.trl_names import TRLKey, trl_names

DOC = "docs/from-trl.md"


def config_keys(cls: type[BaseModel], prefix: str = "") -> set[str]:
    """Every dotted key of `cls`: sections and their fields, nested sections included."""
    keys = set()
    for name, field in cls.model_fields.items():
        key = prefix + name
        keys.add(key)
        section = _section_model(field.annotation)
        if section is not None:
            keys |= config_keys(section, key + ".")
    return keys


def _section_model(annotation: object) -> type[BaseModel] | None:
    """The model of a section field (`X`, `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if _section_model(a) is not None]
        return models[0] if len(models) == 1 else None
    return None


def locate(key: str, path: Path | None, overrides: Sequence[str]) -> str | None:
    """Where `key` (dotted) was set: `override 'k=v'`, `file:line`, or None if not found."""
    for item in reversed(overrides):
        set_key = item.partition("=")[0].strip()
        if key == set_key or key.startswith(set_key + ".") or set_key.startswith(key + "."):
            return f"override {item!r}"
    if path is None:
        return None
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in key.split("."):
        if isinstance(node, yaml.MappingNode):
            found = [(k, v) for k, v in node.value if k.value == part]
            if not found:
                return None
            key_node, node = found[-1]  # a repeated key: YAML keeps the last
            line = key_node.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            return None
    return f"{path}:{line}" if line is not None else None


def unknown_key_hint(key: str, cls: type[BaseModel]) -> str:
    """`; rollouts calls it ...` for a TRL name, `; did you mean ...?` for a near miss, or ''."""
    tables = getattr(cls, "trl_tables", ())
    leaf = key.rsplit(".", 1)[-1]
    found = trl_names(key, tables) or trl_names(leaf, tables)
    if found:
        return _trl_hints(found)
    near = _near_keys(key, config_keys(cls))
    if near:
        return "; did you mean " + " or ".join(repr(k) for k in near) + "?"
    return ""


def trl_hint(key: str, cls: type[BaseModel]) -> str:
    """The TRL hint for a key that exists but was given TRL's meaning (`optim: adamw_torch`)."""
    found = [(t, e) for t, e in trl_names(key, getattr(cls, "trl_tables", ())) if e.ours != (key,)]
    return _trl_hints(found) if found else ""


def _trl_hints(found: list[tuple[str, TRLKey]]) -> str:
    """`; rollouts calls it 'a' (note)`; the TRL class named when several use the name."""
    named = len(found) > 1
    mapped, unmapped = [], []
    for table, entry in found:
        if not entry.ours:
            unmapped.append(f"TRL's {table}.{entry.trl} has no rollouts equivalent: {entry.note}")
            continue
        note = "; ".join(n for n in (table if named else "", entry.note) if n)
        keys = " or ".join(repr(k) for k in entry.ours)
        mapped.append(keys + (f" ({note})" if note else ""))
    clauses = [*(["rollouts calls it " + " or ".join(mapped)] if mapped else []), *unmapped]
    return "; " + "; ".join(clauses) + f" ({DOC})"


def _near_keys(key: str, keys: set[str]) -> list[str]:
    """Our keys `key` probably meant: a close name in its section, a close dotted path, or (for
    a key at most one section deep: `lr`, `train.lr`) the same name in another section."""
    parent, _, leaf = key.rpartition(".")
    prefix = parent + "." if parent else ""
    siblings = sorted(k[len(prefix) :] for k in keys if k.startswith(prefix))
    siblings = [k for k in siblings if "." not in k]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)
    if close:
        return [prefix + close[0]]
    others = sorted(k for k in keys if not key.startswith(k + "."))  # not its own sections
    close = difflib.get_close_matches(key, others, n=1, cutoff=0.8)
    if close:
        return close
    if key.count(".") > 1:  # deep in a section: a same-named key elsewhere is a guess too far
        return []
    return sorted(k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key)[:3]
