"""Test-only compile probes: a callback the CLI loads by class path, compiling with one of Dynamo's own backends (no
C++ compile on CPU) and counting the graphs, and a backend that records each graph it compiles."""

import json
import os

import lightning as L
import torch


class CompileWith(L.Callback):
    """Before the model is configured (and its blocks compiled), every ``torch.compile`` of this process compiles with
    Dynamo's ``backend``; at the end of training, rank r writes how many graphs Dynamo compiled to
    ``<out_dir>/graphs_rank<r>.json``."""

    def __init__(self, out_dir: str, backend: str = "aot_eager"):
        self.out_dir, self.backend, self.graphs = out_dir, backend, 0

    def setup(self, trainer, pl_module, stage):
        compile_ = torch.compile

        def counting(gm, example_inputs):
            self.graphs += 1
            return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

        torch.compile = lambda model, **kwargs: compile_(model, **{**kwargs, "backend": counting})

    def on_train_end(self, trainer, pl_module):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"graphs_rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"graphs": self.graphs}, f)


class RecordingBackend:
    """A Dynamo backend (``aot_eager`` underneath) that keeps, per compiled graph, the grad-requiring inputs' sizes."""

    def __init__(self):
        self.graphs: list[list[int]] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append([t.numel() for t in example_inputs if isinstance(t, torch.Tensor) and t.requires_grad])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
