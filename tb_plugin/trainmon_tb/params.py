"""Query parameters of the plugin's routes. A bad value raises :class:`BadRequest` naming the parameter and
what it accepts; the plugin turns it into a 400 answer."""

from __future__ import annotations

from collections.abc import Collection, Mapping


class BadRequest(ValueError):
    """HTTP 400."""


class NotFound(LookupError):
    """HTTP 404."""


class Forbidden(PermissionError):
    """HTTP 403."""


def text(args: Mapping[str, str], name: str, default: str | None = None, max_len: int = 4096) -> str | None:
    value = args.get(name)
    if value is None or value == "":
        return default
    if len(value) > max_len:
        raise BadRequest(f"parameter {name!r}: longer than {max_len} characters")
    return value


def required(args: Mapping[str, str], name: str) -> str:
    value = text(args, name)
    if value is None:
        raise BadRequest(f"parameter {name!r} is required")
    return value


def integer(
    args: Mapping[str, str],
    name: str,
    default: int | None = None,
    lo: int | None = None,
    hi: int | None = None,
) -> int | None:
    raw = text(args, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"parameter {name!r}: expected an integer, got {raw!r}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"{'-inf' if lo is None else lo}..{'inf' if hi is None else hi}"
        raise BadRequest(f"parameter {name!r}: {value} is outside {bounds}")
    return value


def choice(args: Mapping[str, str], name: str, allowed: Collection[str], default: str | None = None) -> str:
    value = text(args, name, default)
    if value is None:
        raise BadRequest(f"parameter {name!r} is required (one of: {', '.join(allowed)})")
    if value not in allowed:
        raise BadRequest(f"parameter {name!r}: {value!r} is not one of: {', '.join(allowed)}")
    return value


def names(args: Mapping[str, str], name: str) -> list[str] | None:
    """A comma-separated list; None when absent (no filter)."""
    raw = text(args, name)
    if raw is None:
        return None
    return [x.strip() for x in raw.split(",") if x.strip()]


def integers(args: Mapping[str, str], name: str, lo: int = 0, max_count: int = 1 << 20) -> list[int] | None:
    """Comma-separated integers or inclusive ranges ``a-b`` (a timeline row of a group of ranks), each at
    least ``lo``; None when absent (no filter)."""
    items = names(args, name)
    if items is None:
        return None
    values: list[int] = []
    try:
        for x in items:
            a, sep, b = x.partition("-")
            if sep and a.strip():
                first, last = int(a), int(b)
                if last < first or last - first >= max_count:
                    raise ValueError(x)
                values.extend(range(first, last + 1))
            else:
                values.append(int(x))
            if len(values) > max_count:
                raise ValueError(x)
    except ValueError:
        raise BadRequest(
            f"parameter {name!r}: expected comma-separated integers or ranges a-b, got {args.get(name)!r}"
        ) from None
    if any(v < lo for v in values):
        raise BadRequest(f"parameter {name!r}: values must be >= {lo}, got {args.get(name)!r}")
    return values
