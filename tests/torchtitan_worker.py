"""torchtitan's own Trainer on gloo ranks with trainmon attached in one line, for tests/test_torchtitan.py.

    python torchtitan_worker.py OUT_DIR JOB [JOB ...]     (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* set)

torchtitan 0.3.0's llama3 debug model (its ``llama3_debugmodel`` config: FSDP2 over every rank, bf16
parameters with fp32 reduction, selective activation checkpointing, fused AdamW, gradient clipping at 1.0)
trains on a tokenizer and a text set this worker writes (no download), with the patches of
tests/torchtitan_cpu_shim.py. Each JOB is ``NAME`` or ``NAME:off`` (no monitor) and runs in turn in the same
processes; each rank writes ``OUT_DIR/NAME/rank_<r>.json``:

* ``logged``: what torchtitan's metrics logged at each step (its global average loss and gradient norm);
* ``after``: hashes of this rank's parameter shards and AdamW moments after each step;
* ``truth``: per step, the statistics of the whole tensors (``DTensor.full_tensor()``) where the monitor
  takes them: the gradient the optimizer applies (after torchtitan's clipping), the parameters before and
  after the update, the Adam moments; ``monitor``: trainmon's own (``Monitor.latest()``) for the same step;
* ``modules``: the names of the modules that hold parameters; ``log``: trainmon's log lines.

Names are trainmon's: without activation checkpointing's ``_checkpoint_wrapped_module`` segment.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import torchtitan_cpu_shim  # noqa: E402 - tests/ is not a package

STEPS = 3
SEQ_LEN = 64
LOCAL_BATCH = 2
MICRO_BATCHES = 2  # torchtitan's gradient accumulation (global batch = micro-batches x ranks x local batch)
CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "param_distribution": True,
}
WORDS = [f"w{i}" for i in range(200)]
WRAPPER = "_checkpoint_wrapped_module"  # activation checkpointing's segment, which trainmon's names leave out


class Lines(logging.Handler):
    """trainmon's log lines of one job."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def write_assets(folder: Path) -> tuple[Path, Path]:
    """A word-level tokenizer (HF ``tokenizers`` files, as torchtitan loads them) and a small JSON-lines
    text set of random words, in place of the c4_test set and test tokenizer that torchtitan's wheel lacks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer_dir, data_dir = folder / "tokenizer", folder / "data"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<bos>", "<eos>"])
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True, "add_eos_token": True}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(special))
    rng = random.Random(0)
    lines = [
        json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(10, 60)))})
        for _ in range(400)
    ]
    (data_dir / "data.json").write_text("\n".join(lines) + "\n")
    return tokenizer_dir, data_dir


def trainer_config(assets: Path, dump: Path) -> Any:
    """torchtitan's llama3 debug-model config, shortened to a few small steps, on this machine's files."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    tokenizer_dir, data_dir = write_assets(assets)
    config = torchtitan_cpu_shim.sdpa_attention(llama3_debugmodel())
    config.hf_assets_path = str(tokenizer_dir)
    config.dataloader.dataset_path = str(data_dir)
    config.dump_folder = str(dump)
    config.training.local_batch_size = LOCAL_BATCH
    config.training.global_batch_size = LOCAL_BATCH * MICRO_BATCHES * int(os.environ["WORLD_SIZE"])
    config.training.seq_len = SEQ_LEN
    config.training.steps = STEPS
    config.training.disable_cuda_graphs = True  # CUDA graphs: nothing to capture on a CPU
    # torchtitan's default spmd_types backend needs a PyTorch newer than 2.13 (fully_shard refuses its
    # plain annotated parameters); partial_dtensor is 0.3.0's DTensor path for FSDP2 and TP
    config.parallelism.spmd_backend = "partial_dtensor"
    config.debug.seed = 0  # the same initial weights in every job
    config.validator.enable = False
    config.checkpoint.enable = False
    return config


def plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != WRAPPER)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def stats_of(t: torch.Tensor) -> dict[str, float]:
    a = full(t).detach().to(torch.float64).numpy().ravel()
    return {"min": float(a.min()), "max": float(a.max()), "norm": float(np.sqrt((a * a).sum()))}


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(local(t).detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Recorder:
    """What each step of the trainer did, read through its optimizer's hooks and its metrics' ``log``."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.names = {p: plain_name(n) for m in trainer.model_parts for n, p in m.named_parameters()}
        self.inner = trainer.optimizers.optimizers
        self.monitor: Any = None
        self.result: dict[str, list] = {"logged": [], "after": [], "truth": [], "monitor": []}
        self.truth: dict[str, dict[str, float]] = {}
        trainer.optimizers.register_step_pre_hook(self.before_update)
        trainer.optimizers.register_step_post_hook(self.after_update)
        log = trainer.metrics_processor.log

        def logged(step: int, loss: float, max_loss: float, grad_norm: float, **kwargs: Any) -> None:
            self.result["logged"].append({"step": step, "loss": loss, "grad_norm": grad_norm})
            latest = self.monitor.latest() if self.monitor is not None else None
            self.result["monitor"].append({k: dict(v) for k, v in latest.items()} if latest else {})
            log(step, loss, max_loss, grad_norm, **kwargs)

        trainer.metrics_processor.log = logged

    def state_of(self, param: torch.Tensor) -> dict:
        return next((o.state[param] for o in self.inner if param in o.state), {})

    def before_update(self, *args: Any) -> None:
        self.truth = {}
        for param, name in self.names.items():
            if param.grad is not None:
                self.truth[f"grad_reduced/{name}"] = stats_of(param.grad)
            self.truth[f"param_origin/{name}"] = stats_of(param)

    def after_update(self, *args: Any) -> None:
        params = list(self.names)
        moments = [self.state_of(p)[k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        self.result["after"].append({"params": digest(params), "moments": digest(moments)})
        for param, name in self.names.items():
            self.truth[f"param_updated/{name}"] = stats_of(param)
            state = self.state_of(param)
            self.truth[f"exp_avg/{name}"] = stats_of(state["exp_avg"])
            self.truth[f"exp_avg_sq/{name}"] = stats_of(state["exp_avg_sq"])
        self.result["truth"].append(self.truth)


def run(folder: Path, monitored: bool, rank: int) -> dict:
    import trainmon

    config = trainer_config(folder / f"assets_{rank}", folder / "dump")
    trainer = config.build()
    recorder = Recorder(trainer)
    if monitored:
        # the one line (integrations/torchtitan): after the Trainer is built, before it trains
        recorder.monitor = trainmon.attach(trainer, config=CONFIG, logdir=str(folder / "run"))
    trainer.train()
    if recorder.monitor is not None:
        recorder.monitor.close()
    trainer.close()
    result: dict[str, Any] = dict(recorder.result)
    owners = [
        n for m in trainer.model_parts for n, k in m.named_modules() if list(k.parameters(recurse=False))
    ]
    result["modules"] = [plain_name(n) for n in owners]
    result["max_norm"] = config.training.max_norm
    return result


def main() -> None:
    out, jobs = Path(sys.argv[1]), sys.argv[2:]
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the text set is a local folder: never the Hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torchtitan_cpu_shim.install()
    from torchtitan.tools.logging import init_logger

    init_logger()
    rank = int(os.environ["RANK"])
    lines = Lines()
    logging.getLogger("trainmon").addHandler(lines)
    for job in jobs:
        name, _, options = job.partition(":")
        lines.lines = []
        result = run(out / name, options != "off", rank)
        result["log"] = lines.lines
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / f"rank_{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
