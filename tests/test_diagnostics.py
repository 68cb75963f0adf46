"""Attention diagnostics: the weights they read against attention computed by hand, the quantities against a slow
obvious reference, the key tokens, the records `validate` writes, and the report's tables and figures."""

import cmath
import gc
import math
import os

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cable_lightning.callbacks import AttentionDiagnostics
from cable_lightning.cli import main
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.errors import ConfigError
from cable_lightning.eval import diagnostics as diagnostics_module
from cable_lightning.eval.diagnostics import QUANTITIES, context_gain, diagnose, row_quantities, short_context_nll
from cable_lightning.eval.diagnostics_report import diagnostics_report
from cable_lightning.eval.intervals import seed_interval
from cable_lightning.eval.work import DeviceWork
from cable_lightning.lit import CausalLM
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.models import attention as attn_mod
from cable_lightning.models import flex as flex_mod
from cable_lightning.models.attention import attention, attention_map
from cable_lightning.positional import available, build_positional
from cable_lightning.records.io import append_records, read_records
from cable_lightning.records.schema import AttentionRecord, LengthRecord, LongContextRecord

T = 6


def qk(heads: int, dim: int, seed: int = 0):
    torch.manual_seed(seed)
    return torch.randn(1, heads, T, dim, dtype=torch.float64), torch.randn(1, heads, T, dim, dtype=torch.float64)


def layer_weights(pe_name: str, heads: int, dim: int, layer: int = 0, seed: int = 0):
    """The weights the diagnostics read for one layer of a causal model: q, k (after the encoding's rotation) and the
    weights (heads, T, T)."""
    pe = build_positional(BackboneConfig(pos_encoding=pe_name, n_layer=2, n_head=heads, n_embd=heads * dim,
                                         block_size=T)).double()
    q, k = qk(heads, dim, seed)
    h = torch.randn(1, T, heads * dim, dtype=torch.float64)
    rq, rk = pe.rotate(q, k, 0, layer)
    weights = attention_map(rq, rk, pe.score_bias(h, layer, 0, None), True, window=pe.window(layer)).weights
    return q, k, weights[0]


def softmax_rows(scores: dict) -> dict:
    """{(i, j): score} over the keys a row sees -> {(i, j): weight}."""
    out = {}
    for i in range(T):
        row = {j: s for (r, j), s in scores.items() if r == i}
        top = max(row.values())
        norm = sum(math.exp(s - top) for s in row.values())
        out.update({(i, j): math.exp(s - top) / norm for j, s in row.items()})
    return out


def assert_weights(weights: torch.Tensor, expected: dict) -> None:
    """``expected``: {(i, j): weight} for one head; every other (i, j), the future included, must be exactly 0."""
    for i in range(T):
        for j in range(T):
            if (i, j) in expected:
                assert weights[i, j].item() == pytest.approx(expected[i, j], rel=1e-9, abs=1e-12), (i, j)
            else:
                assert weights[i, j].item() == 0.0, (i, j)


def test_rope_weights_by_hand():
    """Softmax over q.k / sqrt(d) of rotated pairs: (x_f + i x_{f + d/2}) turned by position x theta_f."""
    dim, base = 4, 10000.0
    q, k, weights = layer_weights("rope", 1, dim)
    thetas = [base ** (-2 * f / dim) for f in range(dim // 2)]
    scores = {}
    for i in range(T):
        for j in range(i + 1):
            dot = 0.0
            for f, theta in enumerate(thetas):
                zq = complex(q[0, 0, i, f], q[0, 0, i, f + dim // 2]) * cmath.exp(1j * i * theta)
                zk = complex(k[0, 0, j, f], k[0, 0, j, f + dim // 2]) * cmath.exp(1j * j * theta)
                dot += (zq * zk.conjugate()).real
            scores[i, j] = dot / math.sqrt(dim)
    assert_weights(weights[0], softmax_rows(scores))


def test_alibi_weights_by_hand():
    """Softmax over q.k / sqrt(d) - m_h (i - j), slopes 2^-4 and 2^-8 for two heads."""
    dim = 4
    q, k, weights = layer_weights("alibi", 2, dim)
    for head, slope in enumerate([2**-4, 2**-8]):
        scores = {(i, j): float(q[0, head, i] @ k[0, head, j]) / math.sqrt(dim) - slope * (i - j)
                  for i in range(T) for j in range(i + 1)}
        assert_weights(weights[head], softmax_rows(scores))


def test_stick_breaking_weights_by_hand():
    """A_ij = sigmoid(z_ij) prod_{j < m < i} (1 - sigmoid(z_im)) for j < i; nothing on the query itself."""
    dim = 4
    q, k, weights = layer_weights("stick_breaking", 1, dim)

    def beta(i, j):
        return 1 / (1 + math.exp(-float(q[0, 0, i] @ k[0, 0, j]) / math.sqrt(dim)))

    expected = {(i, j): beta(i, j) * math.prod(1 - beta(i, m) for m in range(j + 1, i))
                for i in range(T) for j in range(i)}
    assert_weights(weights[0], expected)
    assert float(weights.sum(-1).max()) <= 1.0


def test_windowed_layer_weights_by_hand():
    """``layers-alibi@3-nope``: layer 0 is ALiBi over its last 3 positions, layer 1 NoPE over everything."""
    dim, slope = 4, 2**-8
    q, k, weights = layer_weights("layers-alibi@3-nope", 1, dim, layer=0)
    scores = {(i, j): float(q[0, 0, i] @ k[0, 0, j]) / math.sqrt(dim) - slope * (i - j)
              for i in range(T) for j in range(max(0, i - 2), i + 1)}
    assert_weights(weights[0], softmax_rows(scores))
    _, _, everything = layer_weights("layers-alibi@3-nope", 1, dim, layer=1)
    past = torch.ones(T, T, dtype=torch.bool).tril()
    assert bool((everything[0][past] > 0).all()) and bool((everything[0][~past] == 0).all())  # NoPE: every past key


@pytest.mark.parametrize("name", available())
def test_weights_are_what_each_encodings_own_backend_applies(name):
    """For every encoding: the weights times v are the output of the backend that runs it (auto), and causal rows
    put nothing on the future."""
    torch.manual_seed(0)
    config = BackboneConfig(pos_encoding=name, n_layer=2, n_head=2, n_embd=16, block_size=16)
    pe = build_positional(config)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        h = torch.randn(2, 9, 16)
        q, k, v = (torch.randn(2, 2, 9, 8) for _ in range(3))
        q, k = pe.rotate(q, k, 0, 1)
        scores = pe.score_bias(h, 1, 0, None)
        weights = attention_map(q, k, scores, True, window=pe.window(1)).weights
        applied = attention(q, k, v, scores, True, backend="auto", window=pe.window(1))
    torch.testing.assert_close(weights @ v, applied, atol=2e-5, rtol=1e-4)
    assert bool((weights.triu(1) == 0).all())


def slow_quantities(weights, scores, logits, start, sink, local):
    """Row by row, the obvious way (float64)."""
    b, h, rows, keys = weights.shape
    out = {name: torch.full((b, h, rows), float("nan"), dtype=torch.float64) for name in QUANTITIES}
    for bi in range(b):
        for hi in range(h):
            for r in range(rows):
                i = start + r
                w = [float(x) for x in weights[bi, hi, r]]
                total = sum(w)
                out["mass"][bi, hi, r] = total
                finite = [float(x) for x in logits[bi, hi, r] if x > float("-inf")]
                out["max_logit"][bi, hi, r] = max(finite) if finite else float("-inf")
                if total == 0:
                    continue
                p = [x / total for x in w]
                entropy = -sum(x * math.log(x) for x in p if x > 0)
                seen = sum(1 for x in scores[bi, hi, r] if x > float("-inf"))
                out["entropy"][bi, hi, r] = entropy
                out["entropy_norm"][bi, hi, r] = entropy / math.log(seen) if seen >= 2 else float("nan")
                out["distance_mean"][bi, hi, r] = sum(x * abs(i - j) for j, x in enumerate(p))
                by_distance = sorted((abs(i - j), x) for j, x in enumerate(p))
                within, p90 = 0.0, None
                for d in sorted({d for d, _ in by_distance}):
                    within += sum(x for dd, x in by_distance if dd == d)
                    if within >= 0.9 and p90 is None:
                        p90 = d
                out["distance_p90"][bi, hi, r] = p90
                out["sink_mass"][bi, hi, r] = sum(p[:sink])
                out["local_mass"][bi, hi, r] = sum(x for j, x in enumerate(p) if abs(i - j) < local)
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_quantities_match_a_slow_reference(causal):
    """Rows 5..11 of a 12-key map: softmax rows, rows that keep part of the stick, a row that attends nowhere and one
    that sees a single key."""
    torch.manual_seed(3)
    start, rows, keys = 5, 7, 12
    scores = torch.randn(2, 3, rows, keys) * 2
    position = torch.arange(start, start + rows)[:, None]
    hidden = torch.arange(keys)[None, :] > position if causal else torch.zeros(rows, keys, dtype=torch.bool)
    scores = scores.masked_fill(hidden, float("-inf"))
    scores[0, 0, 2, :] = float("-inf")  # attends nowhere
    scores[0, 1, 3, :] = float("-inf")
    scores[0, 1, 3, 4] = 0.0  # one key only
    weights = scores.softmax(-1).nan_to_num(0.0)
    weights[1] *= torch.rand(3, rows, 1)  # rows summing to less than 1
    logits = torch.randn(2, 3, rows, keys).masked_fill(hidden, float("-inf"))
    fast = row_quantities(weights, scores, logits, start, 0, sink=3, local=4, causal=causal)
    slow = slow_quantities(weights, scores, logits, start, sink=3, local=4)
    for name in QUANTITIES:
        torch.testing.assert_close(fast[name].double(), slow[name], rtol=1e-5, atol=1e-5, equal_nan=True,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert math.isnan(fast["entropy"][0, 0, 2]) and math.isnan(fast["entropy_norm"][0, 1, 3])


def test_quantities_under_bf16_autocast_are_the_slow_reference_ones():
    """Validation under bf16-mixed runs the diagnostics inside autocast: rows far along a long window whose weight sits
    almost all on the query itself keep their small, non-negative mean distance."""
    torch.manual_seed(4)
    start, rows, keys = 2040, 8, 2048
    position = torch.arange(start, start + rows)[:, None]
    hidden = torch.arange(keys)[None, :] > position
    scores = torch.randn(1, 2, rows, keys)
    scores[..., torch.arange(rows), position[:, 0]] += 14.0  # on itself
    scores = scores.masked_fill(hidden, float("-inf"))
    weights = scores.softmax(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = row_quantities(weights, scores, scores, start, 0, sink=4, local=16, causal=True)
    w = weights.double()
    slow = (w * (position - torch.arange(keys)).double()).sum(-1) / w.sum(-1)  # float64, keys past i weigh 0
    assert (fast["distance_mean"] >= 0).all()
    torch.testing.assert_close(fast["distance_mean"].double(), slow, rtol=1e-4, atol=1e-5)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_backbone(BackboneConfig(pos_encoding="rope", n_layer=1, n_head=2, n_embd=16, block_size=8,
                                         vocab_size=40)).eval()


@torch.no_grad()
def test_short_context_nll_sees_at_most_the_context():
    """Stride 1: each target past the first window gets exactly the ``context`` tokens before it; stride = context:
    non-overlapping chunks."""
    backbone, context = tiny_model(), 8
    tokens = torch.randint(0, 40, (2, 21))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    sliding = short_context_nll(backbone, inputs, targets, context, stride=1, batch_size=5)
    first = backbone.token_nll(inputs[:, :context], targets[:, :context])
    torch.testing.assert_close(sliding[:, :context], first)
    for i in range(context, 20):
        one = backbone.token_nll(inputs[:, i - context + 1 : i + 1], targets[:, i - context + 1 : i + 1])[:, -1]
        torch.testing.assert_close(sliding[:, i], one)
    chunks = short_context_nll(backbone, inputs[:, :16], targets[:, :16], context, stride=context)
    torch.testing.assert_close(chunks, torch.cat([backbone.token_nll(inputs[:, s : s + 8], targets[:, s : s + 8])
                                                  for s in (0, 8)], dim=1))


def test_context_gain_counts_key_and_hurt_tokens_past_the_context():
    long = torch.tensor([[1.0, 1.0, 1.0, 0.5, 4.0, 2.0]])
    short = torch.tensor([[9.0, 1.0, 1.0, 3.0, 1.0, 2.5]])
    scored = torch.tensor([[True, True, True, True, True, False]])
    gain = context_gain(long, short, scored, context=2, threshold=2.0)
    # index 0 drops by 8 but lies within the context (both see it the same); index 5 is not scored
    assert (gain.tokens, gain.key_tokens, gain.hurt_tokens) == (3, 1, 1)
    assert (gain.key_loss, gain.key_loss_short, gain.hurt_loss, gain.hurt_loss_short) == (0.5, 3.0, 4.0, 1.0)
    assert gain.loss == pytest.approx((1.0 + 0.5 + 4.0) / 3) and gain.loss_short == pytest.approx(5.0 / 3)


def test_bad_settings_name_the_value():
    with pytest.raises(ConfigError, match=r"diagnostics.windows must be >= 1, got 0"):
        AttentionDiagnostics(windows=0)
    with pytest.raises(ConfigError, match=r"diagnostics.threshold must be > 0 nats, got -1"):
        AttentionDiagnostics(threshold=-1.0)
    with pytest.raises(ConfigError, match=r"diagnostics.budget must be > 0 \(times the length evaluation\) or null"):
        AttentionDiagnostics(budget=0.0)


def test_the_schedule_runs_the_first_the_final_and_others_within_the_budget():
    """Seconds set by hand: after 3 s of diagnostics against 2 s of length evaluation (1.5x), a budget of 0.5x skips
    validations until the evaluations reach 6 s; the first and a final one (a validate, a fit's last) always run."""
    diagnostics = AttentionDiagnostics(budget=0.5)
    assert diagnostics.due(final=False)
    diagnostics.runs, diagnostics.spent, diagnostics.evaluated = 1, 3.0, 2.0
    assert not diagnostics.due(final=False) and diagnostics.due(final=True)
    diagnostics.evaluated = 5.9
    assert not diagnostics.due(final=False)
    diagnostics.evaluated = 6.0
    assert diagnostics.due(final=False)
    every = AttentionDiagnostics(budget=None)
    every.runs, every.spent, every.evaluated = 1, 100.0, 1.0
    assert every.due(final=False)


def cli_args(data, runs, command="fit", lengths="[32, 64]"):
    return [command, "--model", "cable_lightning.lit.CausalLM", "--model.init_args.backbone.pos_encoding", "alibi",
            "--model.init_args.backbone.n_layer", "2", "--model.init_args.backbone.n_head", "2",
            "--model.init_args.backbone.n_embd", "32", "--model.init_args.warmup_steps", "1",
            "--data.path", data, "--data.block_size", "32", "--data.micro_batch_size", "4",
            "--data.eval_lengths", lengths, "--data.eval_tokens", "128", "--trainer.accelerator", "cpu",
            "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_model_summary", "false",
            "--checkpoint.every_n_train_steps", "2", "--runs_dir", runs, "--experiment", "diag",
            "--seed_everything", "5"]


def test_validate_writes_the_diagnostics_at_every_length(tiny_corpus_dir, tmp_path):
    runs = str(tmp_path)
    main(cli_args(tiny_corpus_dir, runs))
    ckpt = os.path.join(runs, "diag", "alibi", "checkpoints", "last.ckpt")
    main([*cli_args(tiny_corpus_dir, runs, "validate", "[32, 64, 128]"), "--ckpt_path", ckpt,
          "--diagnostics.windows", "1"])
    run = os.path.join(runs, "diag", "alibi", "version_1")
    rows = read_records(os.path.join(run, AttentionRecord.FILE), AttentionRecord)
    lengths = read_records(os.path.join(run, LengthRecord.FILE), LengthRecord)
    assert sorted({(r.length, r.layer, r.head) for r in rows}) == [(n, layer, head) for n in (32, 64, 128)
                                                                   for layer in (0, 1) for head in (0, 1)]
    assert {(r.pe, r.step, r.stage, r.checkpoint, r.run_seed) for r in rows} == \
        {(r.pe, r.step, r.stage, r.checkpoint, r.run_seed) for r in lengths} == {("alibi", 2, "validate", ckpt, 5)}
    assert all(r.windows == 1 and r.mass == pytest.approx(1.0) and 0 < r.entropy_norm <= 1 + 1e-6 for r in rows)
    # the validation records the recipe its checkpoint was trained by (the validate command trains nothing)
    trained = read_records(os.path.join(runs, "diag", "alibi", "version_0", LengthRecord.FILE), LengthRecord)
    assert trained[0].recipe["steps"] == 2 and trained[0].recipe["batch_tokens"] == 4 * 32
    assert trained[0].recipe["precision"] == "32-true"
    assert all(r.recipe == trained[0].recipe and r.machine.startswith("cpu") for r in rows + lengths)
    gains = read_records(os.path.join(run, LongContextRecord.FILE), LongContextRecord)
    assert [(r.length, r.tokens, r.context) for r in gains] == [(64, 32, 32), (128, 96, 32)]
    events = EventAccumulator(run, size_guidance={"images": 0}).Reload()
    assert {f"attention/{name}" for name in QUANTITIES} <= set(events.Tags()["images"])
    assert "long_context/key_share/len_128" in events.Tags()["scalars"]


def record(pe, seed, length, layer, head, entropy, **extra):
    values = dict.fromkeys(QUANTITIES, 0.5) | {"entropy": entropy, "max_logit": float(head + layer)}
    return AttentionRecord(pe=pe, train_length=32, step=10, run_seed=seed, length=length, layer=layer, head=head,
                           windows=2, sink=4, local=4, **values, **extra)


def test_report_tables_and_figures_with_seed_intervals(tmp_path):
    rows = []
    for pe, shift in (("rope", 0.0), ("alibi", 1.0)):
        for seed in (1, 2, 3):
            append_records(str(tmp_path / pe / f"seed{seed}"), [
                record(pe, seed, length, layer, head, shift + seed + 0.1 * head + 0.01 * length)
                for length in (32, 64) for layer in (0, 1) for head in (0, 1)])
            rows.append(LongContextRecord(pe=pe, train_length=32, step=10, run_seed=seed, length=64, context=32,
                                          stride=8, threshold=2.0, windows=2, tokens=64, loss=3.0, loss_short=3.5,
                                          key_tokens=8 * seed, key_loss=1.0, key_loss_short=4.0, hurt_tokens=1,
                                          hurt_loss=5.0, hurt_loss_short=2.0))
    append_records(str(tmp_path / "gains"), rows)
    # the same encoding trained with document masking is another run: its own column, not a fourth seed of rope's
    append_records(str(tmp_path / "rope-docs"), [record("rope", 1, length, 0, 0, 9.0, layout="docs-train")
                                                 for length in (32, 64)])
    tables = diagnostics_report([str(tmp_path)], str(tmp_path / "out" / "r"))
    # a run's layer value is its heads' mean: seed + 0.05 + 0.64 for rope at 64 tokens
    expected = seed_interval([seed + 0.05 + 0.64 for seed in (1, 2, 3)])
    line = next(x for x in tables["attention"].splitlines() if x.startswith("| layer 1 | 64 |"))
    assert f"{expected.mean:.3f} [{expected.low:.3f}, {expected.high:.3f}]" in line.split("|")[4]  # rope's column
    header = next(x for x in tables["attention"].splitlines() if x.startswith("| rows |"))
    assert header == "| rows | length | alibi | rope | rope [docs-train] |"
    maxima = next(x for x in tables["attention"].split("### max_logit")[1].splitlines() if x.startswith("| all | 32"))
    assert maxima.count("2.000 [2.000, 2.000]") == 2  # the largest (head 1 + layer 1), the same every seed
    share = seed_interval([8 / 64, 16 / 64, 24 / 64])
    assert f"{share.mean:.3f} [{share.low:.3f}, {share.high:.3f}]" in tables["long context"]
    for name in QUANTITIES:
        assert (tmp_path / "out" / f"r_attention_{name}.png").stat().st_size > 1000
    assert (tmp_path / "out" / "r_long_context.png").stat().st_size > 1000
    lines = open(tmp_path / "out" / "r_attention.csv").read().splitlines()
    # (all + 2 layers) x 2 lengths x 2 encodings x 3 seeds, and (all + layer 0) x 2 lengths for the masked run
    assert len(lines) == 1 + len(QUANTITIES) * (3 * 2 * 2 * 3 + 2 * 2)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_device_work_counts_operators_reads_back_and_forwards(mode):
    """Reads back: a scalar (float, bool) or a whole tensor (.cpu, .tolist) of device memory; what was read back is
    host memory, free afterwards. Operators: what computes (not views). Forwards: passes through the blocks."""
    backbone, t = tiny_model(), torch.randn(4, 3)
    work = DeviceWork(backbone)
    with mode(), work:
        a = (t * 2).sum(0)  # 2 operators
        float(a[0]), bool(a[1] > 0)  # 2 reads, 1 operator
        host = a.cpu()  # 1 read, the copy 1 operator
        host.tolist(), float(host[0]), (host * 3).tolist()  # host memory
        t.tolist()  # 1 read
    assert work.counts() == {"forwards": 0, "kernels": 4, "transfers": 4}
    tokens = torch.randint(0, 40, (2, 9))
    with mode(), work:
        backbone.token_nll(tokens[:, :-1], tokens[:, 1:])
        backbone.token_nll(tokens[:, :-1], tokens[:, 1:])
    assert work.forwards == 2 and work.kernels > 4


def counted(work: DeviceWork, fn):
    def run(*args, **kwargs):
        with work:
            return fn(*args, **kwargs)
    return run


def test_diagnostics_work_is_bounded_by_the_length_evaluations(tiny_corpus_dir, tmp_path):
    """Counted on CPU (what a GPU would launch and wait for; docs/diagnostics.md#cost), one validation at 1x, 2x and
    4x the training length: the diagnostics pass through the model at most twice per length (the recorded forward
    and one short-context forward), so at most twice as often as the length evaluation, which makes at least one
    pass per length; they read back to the host at most twice per length (the attention statistics and the key
    tokens' figures), not once per layer, head and quantity."""
    lengths = [32, 64, 128]
    dm = TokenDataModule(tiny_corpus_dir, block_size=32, micro_batch_size=4, eval_lengths=lengths, eval_tokens=128)
    torch.manual_seed(0)
    model = CausalLM(BackboneConfig(pos_encoding="alibi", n_layer=2, n_head=2, n_embd=32), data=dm.describe())
    diagnostics = AttentionDiagnostics()
    evaluation, diagnosed = DeviceWork(model.backbone), DeviceWork(model.backbone)
    model.validation_step = counted(evaluation, model.validation_step)
    model.on_validation_epoch_end = counted(evaluation, model.on_validation_epoch_end)
    diagnostics.on_validation_end = counted(diagnosed, diagnostics.on_validation_end)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[diagnostics])
    trainer.validate(model, datamodule=dm, verbose=False)
    counts = f"evaluation {evaluation.counts()}, diagnostics {diagnosed.counts()}"  # docs/diagnostics.md's table
    assert len({r.length for r in diagnostics.attention}) == len(lengths)
    assert evaluation.forwards >= len(lengths), counts
    assert diagnosed.forwards <= 2 * len(lengths) - 1, counts  # no short-context pass at 1x
    assert diagnosed.forwards <= 2 * evaluation.forwards, counts
    assert diagnosed.transfers <= 2 * len(lengths) - 1, counts


def peak_mib(fn) -> float:
    """The rise of this process's peak resident memory while ``fn`` runs (Linux: VmHWM reset through clear_refs)."""
    def status(key):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) / 1024

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


@pytest.mark.parametrize("backend", attn_mod.backends_for("foldable_bias", True))  # ALiBi: every backend
def test_diagnostics_memory_at_a_long_length_stays_near_the_evaluations(backend, monkeypatch):
    """At 4096 tokens the score matrix of one layer (2 heads, fp32) is 128 MiB; each backend's length evaluation holds
    far less except ``materialized`` (the chunked path's and the diagnostics' row blocks shrunk here to 2^20
    elements). The diagnostics' peak stays within twice the evaluation's plus their own row blocks: they never build
    the matrix. ``flex`` runs compiled, as on CUDA (CPU inductor, forward only): the diagnostics once forced
    everything eager, and an eager FlexAttention materializes the scores (about 460 MiB here)."""
    monkeypatch.setattr(diagnostics_module, "BLOCK_ELEMENTS", 2**20)
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2**20)
    monkeypatch.setattr(flex_mod, "FLEX_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(flex_mod, "_compiled_flex", {})
    t, heads = 4096, 2
    torch.manual_seed(0)
    backbone = build_backbone(BackboneConfig(pos_encoding="alibi", n_layer=1, n_head=heads, n_embd=32, vocab_size=96,
                                             block_size=t, attention_backend=backend)).eval()
    ids = torch.randint(0, 96, (1, t))
    with torch.no_grad():
        backbone.token_nll(ids, ids)  # compiles FlexAttention (flex), warms the allocator
    evaluation = peak_mib(lambda: torch.no_grad()(backbone.token_nll)(ids, ids))
    diagnosed = peak_mib(lambda: diagnose(backbone, ids, ids, train_length=t))
    own = 3 * 2**20 * 4 / 2**20  # the diagnostics' row blocks: 2^20 elements over every map, fp32, three times over
    matrix = heads * t * t * 4 / 2**20
    assert 2 * evaluation + own < matrix or backend == "materialized", (evaluation, matrix)
    assert diagnosed <= 2 * evaluation + own, f"diagnostics {diagnosed:.0f} MiB, evaluation {evaluation:.0f} MiB"
