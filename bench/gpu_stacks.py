"""The real training stacks on one GPU with the monitor on: megatron-core's GPTModel (local spec, bf16,
distributed optimizer) through ``trainmon.enable_megatron``, DeepSpeed ZeRO-2 and ZeRO-3 in bf16, and FSDP2
(``fully_shard``, bf16 parameters, fp32 reduction), each at world size 1.

For each stack, one fresh process (a rank of a world of one: NCCL on a GPU, gloo on the CPU) runs
``--rounds`` rounds; a round is two runs from the same seed on the same batches, monitor off and monitor on
(wg + mv, as bench/gpu_overhead.py's ``wgmv``: ``grad_unreduced``, ``grad_reduced``, ``exp_avg``,
``exp_avg_sq``), in rotated order, each on a model built afresh. Every step is timed (bracketed by
``torch.cuda.synchronize``), its loss kept. Per stack it reports:

* whether it ran (else the error's last lines);
* the rows the monitor collected in its last step against the rows the CPU tests say it collects: the four
  wg + mv kinds for every trainable parameter, under the model's own names (without wrappers' prefixes);
* whether the losses of every step are bitwise equal with and without the monitor (eager mode; the process
  runs under ``torch.use_deterministic_algorithms(True, warn_only=True)``, so the two runs can be compared
  at all; the warnings it gave are reported);
* the wg + mv overhead: per round the monitored run's mean measured step over the unmonitored run's, the
  median over rounds (the range in brackets).

megatron-core ships no ``megatron.training`` (Megatron-LM), which ``enable_megatron`` wraps: where it does
not import, a stand-in with Megatron-LM's names is put in its place (``get_args``,
``setup_model_and_optimizer`` called as a module global, as Megatron-LM's ``pretrain`` does), as in
tests/megatron_worker.py. On the CPU (``--tiny``) megatron-core needs tests/megatron_cpu_shim.py (it
hard-codes CUDA); the shim is test-only and is loaded only there, never on a GPU.

    python bench/gpu_stacks.py                                 # on a GPU: every stack, 2 rounds
    python bench/gpu_stacks.py --stacks zero3 fsdp2 --rounds 3
    python bench/gpu_stacks.py --tiny                          # CPU dry run: tiny models, gloo
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this tree's trainmon
sys.path.insert(0, str(REPO / "bench"))

STACKS = ["megatron", "zero2", "zero3", "fsdp2"]
LABELS = {
    "megatron": "megatron-core GPTModel, local spec, bf16, distributed optimizer (enable_megatron)",
    "zero2": "DeepSpeed ZeRO-2, bf16",
    "zero3": "DeepSpeed ZeRO-3, bf16",
    "fsdp2": "FSDP2 fully_shard, bf16 params, fp32 reduce",
}
# what wg + mv records of every trainable parameter under each stack (docs/megatron.md, docs/deepspeed.md,
# docs/fsdp.md; the CPU tests of each stack)
WGMV_KINDS = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Shape:
    layers: int
    d: int
    heads: int
    seq: int
    batch: int
    vocab: int


# on a GPU: a step of some tens of ms, so that a ratio means something, and a model built in seconds
GPU_SHAPE = Shape(layers=8, d=1024, heads=16, seq=1024, batch=4, vocab=32768)
TINY_SHAPE = Shape(layers=1, d=32, heads=2, seq=16, batch=2, vocab=64)
LR = 1e-4


def wgmv_config() -> dict:
    import gpu_overhead

    return dict(gpu_overhead.MODES["wgmv"])


# ----------------------------------------------------------------------------------------------- the stacks


class Run:
    """One model of one stack: ``step(i)`` trains on batch ``i`` and returns the loss (a detached tensor);
    ``names`` are its trainable parameters as the monitor names them; ``monitor`` is trainmon's monitor
    (None when off); ``close()`` stops monitoring."""

    names: list[str]
    monitor: object

    def step(self, i: int):  # pragma: no cover - each stack's own
        raise NotImplementedError

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def tokens(i: int, shape: Shape, device):
    import torch

    generator = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=generator).to(device)


def gpt(shape: Shape):
    """The GPU yardstick's model (bench/gpt_cuda.py) at this shape, for DeepSpeed and FSDP2."""
    import gpt_cuda

    return gpt_cuda.GPT(vocab=shape.vocab, d=shape.d, h=shape.heads, layers=shape.layers, T=shape.seq)


def lm_loss(logits, batch):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


class DeepSpeedRun(Run):
    def __init__(self, stage: int, shape: Shape, device, monitored: bool, logdir: str) -> None:
        import deepspeed
        import torch

        torch.manual_seed(0)
        model = gpt(shape)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        config = {
            "train_micro_batch_size_per_gpu": shape.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,  # torch's AdamW: no DeepSpeed op to build
            "steps_per_print": 10**9,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.names = [n for n, p in self.engine.module.named_parameters() if p.requires_grad]
        self.shape, self.device, self.monitor = shape, device, None
        if monitored:
            import trainmon

            self.monitor = trainmon.attach(
                self.engine, config=wgmv_config(), logdir=logdir, start_iteration=0
            )

    def step(self, i: int):
        batch = tokens(i, self.shape, self.device)
        loss = lm_loss(self.engine(batch[:, :-1]), batch)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


class FsdpRun(Run):
    def __init__(self, shape: Shape, device, monitored: bool, logdir: str) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        torch.manual_seed(0)
        model = gpt(shape).to(device)
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model, self.optimizer = model, torch.optim.AdamW(model.parameters(), lr=LR)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shape, self.device, self.monitor = shape, device, None
        if monitored:
            import trainmon

            self.monitor = trainmon.attach(
                model, self.optimizer, config=wgmv_config(), logdir=logdir, start_iteration=0
            )

    def step(self, i: int):
        batch = tokens(i, self.shape, self.device)
        loss = lm_loss(self.model(batch[:, :-1]), batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


class MegatronRun(Run):
    """Megatron-LM's setup in small: GPTModel (local spec) in bf16 (Float16Module), mcore DDP with the
    distributed optimizer, one micro-batch a step through the no-pipelining schedule. Monitored through
    ``trainmon.enable_megatron`` and Megatron-LM's ``setup_model_and_optimizer``."""

    def __init__(self, shape: Shape, device, monitored: bool, logdir: str) -> None:
        self.shape, self.device, self.handle, self.monitor = shape, device, None, None
        if monitored:
            import trainmon

            training = megatron_training()
            training.get_args().iteration = 0
            self.handle = trainmon.enable_megatron(config=wgmv_config(), logdir=logdir)  # the one line
            self.chunks, self.optimizer, _ = training.setup_model_and_optimizer(None, None)
            self.monitor = self.handle.monitor
            if self.monitor is None:
                raise RuntimeError("enable_megatron attached no monitor (see the log above)")
        else:
            self.chunks, self.optimizer = build_megatron(shape, device)
        inner = self.chunks[0].module.module  # mcore DDP -> Float16Module -> GPTModel
        self.names = [n for n, p in inner.named_parameters() if p.requires_grad]
        import torch

        self.mask = torch.triu(torch.ones(1, 1, shape.seq, shape.seq, dtype=torch.bool), 1).to(device)
        self.positions = torch.arange(shape.seq).unsqueeze(0).expand(shape.batch, -1).to(device)

    def step(self, i: int):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch = tokens(i, self.shape, self.device)

        def forward_step(data_iterator, model):
            data = next(data_iterator)
            output = model(data[:, :-1], self.positions, self.mask, labels=data[:, 1:])

            def loss_func(per_token):
                loss = per_token.float().mean()
                return loss, {"loss": loss.detach().clone()}

            return output, loss_func

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=self.chunks,
            num_microbatches=1,
            seq_length=self.shape.seq,
            micro_batch_size=self.shape.batch,
            forward_only=False,
        )
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("Megatron's optimizer skipped a step")
        return reduced[0]["loss"]

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def build_megatron(shape: Shape, device):
    import torch
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(0)
    on_cpu = device.type == "cpu"
    # the shim's tracker stands in for CUDA RNG states on the CPU
    model_parallel_cuda_manual_seed(0, **({"inference_rng_tracker": True} if on_cpu else {}))
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.d,
        num_attention_heads=shape.heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=on_cpu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the fusions need apex / Transformer Engine / megatron's CUDA extensions, none of them installed
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq,
    ).to(device)
    model = Float16Module(config, model)  # what Megatron-LM's get_model does for bf16
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    chunk = DistributedDataParallel(config, ddp_config, model)
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=LR, bf16=True, use_distributed_optimizer=True, clip_grad=1.0
    )
    optimizer = get_megatron_optimizer(optimizer_config, [chunk])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = chunk.no_sync
    return [chunk], optimizer


def megatron_training():
    """``megatron.training.training``: Megatron-LM's where it imports, else a stand-in with its names (one
    micro-batch a step, iteration 0), whose ``setup_model_and_optimizer`` builds the model of
    ``build_megatron``."""
    import importlib

    try:
        return importlib.import_module("megatron.training.training")
    except ModuleNotFoundError:
        pass
    shape, device = _MEGATRON_SETUP["shape"], _MEGATRON_SETUP["device"]
    args = types.SimpleNamespace(
        global_batch_size=shape.batch, micro_batch_size=shape.batch, data_parallel_size=1, iteration=0
    )
    package = types.ModuleType("megatron.training")
    package.__path__ = []
    training = types.ModuleType("megatron.training.training")
    package.get_args = training.get_args = lambda: args
    package.training = training

    def setup_model_and_optimizer(model_provider, model_type, **kwargs):
        chunks, optimizer = build_megatron(shape, device)
        return chunks, optimizer, None

    training.setup_model_and_optimizer = setup_model_and_optimizer
    sys.modules["megatron.training"], sys.modules["megatron.training.training"] = package, training
    return training


_MEGATRON_SETUP: dict = {}


# ------------------------------------------------------------------------------------------- one stack


def make_run(stack: str, shape: Shape, device, monitored: bool, logdir: str) -> Run:
    if stack == "megatron":
        return MegatronRun(shape, device, monitored, logdir)
    if stack in ("zero2", "zero3"):
        return DeepSpeedRun(int(stack[-1]), shape, device, monitored, logdir)
    return FsdpRun(shape, device, monitored, logdir)


def timed_run(run: Run, steps: int) -> tuple[list[float], list[str]]:
    """Every step's time in ms (bracketed by synchronisation) and its loss (float.hex of the fp32 value)."""
    import torch

    times, losses = [], []
    for i in range(steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = run.step(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss.float()).hex())  # after the timed part: reading it waits for nothing more
    return times, losses


def collected_rows(latest, names: list[str]) -> dict:
    """The wg + mv rows of the monitor's last step against those expected of every trainable parameter."""
    keys = set(latest.keys()) if latest is not None else set()
    expected = [f"{kind}/{name}" for kind in WGMV_KINDS for name in names]
    missing = [key for key in expected if key not in keys]
    kinds = {kind: sum(1 for key in keys if key.startswith(kind + "/")) for kind in WGMV_KINDS}
    return {
        "step": getattr(latest, "step", None),
        "expected": len(expected),
        "present": len(expected) - len(missing),
        "missing": missing[:8],
        "per_kind": kinds,
        "parameters": len(names),
    }


def measure(stack: str, args: argparse.Namespace, shape: Shape, device) -> dict:
    """``args.rounds`` rounds of one stack, off and on (wg + mv) from the same seed, in rotated order."""
    import torch

    steps = args.warmup + args.steps
    rounds = []
    rows = None
    with (
        tempfile.TemporaryDirectory(prefix=f"tm-stack-{stack}-") as tmp,
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")
        for r in range(args.rounds):
            result: dict = {}
            for monitored in (False, True) if r % 2 == 0 else (True, False):
                run = make_run(stack, shape, device, monitored, f"{tmp}/round{r}")
                try:
                    times, losses = timed_run(run, steps)
                    if monitored:
                        rows = collected_rows(run.monitor.latest(), run.names)
                finally:
                    run.close()
                result["on" if monitored else "off"] = {"step_ms": times, "losses": losses}
                del run
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            window = slice(args.warmup, steps)
            off = statistics.fmean(result["off"]["step_ms"][window])
            on = statistics.fmean(result["on"]["step_ms"][window])
            rounds.append({**result, "off_mean_ms": off, "on_mean_ms": on, "ratio": on / off})
        noted = sorted({str(w.message).splitlines()[0][:200] for w in seen if "determinis" in str(w.message)})
    ratios = [r["ratio"] for r in rounds]
    losses = [r[m]["losses"] for r in rounds for m in ("off", "on")]
    return {
        "stack": stack,
        "label": LABELS[stack],
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "shape": asdict(shape),
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": rounds,
        "ratio_mean": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "off_mean_ms": statistics.median(r["off_mean_ms"] for r in rounds),
        "losses_equal": all(x == losses[0] for x in losses),
        "losses": losses[0],
        "rows": rows,
        "deterministic_warnings": noted,
    }


def prepare_megatron(shape: Shape, device) -> None:
    """megatron-core's process-wide state: its parallel groups (of one rank), and on the CPU the test-only
    shim for the CUDA megatron-core hard-codes (in a dry run megatron-core comes last: the shim stays)."""
    if device.type == "cpu":
        sys.path.insert(0, str(REPO / "tests"))
        from megatron_cpu_shim import install

        install()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    _MEGATRON_SETUP.update(shape=shape, device=device)


def stacks_main(args: argparse.Namespace) -> list[dict]:
    """The stacks of ``--stack-main`` in turn in this process (rank 0 of a world of one, one process group
    for all); a stack that fails is reported as such and the next one runs."""
    import torch

    # losses compared bitwise between two runs need reproducible kernels; warn_only: a stack that uses an
    # op without a deterministic version still runs, and the warning is reported
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    if args.tiny and os.environ.get("TRITON_INTERPRET") == "1":
        from gpu_overhead import SMALL_TILES

        from trainmon.stats import triton_path

        triton_path.set_tiling(triton_path.Tiling(**SMALL_TILES))
    shape = TINY_SHAPE if args.tiny else GPU_SHAPE
    stacks = args.stack_main
    backend = "nccl" if device.type == "cuda" else "gloo"
    if any(stack.startswith("zero") for stack in stacks):
        import deepspeed

        if device.type == "cpu":
            # DeepSpeed's CPU accelerator JIT-builds a shared-memory collective (for CPU inference) at
            # init_distributed: a C++ build a dry run does not need, which can leave a stale build lock if
            # the run is stopped
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend)
    else:
        cuda = torch.device("cuda", 0) if device.type == "cuda" else None
        torch.distributed.init_process_group(backend, device_id=cuda)
    reports = []
    for stack in stacks:
        start = time.monotonic()
        try:
            if stack == "megatron":
                prepare_megatron(shape, device)
            report = measure(stack, args, shape, device)
        except Exception:  # noqa: BLE001 - said in the report; the next stack runs
            import traceback

            report = {
                "stack": stack,
                "label": LABELS[stack],
                "error": "raised",
                "log": traceback.format_exc(),
            }
        report["seconds"] = time.monotonic() - start
        print(f"{stack}: {'failed' if 'error' in report else 'ran'} ({report['seconds']:.0f} s)", flush=True)
        reports.append(report)
    torch.distributed.destroy_process_group()
    return reports


# ------------------------------------------------------------------------------------------- the driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# on a GPU megatron-core runs alone (a CUDA error there leaves the others their process); the others share
# one, which saves a start (imports, CUDA, the process group). A dry run takes one process for all, megatron-
# core last, after the test-only shim it needs on the CPU is installed
PROCESSES = [["megatron"], ["zero2", "zero3", "fsdp2"]]
TINY_PROCESSES = [["zero2", "zero3", "fsdp2", "megatron"]]


# the package each stack needs (a GPU image may lack them: bench/gpu_wheels.sh fetches their wheels to carry)
PACKAGES = {"megatron": "megatron.core", "zero2": "deepspeed", "zero3": "deepspeed", "fsdp2": "torch"}


def missing_package(stack: str) -> str | None:
    import importlib.util

    name = PACKAGES[stack]
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    return None if found else f"{name.split('.')[0]} is not installed (carry its wheel: bench/gpu_wheels.sh)"


def run_stacks(stacks: list[str], args: argparse.Namespace, timeout: float) -> list[dict]:
    """Some stacks in a fresh process; their reports, or what went wrong."""
    with tempfile.TemporaryDirectory(prefix="tm-stacks-") as tmp:
        out = Path(tmp) / "report.json"
        argv = [sys.executable, __file__, "--stack-main", *stacks, "--out", str(out)]
        argv += ["--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        argv += ["--tiny"] if args.tiny else []
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspace
        if args.tiny:
            env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        start = time.monotonic()
        # a session of its own: a process stopped at its time limit is stopped with whatever it started
        proc = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            code, output = 124, f"{output}\ntimed out after {timeout:.0f} s"
        if out.exists():
            return json.loads(out.read_text())
        seconds = time.monotonic() - start
        error = {"error": f"exit {code}", "log": output[-3000:], "seconds": seconds}
        return [{"stack": stack, "label": LABELS[stack], **error} for stack in stacks]


def table(reports: list[dict]) -> list[str]:
    lines = [
        "| stack | ran | rows collected (wg + mv) | losses bitwise equal | off ms a step "
        "| **wg + mv / off** |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports:
        if "error" in r:
            lines.append(f"| {r['label']} | NO ({r['error']}) | - | - | - | - |")
            continue
        rows = r["rows"] or {"present": 0, "expected": 0}
        low, high = r["ratio_range"]
        lines.append(
            f"| {r['label']} | yes | {rows['present']} / {rows['expected']} | "
            f"{'yes' if r['losses_equal'] else 'NO'} | {r['off_mean_ms']:.2f} | "
            f"**{r['ratio_mean']:.3f}** ({low:.3f}-{high:.3f}) |"
        )
    return lines


def notes(reports: list[dict]) -> list[str]:
    """What the table cannot hold: missing rows, deterministic-mode warnings, errors' last lines."""
    lines = []
    for r in reports:
        if "error" in r:
            lines.append(f"{r['stack']}: {r['error']}" + (":" if r["log"] else ""))
            lines += ["    " + x for x in r["log"].strip().splitlines()[-15:]]
            continue
        if r["rows"] and r["rows"]["missing"]:
            lines.append(f"{r['stack']}: rows missing, e.g. {', '.join(r['rows']['missing'])}")
        for w in r["deterministic_warnings"]:
            lines.append(f"{r['stack']}: deterministic mode warned: {w}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stacks", nargs="+", default=STACKS, choices=STACKS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="measured steps a run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before (the first one compiles)")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny models, gloo")
    parser.add_argument("--time-budget", type=float, default=240.0, help="seconds for every stack together")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stack-main", nargs="+", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stack_main:
        args.out.write_text(json.dumps(stacks_main(args)) + "\n")
        return
    start = time.monotonic()
    reports: list[dict] = []
    for stack in args.stacks:
        reason = missing_package(stack)
        if reason:
            reports.append(
                {"stack": stack, "label": LABELS[stack], "error": reason, "log": "", "seconds": 0.0}
            )
    missing = {r["stack"] for r in reports}
    layout = TINY_PROCESSES if args.tiny else PROCESSES
    groups = [[s for s in group if s in args.stacks and s not in missing] for group in layout]
    groups = [g for g in groups if g]
    for i, group in enumerate(groups):
        left = args.time_budget - (time.monotonic() - start)
        # an equal share of what is left per process (a process's start, imports and model builds weigh more
        # than a stack's steps); a quick process leaves its rest to the next
        share = left / (len(groups) - i)
        print(f"{' '.join(group)} in one process ({share:.0f} s at most)", flush=True)
        reports += run_stacks(group, args, timeout=max(10.0, share))
    reports.sort(key=lambda r: STACKS.index(r["stack"]))
    for report in reports:
        print(f"    {report['stack']}: {'failed, ' + report['error'] if 'error' in report else 'ran'}")
    print("\n".join(["", *table(reports), *notes(reports)]))
    if args.json:
        args.json.write_text(json.dumps({"stacks": reports, "tiny": args.tiny}, indent=2) + "\n")


if __name__ == "__main__":
    main()
