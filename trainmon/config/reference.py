"""The key tables of ``docs/config.md``, written from the declarations (``trainmon.config.keys``).

Each table sits between ``<!-- keys: NAME -->`` and ``<!-- /keys -->`` in the docs: ``collect``, ``output``,
``schedule`` (the top-level keys by their ``group``), one per section (``alert``, ``alert.webhooks``,
``cc_distribution``, ``grad_probe``) and ``pending`` (the keys accepted, not implemented yet).
``python -m trainmon.config.reference docs/config.md`` rewrites them; ``--check`` only says whether they are
current (``tests/test_config_keys.py`` runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import get_args, get_origin

from trainmon.config.keys import Declared, Section, default_text, meaning_text, type_text
from trainmon.config.schema import MonitorConfig

__all__ = ["tables", "update_docs"]

_BLOCK = re.compile(r"(<!-- keys: (?P<name>[\w.]+) -->\n)(?P<body>.*?)(<!-- /keys -->)", re.S)


def _cell(text: str) -> str:
    return re.sub(r"(?<!\\)\|", r"\\|", text)


def _rows(declared: tuple[Declared, ...]) -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for d in declared:
        cells = (f"`{d.name}`", type_text(d), default_text(d), meaning_text(d))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _pending_rows(declared: tuple[Declared, ...]) -> str:
    lines = ["| key | accepted shape | counts as used when |", "|---|---|---|"]
    for d in declared:
        lines.append(f"| `{d.name}` | {_cell(type_text(d))} | {_cell(d.key.used_when)} |")
    return "\n".join(lines) + "\n"


def _sections(section: type[Section], path: str = "") -> dict[str, type[Section]]:
    """The sections under ``section`` by key path: keys of a section type, and lists of one (a key with a
    validator of its own, such as ``alert.rules``, is documented with what reads it)."""
    out: dict[str, type[Section]] = {}
    for d in section.declared():
        tp = d.type
        if get_origin(tp) is tuple and d.key.check is None:
            tp = get_args(tp)[0]
        if isinstance(tp, type) and issubclass(tp, Section):
            name = f"{path}{d.name}"
            out[name] = tp
            out.update(_sections(tp, f"{name}."))
    return out


def tables(schema: type[MonitorConfig] = MonitorConfig) -> dict[str, str]:
    """Every key table of the docs, by block name."""
    sections = _sections(schema)
    groups: dict[str, list[Declared]] = {}
    for d in schema.declared():
        if d.name in sections and not d.key.group:
            continue  # a section with a table of its own
        if not d.key.group:
            raise ValueError(f"config key {d.name}: declare the docs table it is listed in (group=...)")
        groups.setdefault(d.key.group, []).append(d)
    out = {group: _rows(tuple(declared)) for group, declared in groups.items()}
    out.update({name: _rows(section.declared()) for name, section in sections.items()})
    out["pending"] = _pending_rows(schema.PENDING.declared())
    return out


def update_docs(text: str, schema: type[MonitorConfig] = MonitorConfig) -> str:
    """``text`` (docs/config.md) with every key table rewritten. Raises ValueError for a table the text has
    no place for, or a place that names no table."""
    generated = tables(schema)
    found = [m.group("name") for m in _BLOCK.finditer(text)]
    missing = sorted(set(generated) - set(found))
    unknown = sorted(set(found) - set(generated))
    if missing or unknown:
        raise ValueError(
            f"key tables without a place in the docs: {missing}; places that name no table: {unknown} "
            "(a place is <!-- keys: NAME --> ... <!-- /keys -->)"
        )
    return _BLOCK.sub(lambda m: m.group(1) + generated[m.group("name")] + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rewrite the key tables of docs/config.md")
    parser.add_argument("docs", type=Path, help="docs/config.md")
    parser.add_argument("--check", action="store_true", help="only report whether the tables are current")
    args = parser.parse_args(argv)
    text = args.docs.read_text(encoding="utf-8")
    fresh = update_docs(text)
    if args.check:
        if fresh != text:
            print(f"{args.docs}: the key tables are out of date; run python -m trainmon.config.reference")
            return 1
        return 0
    if fresh != text:
        args.docs.write_text(fresh, encoding="utf-8")
        print(f"{args.docs}: key tables rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
