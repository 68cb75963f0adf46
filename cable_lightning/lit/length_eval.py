"""Validation at every evaluation length: one loader per (length, stride) window set (stride == length: the
non-overlapping protocol; else sliding windows), the perplexity of each, the loss by position bucket of the
non-overlapping windows and each window's NLL (the report's one-seed interval), kept as records for the callbacks
to write (``length_results``, ``position_results``) and logged to TensorBoard."""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import torch
from torchmetrics.aggregation import MeanMetric

from ..checkpoints import shown_name
from ..data.windows import scored_targets
from ..eval import PositionNLL
from ..positional import UnsupportedLengthError
from ..records.schema import LengthRecord, PositionRecord, RunContext

MAX_LOG_PPL = 709.0  # math.exp overflows float64 beyond this: such a perplexity is recorded as inf


def val_tag(quantity: str, length: int, mode: str) -> str:
    """The TensorBoard tag of a validation ``loss`` or ``ppl`` at a length and window mode: ``val_ppl/len_512``,
    ``val_ppl_sliding/len_512`` (the perplexities are the HParams tab's metrics: callbacks/hparams.py)."""
    return f"val_{quantity}{'' if mode == 'nonoverlap' else '_sliding'}/len_{length}"


class LengthEvaluation:
    """Mixed into :class:`lit.modules.LanguageModel`: its validation hooks. It reads the module's ``backbone``,
    ``config``, ``data_info``, ``split_batch`` and ``batch_layout``, the checkpoint it loaded (``loaded_step``,
    ``trained_recipe``) and what names its run (``record_context``, ``recipe``)."""

    def init_length_evaluation(self) -> None:
        self.val_nll = torch.nn.ModuleDict()
        self.val_nll_by_position = torch.nn.ModuleDict()  # non-overlapping windows only
        self.length_results: list[LengthRecord] = []
        self.run_context: Optional[RunContext] = None  # what every record of this validation carries (set at its end)
        self.position_results: list[PositionRecord] = []
        self.unsupported_lengths: set[int] = set()

    def eval_specs(self) -> list[tuple[int, int]]:
        """(length, stride) per validation loader; stride == length is the non-overlapping protocol."""
        return list(self.data_info.eval_specs) if self.data_info else [(self.config.block_size, self.config.block_size)]

    @staticmethod
    def spec_key(length: int, stride: int) -> str:
        return f"{length}" if stride == length else f"{length}_s{stride}"

    def on_validation_epoch_start(self):
        self._eval_time: dict[str, float] = {}
        self._window_nll: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (NLL sums, scored tokens)
        for length, stride in self.eval_specs():
            key = self.spec_key(length, stride)
            if key not in self.val_nll:
                self.val_nll[key] = MeanMetric().to(self.device)
            if stride == length and key not in self.val_nll_by_position:
                self.val_nll_by_position[key] = PositionNLL(length).to(self.device)
            self._eval_time[key] = 0.0
            self._window_nll[key] = []

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        length, stride = self.eval_specs()[dataloader_idx]
        key = self.spec_key(length, stride)
        if length in self.unsupported_lengths:
            return None
        inputs, targets = self.split_batch(batch["tokens"], train=False, batch_idx=batch_idx, start=batch["start"])
        targets = scored_targets(targets, batch["first_scored"])
        start = time.perf_counter()
        try:
            nll = self.backbone.token_nll(inputs, targets, layout=self.batch_layout(inputs, False))
        except UnsupportedLengthError as err:
            self.unsupported_lengths.add(length)
            self.print(f"length {length}: unsupported ({err})")
            return None
        count = (targets != -100).sum()
        self.val_nll[key].update(nll.sum() / count.clamp(min=1), weight=count)
        self._window_nll[key].append((nll.sum(dim=1).detach().cpu(), (targets != -100).sum(dim=1).cpu()))
        if key in self.val_nll_by_position:
            self.val_nll_by_position[key].update(nll, targets != -100)
        self._eval_time[key] += time.perf_counter() - start
        return None

    def on_validation_epoch_end(self):
        """Logs ``val_ppl/len_<L>`` (non-overlapping) and ``val_ppl_sliding/len_<L>``, and keeps the
        rows in ``self.length_results`` (and the loss by position bucket in ``self.position_results``) for the
        length-evaluation callback."""
        self.length_results, self.position_results = [], []
        # A validate/test that loaded a checkpoint is recorded at that checkpoint's step (its loop starts at 0);
        # fit, and the validation after fit, at the trainer's.
        loaded = self.trainer.state.fn != "fit" and self.trainer.ckpt_path and self.loaded_step is not None
        step = self.loaded_step if loaded else self.global_step
        checkpoint = shown_name(os.path.abspath(self.trainer.ckpt_path)) if loaded else None  # a URL, not its copy
        # The run and evaluation every record of this validation names (lengths, tasks, attention diagnostics), so
        # the report keeps runs apart by encoding, training layout, extension and seed whichever record it reads.
        self.run_context = self.record_context(step, checkpoint, self.trained_recipe if loaded else self.recipe())
        for length, stride in self.eval_specs():
            key = self.spec_key(length, stride)
            metric = self.val_nll[key]
            mode = "nonoverlap" if stride == length else "sliding"
            row = dict(**self.run_context, length=length, mode=mode, stride=stride)
            if length in self.unsupported_lengths:
                self.length_results.append(LengthRecord(**row, ppl=None))
                continue
            if metric.update_count == 0 and self.trainer.world_size == 1:
                continue  # under DDP a rank without windows still joins the metric's sync below
            tokens = (int(self.all_gather(metric.weight.detach()).sum().item()) if self.trainer.world_size > 1
                      else int(metric.weight.item()))
            loss = metric.compute()
            self.log(val_tag("loss", length, mode), loss, add_dataloader_idx=False)
            self.log(val_tag("ppl", length, mode), torch.exp(loss), add_dataloader_idx=False)
            if mode == "nonoverlap" and length == self.config.block_size:
                self.log("val/loss", loss, prog_bar=True, add_dataloader_idx=False)
                self.log("val/ppl", torch.exp(loss), add_dataloader_idx=False)
            seconds = self._eval_time[key]
            ppl = math.exp(loss.item()) if loss.item() < MAX_LOG_PPL else math.inf
            window_nll, window_tokens = self._windows(key)
            self.length_results.append(LengthRecord(**row, ppl=ppl, loss=loss.item(), tokens=tokens, seconds=seconds,
                                                    tokens_per_sec=tokens / seconds if seconds else None,
                                                    window_nll=window_nll, window_tokens=window_tokens))
            metric.reset()
            if key in self.val_nll_by_position:
                self.position_results += self._position_rows(self.val_nll_by_position[key], row)

    def _windows(self, key: str) -> tuple[list[float], list[int]]:
        """Each evaluated window's mean NLL and scored tokens in stream order (each window scores the targets after
        the previous one's), every rank's; windows that score nothing are left out."""
        pairs = self._window_nll.get(key) or []
        sums = torch.cat([s for s, _ in pairs]) if pairs else torch.zeros(0)
        counts = torch.cat([c for _, c in pairs]) if pairs else torch.zeros(0, dtype=torch.long)
        scored = counts > 0
        means = [round(x, 4) for x in (sums[scored].double() / counts[scored]).tolist()]
        windows = (means, counts[scored].tolist())
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            gathered = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, windows)
            # rank r evaluated windows r, r + world, r + 2 world, ... (EvalWindows): back into stream order
            order = [(i, r) for r, g in enumerate(gathered) for i in range(len(g[0]))]
            windows = tuple([gathered[r][part][i] for i, r in sorted(order)] for part in (0, 1))
        return windows

    @staticmethod
    def _position_rows(metric: PositionNLL, row: dict) -> list[PositionRecord]:
        """One row per position bucket (first and last 1-based position, mean NLL, scored tokens)."""
        means, counts = metric.compute()
        metric.reset()
        return [PositionRecord(**row, first_position=first, last_position=last, loss=mean.item() if count else None,
                               tokens=int(count.item()))
                for (first, last), mean, count in zip(metric.buckets, means, counts)]
