"""Lightning with ``TrainmonCallback`` (issue 51): a LightningModule holding a tiny Llama whose
``training_step`` calls it (the LightningModule's own ``forward`` never runs), 2 micro-batches a step under
automatic optimization, where Lightning runs the last micro-batch inside ``optimizer.step(closure)``. Every
step is recorded under Lightning's step numbers with the Llama's own row names and micro-steps; the recorded
``grad_reduced`` norms are those ``on_before_optimizer_step`` sees; losses and final parameters are bitwise
those without trainmon; a NaN in micro-batch 0 or in the last one, with ``raise`` and ``skip``, never
lands, as the parameters' and Adam's hashes show."""

from __future__ import annotations

import pytest
import torch

import trainmon
from tests.conftest import FULL_COVERAGE
from tests.hf_tiny import Tokens, tiny_llama
from trainmon.anomaly.alerts import TrainingNaNError

L = pytest.importorskip("lightning")
transformers = pytest.importorskip("transformers")
from tests.test_loops_huggingface import digest  # noqa: E402 - after the skips
from trainmon.loops.lightning import TrainmonCallback  # noqa: E402

STEPS, ACCUMULATE, NAN_STEP = 4, 2, 2  # NAN_STEP in Lightning's numbers (global_step during the step)


class Module(L.LightningModule):
    def __init__(self, nan_micro: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm = tiny_llama()
        self.nan_micro, self.micro, self.losses = nan_micro, 0, []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        micro, self.micro = self.micro % ACCUMULATE, self.micro + 1
        planted = self.nan_micro == micro and self.trainer.global_step == NAN_STEP
        embeds = self.lm.model.embed_tokens(batch["input_ids"]) * (float("nan") if planted else 1.0)
        loss = self.lm(inputs_embeds=embeds, labels=batch["labels"]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Probe(L.Callback):
    def __init__(self) -> None:
        self.norms, self.before, self.after, self.latest = {}, {}, {}, {}
        self.monitor_of = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % ACCUMULATE == 0:
            self.before[trainer.global_step] = digest(pl_module, trainer.optimizers[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms[trainer.global_step] = {
            n: p.grad.double().norm().item() for n, p in pl_module.lm.named_parameters() if p.grad is not None
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % ACCUMULATE == ACCUMULATE - 1:
            self.after[trainer.global_step - 1] = digest(pl_module, trainer.optimizers[0])
            if self.monitor_of is not None and self.monitor_of.monitor is not None:
                latest = self.monitor_of.monitor.latest()
                self.latest[trainer.global_step - 1] = (latest.step, dict(latest.items()))


def fit(tmp_path, monitored: bool, nan_micro: int | None = None, on_nan: str = "continue"):
    module, probe = Module(nan_micro), Probe()
    callbacks = [probe]
    if monitored:
        config = {**FULL_COVERAGE, "alert": {"on_nan": on_nan, "rate_limit_s": 0}}
        probe.monitor_of = TrainmonCallback(config=config)
        callbacks.insert(0, probe.monitor_of)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(Tokens(STEPS * ACCUMULATE * 2), batch_size=2, shuffle=False)
    raised = None
    try:
        trainer.fit(module, loader)
    except TrainingNaNError as error:
        raised = error
    return module, trainer, probe, raised


@pytest.mark.slow
def test_every_step_under_lightnings_numbers_bitwise_and_the_gradients_it_steps_with(tmp_path):
    plain, _, plain_probe, _ = fit(tmp_path / "plain", monitored=False)
    module, _, probe, _ = fit(tmp_path / "monitored", monitored=True)
    assert module.losses == plain.losses and len(module.losses) == STEPS * ACCUMULATE
    assert probe.after[STEPS - 1] == plain_probe.after[STEPS - 1]
    assert sorted(probe.latest) == list(range(STEPS))
    for step, (recorded_step, rows) in probe.latest.items():
        assert recorded_step == step
        assert "actv_grad/model.layers.0.input_layernorm.input_grad" in rows  # the Llama's own names
        for name, norm in probe.norms[step].items():
            assert rows[f"grad_reduced/{name}"]["norm"] == pytest.approx(norm, rel=1e-5), (step, name)
    assert (tmp_path / "monitored" / "trainmon" / "plugins" / "trainmon" / "stats").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("micro", [0, ACCUMULATE - 1], ids=["micro_batch_0", "last_micro_batch"])
@pytest.mark.parametrize("action", ["raise", "skip"])
def test_a_nan_update_never_lands(tmp_path, micro, action):
    module, trainer, probe, raised = fit(tmp_path, monitored=True, nan_micro=micro, on_nan=action)
    if action == "raise":
        assert raised is not None and "not applied" in str(raised)
        assert digest(module, trainer.optimizers[0]) == probe.before[NAN_STEP]
    else:
        assert raised is None and max(probe.after) == STEPS - 1
        assert probe.after[NAN_STEP] == probe.before[NAN_STEP]  # the NaN step changed nothing
        assert probe.after[NAN_STEP + 1] != probe.before[NAN_STEP + 1]  # and training went on


def fabric_run(run=None):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    module = Module(None)
    model, optimizer = fabric.setup(module.lm, torch.optim.AdamW(module.lm.parameters(), lr=1e-3))
    monitor = None
    if run is not None:
        monitor = trainmon.attach(
            model, optimizer, config=FULL_COVERAGE, logdir=run, grad_acc_steps=ACCUMULATE
        )
    losses, rows = [], set()
    for i in range(STEPS * ACCUMULATE):
        ids = Tokens(STEPS * ACCUMULATE * 2)[i]["input_ids"][None]
        with fabric.no_backward_sync(model, enabled=i % ACCUMULATE < ACCUMULATE - 1):
            loss = model(input_ids=ids, labels=ids).loss
            fabric.backward(loss / ACCUMULATE)
        losses.append(loss.item())
        if i % ACCUMULATE == ACCUMULATE - 1:
            optimizer.step()
            optimizer.zero_grad()
            if monitor is not None:
                rows |= set(monitor.latest().keys())
    if monitor is not None:
        monitor.close()
    return losses, [p.detach().clone() for p in model.parameters()], rows


@pytest.mark.slow
def test_fabric_is_watched_through_its_wrappers_under_the_models_own_names(tmp_path):
    losses, params, _ = fabric_run()
    monitored_losses, monitored_params, rows = fabric_run(tmp_path / "run")
    assert monitored_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(params, monitored_params, strict=True))
    assert {"actv_grad/model.layers.0.input_layernorm.input_grad", "exp_avg/lm_head.weight"} <= rows
    assert not any("_forward_module" in row for row in rows)
