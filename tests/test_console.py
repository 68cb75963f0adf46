"""The console of a real run shows the run (preparation, the perplexity table, where the run went, real warnings) and
not the library chatter that ``cable_lightning.console`` filters, each filter by its exact message."""

import logging
import os
import subprocess
import sys
import warnings

from conftest import args

from cable_lightning.console import quiet_library_chatter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHATTER = [
    "Create an account on https://lightning.ai/",  # litdata's advert while preparing
    "Progress:",  # litdata's tqdm bar while preparing
    "\x1b[A",  # the cursor-up escape code such a bar writes into a pipe
    "Workers are ready",  # litdata's per-step notes
    "litlogger",  # Lightning's tip
    "has `__len__` defined",  # Lightning's IterableDataset warning
    "LeafSpec",  # torch's deprecation, raised inside Lightning
    "FLOPs",  # the model summary's column of zeros
]


def test_a_fit_that_prepares_its_data_shows_the_run_and_real_warnings_only(tiny_corpus_docs, tmp_path):
    jsonl, _ = tiny_corpus_docs
    data = str(tmp_path / "prepared")
    command = ["fit", *args(data, str(tmp_path / "runs"), steps=2, every=2, extra=[
        "--data.source", jsonl, "--data.tokenizer", "bpe:512",
        "--trainer.enable_model_summary", "true", "--trainer.enable_progress_bar", "true",
        "--trainer.callbacks+=recorders.Warns"])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-m", "cable_lightning", *command], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console
    assert os.path.isfile(os.path.join(data, "manifest.json"))  # it did prepare, so litdata ran in this process
    for line in CHATTER:
        assert line not in console, (line, console)
    assert "[prepare] wrote" in console  # preparation's own progress
    assert "validation perplexity by length (cable, trained at 32 tokens, step 2)" in console
    assert "Trainable params" in console  # the model summary, without its FLOPs column
    assert "GPU available:" in console  # Lightning's other notes stay
    assert "a warning from the run's own code (tests/recorders.Warns)" in console  # real warnings stay
    assert f"run written to {tmp_path / 'runs' / 'test' / 'cable' / 'version_0'}" in console


def test_the_filters_are_narrow():
    """Each filter drops its own message only: the same deprecation from other code, other warnings and the
    rank-zero logger's other notes pass."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_chatter()
        quiet_library_chatter()  # idempotent
        warnings.warn("Your `IterableDataset` has `__len__` defined. In combination with ...", UserWarning)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)  # not from Lightning
        warnings.warn("some other deprecation", DeprecationWarning)
    assert [str(w.message).split(",")[0] for w in caught] == ["`isinstance(treespec", "some other deprecation"]

    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert len(rank_zero.filters) == len(set(map(id, rank_zero.filters)))
    kept = [f.filter(logging.makeLogRecord({"msg": m})) for f in rank_zero.filters
            for m in ("💡 Tip: For seamless cloud logging, try installing [litlogger](https://pypi.org/...)",
                      "GPU available: False, used: False")]
    assert kept == [False, True]
