"""Compiled blocks (``compile: true``, ``Backbone.compile_blocks``): one block graph serves every layer of every
encoding, and FlexAttention inside a compiled block trains, its block mask built once per shape.

Dynamo's own backends stand in for inductor (no C++ compile on CPU): ``eager`` where only the graphs are counted,
``aot_eager`` where a backward runs through FlexAttention. The CPU build has no FlexAttention backward kernel, so
``aot_eager`` runs torch's eager one, which differs from CUDA's compiled kernel in one way (:func:`flex_on_cpu`)."""

import copy

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch._C import DispatchKey
from torch._higher_order_ops.flex_attention import flex_attention_backward

from cable_lightning.models import BackboneConfig
from cable_lightning.models import attention as attn_mod
from cable_lightning.models import flex as flex_mod
from cable_lightning.models.attention import backends_for
from cable_lightning.models.backbone import Backbone
from cable_lightning.positional import available, from_label

VOCAB, LENGTH = 64, 16
SHAPE = dict(n_head=2, n_embd=32, vocab_size=VOCAB, block_size=LENGTH)  # head size 16: FlexAttention's smallest
FLEX_CAPABLE = [name for name in available() if "flex" in backends_for(from_label(name).scores, True)]


class CountingBackend:
    """A Dynamo backend that keeps every graph it is given and runs it with Dynamo's ``name`` backend."""

    def __init__(self, name: str):
        self.name, self.graphs = name, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend(self.name)(gm, example_inputs)


def compiling_with(monkeypatch, name: str) -> CountingBackend:
    """Every ``torch.compile`` (the blocks' included) compiles with a :class:`CountingBackend` over ``name``."""
    torch._dynamo.reset()
    backend, compile_ = CountingBackend(name), torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compile_(model, **{**kwargs, "backend": backend}))
    return backend


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """FlexAttention's backward on CPU, as CUDA's compiled kernel computes it. The CPU build refuses a backward only for
    want of a kernel (``_validate_device``). Torch's eager backward, which ``aot_eager`` runs, computes the gradient
    of a tensor the score_mod captured only if that tensor requires grad as it runs; in a compiled backward no saved
    activation does, so a bias computed inside the block (every one) got no gradient (``Expected a proper Tensor but
    got None ... 'grad_output'``). The compiled kernel takes the gradients to compute from the traced joint graph
    (inductor's lowering of flex_attention_backward); so does this stand-in."""
    dense = flex_attention_backward.py_kernels[DispatchKey.CompositeExplicitAutograd]

    def backward(*args):
        args = list(args)
        joint_graph, captured = args[8], args[12]
        differentiated = joint_graph.graph.find_nodes(op="output")[0].args[0][5:]  # after d(score) and b, h, q, kv
        args[12] = tuple(t.detach().requires_grad_() if grad is not None else t
                         for t, grad in zip(captured, differentiated))
        return dense(*args)

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)
    monkeypatch.setitem(flex_attention_backward.py_kernels, DispatchKey.CompositeExplicitAutograd, backward)
    monkeypatch.setattr(flex_attention_backward, "_dispatch_cache", {})
    flex_mod._causal_block_mask.cache_clear()
    flex_mod._window_block_mask.cache_clear()
    yield
    torch._dynamo.reset()


def backbone(name: str, n_layer: int, backend: str = "auto", seed: int = 0) -> Backbone:
    """A small backbone whose encoding's weights are away from their initialisation (every layer's its own)."""
    torch.manual_seed(seed)
    model = Backbone(BackboneConfig(pos_encoding=from_label(name), n_layer=n_layer, attention_backend=backend,
                                    **SHAPE))
    with torch.no_grad():
        for p in model.pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def steps(models, n: int = 2, length: int = LENGTH) -> list[torch.Tensor]:
    """``n`` training steps' forward and backward of each model on the same batches of ``length`` tokens; their
    losses."""
    losses = []
    for step in range(n):
        ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(step))
        for model in models:
            model.zero_grad()
            loss = model.loss(ids, ids)
            loss.backward()
            losses.append(loss.detach())
    return losses


def assert_same_gradients(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def layer_kinds(pe) -> int:
    """How many kinds of layer an encoding has: a pattern's distinct (encoding, window) entries, else one."""
    return len(set(zip(pe.part_of, pe.windows))) if hasattr(pe, "part_of") else 1


@pytest.mark.parametrize("name", available())
def test_one_block_graph_serves_every_layer(name, monkeypatch):
    """A 12-layer model's compiled blocks, two training steps: one graph for every layer (a layer's own weights are
    inputs of the graph, through ``PositionalEncoding.layer_view``), and the loss and every gradient are the eager
    model's (each layer reads its own weights, not layer 0's). Two graphs for an encoding with two kinds of layer:
    ``layers``' default pattern, RoPE layers over a 512-token window and NoPE layers, is different code in each.
    Before, each layer was a graph of its own wherever the encoding indexes its weights by the layer's number
    (CABLE, FoX, CoPE, KERPLE, FIRE, DAPEv2, SSMax: 12)."""
    compiled = compiling_with(monkeypatch, "eager")
    model = backbone(name, 12)
    reference = copy.deepcopy(model)
    model.compile_blocks()
    losses = steps([model, reference])
    kinds = layer_kinds(model.pe)
    assert kinds <= 2 and len(compiled.graphs) == kinds, len(compiled.graphs)
    torch.testing.assert_close(losses[0::2], losses[1::2], rtol=1e-6, atol=0)
    assert_same_gradients(model, reference)


@pytest.mark.parametrize("name", FLEX_CAPABLE)
def test_compiled_blocks_train_through_flex_like_chunked(name, monkeypatch, flex_on_cpu):
    """``compile: true`` with the encoding forced onto FlexAttention, 2 layers, two steps under ``aot_eager``: the
    forward and backward run, every gradient equals the chunked backend's (eager), one graph holds both layers with
    FlexAttention inside it, and the block mask is built once for both layers and steps, outside the graph (traced
    into it, Dynamo ignores the cache: the graph built it again at every step)."""
    built = []
    create = flex_module.create_block_mask
    monkeypatch.setattr(flex_module, "create_block_mask", lambda *args, **kwargs: built.append(1) or create(*args,
                                                                                                             **kwargs))
    compiled = compiling_with(monkeypatch, "aot_eager")
    model, reference = backbone(name, 2, "flex"), backbone(name, 2, "chunked")
    model.compile_blocks()
    steps([model, reference])
    assert_same_gradients(model, reference)
    traced = [node for gm in compiled.graphs for node in gm.graph.nodes
              if "create_block_mask" in (node.meta.get("stack_trace") or "")]
    assert not traced, traced[0].meta["stack_trace"]
    assert len(built) == 1
    assert len(compiled.graphs) == 1


def test_flex_inside_a_compiled_region_is_compiled_with_it(monkeypatch):
    """On CUDA FlexAttention runs compiled (``flex_kernel``); inside a compiled block it is the plain function, which
    Dynamo puts in the block's graph. Compiling it there was a side effect of the trace (``_compiled_flex`` set),
    which made every block compile again at its next call."""
    monkeypatch.setattr(flex_mod, "_compiled_flex", {})

    @torch.compile(backend="eager", fullgraph=True)
    def in_a_block(x):
        return x + float(flex_mod.flex_kernel(torch.device("cuda")) is flex_module.flex_attention)

    assert in_a_block(torch.zeros(1)).item() == 1.0
    assert flex_mod._compiled_flex == {}
    torch._dynamo.reset()


@pytest.mark.parametrize("name", [name for name in available() if from_label(name).scores == "logits"])
def test_a_compiled_block_unrolls_few_row_blocks_whatever_the_eager_path_takes(name, monkeypatch):
    """The chunked path's loop over row blocks is unrolled into a compiled block's graph, and compiling grows with the
    blocks (CoPE's fit at 16 x 1024 tokens unrolled 103 and had not compiled after 6 minutes on an H100). With one row
    a block eagerly (``CHUNK_ELEMENTS`` 1), the compiled graph of an 8- and a 16-token step holds one block each
    (``COMPILED_CHUNK_ELEMENTS``; the blocks' outputs are concatenated by one ``cat``), and its loss and gradients are
    those of the eager model's 8 and 16 blocks."""
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 1)
    compiled = compiling_with(monkeypatch, "eager")
    for length in (8, 16):
        before = len(compiled.graphs)
        model = backbone(name, 1)
        reference = copy.deepcopy(model)
        model.compile_blocks()
        losses = steps([model, reference], n=1, length=length)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
        assert_same_gradients(model, reference)
        assert len(compiled.graphs) == before + 1
        blocks = [len(node.args[0]) for node in compiled.graphs[-1].graph.nodes
                  if node.target is torch.cat and "torch.cat(outputs" in (node.meta.get("stack_trace") or "")]
        assert blocks == [1], (length, blocks)
