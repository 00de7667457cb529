"""Hugging Face's Trainer with ``TrainmonCallback`` (issue 51): a tiny Llama from a config, gradient
accumulation 2, on the CPU. Every step is recorded under the Trainer's step numbers; the recorded
``grad_reduced`` norms are the ones the Trainer's ``on_pre_optimizer_step`` sees; losses and final
parameters equal bit for bit those of the same run without trainmon; a NaN planted in micro-batch 0 or in
the last micro-batch, with ``raise`` and ``skip``, ends or skips exactly as the parameters' and Adam's hashes
show."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.conftest import FULL_COVERAGE
from tests.hf_tiny import Tokens, tiny_llama
from trainmon.anomaly.alerts import TrainingNaNError

transformers = pytest.importorskip("transformers")
from trainmon.loops.huggingface import TrainmonCallback  # noqa: E402 - after the skip

STEPS, ACCUMULATE, NAN_STEP = 6, 2, 3  # NAN_STEP in the Trainer's numbers (global_step after it)


def digest(model: torch.nn.Module, optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in state:
                h.update(state[key].detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Probe(transformers.TrainerCallback):
    """What the Trainer itself sees: the gradients at on_pre_optimizer_step, hashes around each step, and
    trainmon's latest step at on_step_end; plants the NaN."""

    def __init__(self, nan_micro: int | None) -> None:
        self.nan_micro, self.forwards = nan_micro, 0
        self.norms, self.before, self.after, self.latest = {}, {}, {}, {}
        self.monitor_of = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        poison = model.model.layers[0].input_layernorm

        def plant(module, inputs, output):
            micro = self.forwards % ACCUMULATE
            self.forwards += 1
            if self.nan_micro is not None and state.global_step + 1 == NAN_STEP and micro == self.nan_micro:
                return output * float("nan")
            return None

        poison.register_forward_hook(plant)

    def on_step_begin(self, args, state, control, **kwargs):
        self.before[state.global_step + 1] = digest(self.model, self.optimizer.optimizer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.norms[state.global_step + 1] = {
            n: p.grad.double().norm().item() for n, p in self.model.named_parameters() if p.grad is not None
        }

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = digest(self.model, self.optimizer.optimizer)
        if self.monitor_of is not None and self.monitor_of.monitor is not None:
            latest = self.monitor_of.monitor.latest()
            self.latest[state.global_step] = (latest.step, dict(latest.items()))


def train(tmp_path, name: str, monitored: bool, nan_micro: int | None = None, on_nan: str = "continue"):
    torch.manual_seed(0)
    model = tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    probe = Probe(nan_micro)
    callbacks = [probe]
    if monitored:
        monitor_config = {**FULL_COVERAGE, "alert": {"on_nan": on_nan, "rate_limit_s": 0}}
        probe.monitor_of = TrainmonCallback(config=monitor_config)
        callbacks.insert(0, probe.monitor_of)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(STEPS * ACCUMULATE * 2), callbacks=callbacks
    )
    raised = None
    try:
        trainer.train()
    except TrainingNaNError as error:
        raised = error
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, probe, losses, raised


@pytest.mark.slow
def test_every_step_under_the_trainers_numbers_bitwise_and_the_gradients_it_steps_with(tmp_path):
    _, plain, plain_losses, _ = train(tmp_path, "plain", monitored=False)
    trainer, probe, losses, _ = train(tmp_path, "monitored", monitored=True)
    assert losses == plain_losses and len(losses) == STEPS
    assert probe.after[STEPS] == plain.after[STEPS]  # parameters and Adam state, bit for bit
    assert sorted(probe.latest) == list(range(1, STEPS + 1))
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    for step, (recorded_step, rows) in probe.latest.items():
        assert recorded_step == step
        assert rows["scalar/grad_norm_before_clip"]["max"] == logged[step]  # the Trainer's own value
        for name, norm in probe.norms[step].items():
            assert rows[f"grad_reduced/{name}"]["norm"] == pytest.approx(norm, rel=1e-5), (step, name)
    run = tmp_path / "monitored" / "trainmon"
    assert (
        (run / "plugins" / "trainmon" / "stats").is_dir() or any(run.rglob("*.parquet")) or any(run.iterdir())
    )


@pytest.mark.slow
@pytest.mark.parametrize("micro", [0, ACCUMULATE - 1], ids=["micro_batch_0", "last_micro_batch"])
@pytest.mark.parametrize("action", ["raise", "skip"])
def test_a_nan_update_never_lands(tmp_path, micro, action):
    _, probe, _, raised = train(tmp_path, "nan", monitored=True, nan_micro=micro, on_nan=action)
    if action == "raise":
        assert raised is not None and "not applied" in str(raised)
        assert digest(probe.model, probe.optimizer.optimizer) == probe.before[NAN_STEP]
        assert max(probe.after) == NAN_STEP - 1
    else:
        assert raised is None and max(probe.after) == STEPS
        assert probe.after[NAN_STEP] == probe.before[NAN_STEP]  # the NaN step changed nothing
        assert probe.after[NAN_STEP + 1] != probe.before[NAN_STEP + 1]  # and training went on
