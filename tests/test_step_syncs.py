"""What a fit's steady training step asks of the device through the CLI, progress bar on: no read
back that waits (the divergence check's flag is copied without waiting and read a step later), no upload of a logged
number, and a synchronize only where a throughput rate is computed (the logging steps)."""

import lightning as L
import pytest
import torch
from conftest import args

from cable_lightning.cli import main
from cable_lightning.eval.work import DeviceWork

STEPS, LOG_EVERY = 12, 4


class StepWork(L.Callback):
    """Per training step, from its batch's start to the next batch's: the reads back, deferred copies and uploads
    one ``DeviceWork`` counts (one for the whole fit: a copy made in one step and read in the next is host memory
    there), and the calls of the synchronize stand-in (``synchronized``, a list each call appends to). The loader's
    batch is host memory until it is copied to the device: the data module's check of its ids is not counted."""

    def __init__(self, synchronized: list):
        self.synchronized, self.steps, self.work, self.inside = synchronized, [], DeviceWork(), False

    def setup(self, trainer, pl_module, stage):
        data, check = trainer.datamodule, trainer.datamodule.on_before_batch_transfer

        def host_check(batch, dataloader_idx):
            if not self.inside:
                return check(batch, dataloader_idx)
            self.work.__exit__(None, None, None)
            try:
                return check(batch, dataloader_idx)
            finally:
                self.work.__enter__()

        data.on_before_batch_transfer = host_check

    def counts(self) -> dict:
        return dict(reads=self.work.transfers, deferred=self.work.deferred, uploads=self.work.uploads,
                    syncs=len(self.synchronized))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.close()
        self.work.__enter__()
        self.inside, self.first = True, self.counts()

    def close(self):
        if self.inside:
            self.work.__exit__(None, None, None)
            self.inside = False
            self.steps.append({key: value - self.first[key] for key, value in self.counts().items()})

    def on_train_end(self, trainer, pl_module):
        self.close()


@pytest.mark.parametrize("model,pe", [("CausalLM", "cable"), ("MaskedLM", "alibi")])
def test_a_steady_step_waits_for_no_read_and_synchronizes_only_to_compute_a_rate(tiny_corpus_dir, tmp_path, monkeypatch,
                                                                          model, pe):
    """Lightning's ThroughputMonitor synchronized at every batch, Lightning read every value logged with
    ``prog_bar=True`` (the loss) at every batch, every number logged with ``self.log`` was copied to the device, and
    the MLM masking copied its special ids to the device and sized its pool with ``nonzero`` at every step: on a GPU
    each waits for the step's kernels; so did the divergence check's read of its own step's flag (4.4 ms of a 33.4 ms
    compiled gpt2-small step on an H100), now copied without waiting and read at the next step. The throughput
    callback synchronizes the device's own module (``torch.cuda`` on a GPU, ``torch.cpu`` here), so the stand-in
    counts what a GPU would run."""
    synchronized = []
    for module in (torch.cpu, torch.cuda):
        monkeypatch.setattr(module, "synchronize", lambda device=None: synchronized.append(device))
    work = StepWork(synchronized)
    cli = main(["fit", *args(tiny_corpus_dir, str(tmp_path), pe=pe, model=model, steps=STEPS, every=STEPS),
                "--trainer.log_every_n_steps", str(LOG_EVERY), "--trainer.enable_progress_bar", "true",
                "--data.eval_lengths", "[32]", "--diagnostics.enabled", "false", "--length_eval.figure", "false"],
               extra_callbacks=[work])
    assert cli.trainer.global_step == STEPS and cli.trainer.progress_bar_callback is not None
    steady = {step: counts for step, counts in enumerate(work.steps, start=1) if 1 < step < STEPS}
    logging = {step for step in steady if step % LOG_EVERY == 0}
    assert logging == {4, 8}
    for step, counts in steady.items():
        if step in logging:  # the logger reads what it writes; the rate's clock is synchronized once
            assert counts["syncs"] == 1 and counts["uploads"] == 0, (step, work.steps)
        else:
            # two copies read a step later: the divergence flag and the ranks' word on a preemption signal
            assert counts == dict(reads=0, deferred=2, uploads=0, syncs=0), (step, work.steps)
    logged = cli.trainer.logged_metrics  # what the logger was given at the logging steps
    assert {"train/loss", "train/lr", "train/tokens_seen", "train/grad_norm"} <= set(logged)
    assert logged["train/device/items_per_sec"] > 0  # the rate, from the synchronized clock
