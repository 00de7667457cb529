"""Compile every Triton kernel of trainmon ahead of time for NVIDIA GPUs, on a machine without one.

Triton's interpreter (how the tests run the kernels on the CPU) accepts code that the GPU compiler rejects;
this compiles each kernel, with every dtype variant the host side launches, to a cubin for sm_90 (Hopper)
and sm_80 (Ampere), with the Triton that imports (put another version's folder first on PYTHONPATH to
check it: bench/triton_versions.sh does). Works with Triton 3.2 through 3.9: 3.2 names the compile-time
constants ``constants=`` and reads the signature by position, later versions ``constexprs=`` by name.

    python bench/triton_aot.py                  # prints "compiled 82" when every kernel compiles
    python bench/triton_aot.py --dump ptx/      # also writes each kernel's PTX (to diff two versions)
    python bench/triton_aot.py --arch 90 --only stats_table --loads   # each kernel's global loads, by width

Run it without TRITON_INTERPRET (this script clears it before importing Triton).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import itertools
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # an interpreted kernel has nothing to compile
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what the launches ask for (enable_fp_fusion)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from trainmon.stats import triton_kernels as k  # noqa: E402

# the launches' tiling (trainmon.stats.triton_path.Tiling) and warps
TILE = {"BLOCK": 2048, "CHUNK": 65536}
WARPS = {"finalize": 4, "gather_table": 4, "signs_table": 4}  # others: Tiling.warps (8)
_NAMED_CONSTEXPRS = "constexprs" in inspect.signature(triton.compiler.ASTSource.__init__).parameters


def source(fn, signature: dict[str, str], constexprs: dict[str, object]):
    """An ASTSource for ``fn`` on any supported Triton: the signature in the kernel's argument order (3.2
    reads it by position), compile-time constants under the keyword this version takes."""
    order = [name for name in fn.arg_names if name in signature]
    if len(order) != len(signature):
        raise KeyError(f"{fn.__name__}: not arguments of the kernel: {set(signature) - set(order)}")
    if _NAMED_CONSTEXPRS:
        sig = {name: signature[name] for name in order} | {name: "constexpr" for name in constexprs}
        return triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compiler.ASTSource(
        fn=fn, signature={name: signature[name] for name in order}, constants=constexprs
    )


def variants(arch: int):
    """(name, kernel, signature, constexprs) of every launch the host side makes, with its integer arguments
    as i32 and as i64 (a launch types a Python int by its value: i32 below 2**31). sm_80 gets the fp32
    variants only: what differs between dtypes is the same code for every architecture."""
    kinds = (("fp32", tl.float32, False), ("fp16", tl.float16, False), ("i16", tl.int16, True))
    for (name, dtype, bf16), i in itertools.product(kinds if arch == 90 else kinds[:1], ("i32", "i64")):
        ptr = "*" + name
        label = f"{name}_{i}"
        table = {"tab_ptr": "*i64", "ntensors": i}
        part = {"part_ptr": "*fp64", "first_row": i}
        # each with the base kernels and the fast variants (Tiling(kernel="fast")), the latter with the most
        # loads in flight the sweep tries
        for suffix, tile in (("", TILE), ("_fast", {**TILE, "UNROLL": 4})):
            yield (
                f"stats_one{suffix}_{label}",
                getattr(k, "stats_one" + suffix),
                {"x_ptr": ptr, "n": i, **part, "zero_hi": "fp32"},
                {"BF16": bf16, **tile},
            )
            yield (
                f"stats_table{suffix}_{label}",
                getattr(k, "stats_table" + suffix),
                {**table, **part, "zero_hi": "fp32"},
                {"DTYPE": dtype, "BF16": bf16, **tile},
            )
            yield (
                f"adam_table{suffix}_{label}",
                getattr(k, "adam_table" + suffix),
                {**table, "ftab_ptr": "*fp32", "nblocks": i, **part, "zero_hi": "fp32"},
                {"DTYPE": dtype, "BF16": bf16, **tile},
            )
        yield (
            f"bins_table_{label}",
            k.bins_table,
            {**table, "bounds_ptr": "*fp32", **part},
            {"NB": 3, "NBP": 4, "DTYPE": dtype, "BF16": bf16, **TILE},
        )
        yield (
            f"gather_table_{label}",
            k.gather_table,
            {**table, "pos_ptr": "*i64", "out_ptr": "*fp32"},
            {"DTYPE": dtype, "BF16": bf16, "BLOCK": 256},
        )
        yield (
            f"signs_table_{label}",
            k.signs_table,
            {**table, "out_ptr": "*u8"},
            {"DTYPE": dtype, "BF16": bf16, "BYTES": 256},
        )
    for i in ("i32", "i64"):  # every dtype in one kernel, told apart at run time
        yield (
            f"stats_batch_{i}",
            k.stats_batch,
            {"tab_ptr": "*i64", "ntensors": i, "part_ptr": "*fp64", "first_row": i}
            | {"zero_f32": "fp32", "zero_f16": "fp32", "zero_bf16": "fp32"},
            TILE,
        )
        yield (
            f"stats_batch_fast_{i}",
            k.stats_batch_fast,
            {"tab_ptr": "*i64", "ntensors": i, "part_ptr": "*fp64", "first_row": i}
            | {"zero_f32": "fp32", "zero_f16": "fp32", "zero_bf16": "fp32"},
            {**TILE, "UNROLL": 4},
        )
    yield "finalize", k.finalize, {"desc_ptr": "*i64", "part_ptr": "*fp64", "out_ptr": "*fp64"}, {"ROWS": 128}


def instructions(ptx: str) -> str:
    """The PTX without comments, source locations and debug sections: what two builds are compared on."""
    body = ptx.split(".section", 1)[0]
    lines = (re.sub(r"//.*", "", line).rstrip() for line in body.splitlines())
    return "\n".join(line for line in lines if line and not line.lstrip().startswith((".loc", ".file")))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--dump", type=Path, help="write <kernel>_sm<arch>.ptx (instructions only) here")
    parser.add_argument("--only", nargs="+", default=(), help="the variants whose label starts so")
    parser.add_argument(
        "--loads",
        action="store_true",
        help="print each kernel's global loads by width (ld.global.v4: 16 bytes)",
    )
    args = parser.parse_args()
    done = 0
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        for label, fn, signature, constexprs in variants(arch):
            if args.only and not label.startswith(tuple(args.only)):
                continue
            warps = WARPS.get(fn.__name__, 8)
            try:
                compiled = triton.compiler.compile(
                    source(fn, signature, constexprs), target=target, options={"num_warps": warps}
                )
            except Exception as error:
                raise SystemExit(
                    f"triton {triton.__version__}: {label} for sm_{arch} failed:\n{error}"
                ) from error
            if args.loads:
                loads = collections.Counter(re.findall(r"ld\.global(?:\.\w+)*", compiled.asm["ptx"]))
                print(f"{label} sm_{arch}: " + ", ".join(f"{k} {v}" for k, v in sorted(loads.items())))
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{label}_sm{arch}.ptx").write_text(instructions(compiled.asm["ptx"]))
            done += 1
    print(f"triton {triton.__version__}: sm_{', sm_'.join(map(str, args.arch))}")
    print("compiled", done)


if __name__ == "__main__":
    main()
