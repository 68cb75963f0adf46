"""``TokenDataModule``: a prepared folder -> shuffled, resumable training windows and fixed evaluation windows.

Train batches are ``LongTensor (micro_batch_size, block_size + 1)`` from litdata's StreamingDataLoader; Lightning
saves and restores its position in checkpoints (and litdata refuses a state that no longer fits the data). Every
evaluation length scores the same first ``eval_tokens`` targets of the held-out array: one loader per
(length, stride) in ``eval_specs()``, each batch ``{"tokens": (B, L + 1), "first_scored": (B,)}``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from cable_lightning.data.layouts import TrainingLayout
from cable_lightning.data.lengths import Lengths, length_list
from cable_lightning.data.manifest import DataInfo, load_split, read_manifest
from cable_lightning.data.remote import Store, is_remote
from cable_lightning.data.tokenizers import Tokenizer, get_tokenizer
from cable_lightning.data.windows import EvalWindows
from cable_lightning.tasks.generation import EVAL, OWN_MASK_ID, OWN_VOCABULARY, TaskMix, TaskVocabulary

from ..errors import ConfigError

# LitData reads its number of nodes from NNODES (a name launch scripts often export for torchrun) or guesses it as
# world size // visible GPUs. With more than one, litdata 0.2.76 keeps each node's chunks from the first epoch on, and
# from the second epoch the nodes' shares overlap (a chunk split between two nodes is read whole by both) and differ in
# length, some windows read by no rank (tests/test_multinode.py runs two nodes so). As one node it assigns each
# epoch's windows over all ranks afresh: disjoint, equal shares, each node streaming about 1/num_nodes of the chunks.
LITDATA_NODES = "NNODES"


def collate_tokens(windows: list[Any]) -> torch.Tensor:
    """Stack token windows (numpy uint16/int32) into one int64 batch."""
    return torch.from_numpy(np.stack([np.asarray(w) for w in windows]).astype(np.int64))


def check_token_ids(tokens: torch.Tensor | np.ndarray, vocab_size: int, where: str) -> None:
    """Ids the embedding cannot look up are a one-line error naming where they were read, not torch's IndexError."""
    largest, smallest = int(tokens.max()), int(tokens.min())
    if largest >= vocab_size or smallest < 0:
        bad = largest if largest >= vocab_size else smallest
        raise ConfigError(f"token id {bad} in {where} is outside the model's vocabulary of {vocab_size} ids: the data "
                          "is corrupt or was not made with the model's tokenizer; prepare it again with that tokenizer "
                          "(or point data.path at data that was)")


@functools.cache
def _stream_loader_class() -> type:
    from litdata import StreamingDataLoader

    class StreamLoader(StreamingDataLoader):
        """LitData's loader, resumable on another node: the folder a streamed dataset caches its chunks in is where
        this node keeps them, not part of the position, so a checkpoint's is replaced by this run's (same URL).

        And resumable across epochs: litdata ends a resumed epoch only when its iterator runs dry, but Lightning
        stops after ``len(loader)`` batches without asking for one more, so the next epoch would resume the loaded
        position again (replaying the last epoch's batches from the last checkpoint's position, every later batch
        shifted). An epoch whose batches were all yielded is over: the next iteration starts the next epoch, as in an
        uninterrupted run."""

        def __iter__(self):
            if self.restore and self.epoch_read():
                self.restore = False  # litdata then clears the dataset's loaded state and moves to the next epoch
            yield from super().__iter__()

        def epoch_read(self) -> bool:
            """Whether the epoch's windows were all yielded, counted over every rank: after a resume on another
            number of processes litdata counts this loader's yield from 0, after the windows the old ranks read
            (its ``_elastic_drop_first``), and the resumed epoch must end there too, not start again empty."""
            world = self.dataset.distributed_env.world_size
            before = getattr(self.dataset, "_elastic_drop_first", None) or 0
            return before + self._num_samples_yielded_streaming * world >= len(self) * self.batch_size * world

        def load_state_dict(self, obj: dict[str, Any]) -> None:
            state, url = obj.get("dataset"), getattr(self.dataset.input_dir, "url", None)
            saved_seed = state.get("seed") if isinstance(state, dict) else None
            if saved_seed is not None and saved_seed != self.dataset.seed:  # litdata's word: a traceback, later
                raise ConfigError(f"the checkpoint's training stream was shuffled with data.seed {saved_seed}, this "
                                  f"run's data.seed is {self.dataset.seed}; resume with --data.seed {saved_seed}, or "
                                  "start a new run from its weights (--model.init_args.init_weights)")
            if url and isinstance(state, dict) and state.get("input_dir_url") == url:
                obj = {**obj, "dataset": {**state, "input_dir_path": self.dataset.input_dir.path}}
            super().load_state_dict(obj)

    return StreamLoader


def local_rank_zero_first(trainer: Any, build: Callable[[], Any]) -> Any:
    """``build()`` on local rank 0, then on the node's other ranks once it has finished. A store's dataset downloads
    its chunk index into a cache folder every rank of a node shares, and LitData lets a rank that finds another's
    download under way wait only a second before reading a file that is not there yet (Lightning-AI/litData#337);
    after local rank 0 the others find the index in place. Rank 0's error reaches the barrier first, so no rank waits
    on it forever."""
    if trainer is None or trainer.world_size == 1:
        return build()
    if trainer.local_rank != 0:
        trainer.strategy.barrier("local-rank-zero-first")
        return build()
    try:
        return build()
    finally:
        trainer.strategy.barrier("local-rank-zero-first")


class BlankRows(IterableDataset):
    """Endless blank (rows, length) batches for a run of tasks alone: the rows are made from the batch number in
    ``on_before_batch_transfer``, where a resumed run knows it, so the loader itself carries no position."""

    def __init__(self, rows: int, length: int):
        self.rows, self.length = rows, length

    def __iter__(self):
        while True:
            yield torch.zeros(self.rows, self.length, dtype=torch.long)


class TokenDataModule(L.LightningDataModule):
    """Token windows from a folder written by ``python -m cable_lightning prepare``.

    Args:
        path: the prepared folder (manifest.json, train/, val.npy).
        block_size: training context length; train windows hold ``block_size + 1`` tokens.
        micro_batch_size: windows per batch (per device).
        num_workers: DataLoader worker processes for training (evaluation reads in the main process).
        seed: shuffle seed of the training stream.
        eval_lengths: validation context lengths (default ``[block_size]``): lengths and ranges
            (``[128, 256]``, ``"128..2048 step 128"``; :func:`.lengths.length_list`).
        eval_tokens: targets scored at every eval length (the same first tokens of the held-out split each time).
        eval_stride: also score each length longer than this with sliding windows advancing by ``eval_stride``
            tokens (ALiBi's appendix-B protocol); None scores non-overlapping windows only.
        source, tokenizer: what ``path`` is prepared from, when given: the CLI prepares it first (a no-op on a
            finished folder, an error on one prepared from something else; :func:`..run_setup.prepare_first`).
            This class only reads a prepared folder.
        cache_dir: for an ``s3://bucket/prefix`` path, the local folder for streamed chunks and the fetched
            manifest, index and held-out arrays (default: LitData's, ``$LITDATA_CACHE_DIR`` or
            ``~/.lightning/chunks``).
        max_cache_size: the most disk the streamed chunks may take there, e.g. ``"200GB"`` (default: LitData's, 75%
            of the free disk, leaving 50 GB free where it can); least-recently-used chunks are evicted.
        endpoint_url: an S3-compatible store's endpoint (default: boto3's, from ``AWS_ENDPOINT_URL`` or the
            profile); credentials and region always come from boto3's usual places.
        tasks: synthetic tasks to train on, ``{name: {setting: value}}`` (:mod:`cable_lightning.tasks`), taken in
            turn; training batches become ``{"tokens", "loss_weight"}``. An algorithmic task (the Chomsky-hierarchy
            benchmark, :mod:`cable_lightning.tasks.chomsky`) trains alone: each batch draws one input length in
            [1, ``block_size``] and its rows hold that many input symbols and the output (``block_size`` is the
            longest input trained on, not the tokens read). With ``path`` null the tasks use a
            vocabulary of their own and validation perplexity is measured on task examples; with a prepared
            ``path``, its tokenizer's ids (and its text, for ``passkey``).
        task_fraction: the share of each training batch's rows that are task examples (the rest: the corpus).
        lm_loss_weight: the loss weight of a task row's tokens other than its answer (0: answer tokens only; 1:
            the ordinary language-model loss on the whole row). Corpus rows weigh 1 everywhere.
        layout: what training sees of a block (``cable_lightning.data.layouts``): document masking
            (``--data.layout.documents train``), randomized or PoSE positions, a length schedule.
    """

    def __init__(self, path: str | None = "data/pydocs-bpe4096", block_size: int = 128, micro_batch_size: int = 8,
                 num_workers: int = 0, seed: int = 42, eval_lengths: Lengths | None = None, eval_tokens: int = 65536,
                 eval_stride: int | None = None, source: str | None = None, tokenizer: str | None = None,
                 tasks: dict[str, Any] | None = None,  # each task's settings checked by TaskMix, in one line
                 task_fraction: float = 1.0, lm_loss_weight: float = 0.0, cache_dir: str | None = None,
                 max_cache_size: str | None = None, endpoint_url: str | None = None,
                 layout: TrainingLayout = TrainingLayout()):
        super().__init__()
        self.layout = layout if isinstance(layout, TrainingLayout) else TrainingLayout.from_dict(layout)
        self.layout.check(block_size)
        for name, value in (("task_fraction", task_fraction), ("lm_loss_weight", lm_loss_weight)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        task_mix = TaskMix(tasks) if tasks is not None else None  # an empty, unknown or bad task: one line, now
        if task_mix is not None and task_mix.algorithmic and path is not None:
            raise ConfigError(f"task {task_mix.tasks[0].name} is algorithmic: it trains alone, in the tasks' own "
                              f"vocabulary; set data.path null (got {path!r})")
        if path is None and (not tasks or task_fraction < 1 or source is not None):
            raise ConfigError("data.path is null, which only a run of tasks alone can be (data.tasks set, "
                              f"task_fraction 1, no source); got tasks={tasks}, task_fraction={task_fraction}; "
                              "point data.path at a prepared corpus")
        for name, value, minimum in (("block_size", block_size, 1), ("micro_batch_size", micro_batch_size, 1),
                                     ("eval_tokens", eval_tokens, 1), ("num_workers", num_workers, 0)):
            if value < minimum:
                raise ConfigError(f"{name} must be an integer >= {minimum}, got {value}")
        if eval_stride is not None and eval_stride < 1:
            raise ConfigError(f"eval_stride must be positive or None, got {eval_stride}")
        if (source is None) != (tokenizer is None):
            raise ConfigError("give both data.source and data.tokenizer (to prepare a missing corpus) or neither")
        self.path, self.block_size, self.micro_batch_size = path, int(block_size), int(micro_batch_size)
        self.num_workers, self.seed, self.eval_tokens = int(num_workers), int(seed), int(eval_tokens)
        self.eval_lengths = [int(block_size)] if eval_lengths is None else length_list(eval_lengths,
                                                                                         "data.eval_lengths")
        self.eval_stride = None if eval_stride is None else int(eval_stride)
        self.source, self.tokenizer_spec = source, tokenizer
        self.cache_dir, self.max_cache_size, self.endpoint_url = cache_dir, max_cache_size, endpoint_url
        self.store = Store(self.path, endpoint_url) if is_remote(self.path) else None  # a bad URL fails here
        self.folder = None if self.store else self.path  # local: the path; remote: its fetched small files
        self.task_settings, self.task_fraction, self.lm_loss_weight = tasks, float(task_fraction), float(lm_loss_weight)
        self.tasks = task_mix
        if self.tasks is not None:
            if path is None:
                self.tasks.vocab = TaskVocabulary.own()
                text = ", ".join(task.name for task in self.tasks.tasks if task.needs_text)
                if text:  # not a length problem: check_tasks would blame data.block_size
                    raise ConfigError(f"task {text} is written in text and needs a prepared corpus's tokenizer, but "
                                      "data.path is null (the tasks' own vocabulary has no text); point data.path at a "
                                      f"prepared corpus, or leave {text} out of data.tasks")
            self.check_tasks()
        self._manifest: dict[str, Any] | None = None
        self._eval_streams: dict[str, torch.Tensor] = {}

    def describe(self) -> DataInfo:
        """What the model needs from the data; the manifest is read and every file checked once."""
        if self.path is None:  # tasks alone, in their own vocabulary
            return DataInfo(vocab_size=OWN_VOCABULARY, eot_id=0, mask_id=OWN_MASK_ID, special_ids=(0, OWN_MASK_ID),
                            tokenizer={"kind": "task", "name": f"task-vocabulary-{OWN_VOCABULARY}",
                                       "hash": f"task-vocabulary-v2-{OWN_VOCABULARY}"},
                            block_size=self.block_size, eval_specs=tuple(self.eval_specs()),
                            layout=self.layout.as_dict(), tasks_alone=self.tasks_alone())
        if self._manifest is None:
            if self.store is not None:  # manifest, index, held-out arrays fetched once per node; chunk sizes checked
                self.folder = self.store.mirror(self.cache_dir)
            self._manifest = read_manifest(self.folder, check_train=self.store is None)
        m = self._manifest
        if self.tasks is not None and self.tasks.vocab is None:
            needs_text = any(task.needs_text for task in self.tasks.tasks)
            self.tasks.vocab = TaskVocabulary.from_ids(int(m["vocab_size"]), m["special_ids"],
                                                       self.load_tokenizer() if needs_text else None)
            self.check_tasks()  # a text task's length in tokens is known now
        return DataInfo(vocab_size=int(m["vocab_size"]), eot_id=int(m["eot_id"]), mask_id=m["mask_id"],
                        special_ids=tuple(m["special_ids"]), tokenizer=dict(m["tokenizer"]["identity"]),
                        block_size=self.block_size, eval_specs=tuple(self.eval_specs()), layout=self.layout.as_dict(),
                        tasks_alone=self.tasks_alone())

    def corpus_hash(self) -> str | None:
        """The prepared corpus's content hash as its manifest records it (``python-code``'s ``corpus_hash``), so that
        records of runs on several machines can tell whether they measured the same text; None without one."""
        if self.path is None:
            return None
        self.describe()
        source = self._manifest.get("source")
        return source.get("corpus_hash") if isinstance(source, dict) else None

    def tasks_alone(self) -> dict[str, dict] | None:
        """The tasks a run of tasks alone trains on, each with every setting (:attr:`DataInfo.tasks_alone`)."""
        return self.tasks.settings() if self.tasks is not None and self.task_fraction == 1.0 else None

    def check_tasks(self) -> None:
        """The training length fits every task (task_fraction 0: no task row is trained on, only evaluated)."""
        if not self.task_fraction:
            return
        try:
            self.tasks.check_length(self.block_size)
        except ConfigError as exc:
            raise ConfigError(f"data.block_size {self.block_size} is too short for a task: {exc}") from None

    def setup(self, stage: str) -> None:
        self.describe()

    def eval_specs(self) -> list[tuple[int, int]]:
        """(length, stride) of each eval loader in dataloader_idx order: every length non-overlapping (stride =
        length), then the sliding ones when ``eval_stride`` is set."""
        specs = [(n, n) for n in self.eval_lengths]
        return specs + [(n, self.eval_stride) for n in self.eval_lengths if self.eval_stride and self.eval_stride < n]

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer that made the data (for decoding samples); its identity must match the manifest's."""
        if self.path is None:
            raise ConfigError("data.path is null: the tasks' own vocabulary has no tokenizer (text such as the "
                              "passkey task needs a prepared corpus)")
        if self._manifest is None:
            self.describe()
        info = self._manifest["tokenizer"]
        ref = os.path.join(self.folder, info["file"]) if info.get("file") else info["spec"]
        tok = get_tokenizer(ref, name=info["identity"]["name"])
        if tok.identity != info["identity"]:
            raise ConfigError(f"tokenizer {ref} (hash {tok.identity['hash'][:12]}) is not the one that prepared "
                              f"{self.path}; re-prepare it")
        return tok

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Every training batch's token ids are checked against the vocabulary here, on the host before the copy to the
        device (a chunk corrupted anywhere in the stream is named when it is read); with ``tasks``, task rows then
        replace the first rows (:meth:`task_batch`)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or not trainer.training:
            return batch
        batch_number = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        check_token_ids(batch, self.describe().vocab_size, f"training batch {batch_number} of {self.path}")
        if self.tasks is not None and self.task_fraction:  # task_fraction 0: tasks are only evaluated
            return self.task_batch(batch, batch_number, trainer.global_rank, trainer.world_size)
        return batch

    def task_batch(self, batch: torch.Tensor, batch_number: int, rank: int, world_size: int) -> dict:
        """The batch with its first ``task_fraction`` rows replaced by task examples (TaskMix.training_rows: unique
        per (batch number, rank), the same after a resume), the loss weight of every target (1 for corpus rows and
        for answers, ``lm_loss_weight`` for a task row's other tokens) and which targets are answers (a masked LM
        hides those from its input). Both are (B, L), aligned with ``tokens[:, 1:]``."""
        if self.tasks.algorithmic:  # rows of one drawn input length replace the blank batch
            length = self.tasks.training_length(self.seed, batch_number, self.block_size)
            ids, answer = self.tasks.training_rows(length, self.seed, batch_number, rank, world_size, batch.shape[0])
            answers = torch.from_numpy(answer[:, 1:])
            return {"tokens": torch.from_numpy(ids), "loss_weight": answers.float(), "answer": answers}
        rows = round(self.task_fraction * batch.shape[0])
        weight = torch.ones(batch.shape[0], batch.shape[1] - 1)
        answers = torch.zeros(batch.shape[0], batch.shape[1] - 1, dtype=torch.bool)
        if rows:
            ids, answer = self.tasks.training_rows(batch.shape[1], self.seed, batch_number, rank, world_size, rows)
            batch = batch.clone()
            batch[:rows] = torch.from_numpy(ids)
            answers[:rows] = torch.from_numpy(answer[:, 1:])
            weight[:rows] = torch.where(answers[:rows], 1.0, self.lm_loss_weight)
        return {"tokens": batch, "loss_weight": weight, "answer": answers}

    def train_dataloader(self) -> Any:
        from litdata import StreamingDataset, TokensLoader

        self.describe()
        if self.tasks is not None and self.task_fraction == 1.0:  # rows made in on_before_batch_transfer
            return DataLoader(BlankRows(self.micro_batch_size, self.block_size + 1), batch_size=None)
        remote = dict(cache_dir=self.cache_dir, max_cache_size=self.max_cache_size,
                      storage_options=self.store.storage_options()) if self.store else {}
        os.environ[LITDATA_NODES] = "1"  # one epoch-wide assignment over every rank: see LITDATA_NODES

        def stream() -> StreamingDataset:
            return StreamingDataset(f"{self.store.url}/train" if self.store else os.path.join(self.path, "train"),
                                    item_loader=TokensLoader(block_size=self.block_size + 1),
                                    shuffle=True, seed=self.seed, drop_last=True, **remote)

        dataset = local_rank_zero_first(getattr(self, "trainer", None), stream) if self.store else stream()
        if len(dataset) == 0:
            tokens = self._manifest["splits"]["train"]["tokens"]
            raise ConfigError(f"train split of {self.path} has {tokens} tokens: no window of block_size + 1 = "
                              f"{self.block_size + 1} fits; lower block_size")
        return _stream_loader_class()(dataset, batch_size=self.micro_batch_size, num_workers=self.num_workers,
                                   collate_fn=collate_tokens, drop_last=True, pin_memory=torch.cuda.is_available(),
                                   persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> Any:
        return self._eval_loaders("val")

    def test_dataloader(self) -> Any:
        """The source's own test split when it has one (wikitext-103), else val; same protocol as validation."""
        self.describe()
        return self._eval_loaders("test" if self._manifest and "test" in self._manifest["splits"] else "val")

    def eval_stream(self, split: str = "val") -> torch.Tensor:
        """The first ``max(eval_tokens, longest eval length) + 1`` tokens of ``split`` (int64), read once; without a
        corpus, task examples of the training length one after another (evaluation examples, never trained on)."""
        if split not in self._eval_streams and self.path is None:
            longest = max(length for length, _ in self.eval_specs())
            count, pieces, index = max(self.eval_tokens, longest) + 1, [], 0
            while sum(map(len, pieces)) < count:
                pieces.append(self.tasks.example(self.block_size + 1, self.seed, EVAL, index).ids)
                index += 1
            self._eval_streams[split] = torch.from_numpy(np.concatenate(pieces)[:count])
        if split not in self._eval_streams:
            self.describe()
            held_out = load_split(self.folder, split, self._manifest)
            check_token_ids(held_out, self.describe().vocab_size, f"the {split} split of {self.path}")
            longest = max(length for length, _ in self.eval_specs())
            if len(held_out) < longest + 1:
                raise ConfigError(f"eval length {longest} needs {longest + 1} consecutive tokens but the {split} split "
                                  f"of {self.path} has {len(held_out)}; drop that length from eval_lengths or hold out "
                                  "more data")
            if self.eval_tokens + 1 > len(held_out):
                rank_zero_warn(f"eval_tokens={self.eval_tokens} is more than the {len(held_out) - 1} targets in "
                               f"{split} of {self.path}; scoring those")
            count = min(max(self.eval_tokens, longest) + 1, len(held_out))
            self._eval_streams[split] = torch.from_numpy(held_out[:count].astype(np.int64))
        return self._eval_streams[split]

    def _eval_loaders(self, split: str) -> Any:
        tokens, trainer = self.eval_stream(split), getattr(self, "trainer", None)
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        loaders = []
        for length, stride in self.eval_specs():
            windows = EvalWindows(tokens, length, stride, rank=rank, world_size=world)
            # EvalWindows already holds this rank's share; a one-replica sampler keeps Lightning from splitting it
            # again.
            loaders.append(DataLoader(windows, batch_size=self.micro_batch_size if length <= self.block_size else 1,
                                      sampler=DistributedSampler(windows, num_replicas=1, rank=0, shuffle=False)))
        return loaders[0] if len(loaders) == 1 else loaders
