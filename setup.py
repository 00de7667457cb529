"""Build of the optional native code; all project metadata lives in pyproject.toml.

``trainmon.stats._statskernel`` is plain C (CPython API only, no torch headers) and compiles in about a
second.
It selects SSE2/AVX2/AVX-512 code paths at import time from the CPU, so it is built without -march flags
and the same binary runs on any x86-64 machine. It links no OpenMP library: large calls run on the OpenMP
pool torch has loaded, looked up at run time. ``optional=True``: when no compiler is available the
install still succeeds and trainmon uses its torch implementation of the stats kernel.

``trainmon.step._fastrows`` is the step buffer's hot path for tensors that join a Triton batch (GPUs), also
plain C; without it the same work runs in Python.
"""

import sys

from setuptools import Extension, setup

if sys.platform == "win32":
    compile_args: list[str] = ["/O2"]
    link_args: list[str] = []
else:
    # -fno-math-errno lets sqrtf vectorise; IEEE semantics (NaN/Inf comparisons) are kept: no -ffast-math.
    compile_args = ["-O3", "-fno-math-errno", "-std=gnu11", "-Wno-psabi"]
    link_args = ["-ldl"] if sys.platform.startswith("linux") else []  # dlopen (in libc since glibc 2.34)

setup(
    ext_modules=[
        Extension(
            "trainmon.stats._statskernel",
            ["trainmon/stats/_statskernel.c"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        ),
        Extension(
            "trainmon.step._fastrows",
            ["trainmon/step/_fastrows.c"],
            extra_compile_args=[arg for arg in compile_args if arg != "-fno-math-errno"],
            optional=True,
        ),
    ]
)
