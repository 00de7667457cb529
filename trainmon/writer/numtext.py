"""Number text for the CSV writer, for a whole step at once: the shortest text that reads back as the same
float32, and integers.

Per-element formatting in Python (``repr``, numpy's Dragon4) costs 0.4-1.5 us a value, more than the
writer's whole budget (>= 1M values/s). Here the digits are found with array arithmetic: for each value
the shortest ``p`` (1..9 significant digits) whose correctly rounded decimal ``n * 10**-k`` converts back
to the same float32 (``np.float32(float(text)) == value``); the text is then assembled byte by byte from a
table of character patterns, one per (sign, digits, exponent) shape, and the exact layout Python's
``repr`` gives that decimal (``0.0014557711``, ``3.6e-15``, ``100.0``, ``-0.0``, ``nan``, ``-inf``).

Values a float32 cannot hold (finite float64 beyond its range, or non-zero below its smallest subnormal)
keep their float64 value: their text is Python's ``repr``. So do the rare ones whose scale ``10**k`` is not
exact in float64 (|k| > 22: magnitudes below about 1e-14 or above 1e30), where the array arithmetic might
land on a neighbouring decimal: they are done per element with Python's correctly rounded formatting.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Decimals", "Renderer", "float32_decimals", "int_decimals", "merge"]

# Styles of a cell.
FLOAT, INT, NAN, INF, ZERO = 0, 1, 2, 3, 4

_EXACT_POW10 = 22  # 10**m is exact in float64 up to here
_P10 = np.array([float(10**m) for m in range(64)])  # correctly rounded
_P10_INT = np.array([10**m for m in range(19)], dtype=np.int64)
_SCI_BELOW, _SCI_FROM = -4, 16  # repr's switch to exponent notation: e < -4 or e >= 16

# Source columns of one cell: its digits right-aligned in 0.._NDIG-1, then fixed characters and the
# exponent's sign and three digits. A pattern is the list of source columns that spell the cell.
_NDIG = 20
_C_ZERO, _C_DOT, _C_MINUS, _C_E, _C_ESIGN, _C_EXP = 20, 21, 22, 23, 24, 25  # _C_EXP.._C_EXP+2
_C_N, _C_A, _C_I, _C_F, _C_COMMA, _C_NL = 28, 29, 30, 31, 32, 33
_SRC = 34
_FIXED = {
    _C_ZERO: "0",
    _C_DOT: ".",
    _C_MINUS: "-",
    _C_E: "e",
    _C_N: "n",
    _C_A: "a",
    _C_I: "i",
    _C_F: "f",
    _C_COMMA: ",",
    _C_NL: "\n",
}
_MAXP = _NDIG - 1  # digits a pattern has room for (int64 counts have at most 19)
_NPOS = _SCI_FROM - _SCI_BELOW  # positional exponents -4..15
_STRIDE = _NPOS + 3  # per (sign, digits): the positional shapes, 2 exponent widths, the integer


class Decimals(NamedTuple):
    """Cells as decimals: ``(-1)**neg * n * 10**(e - p + 1)`` with ``p`` digits in ``n``; ``style``
    FLOAT (written like ``repr``), INT (``%d``), or NAN / INF / ZERO (sign from ``neg``)."""

    neg: np.ndarray  # bool
    n: np.ndarray  # int64
    p: np.ndarray  # int64, >= 1
    e: np.ndarray  # int64
    style: np.ndarray  # int8


def _patterns() -> tuple[np.ndarray, np.ndarray, int]:
    pats: list[list[int]] = []
    for neg in (0, 1):
        sign = [_C_MINUS] if neg else []
        for p in range(1, _MAXP + 1):
            digits = [_NDIG - p + j for j in range(p)]
            for e in range(_SCI_BELOW, _SCI_FROM):
                lead = max(0, -e)  # zeros before the digits: "0.000" for e = -4
                point = max(e + 1, 1)
                trail = e + 2 - p if e >= 0 and p <= e + 1 else 0  # "1200.0"
                g = [_C_ZERO] * lead + digits + [_C_ZERO] * trail
                pats.append(sign + g[:point] + [_C_DOT] + g[point:])
            mantissa = sign + digits[:1] + ([_C_DOT, *digits[1:]] if p > 1 else [])
            for width in (2, 3):
                pats.append(mantissa + [_C_E, _C_ESIGN] + list(range(_C_EXP + 3 - width, _C_EXP + 3)))
            pats.append(sign + digits)
    specials = len(pats)
    pats += [
        [_C_N, _C_A, _C_N],
        [_C_N, _C_A, _C_N],
        [_C_I, _C_N, _C_F],
        [_C_MINUS, _C_I, _C_N, _C_F],
        [_C_ZERO, _C_DOT, _C_ZERO],
        [_C_MINUS, _C_ZERO, _C_DOT, _C_ZERO],
    ]
    width = max(map(len, pats)) + 1
    # Each pattern twice: followed by a comma (a cell inside a row) or by a newline (a row's last cell).
    table = np.zeros((2 * len(pats), width), dtype=np.intp)
    lens = np.zeros(2 * len(pats), dtype=np.int64)
    for i, pat in enumerate(pats):
        for j, end in enumerate((_C_COMMA, _C_NL)):
            table[2 * i + j, : len(pat) + 1] = [*pat, end]
            lens[2 * i + j] = len(pat) + 1
    return table, lens, specials


_PAT, _PAT_LEN, _SPECIALS = _patterns()
_COLUMN = np.arange(_PAT.shape[1])
_FIXED_ROW = np.zeros(_SRC, dtype=np.uint8)
for _col, _ch in _FIXED.items():
    _FIXED_ROW[_col] = ord(_ch)
# Four ASCII digits of 0..9999, for turning integers into digits without one division per digit.
_QUAD = np.array([list(f"{i:04d}".encode()) for i in range(10000)], dtype=np.uint8)


def _digit_count(n: np.ndarray) -> np.ndarray:
    return np.maximum(np.searchsorted(_P10_INT, n, side="right"), 1)


def _parse(text: str) -> tuple[int, int, int]:
    """(n, p, e) of a decimal text such as ``-1.25e-05`` or ``0.0012``: digits without trailing zeros."""
    mantissa, _, exp = text.lstrip("-").partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = whole + frac
    stripped = digits.lstrip("0")
    if not stripped:
        return 0, 1, 0
    e = len(whole) - 1 + int(exp or 0) - (len(digits) - len(stripped))
    stripped = stripped.rstrip("0")
    return int(stripped), len(stripped), e


def _python_decimal(value: float, as_float32: bool) -> tuple[int, int, int]:
    """One element the arrays cannot do exactly: Python's correctly rounded conversions."""
    if not as_float32:
        return _parse(repr(value))
    value = abs(value)
    target = np.float32(value)
    for p in range(1, 18):
        nearest = f"{value:.{p - 1}e}"
        mantissa, _, exp = nearest.partition("e")
        # At a power of two the float32 above is twice as far as the one below: the p-digit decimal just
        # above the value may read back when the nearest (below) does not.
        above = f"{int(mantissa.replace('.', '')) + 1}e{int(exp) - (p - 1)}"
        for text in (nearest, above):
            with np.errstate(over="ignore"):  # a rounded-up text beyond float32's range reads as inf
                if np.float32(float(text)) == target:
                    return _parse(text)
    return _parse(repr(value))  # unreachable: 9 digits always do


def _scaled(a: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``n = rint(a * 10**k)`` and the float64 nearest to ``n * 10**-k`` (exact scale for |k| <= 22)."""
    s = _P10[np.abs(k)]
    down = k < 0
    if not down.any():
        n = np.rint(a * s)
        return n, n / s
    n = np.rint(np.where(down, a / s, a * s))
    return n, np.where(down, n * s, n / s)


def _unscaled(n: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``n`` and the float64 nearest to ``n * 10**-k`` (exact scale for |k| <= 22)."""
    s = _P10[np.abs(k)]
    return n, np.where(k < 0, n * s, n / s)


def float32_decimals(values: np.ndarray) -> Decimals:
    """The shortest decimal of each value's float32 (see the module docstring)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        x32 = x.astype(np.float32)
    v = x32.astype(np.float64)
    neg = np.signbit(x)
    style = np.full(x.size, FLOAT, dtype=np.int8)
    style[np.isnan(x)] = NAN
    style[np.isinf(x)] = INF
    style[x == 0] = ZERO
    finite = np.isfinite(v) & (v != 0)
    wide = np.flatnonzero((style == FLOAT) & ~finite)  # float32 cannot hold it: keep the float64
    n_out = np.zeros(x.size, dtype=np.int64)
    k_out = np.zeros(x.size, dtype=np.int64)
    idx = np.flatnonzero(finite)
    if idx.size:
        a = np.abs(v[idx])
        t = np.abs(x32[idx])
        e = np.floor(np.log10(a)).astype(np.int64)
        n_best = np.zeros(idx.size)
        k_best = np.full(idx.size, 1 << 20, dtype=np.int64)  # "not found" until a trial passes
        # A power of two has a float32 neighbour below at half the distance of the one above, so the
        # nearest p-digit decimal (below it) may miss while the one just above reads back.
        pow2 = (t.view(np.uint32) & 0x7FFFFF) == 0

        def trial(sel: np.ndarray, p: int) -> np.ndarray:
            """Which of ``sel`` read back from ``p`` digits; those get them as their decimal."""
            k = p - 1 - e[sel]
            n, r = _scaled(a[sel], k)
            ok = r.astype(np.float32) == t[sel]
            retry = np.flatnonzero(~ok & pow2[sel])
            if retry.size:
                n_up, r_up = _unscaled(n[retry] + 1, k[retry])
                hit = r_up.astype(np.float32) == t[sel[retry]]
                n[retry[hit]] = n_up[hit]
                ok[retry[hit]] = True
            n_best[sel[ok]] = n[ok]
            k_best[sel[ok]] = k[ok]
            return ok

        # Most float32 values need 8 or 9 digits: try 8, then 9 where 8 fails, or 7, 6, ... while it passes.
        everyone = np.arange(idx.size)
        ok = trial(everyone, 8)
        trial(everyone[~ok], 9)
        shorter = everyone[ok]
        for p in range(7, 0, -1):
            if not shorter.size:
                break
            shorter = shorter[trial(shorter, p)]
        far = np.flatnonzero(np.abs(k_best) > _EXACT_POW10)
        n_int = n_best.astype(np.int64)
        for j in far.tolist():
            nj, pj, ej = _python_decimal(float(v[idx[j]]), True)
            n_int[j] = nj
            k_best[j] = pj - 1 - ej
        # A decimal with trailing zeros is a shorter one: drop them (and a carry such as 9.99 -> 10.0).
        while True:
            z = np.flatnonzero(n_int % 10 == 0)
            if not z.size:
                break
            n_int[z] //= 10
            k_best[z] -= 1
        n_out[idx] = n_int
        k_out[idx] = k_best
    p_out = _digit_count(n_out)
    e_out = p_out - 1 - k_out
    for j in wide.tolist():
        n_out[j], p_out[j], e_out[j] = _python_decimal(float(x[j]), False)
    return Decimals(neg, n_out, p_out, e_out, style)


def int_decimals(values: np.ndarray) -> Decimals:
    """Integers written like ``%d`` (truncated); non-finite values as ``nan``/``inf``/``-inf``."""
    x = np.asarray(values, dtype=np.float64).ravel()
    style = np.full(x.size, INT, dtype=np.int8)
    style[np.isnan(x)] = NAN
    style[np.isinf(x)] = INF
    finite = style == INT
    n = np.zeros(x.size, dtype=np.int64)
    n[finite] = np.abs(np.trunc(x[finite]))
    neg = np.signbit(x) & (n != 0) | (style == INF) & (x < 0)
    return Decimals(neg, n, _digit_count(n), np.zeros(x.size, dtype=np.int64), style)


def merge(parts: list[tuple[Decimals, np.ndarray]], size: int) -> Decimals:
    """Cells of several kinds (each with the flat positions it fills) as one :class:`Decimals`."""
    out = Decimals(
        np.zeros(size, dtype=bool),
        np.zeros(size, dtype=np.int64),
        np.ones(size, dtype=np.int64),
        np.zeros(size, dtype=np.int64),
        np.zeros(size, dtype=np.int8),
    )
    for dec, where in parts:
        for dst, src in zip(out, dec, strict=True):
            dst[where] = src
    return out


class Renderer:
    """Renders :class:`Decimals` as rows of text, reusing its scratch arrays from call to call.

    A step's scratch (about 1 MB for 7000 cells) is above glibc's mmap threshold: allocated afresh each
    step, its page faults cost as much as the rendering itself. One renderer per sink (not shared between
    threads)."""

    def __init__(self) -> None:
        self._size = -1
        self._src = np.empty((0, _SRC), dtype=np.uint8)
        self._gather = np.empty((0, _PAT.shape[1]), dtype=np.intp)
        self._chars = np.empty((0, _PAT.shape[1]), dtype=np.uint8)
        self._offsets = np.empty((0, 1), dtype=np.intp)

    def _scratch(self, size: int) -> None:
        if size > self._src.shape[0]:
            self._src = np.empty((size, _SRC), dtype=np.uint8)
            self._gather = np.empty((size, _PAT.shape[1]), dtype=np.intp)
            self._chars = np.empty((size, _PAT.shape[1]), dtype=np.uint8)
            self._offsets = (np.arange(size, dtype=np.intp) * _SRC)[:, None]

    def rows(self, dec: Decimals, columns: int) -> list[str]:
        """The cells of each row, ``","``-joined: one string per row (cells in row-major order)."""
        size = dec.n.size
        if size == 0:
            return []
        self._scratch(size)
        neg = dec.neg.astype(np.int64)
        p = np.minimum(dec.p, _MAXP)
        base = (neg * _MAXP + (p - 1)) * _STRIDE
        e = dec.e
        positional = (e >= _SCI_BELOW) & (e < _SCI_FROM)
        pid = np.where(positional, base + (e - _SCI_BELOW), base + _NPOS + (np.abs(e) >= 100))
        style = dec.style
        if (style != FLOAT).any():
            pid = np.where(style == INT, base + _NPOS + 2, pid)
            special = style >= NAN
            if special.any():
                code = _SPECIALS + 2 * (style.astype(np.int64) - NAN) + neg
                pid = np.where(special, code, pid)
        pid = 2 * pid
        pid[columns - 1 :: columns] += 1  # the row's last cell ends with a newline
        lengths = _PAT_LEN[pid]

        src = self._src[:size]
        src[:] = _FIXED_ROW
        quads = (int(p.max()) + 3) // 4
        rest = dec.n
        for q in range(quads):
            lo = _NDIG - 4 * (q + 1)
            src[:, lo : lo + 4] = _QUAD[rest % 10000]
            rest = rest // 10000
        if not positional.all():
            ae = np.abs(e)
            src[:, _C_ESIGN] = np.where(e < 0, ord("-"), ord("+"))
            src[:, _C_EXP : _C_EXP + 3] = _QUAD[ae % 1000][:, 1:]

        gather = self._gather[:size]
        np.take(_PAT, pid, axis=0, out=gather)
        gather += self._offsets[:size]
        chars = self._chars[:size]
        np.take(self._src.ravel(), gather, out=chars)
        keep = _COLUMN[: chars.shape[1]] < lengths[:, None]
        text = chars[keep].tobytes().decode("ascii")
        return text.split("\n")[:-1]
