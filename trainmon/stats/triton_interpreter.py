"""Triton's interpreter (``TRITON_INTERPRET=1``: the kernels on CPU tensors, as CI and the CPU dry runs run
them) without its repeated set-up inside a launch.

A launch under the interpreter first patches the language modules (``triton.language``, its ``core``) that
its kernel's module sees, then runs the kernel once per program. Every call of a ``@triton.jit`` function
inside the kernel (the kernels' helpers, and ``tl.zeros`` and the like, which Triton writes as such functions)
patches the modules its own module sees again (Triton 3.2 to 3.9 alike): ``inspect.getmembers`` over them,
about 160 us a call, which changes nothing once the launch has patched those modules already. The kernels
here call helpers once per block, so that set-up was half of an interpreted step (a one-layer GPT at full
coverage: 2.05 s a step, 1.05 s without it).

:func:`skip_repatching` makes such a call skip the patching when every language module it would patch was
patched earlier in the same launch: the same code runs against the same patched language, so every result
is the same (``tests/test_stats_triton.py`` compares the two). A call outside a launch, or one that sees a
module not patched yet, is left as Triton does it, and so is a Triton whose interpreter is laid out
otherwise. ``triton_path.kernels()`` installs it when it loads the kernels under the interpreter.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_MARK = "_trainmon_skips_repatching"


class _Launch(threading.local):
    """The launch running on this thread, if any: the language modules it patched (by id) and the globals of
    the functions whose calls need no patching, as their modules are among them."""

    running = False
    patched: frozenset[int] = frozenset()
    covered: frozenset[int] = frozenset()


def skip_repatching() -> bool:
    """Install the skip into Triton's interpreter (once per process); False where its layout is not the one
    this knows (nothing changed then)."""
    try:
        from triton.runtime import interpreter
    except Exception:  # no Triton, or one that fails to import: nothing to change
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    language = getattr(interpreter, "tl", None)
    core = getattr(language, "core", None)
    if not callable(patch_lang) or executor is None or core is None:
        return False
    if getattr(patch_lang, _MARK, False):
        return True
    launch = _Launch()
    run_launch = executor.__call__

    def languages(fn: Any) -> frozenset[int]:
        """What Triton's ``_patch_lang(fn)`` patches: the language modules among ``fn``'s globals."""
        return frozenset(id(value) for value in fn.__globals__.values() if value is language or value is core)

    @functools.wraps(patch_lang)
    def patch_once(fn: Any) -> Any:
        if not launch.running:
            return patch_lang(fn)
        where = id(fn.__globals__)
        if where in launch.covered:
            return None  # a call inside the kernel: its callers ignore what this returns
        needed = languages(fn)
        if needed and needed <= launch.patched:  # none: Triton's own call says what is wrong
            launch.covered = launch.covered | {where}
            return None
        scope = patch_lang(fn)  # the launch's own patching, or a module it did not see
        launch.patched = launch.patched | needed
        return scope

    @functools.wraps(run_launch)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = launch.running, launch.patched, launch.covered
        launch.running, launch.patched, launch.covered = True, frozenset(), frozenset()
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            launch.running, launch.patched, launch.covered = outer

    setattr(patch_once, _MARK, True)
    interpreter._patch_lang = patch_once
    executor.__call__ = run
    return True
