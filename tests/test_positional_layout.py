"""Layouts (per-token positions and documents) through every registered encoding and attention backend: a document of
a packed block is run as if alone (no key of another document leaks in, and positions, sums and counts restart), a
layout of contiguous positions is today's forward, and a constant shift of the positions changes only what reads
absolute positions."""

import pytest
import torch

from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.models import attention as attn_mod
from cable_lightning.models.attention import backends_for
from cable_lightning.positional import available, from_label, score_bias_encodings
from cable_lightning.positional.layout import Layout

# Every encoding, and DAPEv2 over every encoding it can wrap.
VARIANTS = sorted({from_label(pe).label() for pe in available() + [f"dape_v2+{pe}" for pe in score_bias_encodings()]})
DOCUMENTS = [7, 9, 8]  # one packed block of three documents
LENGTH = sum(DOCUMENTS)
VOCAB = 97


def tiny(pe, causal=True, backend="auto"):
    torch.manual_seed(0)
    config = BackboneConfig(pos_encoding=pe, n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, causal=causal,
                            block_size=64, attention_backend=backend)
    model = build_backbone(config).eval()
    with torch.no_grad():  # make learned PE parameters non-trivial (T5 and CoPE start at zero)
        for p in model.pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def document_ids(lengths=DOCUMENTS, batch=2):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(batch, -1)


def packed_pair():
    """Two batches of one packed block that differ in one token of the second document."""
    torch.manual_seed(1)
    x = torch.randint(0, VOCAB, (2, LENGTH))
    y = x.clone()
    y[:, 7 + 4] = (x[:, 7 + 4] + 1) % VOCAB
    return x, y


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pe", VARIANTS)
def test_each_document_of_a_packed_block_runs_as_if_alone(pe, causal, monkeypatch):
    """On every backend that can run the encoding: changing one document leaves every other document's logits as
    they were, and each document's logits are those of the document run alone (positions restart: absolute tables,
    FIRE's normaliser, CABLE's and FoX's sums, CoPE's counts, SSMax's count of keys)."""
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * 4 * LENGTH * 5)  # several query blocks on the chunked path
    model = tiny(pe, causal)
    x, y = packed_pair()
    with torch.no_grad():
        alone = [model(x[:, start : start + n]) for start, n in zip([0, 7, 16], DOCUMENTS)]
        # causal (training): every backend that runs the encoding; bidirectional: the one it picks
        for backend in backends_for(from_label(pe).scores, causal) if causal else ["auto"]:
            for block in model.blocks:
                block.attn.backend = backend
            a = model(x, layout=Layout.build(2, LENGTH, "cpu", documents=document_ids()))
            b = model(y, layout=Layout.build(2, LENGTH, "cpu", documents=document_ids()))
            torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-5, rtol=1e-5, msg=backend)
            torch.testing.assert_close(a[:, 16:], b[:, 16:], atol=1e-5, rtol=1e-5, msg=backend)
            changed = slice(7 + 4, 16) if causal else slice(7, 16)
            assert not torch.allclose(a[:, changed], b[:, changed], atol=1e-4), backend
            for start, n, own in zip([0, 7, 16], DOCUMENTS, alone):
                torch.testing.assert_close(a[:, start : start + n], own, atol=2e-5, rtol=1e-4, msg=backend)


@pytest.mark.parametrize("pe", ["cable", "fox", "alibi", "rope", "cope", "fire", "dape_v2+cable", "ssmax+rope"])
def test_no_gradient_crosses_a_document_boundary(pe):
    """Training under documents: the loss of one document has no gradient through another's tokens."""
    model = tiny(pe).train()
    embeddings = model.wte.weight
    x = torch.randint(0, VOCAB, (1, LENGTH))
    inputs = []

    def keep(module, args, output):
        output.retain_grad()
        inputs.append(output)

    model.wte.register_forward_hook(keep)
    hidden = model.hidden_states(x, layout=Layout.build(1, LENGTH, "cpu", documents=document_ids(batch=1)))
    (hidden[:, 16:] * torch.randn(1, 8, 32)).sum().backward()  # the third document's outputs
    grad = inputs[0].grad[0]
    # zero up to fp32 rounding (CABLE's restarted sums subtract the sum before the document); a leak is O(1)
    assert grad[:16].abs().max() <= 1e-6 * grad[16:].abs().max()
    assert embeddings.grad is not None


@pytest.mark.parametrize("pe", VARIANTS)
def test_contiguous_positions_are_todays_forward(pe):
    model = tiny(pe)
    x = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        plain = model(x)
        laid_out = model(x, layout=Layout.build(2, LENGTH, "cpu", positions=torch.arange(LENGTH)))
    torch.testing.assert_close(laid_out, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", VARIANTS)
def test_a_constant_shift_changes_only_absolute_encodings(pe):
    """Relative encodings see the same differences of positions; absolute tables and FIRE (past its threshold) read
    the positions themselves. An encoding that reads no positions at all gives the same outputs for any increasing
    positions; one that does gives other outputs for other gaps."""
    model = tiny(pe)
    x = torch.randint(0, VOCAB, (2, LENGTH))
    shifted = torch.arange(LENGTH) + (100 if model.pe.longest is None else model.pe.longest - LENGTH)  # a table's end
    gaps = torch.cumsum(torch.randint(1, 5, (2, LENGTH)), dim=-1)
    with torch.no_grad():
        plain = model(x)
        moved = model(x, layout=Layout.build(2, LENGTH, "cpu", positions=shifted))
        spread = model(x, layout=Layout.build(2, LENGTH, "cpu", positions=gaps))
    if model.pe.relative:
        torch.testing.assert_close(moved, plain, atol=2e-5, rtol=1e-4)
    else:
        assert not torch.allclose(moved, plain, atol=1e-4)
    if model.pe.reads_positions:
        assert not torch.allclose(spread, plain, atol=1e-4)
    else:
        torch.testing.assert_close(spread, plain, atol=1e-5, rtol=1e-5)


def test_documents_and_positions_together_restart_and_skip():
    """Explicit positions within documents: RoPE of a document at positions p equals it alone at those p."""
    model = tiny("rope")
    x = torch.randint(0, VOCAB, (1, LENGTH))
    positions = torch.cat([torch.arange(n) * 3 + 5 for n in DOCUMENTS])
    with torch.no_grad():
        packed = model(x, layout=Layout.build(1, LENGTH, "cpu", documents=document_ids(batch=1), positions=positions))
        alone = model(x[:, 7:16], layout=Layout.build(1, 9, "cpu", positions=positions[7:16]))
    torch.testing.assert_close(packed[:, 7:16], alone, atol=1e-5, rtol=1e-5)


def test_bad_layouts_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^documents must be integers of shape \(2, 5\) or \(5,\)"):
        Layout.build(2, 5, "cpu", documents=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^documents must not decrease along a row"):
        Layout.build(1, 3, "cpu", documents=torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match=r"^positions must increase along each document"):
        Layout.build(1, 3, "cpu", positions=torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match=r"^positions must be >= 0; got -1"):
        Layout.build(1, 3, "cpu", positions=torch.tensor([-1, 2, 3]))
    # a new document may start at any position
    Layout.build(1, 4, "cpu", documents=torch.tensor([0, 0, 1, 1]), positions=torch.tensor([4, 9, 0, 1]))
    model = tiny("learnable")
    with pytest.raises(ValueError, match="exceeds the learnable encoding's 64 positions"):
        model(torch.zeros(1, 3, dtype=torch.long), layout=Layout.build(1, 3, "cpu", positions=torch.tensor([0, 1, 64])))


def test_layout_bookkeeping():
    layout = Layout.build(1, 6, "cpu", documents=torch.tensor([3, 3, 4, 4, 4, 7]))
    assert layout.positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    assert layout.first.tolist() == [[0, 0, 2, 2, 2, 5]] and layout.last.tolist() == [[1, 1, 4, 4, 4, 5]]
    sums = layout.restart_sums(torch.arange(1.0, 7.0).view(1, 1, 6))
    assert sums.tolist() == [[[1.0, 3.0, 3.0, 7.0, 12.0, 6.0]]]
