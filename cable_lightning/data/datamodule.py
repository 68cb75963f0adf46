"""``TokenDataModule``: prepared token chunks -> training windows (shuffled, resumable) and fixed eval windows.

Train batches are ``LongTensor (micro_batch_size, block_size + 1)``; the model takes ``[:, :-1]`` as input and
``[:, 1:]`` as targets (or masks the first ``block_size`` for MLM). Validation scores the same stream, the first
``eval_tokens`` targets of the val split, at every evaluation length: one loader per (length, stride) in
``eval_specs``, each batch a dict ``{"tokens": (B, L + 1), "first_scored": (B,)}`` built by
:class:`cable_lightning.eval.EvalWindows` (stride L = the paper's non-overlapping windows).
"""

from __future__ import annotations

import os
import time
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler

from cable_lightning.data.manifest import MANIFEST, check_split, fix_command, read_manifest
from cable_lightning.data.tokenizers import Tokenizer, get_tokenizer

# How long other ranks wait for rank 0 to auto-prepare a missing corpus.
PREPARE_WAIT_S = 2 * 3600


def collate_tokens(windows: list[Any]) -> torch.Tensor:
    """Stack token windows (numpy uint16/int32 or tensors) into one int64 batch."""
    return torch.from_numpy(np.stack([np.asarray(w) for w in windows]).astype(np.int64))


class TokenDataModule(L.LightningDataModule):
    """Token windows from a folder written by ``python -m cable_lightning.data.prepare``.

    Args:
        path: the prepared folder (holds manifest.json, train/, val/).
        block_size: training context length; train windows hold ``block_size + 1`` tokens.
        micro_batch_size: windows per batch (per device).
        num_workers: DataLoader worker processes for training (0 reads in the main process). Eval windows
            come from a small in-memory stream and are always read in the main process.
        seed: shuffle seed of the training stream.
        eval_lengths: validation context lengths (default ``[block_size]``).
        eval_tokens: targets scored at every eval length (the same first tokens of the val split each time).
        eval_stride: also score each length longer than this with sliding windows advancing by ``eval_stride``
            tokens (ALiBi's appendix-B protocol); None scores non-overlapping windows only.
        source, tokenizer: when given and ``path`` is not prepared yet, prepare it from them first (rank 0 does
            it, other ranks wait); when ``path`` is prepared, they must match what it was prepared from.
    """

    def __init__(
        self,
        path: str = "data/pydocs-bpe4096",
        block_size: int = 128,
        micro_batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 42,
        eval_lengths: list[int] | None = None,
        eval_tokens: int = 65536,
        eval_stride: int | None = None,
        source: str | None = None,
        tokenizer: str | None = None,
    ):
        super().__init__()
        for name, value in (("block_size", block_size), ("micro_batch_size", micro_batch_size), ("eval_tokens", eval_tokens)):
            if int(value) < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if eval_lengths is not None and (not eval_lengths or any(int(n) < 1 for n in eval_lengths)):
            raise ValueError(f"eval_lengths must be a non-empty list of positive lengths, got {eval_lengths}")
        if eval_stride is not None and int(eval_stride) < 1:
            raise ValueError(f"eval_stride must be a positive number of tokens or None, got {eval_stride}")
        if (source is None) != (tokenizer is None):
            raise ValueError("give both data.source and data.tokenizer (to prepare a missing corpus) or neither")
        self.path = str(path)
        self.block_size = int(block_size)
        self.micro_batch_size = int(micro_batch_size)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.eval_lengths = None if eval_lengths is None else [int(n) for n in eval_lengths]
        self.eval_tokens = int(eval_tokens)
        self.eval_stride = None if eval_stride is None else int(eval_stride)
        self.source = source
        self.tokenizer_spec = tokenizer
        self._manifest: dict[str, Any] | None = None
        self._tokenizer: Tokenizer | None = None
        self._eval_streams: dict[str, torch.Tensor] = {}
        self._train_loader: Any = None
        self._pending_train_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ what the data is

    @property
    def manifest(self) -> dict[str, Any]:
        """The prepared folder's manifest; reading it also checks that every chunk is present and whole."""
        if self._manifest is None:
            if self.source is not None and not os.path.isfile(os.path.join(self.path, MANIFEST)):
                self._prepare_missing()
            manifest = read_manifest(self.path)
            if self.source is not None:
                self._check_request(manifest)
            self._manifest = manifest
        return self._manifest

    def _prepare_missing(self) -> None:
        """Auto-prepare ``path`` from ``source``/``tokenizer`` (rank 0); other ranks wait for the manifest."""
        if rank_zero_only.rank == 0:
            from cable_lightning.data.prepare import prepare

            prepare(source=self.source, tokenizer=self.tokenizer_spec, out=self.path)
            return
        deadline = time.time() + PREPARE_WAIT_S
        while not os.path.isfile(os.path.join(self.path, MANIFEST)):
            if time.time() > deadline:
                raise TimeoutError(f"rank {rank_zero_only.rank} waited {PREPARE_WAIT_S} s for rank 0 to prepare {self.path}; prepare it before launching: {fix_command(self.path, {'request': {'source': self.source, 'tokenizer': self.tokenizer_spec}})}")
            time.sleep(5)

    def _check_request(self, manifest: dict[str, Any]) -> None:
        request = manifest.get("request", {})
        wanted = {"source": self.source, "tokenizer": self.tokenizer_spec}
        if request.get("source") != self.source:  # maybe another spelling of it (fineweb-edu:sample-10BT)
            from cable_lightning.data.sources import get_source

            try:
                wanted["source"] = get_source(self.source).name
            except (ValueError, OSError):  # e.g. local files deleted after preparing: compare the spec as given
                pass
        have = {k: request.get(k) for k in wanted}
        if have != wanted:
            raise ValueError(
                f"data at {self.path} was prepared from {have['source']!r} with {have['tokenizer']!r}, but the data section asks "
                f"for {wanted['source']!r} with {wanted['tokenizer']!r}; point data.path elsewhere or re-prepare with --overwrite"
            )

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.manifest["eot_id"])

    @property
    def mask_id(self) -> int:
        return int(self.manifest["mask_id"])

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids MLM masking must never choose (separators, padding...), as recorded by prepare."""
        return tuple(int(i) for i in self.manifest.get("special_ids", [self.eot_id]))

    @property
    def tokenizer_identity(self) -> dict[str, Any]:
        return dict(self.manifest["tokenizer"]["identity"])

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer that made the data (for decoding samples); its identity must match the manifest's."""
        if self._tokenizer is None:
            info = self.manifest["tokenizer"]
            ref = os.path.join(self.path, info["file"]) if info.get("file") else info["spec"]
            tok = get_tokenizer(ref, name=info["identity"]["name"])
            if tok.identity != info["identity"]:
                raise ValueError(
                    f"tokenizer {ref} (hash {tok.identity['hash'][:12]}) differs from the one that prepared {self.path} "
                    f"(hash {info['identity']['hash'][:12]}); run {fix_command(self.path, self.manifest, True)}"
                )
            self._tokenizer = tok
        return self._tokenizer

    def check_tokenizer(self, identity: dict[str, Any]) -> None:
        """Raise when a checkpoint's tokenizer identity is not the one this data was prepared with."""
        mine = self.tokenizer_identity
        if identity.get("hash") != mine["hash"] or identity.get("kind") != mine["kind"]:
            raise ValueError(
                f"checkpoint was trained with tokenizer {identity.get('name')!r} (hash {str(identity.get('hash'))[:12]}) "
                f"but data at {self.path} uses {mine['name']!r} (hash {mine['hash'][:12]}); re-prepare the data with "
                f"--tokenizer {identity.get('name')} or pick the matching data"
            )

    @property
    def eval_specs(self) -> list[tuple[int, int]]:
        """(length, stride) of each eval dataloader, in dataloader_idx order: every length non-overlapping
        (stride = length), then the sliding ones when ``eval_stride`` is set."""
        lengths = list(self.eval_lengths) if self.eval_lengths else [self.block_size]
        specs = [(n, n) for n in lengths]
        if self.eval_stride is not None:
            specs += [(n, self.eval_stride) for n in lengths if self.eval_stride < n]
        return specs

    # ------------------------------------------------------------------ loaders

    def _split_dir(self, split: str) -> str:
        if split not in self.manifest["splits"]:
            raise ValueError(f"{self.path} has no {split!r} split (it has {', '.join(self.manifest['splits'])})")
        return os.path.join(self.path, split)

    def train_dataloader(self) -> Any:
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        dataset = StreamingDataset(
            self._split_dir("train"),
            item_loader=TokensLoader(block_size=self.block_size + 1),
            shuffle=True,
            seed=self.seed,
            drop_last=True,
        )
        if len(dataset) == 0:
            tokens = self.manifest["splits"]["train"]["tokens"]
            raise ValueError(f"train split of {self.path} has {tokens} tokens: no window of block_size + 1 = {self.block_size + 1} fits; lower block_size")
        loader = StreamingDataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            num_workers=self.num_workers,
            collate_fn=collate_tokens,
            drop_last=True,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )
        if self._pending_train_state is not None:
            loader.load_state_dict(self._pending_train_state)
            self._pending_train_state = None
        self._train_loader = loader
        return loader

    def val_dataloader(self) -> Any:
        return self._eval_loaders("val")

    def test_dataloader(self) -> Any:
        """The source's own test split when it has one (wikitext-103), else val; same protocol as validation."""
        return self._eval_loaders("test" if "test" in self.manifest["splits"] else "val")

    def eval_stream(self, split: str = "val") -> torch.Tensor:
        """The first ``max(eval_tokens, longest eval length) + 1`` tokens of ``split`` (int64), read once."""
        if split not in self._eval_streams:
            from litdata import StreamingDataset, TokensLoader

            longest = max(length for length, _ in self.eval_specs)
            total = int(self.manifest["splits"][split]["tokens"])
            first_chunk = int(check_split(self.path, split, self.manifest)["chunks"][0]["dim"])
            if first_chunk < longest + 1:
                raise ValueError(
                    f"eval length {longest} needs {longest + 1} consecutive tokens but the {split} split of {self.path} "
                    f"has {total} tokens{'' if first_chunk == total else f' ({first_chunk} in its first chunk)'}; "
                    "drop that length from eval_lengths or hold out more validation data"
                )
            want = max(self.eval_tokens, longest) + 1
            if want > first_chunk:
                rank_zero_warn(f"eval_tokens={self.eval_tokens} asks for more than the {first_chunk - 1} targets in the first {split} chunk of {self.path}; scoring {first_chunk - 1}")
            count = min(want, first_chunk)
            window = StreamingDataset(self._split_dir(split), item_loader=TokensLoader(block_size=count), shuffle=False)[0]
            self._eval_streams[split] = torch.from_numpy(np.asarray(window).astype(np.int64))
        return self._eval_streams[split]

    def _eval_loaders(self, split: str) -> Any:
        from cable_lightning.eval import EvalWindows

        tokens = self.eval_stream(split)
        trainer = getattr(self, "trainer", None)
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        loaders = []
        for length, stride in self.eval_specs:
            windows = EvalWindows(tokens, length, stride, rank=rank, world_size=world)
            loaders.append(
                DataLoader(
                    windows,
                    batch_size=self.micro_batch_size if length <= self.block_size else 1,
                    # EvalWindows already holds this rank's share; a DistributedSampler over one replica keeps
                    # Lightning from splitting (and padding) it a second time.
                    sampler=DistributedSampler(windows, num_replicas=1, rank=0, shuffle=False),
                    num_workers=0,
                )
            )
        return loaders[0] if len(loaders) == 1 else loaders

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """The training loader's position (litdata state), saved into Lightning checkpoints by the Trainer."""
        if self._train_loader is not None:
            loader_state = self._train_loader.state_dict()
        elif self._pending_train_state is not None:
            loader_state = self._pending_train_state
        else:
            return {}
        return {"train_loader": loader_state, "settings": self._resume_settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the training position; applied when ``train_dataloader`` builds the loader."""
        if not state_dict or "train_loader" not in state_dict:
            return
        saved = state_dict.get("settings", {})
        mine = self._resume_settings()
        changed = {k: (saved[k], mine[k]) for k in mine if k in saved and saved[k] != mine[k]}
        if changed:
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            raise ValueError(f"cannot resume the training stream: data settings changed since the checkpoint ({what}); restore them or start a new run")
        self._pending_train_state = state_dict["train_loader"]
        if self._train_loader is not None:  # loader already built (e.g. state loaded late): apply now
            self._train_loader.load_state_dict(self._pending_train_state)
            self._pending_train_state = None

    def _resume_settings(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "micro_batch_size": self.micro_batch_size,
            "seed": self.seed,
            "tokenizer_hash": self.tokenizer_identity["hash"],
            "train_tokens": self.manifest["splits"]["train"]["tokens"],
        }
