"""TokenDataModule (data/datamodule.py): what a run reads from a prepared folder: batches, evaluation loaders,
resumes that continue the exact stream, missing data named, the CLI preparing first. CPU only, no network."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import SMALL_DOCS, fast_prepare, one_line, read_split_tokens

from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.manifest import read_manifest
from cable_lightning.data.tokenizers import EOT_TOKEN
from cable_lightning.errors import ConfigError

pytestmark = pytest.mark.usefixtures("no_network")


def test_datamodule_describes_the_manifest(tiny_corpus_dir):
    info = TokenDataModule(tiny_corpus_dir, block_size=64, eval_lengths=[64, 128], eval_stride=32).describe()
    assert (info.vocab_size, info.eot_id, info.mask_id, info.special_ids) == (512, 0, 1, (0, 1))
    assert info.tokenizer == read_manifest(tiny_corpus_dir)["tokenizer"]["identity"]
    assert info.block_size == 64 and info.eval_specs == ((64, 64), (128, 128), (64, 32), (128, 32))
    assert type(info).from_dict(json.loads(json.dumps(info.as_dict()))) == info, "survives a plain-values round trip"


def test_train_batches(tiny_corpus_dir):
    dm = TokenDataModule(tiny_corpus_dir, block_size=64, micro_batch_size=4)
    loader = dm.train_dataloader()
    train_tokens = read_manifest(tiny_corpus_dir)["splits"]["train"]["tokens"]
    assert len(loader) == train_tokens // 65 // 4
    batches = [b for _, b in zip(range(3), loader)]
    for batch in batches:
        assert batch.shape == (4, 65) and batch.dtype == torch.int64
        assert 0 <= int(batch.min()) and int(batch.max()) < 512
    assert not torch.equal(batches[0], batches[1])
    # Windows are real stretches of the stream: the first window is found verbatim in the train tokens.
    stream = read_split_tokens(tiny_corpus_dir, "train")
    first = batches[0][0].numpy()
    starts = np.flatnonzero(stream[: len(stream) - 64] == first[0])
    assert any(np.array_equal(stream[s : s + 65], first) for s in starts)


def test_shuffle_depends_on_seed(tiny_corpus_dir):
    first = [next(iter(TokenDataModule(tiny_corpus_dir, block_size=32, seed=s).train_dataloader())) for s in (1, 1, 2)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])


def test_val_loaders_per_length(tiny_corpus_dir):
    dm = TokenDataModule(tiny_corpus_dir, block_size=64, micro_batch_size=4, eval_lengths=[32, 64, 256],
                         eval_tokens=2048)
    loaders = dm.val_dataloader()
    assert dm.eval_specs() == [(32, 32), (64, 64), (256, 256)]
    assert isinstance(loaders, list) and len(loaders) == 3
    val = torch.from_numpy(read_split_tokens(tiny_corpus_dir, "val").astype(np.int64))
    for length, loader, batch_size in zip([32, 64, 256], loaders, [4, 4, 1]):
        batches = list(loader)
        assert batches[0]["tokens"].shape == (batch_size, length + 1)
        windows = torch.cat([b["tokens"] for b in batches])
        scored = sum(int((length - b["first_scored"]).sum()) for b in batches)
        assert scored == 2048, "every length scores the same eval_tokens targets"
        assert len(windows) == -(-2048 // length)
        assert torch.equal(windows[0], val[: length + 1])  # the head of the val split
        if len(windows) > 1:
            assert torch.equal(windows[1], val[length : 2 * length + 1])  # non-overlapping: next window
    single = TokenDataModule(tiny_corpus_dir, block_size=64, eval_tokens=1024).val_dataloader()
    assert isinstance(single, torch.utils.data.DataLoader)


def test_sliding_eval_specs(tiny_corpus_dir):
    dm = TokenDataModule(tiny_corpus_dir, block_size=64, eval_lengths=[32, 128], eval_stride=64, eval_tokens=1024)
    assert dm.eval_specs() == [(32, 32), (128, 128), (128, 64)]
    sliding = dm.val_dataloader()[2]
    assert sum(int((128 - b["first_scored"]).sum()) for b in sliding) == 1024


def test_eval_length_longer_than_val_is_named(tiny_corpus_dir):
    val_tokens = read_manifest(tiny_corpus_dir)["splits"]["val"]["tokens"]
    dm = TokenDataModule(tiny_corpus_dir, eval_lengths=[64, 1_000_000])
    with pytest.raises(ValueError) as exc:
        dm.val_dataloader()
    message = one_line(exc)
    assert "1000000" in message and str(val_tokens) in message


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_resume_continues_the_exact_stream(tiny_corpus_dir):
    """Consume k batches, save the loader's state (what Lightning stores in a checkpoint), rebuild from it: the
    next batches are the uninterrupted run's. litdata itself refuses a state that no longer fits the data."""
    settings = dict(block_size=32, micro_batch_size=4, seed=7)
    expected = _take(iter(TokenDataModule(tiny_corpus_dir, **settings).train_dataloader()), 11)

    loader = TokenDataModule(tiny_corpus_dir, **settings).train_dataloader()
    it = iter(loader)
    assert all(torch.equal(a, b) for a, b in zip(_take(it, 6), expected[:6]))
    state = loader.state_dict()
    assert state["num_samples_yielded"] == 6 * 4

    resumed = TokenDataModule(tiny_corpus_dir, **settings).train_dataloader()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_take(iter(resumed), 5), expected[6:]))

    other = TokenDataModule(tiny_corpus_dir, **{**settings, "block_size": 64}).train_dataloader()
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="`item_loader`"):  # refused before, by the model (trained at block_size 32)
        next(iter(other))
    reseeded = TokenDataModule(tiny_corpus_dir, **{**settings, "seed": 8}).train_dataloader()
    with pytest.raises(ConfigError, match="shuffled with data.seed 7, this run.s data.seed is 8; resume with"):
        reseeded.load_state_dict(state)


def test_a_resume_on_fewer_processes_continues_with_the_epochs_unseen_windows(small_corpus_dir, monkeypatch):
    """Two ranks read 2 batches each, and rank 0's loader state (what a checkpoint holds) is resumed by one process:
    litdata resumes elastically, with exactly the windows neither rank read in that epoch (none twice, none lost),
    then the one-process run's next epoch. (Environment variables stand in for the process group here.)"""
    settings = dict(block_size=128, micro_batch_size=8, seed=7)

    def loader(world_size, rank):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("GLOBAL_RANK", str(rank))
        return TokenDataModule(small_corpus_dir, **settings).train_dataloader()

    def windows(batches):
        return [row.numpy().tobytes() for batch in batches for row in batch]

    epoch = set()
    for rank in (0, 1):
        epoch |= set(windows(loader(2, rank)))
    ranks = [loader(2, rank) for rank in (0, 1)]
    read = [windows(_take(iter(one), 2)) for one in ranks]
    state = ranks[0].state_dict()
    alone = loader(1, 0)
    alone.load_state_dict(state)
    rest = windows(alone)
    assert len(epoch) == 96 and len(rest) == 64
    assert set(rest) == epoch - set(read[0]) - set(read[1])
    uninterrupted = loader(1, 0)
    list(uninterrupted)
    assert windows(alone) == windows(uninterrupted)


def test_resume_through_trainer_checkpoint(tiny_corpus_dir, tmp_path):
    """The same through Lightning: a checkpoint saved mid-run by ModelCheckpoint, resumed with ckpt_path."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch.clone())
            return self.w * batch.float().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(steps, root, ckpt_path=None, callbacks=()):
        model = Recorder()
        trainer = L.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, default_root_dir=str(root),
            callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
        )
        trainer.fit(model, TokenDataModule(tiny_corpus_dir, block_size=16, micro_batch_size=2), ckpt_path=ckpt_path)
        return model.seen

    ckpt_dir = tmp_path / "ckpt"
    full = fit(8, tmp_path / "a", callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1)])
    ckpt = next(p for p in os.listdir(ckpt_dir) if "step=5" in p)
    saved = torch.load(ckpt_dir / ckpt, weights_only=False)
    assert "TokenDataModule" not in saved, "one copy of the position: Lightning's, not the DataModule's"
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["num_samples_yielded"] == 5 * 2
    rest = fit(8, tmp_path / "b", ckpt_path=str(ckpt_dir / ckpt))
    assert len(full) == 8 and len(rest) == 3
    assert all(torch.equal(a, b) for a, b in zip(rest, full[5:]))


def test_missing_or_corrupt_data_is_named(tiny_corpus_dir, tmp_path):
    def error(path):
        with pytest.raises((FileNotFoundError, ValueError)) as exc:
            TokenDataModule(str(path)).describe()
        return one_line(exc)

    assert "python -m cable_lightning prepare" in error(tmp_path / "nowhere")
    broken = tmp_path / "copy"
    shutil.copytree(tiny_corpus_dir, broken)
    manifest = broken / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good[:100])
    assert str(manifest) in error(broken) and "--overwrite" in error(broken)
    manifest.unlink()
    assert "no manifest.json" in error(broken)
    manifest.write_text(good)
    val = broken / "val.npy"
    val.write_bytes(val.read_bytes()[:1000])
    assert str(val) in error(broken)
    shutil.copy(os.path.join(tiny_corpus_dir, "val.npy"), val)
    chunk = broken / "train" / json.loads((broken / "train" / "index.json").read_text())["chunks"][0]["filename"]
    chunk.write_bytes(chunk.read_bytes()[:1000])
    assert str(chunk) in error(broken) and "truncated" in error(broken)
    chunk.unlink()
    assert str(chunk) in error(broken) and "missing" in error(broken)


def test_the_cli_prepares_first_from_source_and_tokenizer(small_txt_dir, tmp_path, monkeypatch):
    """The data module only reads; the CLI prepares the data section's path first when it names a source."""
    import cable_lightning.data.prepare as prep
    from cable_lightning.run_setup import prepare_first

    real = prep.prepare  # not fast_prepare, which would call this stand-in
    monkeypatch.setattr(prep, "prepare", lambda **kw: real(**kw, val_tokens=50, num_workers=1, start_method="fork",
                                                            verbose=False))
    path = str(tmp_path / "auto")
    dm = TokenDataModule(path, source=small_txt_dir, tokenizer="bpe:300")
    with pytest.raises(FileNotFoundError):
        dm.describe()  # describing never prepares
    prepare_first(dm)
    assert dm.describe().vocab_size == 300 and os.path.isfile(os.path.join(path, "manifest.json"))
    with pytest.raises(ValueError) as exc:
        prepare_first(TokenDataModule(path, source=small_txt_dir, tokenizer="bpe:400"))
    assert "bpe:300" in one_line(exc) and "bpe:400" in str(exc.value)


def test_causal_training_takes_a_tokenizer_without_mask_and_mlm_refuses_it(small_txt_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from cable_lightning.lit import CausalLM, MaskedLM
    from cable_lightning.models import BackboneConfig

    vocab = {EOT_TOKEN: 0, **{ch: i + 1 for i, ch in enumerate(sorted(set("".join(SMALL_DOCS))))}, "[UNK]": 999}
    no_mask = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    no_mask.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    no_mask.add_special_tokens([EOT_TOKEN])
    path = str(tmp_path / "tokenizer.json")
    no_mask.save(path)
    out = str(tmp_path / "nomask")
    manifest = fast_prepare(source=small_txt_dir, tokenizer=path, out=out, val_tokens=50)
    assert manifest["mask_id"] is None and manifest["special_ids"] == [0]
    info = TokenDataModule(out, block_size=16).describe()
    model = CausalLM(BackboneConfig(n_layer=1, n_head=2, n_embd=16), data=info)
    assert model.config.vocab_size == 1000
    with pytest.raises(ValueError) as exc:
        MaskedLM(BackboneConfig(preset="bert-base", n_layer=1, n_head=2, n_embd=16), data=info)
    assert "mask token" in one_line(exc) and "tokenizer" in str(exc.value)
