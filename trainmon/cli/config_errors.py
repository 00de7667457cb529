"""Every error of a config file at once, for ``trainmon config check``: the loader stops at the first error,
so the file is loaded again without the key that error names (a section's key, else the top-level key), until
it loads or nothing more can be taken out. Each error is the loader's own message; what is left after an
error's key is taken out is the user's config, so no error is made up."""

from __future__ import annotations

import copy
import re
from collections.abc import MutableMapping
from typing import Any

from trainmon.config import load_config
from trainmon.config.check import ConfigError
from trainmon.config.load import read_config_file

__all__ = ["every_error"]

MAX_ERRORS = 50
_TOKEN = re.compile(r"\[(?:'((?:[^'\\]|\\.)*)'|\"([^\"]*)\"|(\d+))\]|\.?(\w+)")


def _path(key: str | None) -> list[str | int]:
    """``alert.webhooks[0].kind`` -> ``["alert", "webhooks", 0, "kind"]``; ``targets['a b']`` too."""
    out: list[str | int] = []
    for quoted, double, index, name in _TOKEN.findall(key or ""):
        out.append(int(index) if index else quoted or double or name)
    return out


def _drop(raw: MutableMapping[Any, Any], key: str | None) -> bool:
    """Take the key an error names out of ``raw``: a key of a section (``alert.on_nan``), else the top-level
    key (``ops`` for ``ops[1]``). False when there is nothing to take out."""
    path = _path(key)
    if not path or path[0] not in raw:
        return False
    section = raw[path[0]]
    if len(path) > 1 and isinstance(section, MutableMapping) and path[1] in section:
        del section[path[1]]
    else:
        del raw[path[0]]
    return True


def every_error(file: str, first: ConfigError) -> list[ConfigError]:
    """``first`` (the loader's error for ``file``) and the errors after it, each once."""
    try:
        raw = copy.deepcopy(dict(read_config_file(file)))
    except ConfigError:  # not a config at all: its one error
        return [first]
    found, error = [first], first
    while len(found) < MAX_ERRORS and _drop(raw, error.key):
        try:
            load_config(raw)
            break
        except ConfigError as e:
            error = ConfigError(e.reason, key=e.key, file=file)
            if any(str(f) == str(error) for f in found):
                break
            found.append(error)
    return found
