"""What a fit's steady training step asks of the device through the CLI, progress bar on (issue 52, item 3): one read
back per optimizer step (the divergence check), no upload of a logged number, and a synchronize only where a
throughput rate is computed (the logging steps)."""

import lightning as L
import pytest
import torch
from test_cli import args

from cable_lightning.cli import main
from cable_lightning.eval.work import DeviceWork

STEPS, LOG_EVERY = 12, 4


class StepWork(L.Callback):
    """Per training step, from its batch's start to the next batch's: the reads back and uploads ``DeviceWork``
    counts, and the calls of the synchronize stand-in (``synchronized``, a list each call appends to). The loader's
    batch is host memory until it is copied to the device: the data module's check of its ids is not counted."""

    def __init__(self, synchronized: list):
        self.synchronized, self.steps, self.work = synchronized, [], None

    def setup(self, trainer, pl_module, stage):
        data, check = trainer.datamodule, trainer.datamodule.on_before_batch_transfer

        def host_check(batch, dataloader_idx):
            if self.work is None:
                return check(batch, dataloader_idx)
            self.work.__exit__(None, None, None)
            try:
                return check(batch, dataloader_idx)
            finally:
                self.work.__enter__()

        data.on_before_batch_transfer = host_check

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.close()
        self.work, self.first = DeviceWork().__enter__(), len(self.synchronized)

    def close(self):
        if self.work is not None:
            self.work.__exit__(None, None, None)
            self.steps.append(dict(reads=self.work.transfers, uploads=self.work.uploads,
                                   syncs=len(self.synchronized) - self.first))
            self.work = None

    def on_train_end(self, trainer, pl_module):
        self.close()


@pytest.mark.parametrize("model,pe", [("CausalLM", "cable"), ("MaskedLM", "alibi")])
def test_a_steady_step_reads_once_and_synchronizes_only_to_compute_a_rate(tiny_corpus_dir, tmp_path, monkeypatch,
                                                                          model, pe):
    """Lightning's ThroughputMonitor synchronized at every batch, Lightning read every value logged with
    ``prog_bar=True`` (the loss) at every batch, every number logged with ``self.log`` was copied to the device, and
    the MLM masking copied its special ids to the device and sized its pool with ``nonzero`` at every step: on a GPU
    each waits for the step's kernels. The throughput callback synchronizes the device's own module (``torch.cuda``
    on a GPU, ``torch.cpu`` here), so the stand-in counts what a GPU would run."""
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
            assert counts == dict(reads=1, uploads=0, syncs=0), (step, work.steps)
    logged = cli.trainer.logged_metrics  # what the logger was given at the logging steps
    assert {"train/loss", "train/lr", "train/tokens_seen", "train/grad_norm"} <= set(logged)
    assert logged["train/device/items_per_sec"] > 0  # the rate, from the synchronized clock
