"""Are trainmon's outputs byte-identical between two versions of the code?

    python bench/same_outputs.py --against REV     # this working tree against git revision REV
    python bench/same_outputs.py --tree A --tree B # two checkouts
    python bench/same_outputs.py --against REV --old-outputs   # asking for the outputs before issue 33

Each tree trains the same fixed-seed workloads in a fresh process with ``time.time`` frozen, the step
timer's clock stopped (``perf_counter`` of ``trainmon.step.timing`` and ``trainmon.monitor``: every part of a
step takes 0 s) and its count of garbage collections off (they fall where the process's allocations, the
writer thread's included, put them), and ``uuid4`` counting (so wall times in events, records and the
manifest, step times, and dump request ids, are equal), then runs the read-side commands over the result.
Every file written (events, CSV, statistics store, anomaly records, manifest, dumps, grad_probe files, the
timing tables) and every command's output is hashed; the script prints each difference and exits 1 if there
is one. A restructuring that changes no behaviour must print "identical".

Workloads: ``trainmon demo`` (all kinds, a loss spike, a NaN with ``capture: exact`` and ``on_nan: skip``,
its report), a run with grad_probe, a threshold rule, ``ndigits`` and a dump request, and ``analyze``,
``analyze --explain``, ``dump ls``, ``dump show``, ``csv2tb``, and ``tb2csv`` over them.
Event-file names carry the host and process id: those two parts are normalised; safetensors dumps are compared
by metadata (sorted) and tensor bytes, as safetensors writes its metadata map in a per-process order.

``--old-outputs``: a tree that has the ``tensorboard_tensors`` key (issue 33: TensorBoard's summary and no CSV
by default) trains every workload with ``format: [tensorboard, csv]`` and ``tensorboard_tensors: all``, the
outputs written by default before; a tree without the key trains them as they are. So a tree from before
issue 33 and one after must then print "identical" (but for what the commands print about the defaults).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FROZEN_TIME = 1_750_000_000.25
# A fresh interpreter with a frozen wall clock, importing trainmon from the tree on PYTHONPATH.
# uuid4 (dump request ids) counts from 1, so the requests and the dump index are the same bytes.
# The step timer's clock (the modules that time a step's parts import perf_counter by name) reads 0 always,
# and the timer counts no collections: a finder wraps those two modules' loading, so no other clock of the
# process (waits, timeouts) is touched.
STOPPED_CLOCKS = ("trainmon.step.timing", "trainmon.monitor")
PRELUDE = (
    f"import time, uuid, itertools; time.time = lambda: {FROZEN_TIME!r}; _ids = itertools.count(1); "
    "uuid.uuid4 = lambda: uuid.UUID(int=next(_ids)); "
    "import sys, importlib.machinery as _im\n"
    "class _StoppedClock:\n"
    "    @staticmethod\n"
    "    def find_spec(name, path=None, target=None):\n"
    f"        if name not in {STOPPED_CLOCKS!r}:\n"
    "            return None\n"
    "        spec = _im.PathFinder.find_spec(name, path)\n"
    "        run = spec.loader.exec_module\n"
    "        def exec_module(module):\n"
    "            run(module)\n"
    "            module.perf_counter = lambda: 0.0\n"
    "            if hasattr(module, 'StepTimer'):\n"
    "                module.StepTimer.on_gc = lambda self, phase, info: None\n"
    "        spec.loader.exec_module = exec_module\n"
    "        return spec\n"
    "sys.meta_path.insert(0, _StoppedClock)\n"
)

EXTRA_RUN = r"""
import sys, torch, trainmon
from trainmon.demo import DemoSetup, build, lm_loss, synthetic_batch
setup = DemoSetup(spike_step=10**9)
torch.manual_seed(0)
torch.set_num_threads(1)
model, optimizer = build(setup, 3)
gen = torch.Generator().manual_seed(4)
config = {
    "targets": ["layers.0", "layers.1.mlp"],
    "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
    "param_distribution": True, "ur_distribution": True, "ndigits": 6,
    "ops": ["min", "max", "norm", "nans"],
    "grad_probe": {"enable": True, "grad_level": "L2", "sample_size": 64, "sign_bitmap": True},
    "alert": {"rules": [{"rule": "nan"}, {"rule": "threshold", "kinds": ["grad_reduced"], "stats": ["norm"],
                         "above": 0.02}], "dump": True},
}
with trainmon.attach(model, optimizer, config=config, logdir=sys.argv[1]) as mon:
    for step in range(12):
        if step == 5:
            from trainmon.cli import main
            main(["dump", "request", sys.argv[1], "--name", "layers.0.*", "--step", "7"])
        loss = lm_loss(model, synthetic_batch(setup, gen))
        mon.track("loss", loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
"""


# --old-outputs: every attach of a tree that knows tensorboard_tensors asks for the outputs written by default
# before issue 33 (keyword overrides of attach, so the demo's own config keeps everything else)
OLD_OUTPUTS = (
    "import trainmon; from trainmon.config.schema import MonitorConfig as _C; "
    "_keys = _C.key_names(); _attach = trainmon.attach; "
    "trainmon.attach = (lambda *a, **k: _attach(*a, **{**k, 'format': ['tensorboard', 'csv'], "
    "'tensorboard_tensors': 'all'})) if 'tensorboard_tensors' in _keys else _attach; "
)
_old_outputs = False


def _python(tree: Path, code: str, args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    prelude = PRELUDE + (OLD_OUTPUTS if _old_outputs else "")
    result = subprocess.run(
        [sys.executable, "-c", prelude + code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = result.stdout + result.stderr
    if result.returncode not in (0, 1, 2):
        raise SystemExit(f"{tree}: {' '.join(args)} failed ({result.returncode}):\n{out[-3000:]}")
    return f"[exit {result.returncode}]\n{out}"


def _cli(tree: Path, args: list[str], cwd: Path) -> str:
    return _python(tree, "import sys; from trainmon.cli import main; sys.exit(main(sys.argv[1:]))", args, cwd)


def _normalise_text(text: str, cwd: Path) -> str:
    text = text.replace(str(cwd.resolve()), "<cwd>").replace(str(cwd), "<cwd>")
    # durations: the demo's training time, csv2tb's conversion time
    text = re.sub(r"trained (\d+) steps in [\d.]+ s", r"trained \1 steps in <t> s", text)
    text = re.sub(r" in [\d.]+ s$", " in <t> s", text, flags=re.M)
    # the tree's own paths (tracebacks, warnings) differ by checkout
    return re.sub(r'File "[^"]*/trainmon/', 'File "<tree>/trainmon/', text)


def _event_name(name: str) -> str:
    # events.out.tfevents.<time>.<host>.<pid>.<uid>
    return re.sub(r"(tfevents\.\d+)\.[^/]+?\.\d+\.(\d+)", r"\1.<host>.<pid>.\2", name)


def run_tree(tree: Path, work: Path) -> dict[str, str]:
    """Run every workload with ``tree``'s trainmon in ``work``; returns {what: sha256 or text}."""
    work.mkdir(parents=True)
    outputs: dict[str, str] = {}
    which = _python(tree, "import trainmon; print(trainmon.__file__)", [], work)
    if str(tree) not in which:
        raise SystemExit(f"trainmon was not imported from {tree}: {which}")
    outputs["cmd:demo"] = _cli(tree, ["demo", "--steps", "40", "--nan-step", "30", "--logdir", "demo"], work)
    outputs["cmd:extra"] = _python(tree, EXTRA_RUN, ["extra"], work)
    for key in ("cmd:demo", "cmd:extra"):  # a workload that fails would compare nothing
        if not outputs[key].startswith("[exit 0]"):
            raise SystemExit(f"{tree}: {key} failed:\n{outputs[key][-3000:]}")
    for run in ("demo", "extra"):
        outputs[f"cmd:analyze {run}"] = _cli(tree, ["analyze", run], work)
        outputs[f"cmd:analyze --json {run}"] = _cli(tree, ["analyze", run, "--json"], work)
        outputs[f"cmd:explain {run}"] = _cli(tree, ["analyze", run, "--explain"], work)
        outputs[f"cmd:dump ls {run}"] = _cli(tree, ["dump", "ls", run], work)
        outputs[f"cmd:csv2tb {run}"] = _cli(tree, ["csv2tb", f"{run}/rank_0", "-o", f"{run}-tb"], work)
        outputs[f"cmd:tb2csv {run}"] = _cli(tree, ["tb2csv", f"{run}/rank_0", "-o", f"{run}-csv"], work)
    dumps = sorted((work / "demo").rglob("*.safetensors"))[:3]
    for dump in dumps:
        outputs[f"cmd:dump show {dump.name}"] = _cli(tree, ["dump", "show", str(dump)], work)
    for key, text in list(outputs.items()):
        outputs[key] = _normalise_text(text, work)
    for path in sorted(p for p in work.rglob("*") if p.is_file()):
        rel = _event_name(path.relative_to(work).as_posix())
        outputs[f"file:{rel}"] = _digest(path)
    return outputs


def _digest(path: Path) -> str:
    if path.suffix != ".safetensors":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    # safetensors writes its metadata map in hash order, which differs from process to process: hash the
    # metadata sorted, and the tensors' bytes
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(path, "np") as f:
        digest.update(repr(sorted((f.metadata() or {}).items())).encode())
        for key in sorted(f.keys()):
            value = f.get_tensor(key)
            digest.update(f"{key}{value.dtype}{value.shape}".encode() + value.tobytes())
    return digest.hexdigest()


def _worktree(rev: str, into: Path) -> Path:
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(into), rev], check=True,
                   capture_output=True)
    # the native stats kernel is built in place, as an editable install has it
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into, check=True,
                   capture_output=True)
    return into


def compare(a: dict[str, str], b: dict[str, str], names: tuple[str, str]) -> list[str]:
    problems = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            problems.append(f"{key}: only in {names[0] if key in a else names[1]}")
        elif a[key] != b[key]:
            if key.startswith("cmd:"):
                la, lb = a[key].splitlines(), b[key].splitlines()
                pairs = enumerate(zip(la, lb, strict=False))
                first = next((i for i, (x, y) in pairs if x != y), min(len(la), len(lb)))
                problems.append(
                    f"{key}: line {first + 1} differs:\n  {names[0]}: "
                    f"{la[first] if first < len(la) else '<end>'}\n  {names[1]}: "
                    f"{lb[first] if first < len(lb) else '<end>'}"
                )
            else:
                problems.append(f"{key}: bytes differ")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="git revision to compare this working tree with")
    parser.add_argument("--tree", action="append", type=Path, default=[], help="a checkout (give two)")
    parser.add_argument("--keep", type=Path, help="keep the outputs under this folder")
    parser.add_argument(
        "--old-outputs",
        action="store_true",
        help="trees with tensorboard_tensors train with format [tensorboard, csv], tensorboard_tensors: all",
    )
    args = parser.parse_args(argv)
    global _old_outputs
    _old_outputs = args.old_outputs
    scratch = Path(tempfile.mkdtemp(prefix="same-outputs-"))
    try:
        if args.against:
            trees = [_worktree(args.against, scratch / "baseline"), Path(__file__).resolve().parents[1]]
        elif len(args.tree) == 2:
            trees = [t.resolve() for t in args.tree]
        else:
            parser.error("give --against REV or two --tree")
        results = [run_tree(tree, scratch / f"out{i}") for i, tree in enumerate(trees)]
        names = (args.against or str(trees[0]), str(trees[1]))
        problems = compare(*results, names)
        if args.keep:
            shutil.copytree(scratch, args.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("baseline"))
        print(f"{len(results[0])} outputs compared")
        for p in problems:
            print(p)
        print("identical" if not problems else f"{len(problems)} differences")
        return 1 if problems else 0
    finally:
        if args.against:
            repo = Path(__file__).resolve().parents[1]
            baseline = str(scratch / "baseline")
            remove = ["git", "-C", str(repo), "worktree", "remove", "--force", baseline]
            subprocess.run(remove, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
