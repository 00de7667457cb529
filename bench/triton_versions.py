"""The Triton kernels on every Triton that CUDA builds of torch bring: compile and interpreter, per version.

For each version: the wheel is downloaded once into a cache folder (``$TRAINMON_TRITON_CACHE``, default
``~/.cache/trainmon-triton``: ``wheels/``, ~200-250 MB a version) and installed into its own folder there
(``site/<version>``, ~650 MB, never into the venv); then, with that folder first on PYTHONPATH (ahead of the
venv's Triton):

* **compile**: ``bench/triton_aot.py`` builds every kernel for sm_90 and sm_80 (no GPU needed);
* **interpreter**: the golden tests of the kernels under Triton's interpreter (tests/test_stats_triton.py,
  tests/test_stats.py and tests/test_triton_fallback.py, ``-k "triton and not compile"``) with the venv's
  torch and numpy;
* **digest**: ``bench/triton_digest.py``, the SHA-256 of every kernel's output on fixed inputs under the
  interpreter, compared with the venv's Triton (equal: bit-identical results).

Prints a markdown table (version x compile / interpreter / digest) and, with ``--record``, writes
``bench/triton_checked.json``: the kernels' source hash and each version's result, which the CI test
tests/test_triton_oldest.py reads to skip the oldest version's check while the kernels are unchanged.

    bench/triton_versions.sh                       # all versions (VERSIONS), about 2 minutes each
    bench/triton_versions.sh --versions 3.2.0 3.6.0 --record
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "trainmon" / "stats" / "triton_kernels.py"
RECORD = REPO / "bench" / "triton_checked.json"
# the Triton of torch 2.6, 2.7, 2.8, 2.9, 2.10/2.11, and the newest (constraints.txt pins it for the tests)
VERSIONS = ("3.2.0", "3.3.1", "3.4.0", "3.5.1", "3.6.0", "3.9.0")
OLDEST = VERSIONS[0]
INTERPRETER_TESTS = ("tests/test_stats_triton.py", "tests/test_stats.py", "tests/test_triton_fallback.py")


def cache_dir() -> Path:
    return Path(os.environ.get("TRAINMON_TRITON_CACHE", Path.home() / ".cache" / "trainmon-triton"))


def kernels_sha256() -> str:
    return hashlib.sha256(KERNELS.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Result:
    version: str
    compile: str  # "pass", or the error
    interpreter: str  # pytest's summary line
    interpreter_ok: bool
    digest: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.compile == "pass" and self.interpreter_ok


def install(version: str, cache: Path) -> Path:
    """The folder holding Triton ``version`` (installed there once, from a wheel downloaded once)."""
    site = cache / "site" / version
    if (site / "triton" / "__init__.py").exists():
        return site
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    if not list(wheels.glob(f"triton-{version}-*.whl")):
        _run(
            [
                *pip,
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(wheels),
                f"triton=={version}",
            ]
        )
    [wheel] = wheels.glob(f"triton-{version}-*.whl")
    partial = site.with_name(version + ".partial")
    _run([*pip, "install", "--quiet", "--no-deps", "--no-index", "--target", str(partial), str(wheel)])
    partial.rename(site)  # a folder that exists is complete
    return site


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv[:6])} ... failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


def environment(site: Path | None) -> dict[str, str]:
    """This process's environment with ``site`` (a Triton version) ahead of the repo and the venv."""
    paths = ([str(site)] if site else []) + [str(REPO), str(REPO / "tb_plugin")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def check(version: str, site: Path | None, timeout: float = 900) -> Result:
    """Compile, interpreter tests and digest with Triton from ``site`` (None: the venv's own)."""
    start = time.monotonic()
    env = environment(site)
    aot = subprocess.run(
        [sys.executable, str(REPO / "bench" / "triton_aot.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = aot.stdout.strip().splitlines()
    if aot.returncode == 0 and lines and lines[-1].startswith("compiled "):
        compiled = "pass"
    else:
        compiled = _last_line(aot.stderr or aot.stdout) or f"exit {aot.returncode}"
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton and not compile"]
        + list(INTERPRETER_TESTS),
        env={**env, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )
    counts = [part for part in _last_line(tests.stdout).strip("= ").split(", ") if "deselected" not in part]
    summary = ", ".join(part.split(" in ")[0] for part in counts if "warning" not in part)
    return Result(version, compiled, summary, tests.returncode == 0, digest(site), time.monotonic() - start)


def digest(site: Path | None, timeout: float = 600) -> str:
    """bench/triton_digest.py's digest with Triton from ``site`` (None: the venv's)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "triton_digest.py")],
        env=environment(site),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    found = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("digest ")]
    return found[0] if found else "error: " + _last_line(done.stderr)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def installed_version() -> str:
    done = _run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=environment(None))
    return done.stdout.strip()


def table(results: list[Result], reference: Result | None) -> str:
    rows = [
        "| Triton | AOT compile, sm_90 + sm_80 | interpreter golden tests | results vs the venv's Triton |",
        "|---|---|---|---|",
    ]
    for r in results:
        same = "-" if reference is None else "bit-identical" if r.digest == reference.digest else "differ"
        if r.version == (reference.version if reference else None):
            same = "(reference)"
        rows.append(f"| {r.version} | {r.compile} | {r.interpreter} | {same} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS))
    parser.add_argument("--record", action="store_true", help=f"write {RECORD.relative_to(REPO)}")
    args = parser.parse_args()
    cache = cache_dir()
    venv_version = installed_version()
    print(f"cache {cache}; the venv's Triton {venv_version}", flush=True)
    results: list[Result] = []
    reference = None
    for version in args.versions:
        site = None if version == venv_version else install(version, cache)
        result = check(version, site)
        print(
            f"{version}: compile {result.compile}; interpreter {result.interpreter}; "
            f"digest {result.digest[:16]} ({result.seconds:.0f} s)",
            flush=True,
        )
        results.append(result)
        if version == venv_version:
            reference = result
    if reference is None:
        reference = check(venv_version, None)
    print()
    print(table(results, reference))
    if args.record:
        import numpy
        import torch

        RECORD.write_text(
            json.dumps(
                {
                    "kernels_sha256": kernels_sha256(),
                    "when": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__,
                    "numpy": numpy.__version__,
                    "reference": reference.version,
                    "versions": {r.version: {**asdict(r), "ok": r.ok} for r in results},
                },
                indent=2,
            )
            + "\n"
        )
        print(f"\nwrote {RECORD}")
    if not all(r.ok for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
