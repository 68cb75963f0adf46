"""GPU probe: what the fit loop's one host read a step (the divergence check) and main-process data loading cost
a compiled gpt2-small NoPE fit on the GPU. gpu-check's own fit (Run.fit, its FitClock: the steady steps' median
period) four times in one process: as it is; the divergence check's read replaced by nothing (a probe only: not
safe for a run); data loaded by 4 worker processes; both. Rows to $OUT/syncprobe.md as they come."""
import argparse
import dataclasses
import os
import sys

from cable_lightning import gpu_check
from cable_lightning.lit.modules import LanguageModel

REH = os.environ.get("REHEARSE") == "1"
out = os.path.join(os.environ.get("OUT", "/tmp"), "syncprobe.md")
args = argparse.Namespace(data_path="data/pydocs-bpe4096", runs_dir=os.environ.get("RUNS", "/tmp/syncprobe-runs"),
                          budget_scale=1.0)
base = gpu_check.REHEARSAL if REH else gpu_check.GPU
report = gpu_check.Report(out, f"## syncprobe ({'CPU rehearsal' if REH else 'GPU'})")
run = gpu_check.Run(args, base, not REH, report)
checked = LanguageModel.stop_if_diverged
with run.watch.watching(), (gpu_check.eager_dynamo() if REH else gpu_check.nullcontext()):
    report.table(gpu_check.FIT_HEAD)
    stamp = run.stamp
    for name in sys.argv[1:] or ["as-is", "no-read", "workers4", "no-read+workers4"]:
        run.stamp = f"{stamp}-{name}"  # each fit its own run folder
        workers = ("--data.num_workers", "4") if "workers4" in name else ()
        run.sizes = dataclasses.replace(base, extra=base.extra + workers)
        LanguageModel.stop_if_diverged = (lambda self, norm: None) if "no-read" in name else checked
        run.fit(name, "nope")
report.close()
