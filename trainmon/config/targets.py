"""Which modules and parameters a config's ``targets`` select, and the optional name shortening.

A target pattern is one of

* an exact name: ``layers.0.mlp``;
* a glob, when it contains any of ``*?[``: ``layers.*.mlp`` (``fnmatchcase`` on the whole name, so
  ``*`` also crosses dots);
* a regular expression after ``re:``: ``re:layers\\.(0|1)\\.mlp`` (``re.fullmatch``).

Any of them may start with msprobe's model-chunk prefix ``"<int>:"`` (``"1:layers.0"``), which limits the
pattern to that virtual-pipeline chunk; without it the pattern applies to every chunk.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainmon.config import MonitorConfig

__all__ = [
    "SQUASH_ANCHORS",
    "TargetMatcher",
    "TargetPattern",
    "Unmatched",
    "parse_target",
    "squash_name",
    "unmatched_targets",
]

_CHUNK_PREFIX = re.compile(r"(\d+):(.*)", re.DOTALL)
_GLOB_CHARS = frozenset("*?[")
_REGEX_PREFIX = "re:"


@dataclass(frozen=True)
class TargetPattern:
    """One parsed target. ``regex`` is None for exact names."""

    text: str
    chunk: int | None
    body: str
    kind: str  # "exact", "glob" or "regex"
    regex: re.Pattern[str] | None = None

    def matches(self, name: str) -> bool:
        if self.regex is None:
            return name == self.body
        return self.regex.fullmatch(name) is not None


def parse_target(text: str) -> TargetPattern:
    """Parse one pattern; raises ValueError with a readable reason when it cannot be compiled."""
    if not isinstance(text, str):
        raise ValueError(f"a target must be a string, got {type(text).__name__}")
    chunk: int | None = None
    body = text
    m = _CHUNK_PREFIX.fullmatch(text)
    if m:
        chunk, body = int(m.group(1)), m.group(2)
    if body.startswith(_REGEX_PREFIX):
        expr = body[len(_REGEX_PREFIX) :]
        try:
            return TargetPattern(text, chunk, expr, "regex", re.compile(expr))
        except re.error as e:
            raise ValueError(f"invalid regular expression {expr!r}: {e}") from None
    if _GLOB_CHARS.intersection(body):
        try:
            return TargetPattern(text, chunk, body, "glob", re.compile(fnmatch.translate(body)))
        except re.error as e:  # e.g. an unclosed "[" that fnmatch passes through
            raise ValueError(f"invalid glob {body!r}: {e}") from None
    return TargetPattern(text, chunk, body, "exact")


class _Group:
    """Patterns that share a chunk scope: exact names in a set, the rest compiled."""

    __slots__ = ("exact", "regexes")

    def __init__(self) -> None:
        self.exact: set[str] = set()
        self.regexes: list[re.Pattern[str]] = []

    def add(self, p: TargetPattern) -> None:
        if p.regex is None:
            self.exact.add(p.body)
        else:
            self.regexes.append(p.regex)

    def matches(self, name: str) -> bool:
        return name in self.exact or any(r.fullmatch(name) for r in self.regexes)


class TargetMatcher:
    """Selects modules and parameters by the config's target patterns.

    ``all_modules`` makes :meth:`match_module` accept every module (msprobe's ``all_xy``, or
    ``xy_distribution`` with no targets); use :meth:`from_config` to get it right.
    """

    def __init__(self, targets: Iterable[str] = (), *, all_modules: bool = False) -> None:
        self.patterns: tuple[TargetPattern, ...] = tuple(parse_target(t) for t in targets)
        self.all_modules = all_modules
        self._any_chunk = _Group()
        self._by_chunk: dict[int, _Group] = {}
        for p in self.patterns:
            group = self._any_chunk if p.chunk is None else self._by_chunk.setdefault(p.chunk, _Group())
            group.add(p)

    @classmethod
    def from_config(cls, config: MonitorConfig) -> TargetMatcher:
        return cls(config.targets, all_modules=config.monitor_all_modules)

    def __repr__(self) -> str:
        texts = [p.text for p in self.patterns]
        return f"TargetMatcher({texts!r}, all_modules={self.all_modules})"

    def _matches(self, name: str, chunk: int) -> bool:
        if self._any_chunk.matches(name):
            return True
        group = self._by_chunk.get(chunk)
        return group is not None and group.matches(name)

    def match_module(self, name: str, chunk: int = 0) -> bool:
        """True when a pattern matches the module's full name (``named_modules()`` spelling)."""
        return self.all_modules or self._matches(name, chunk)

    def match_param(self, name: str, chunk: int = 0) -> bool:
        """True when there are no targets, or a pattern matches the parameter's name or the name of a
        module that owns it (a prefix ending at a dot): ``layers.1`` selects ``layers.1.mlp.bias`` but
        not ``layers.10.weight``."""
        if not self.patterns:
            return True
        return any(self._matches(prefix, chunk) for prefix in _owner_names(name))


@dataclass(frozen=True)
class Unmatched:
    """A target that selects nothing, and the model's names closest to it (best first; may be empty)."""

    target: str
    closest: tuple[str, ...]


def unmatched_targets(
    patterns: Iterable[TargetPattern], names_by_chunk: Sequence[Collection[str]], n: int = 3
) -> list[Unmatched]:
    """The patterns that match none of ``names_by_chunk[c]`` (chunk ``c``'s module and parameter names: what
    :meth:`TargetMatcher.match_module` and :meth:`~TargetMatcher.match_param` test), each with up to ``n``
    close names, taken from the chunk the pattern is limited to (every chunk when it names none that exists).
    """
    found = []
    for p in patterns:
        chunks = range(len(names_by_chunk)) if p.chunk is None else [p.chunk]
        chunks = [c for c in chunks if 0 <= c < len(names_by_chunk)]
        if any(p.matches(name) for c in chunks for name in names_by_chunk[c]):
            continue
        # compare the pattern's text with names: a misspelt glob or regex is still close to what it meant
        pool = chunks or range(len(names_by_chunk))
        candidates = sorted({name for c in pool for name in names_by_chunk[c] if name})
        wrapped = _under_a_wrapper(p, candidates, n)
        close = [c for c in difflib.get_close_matches(p.body, candidates, n=n) if c not in wrapped]
        found.append(Unmatched(p.text, tuple([*wrapped, *close][:n])))
    return found


def _under_a_wrapper(pattern: TargetPattern, candidates: Sequence[str], n: int) -> list[str]:
    """Up to ``n`` names (shortest first) the pattern matches once their first components are dropped: the
    model is wrapped (DDP's ``module.``, Megatron's ``module.module.``) and the target names the inner
    model's module, so ``0`` means ``module.0``."""
    found: list[str] = []
    for name in sorted(candidates, key=lambda s: (len(s), s)):
        parts = name.split(".")
        if any(pattern.matches(".".join(parts[i:])) for i in range(1, len(parts))):
            found.append(name)
            if len(found) == n:
                break
    return found


def _owner_names(name: str) -> Iterator[str]:
    # "" is the root module: the target "" (msprobe's spelling of "everything") owns every parameter.
    yield ""
    start = 0
    while (dot := name.find(".", start)) != -1:
        yield name[:dot]
        start = dot + 1
    yield name


# Name segments where the informative part of a Megatron / HF parameter or module name starts.
# Everything before the first of them (DDP / Float16Module wrappers, "language_model.encoder.") goes.
SQUASH_ANCHORS: tuple[str, ...] = (
    "layers",
    "embedding",
    "embeddings",
    "embed_tokens",
    "final_layernorm",
    "final_layer_norm",
    "final_norm",
    "output_layer",
    "lm_head",
)
_SQUASH = re.compile(r"(?:^|(?<=\.))(?:" + "|".join(map(re.escape, SQUASH_ANCHORS)) + r")(?=\.|$)")


def squash_name(name: str) -> str:
    """Shorten a long name to the part starting at the first anchor segment (see ``SQUASH_ANCHORS``):
    ``module.module.decoder.layers.3.mlp.linear_fc1.weight`` -> ``layers.3.mlp.linear_fc1.weight``.
    A ``"<chunk>:"`` prefix is kept. Names without an anchor are returned unchanged."""
    prefix = ""
    m = _CHUNK_PREFIX.fullmatch(name)
    if m:
        prefix, name = f"{m.group(1)}:", m.group(2)
    found = _SQUASH.search(name)
    return prefix + (name[found.start() :] if found else name)
