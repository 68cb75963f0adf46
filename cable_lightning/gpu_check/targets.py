"""The paper's shape and its targets: fits with GPT-2's vocabulary, compared with the paper's and llm.c's
tokens/s, and each row's verdict on its target (one H100, steady steps of a real fit; on a CPU rehearsal the verdicts
are of CPU figures, not GPU ones)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

GPT2_VOCAB = 50257  # the paper's vocabulary (GPT-2's BPE)
PAPER_RATE = 1.9e6 / 8  # the paper: GPT-2 small with CABLE, 1.9M tokens/s on 8 H100s, about 238k a GPU
LLMC_RATE = 460e3  # llm.c and modded-nanogpt: GPT-2 small at about 460k tokens/s on one H100 (roughly 40% MFU)
# The shapes a run fits: the paper's (GPT-2's vocabulary) and the prepared data's own; each its own parts
SHAPES = {"gpt2-vocab": "gpt2-vocab fit", "prepared": "fit"}


@dataclasses.dataclass(frozen=True)
class Target:
    """A row's target: the least MFU, tokens/s and ratio to NoPE (at the same shape) it must reach."""

    text: str
    mfu: float | None = None
    rate: float | None = None
    x_nope: float | None = None

    def verdict(self, mfu: float | None, rate: float | None, x_nope: float | None) -> str:
        """``met`` or ``missed``, after the target; ``not measured`` when a figure it needs is missing."""
        needs = [(least, got) for least, got in ((self.mfu, mfu), (self.rate, rate), (self.x_nope, x_nope))
                 if least is not None]
        if any(got is None for _, got in needs):
            return f"{self.text}: not measured"
        return f"{self.text}: {'met' if all(got >= least for least, got in needs) else 'missed'}"


TARGETS = {"nope": Target("MFU >= 40%", mfu=0.40),
           "cable": Target(">= 357k tokens/s and >= 0.9x NoPE", rate=1.5 * PAPER_RATE, x_nope=0.9),
           "alibi": Target(">= 0.9x NoPE", x_nope=0.9), "fox": Target(">= 0.9x NoPE", x_nope=0.9),
           **{label: Target(">= 0.3x NoPE", x_nope=0.3) for label in ("cope", "dape_v2+cable", "stick_breaking")}}
FLEX_TARGET = Target(">= 0.6x NoPE", x_nope=0.6)  # every encoding on the flex path


def target_of(label: str, backend: str) -> Target | None:
    """The target for a paper-shape fit of ``label`` (None: none is set, as for RoPE)."""
    return TARGETS.get(label) or (FLEX_TARGET if backend == "flex" else None)


def widened(prepared: str, out: str, vocab: int = GPT2_VOCAB) -> str:
    """A folder ``out`` that reads as the prepared folder ``prepared`` with a ``vocab``-entry vocabulary: the manifest
    with ``vocab_size`` replaced, every other file linked. The paper's shape without GPT-2's tokenizer: which ids
    appear changes no step's work (the LM head, the softmax, the embedding's gradient and AdamW are dense over the
    whole vocabulary), so the prepared corpus's ids stand in for GPT-2's."""
    from ..data.manifest import MANIFEST, read_manifest

    manifest = read_manifest(prepared)
    if int(manifest["vocab_size"]) > vocab:
        raise ValueError(f"{prepared} has {manifest['vocab_size']} token ids, more than the {vocab} to widen to")
    shutil.rmtree(out, ignore_errors=True)  # gpu-check's own folder under --runs_dir, remade each run
    os.makedirs(out)
    for name in os.listdir(prepared):
        if name != MANIFEST:
            os.symlink(os.path.abspath(os.path.join(prepared, name)), os.path.join(out, name))
    with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({**manifest, "vocab_size": vocab, "widened_from": os.path.abspath(prepared)}, f, indent=2)
    return out
