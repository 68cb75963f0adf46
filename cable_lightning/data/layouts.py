"""What the model sees of a training block: document masking, position indices and a length schedule, one setting of
the data section (``--data.layout.*``) made into a :class:`~cable_lightning.positional.layout.Layout` per batch
(docs/training_distances.md).

- ``documents``: ``train`` keeps attention inside each document of a packed training block (documents end at the
  data's end-of-text id, which belongs to the document it ends) and restarts positions at each; ``all`` does the same
  for the evaluation windows; ``none`` (default) trains and evaluates on packed blocks as before.
- ``positions``: ``contiguous`` (default; 0, 1, 2, ... from each document's or window's start); ``randomized``: each
  document (or row) gets a sorted sample, without replacement, of positions in [0, ``position_range``) (Ruoss et al.,
  2023, "Randomized Positional Encodings Boost Length Generalization of Transformers"); ``pose``: each row is cut at
  ``pose_chunks`` - 1 random points and each chunk's positions are moved forward by a random skip, the skips growing
  from chunk to chunk and the last position staying below ``position_range`` (Zhu et al., 2023, "PoSE: Efficient
  Context Window Extension of LLMs via Positional Skip-wise Training").
- ``schedule``: the attention window grows from ``schedule_start`` tokens to the block size over ``schedule_steps``
  optimizer steps, ``linear`` or ``stepwise`` (``schedule_stages`` lengths, doubling-like: geometric between the start
  and the block size): each row is cut into windows of the step's length, attended to (and positioned) separately, so
  a step trains as many tokens at every length (SkyLadder's context-window schedule, Zhu et al., 2025). The length is a
  function of the optimizer step alone, so a resumed run continues the schedule where it was.

Evaluation keeps its windows (contiguous positions, no schedule); with ``documents: all`` it masks documents too.
Random draws come from a generator seeded by (seed, step, batch, rank): a resumed run draws the same positions.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

from ..errors import ConfigError
from ..positional.layout import Layout

Documents = Literal["none", "train", "all"]
Positions = Literal["contiguous", "randomized", "pose"]
Schedule = Literal["none", "linear", "stepwise"]


@dataclass(frozen=True)
class TrainingLayout:
    """The data section's ``layout`` (see the module's text)."""

    documents: Documents = "none"
    positions: Positions = "contiguous"
    position_range: Optional[int] = None
    pose_chunks: int = 2
    schedule: Schedule = "none"
    schedule_start: int = 32
    schedule_steps: int = 0
    schedule_stages: int = 3

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            allowed = typing.get_args(hints[field.name]) if typing.get_origin(hints[field.name]) is Literal else ()
            if allowed and getattr(self, field.name) not in allowed:
                raise ConfigError(f"data.layout.{field.name}={getattr(self, field.name)!r} is not valid; "
                                  f"valid: {', '.join(allowed)}")
        if self.positions != "contiguous" and self.position_range is None:
            raise ConfigError(f"data.layout.positions={self.positions} draws positions from [0, position_range): set "
                              "data.layout.position_range (e.g. 8 x the block size)")
        for name, minimum in (("position_range", 1), ("pose_chunks", 1), ("schedule_start", 1),
                              ("schedule_stages", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ConfigError(f"data.layout.{name} must be an integer >= {minimum}, got {value!r}")
        if self.schedule != "none" and (not isinstance(self.schedule_steps, int) or self.schedule_steps < 1):
            raise ConfigError(f"data.layout.schedule={self.schedule} grows the window over schedule_steps optimizer "
                              f"steps: set data.layout.schedule_steps >= 1, got {self.schedule_steps!r}")

    @classmethod
    def from_dict(cls, values: dict | None) -> "TrainingLayout":
        return cls(**(values or {}))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self, block_size: int) -> None:
        """Against the training length, before anything is built: one line per problem."""
        if self.positions != "contiguous" and self.position_range < block_size:
            raise ConfigError(f"data.layout.position_range {self.position_range} is shorter than the block size "
                              f"{block_size}: {self.positions} positions are drawn from a longer range; set it "
                              f">= {block_size}")
        if self.schedule != "none" and self.schedule_start > block_size:
            raise ConfigError(f"data.layout.schedule_start {self.schedule_start} is longer than the block size "
                              f"{block_size} it grows to; set it <= {block_size}")

    @property
    def active(self) -> bool:
        return self != TrainingLayout()

    def label(self, block_size: int) -> Optional[str]:
        """How records name it (None: the default, packed blocks at contiguous positions): ``docs``,
        ``randomized1024``, ``pose1024x2``, ``linear32-128@400``, ``stepwise32-128x3@400``, joined by ``+``."""
        if not self.active:
            return None
        parts = [f"docs-{self.documents}"] if self.documents != "none" else []
        if self.positions == "randomized":
            parts.append(f"randomized{self.position_range}")
        elif self.positions == "pose":
            parts.append(f"pose{self.position_range}x{self.pose_chunks}")
        if self.schedule != "none":
            stages = f"x{self.schedule_stages}" if self.schedule == "stepwise" else ""
            parts.append(f"{self.schedule}{self.schedule_start}-{block_size}{stages}@{self.schedule_steps}")
        return "+".join(parts)

    def window(self, step: int, row: int) -> int:
        """The training window (tokens attended to and positioned together) at optimizer step ``step`` in a row of
        ``row`` tokens (the block size for packed text; a task's row can be longer)."""
        if self.schedule == "none" or step >= self.schedule_steps:
            return row
        start, progress = min(self.schedule_start, row), step / self.schedule_steps
        if self.schedule == "linear":
            return int(start + (row - start) * progress)
        stage = int(progress * self.schedule_stages)  # stepwise: stage k of schedule_stages before the whole row
        return int(round(start * (row / start) ** (stage / self.schedule_stages)))

    def reads_positions(self) -> bool:
        """Whether the layout sets positions other than each segment's 0, 1, 2, ... (what an encoding that reads no
        positions cannot see)."""
        return self.positions != "contiguous"

    def build(self, ids: Tensor, eot_id: int, step: int, train: bool,
              generator: torch.Generator | None = None) -> Layout | None:
        """The layout of a batch of input ids (B, T); None where it is today's (contiguous, one document). Training
        attends over the row, never cut at ``block_size``: a task's row (a Chomsky input and one mask per answer token)
        is longer than the block size it is configured with, and a window of ``block_size`` would train its answers
        apart from their input."""
        documents = None
        if self.documents == "all" or self.documents == "train" and train:
            documents = document_ids(ids, eot_id)
        if train:  # the schedule grows to the whole row: a task's row (input and answers) can outgrow block_size
            window = self.window(step, ids.shape[1])
            if window < ids.shape[1]:
                windows = torch.arange(ids.shape[1], device=ids.device) // window
                documents = windows.expand_as(ids) if documents is None else segments(documents, windows)
        if not train or self.positions == "contiguous":
            if documents is None:
                return None
            return Layout.build(ids.shape[0], ids.shape[1], ids.device, documents=documents)
        layout = Layout.build(ids.shape[0], ids.shape[1], ids.device, documents=documents)
        if self.positions == "randomized":
            positions = randomized_positions(layout, self.position_range, generator)
        else:
            positions = pose_positions(layout, self.position_range, self.pose_chunks, generator)
        return Layout.build(ids.shape[0], ids.shape[1], ids.device, documents=documents, positions=positions)


def document_ids(ids: Tensor, eot_id: int) -> Tensor:
    """(B, T) the document of each token: documents end at (and include) the end-of-text id."""
    ends = (ids == eot_id).long()
    return torch.cumsum(ends, dim=-1) - ends


def segments(documents: Tensor, windows: Tensor) -> Tensor:
    """Ids of the runs of tokens that share both a document and a window (each a segment of its own)."""
    change = torch.zeros_like(documents, dtype=torch.bool)
    change[:, 1:] = (documents[:, 1:] != documents[:, :-1]) | (windows[1:] != windows[:-1])
    return torch.cumsum(change.long(), dim=-1)


def randomized_positions(layout: Layout, position_range: int, generator: torch.Generator | None) -> Tensor:
    """Each segment's (document's, window's or row's) positions: a sorted sample without replacement from
    [0, ``position_range``) (Ruoss et al., 2023)."""
    order = layout.order.cpu()
    positions = torch.empty_like(order)
    starts = (order == 0).nonzero().tolist()
    lengths = (layout.last - layout.first + 1).cpu()
    for row, start in starts:
        n = int(lengths[row, start])
        if n > position_range:
            raise ConfigError(f"a segment of {n} tokens cannot take distinct positions in [0, {position_range}); set "
                              f"data.layout.position_range >= {n}")
        sample = torch.randperm(position_range, generator=generator)[:n]
        positions[row, start : start + n] = sample.sort().values
    return positions.to(layout.positions.device)


def pose_positions(layout: Layout, position_range: int, chunks: int, generator: torch.Generator | None) -> Tensor:
    """PoSE's skip-wise positions (Zhu et al., 2023): each row cut into ``chunks`` pieces at random points; the
    positions of piece k (counted from each segment's start) move forward by u_k, with u_0 = 0 and u_1 <= u_2 <= ...
    drawn from [0, position_range - T], so that the last position stays below ``position_range``."""
    batch, length = layout.positions.shape
    order = layout.order.cpu()
    room = position_range - length
    if room < 0:
        raise ConfigError(f"data.layout.position_range {position_range} is shorter than the {length} tokens of a row; "
                          f"set it >= {length}")
    cuts = min(chunks, length) - 1
    skips = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        points = (torch.randperm(length - 1, generator=generator)[:cuts] + 1).sort().values
        shifts = torch.randint(0, room + 1, (cuts,), generator=generator).sort().values
        piece = torch.bucketize(torch.arange(length), points, right=True)  # 0 before the first cut point
        skips[row] = torch.cat([torch.zeros(1, dtype=torch.long), shifts])[piece]
    return (order + skips).to(layout.positions.device)


def layout_generator(seed: int, step: int, batch_idx: int, rank: int) -> torch.Generator:
    """The random positions' generator of one training batch: the same after a resume."""
    return torch.Generator().manual_seed(micro_batch_seed(seed, step, batch_idx, rank))


def micro_batch_seed(seed: int, step: int, batch_idx: int, rank: int, *stream: int) -> int:
    """A seed of one training micro-batch, the same after a resume; ``stream`` tells apart the draws of one batch
    (none: its positions; 1: dropout's)."""
    return hash((int(seed), int(step), int(batch_idx), int(rank), *stream)) % 2**63



def check_encoding(layout: TrainingLayout, pe) -> None:
    """The layout against the model's encoding (``pe``: its module), before training: positions other than
    contiguous need an encoding that reads them, and a table must hold every position drawn."""
    from ..positional import available, encoding_class

    if layout.reads_positions() and not pe.reads_positions:
        readers = [name for name in available() if encoding_class(name).module.reads_positions is True]
        wrappers = [name for name in available() if isinstance(encoding_class(name).module.reads_positions, property)]
        raise ConfigError(f"data.layout.positions={layout.positions} changes nothing for {pe.settings.label()}: it "
                          "reads no position indices, only the order of the tokens (and their documents); use "
                          f"positions contiguous, or an encoding that reads positions: {', '.join(readers)} (or "
                          f"{'/'.join(wrappers)} over one)")
    if layout.reads_positions() and pe.longest is not None and layout.position_range > pe.longest:
        raise ConfigError(f"data.layout.position_range {layout.position_range} is more than the "
                          f"{pe.settings.label()} encoding's {pe.longest} positions; lower it or give the encoding "
                          f"that many (learnable.max_positions {layout.position_range})")


def configured_layout(settings) -> TrainingLayout:
    """The data section's layout as the CLI holds it (a parsed namespace, a dict, None or the layout itself)."""
    if settings is None or isinstance(settings, TrainingLayout):
        return settings or TrainingLayout()
    values = settings.as_dict() if hasattr(settings, "as_dict") else settings if isinstance(settings, dict) else vars(
        settings)
    return TrainingLayout.from_dict(dict(values))


def check_configured_layout(settings, backbone, block_size: int) -> None:
    """The CLI's check, before anything is built: the data section's layout (a parsed namespace, a dict or None)
    against the configured backbone (a BackboneConfig) at the data's block size, through a module of its encoding
    alone."""
    if settings is None:
        return
    backbone = dataclasses.replace(backbone, block_size=block_size)
    layout = configured_layout(settings)
    if layout.reads_positions():
        check_encoding(layout, backbone.pos_encoding.build(backbone))
