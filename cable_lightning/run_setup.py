"""Setting a run up from its parsed config, before and as its classes are built: the data prepared first, the
backbone's settings checked, the run's folder named, the global batch turned into gradient accumulation."""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import numpy as np
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .data.datamodule import TokenDataModule
from .data.lengths import length_list
from .errors import ConfigError, RunFailedError
from .models.config import BackboneConfig
from .positional import ENCODING_FLAG
from .positional.registry import named_class
from .tasks.generation import TaskMix


def prepare_first(data: TokenDataModule) -> None:
    """Prepare the data section's ``path`` from its ``source`` and ``tokenizer`` when it names them (a no-op on a
    folder prepared for that request, an error on one prepared from something else). Every rank calls it: prepare's
    lock keeps ranks that start together safe."""
    if data.source is None:
        return
    from .data import prepare  # the offline builder, imported only when a run asks for it

    # litdata's optimize reseeds Python, NumPy and torch to 42; the run's seed_everything must still hold.
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            prepare.prepare(source=data.source, tokenizer=data.tokenizer_spec, out=data.path,
                            endpoint_url=data.endpoint_url)
        except prepare.PrepareStopped as stop:  # as prepare alone: one line, 128 + the signal (run_failures.stopped)
            stopped = SIGTERMException(f"the workers were stopped and nothing was written to {data.path}; run the "
                                       "same command again")
            stopped.signum = stop.signum
            raise stopped from None
        except ConfigError:
            raise
        except (ValueError, OSError) as exc:  # prepare's own one-line errors (bad source, conflicting folder)
            raise ConfigError(f"preparing {data.path}: {exc}") from exc
        except RuntimeError as exc:
            raise RunFailedError(f"preparing {data.path}: {exc}") from exc
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def describe_prepared(data: TokenDataModule) -> dict:
    """The data's description for the model, the data prepared first when the data section asks for it: the
    model's vocabulary comes from the data, so this runs before the model exists."""
    prepare_first(data)
    return data.describe().as_dict()


def configured_backbone(config) -> BackboneConfig:
    """The model section's backbone, built (and so checked: shape, encoding and its settings, attention backend)
    from the parsed config, before any class is instantiated or any data is prepared."""
    backbone = config.model.init_args.get("backbone") if config.model is not None else None
    return BackboneConfig.from_dict(backbone.as_dict() if backbone is not None else {})


def check_task_rows(config, backbone: BackboneConfig) -> None:
    """An algorithmic task's training rows (its longest input, data.block_size symbols, and one token per answer
    symbol) must fit the encoding's table, before anything is built: a learnable table of the block size held the
    inputs but not the rows, and training died in a traceback at the first long batch. Evaluation lengths it cannot
    hold are recorded as unsupported, not refused."""
    data = config.get("data")
    if data is None or not data.get("tasks"):
        return
    mix = TaskMix(data.tasks.as_dict() if hasattr(data.tasks, "as_dict") else data.tasks)
    table = backbone.pos_encoding.longest_length(data.block_size)
    if table is None or not mix.algorithmic:
        return
    task = mix.tasks[0]
    row = max(task.tokens_read(length) for length in range(1, data.block_size + 1))
    if row <= table:
        return
    lengths = next((length_list(given, setting) for given, setting in
                    (((config.get("task_eval") or {}).get("lengths"), "task_eval.lengths"),
                     (data.get("eval_lengths"), "data.eval_lengths")) if given is not None), [data.block_size])
    evaluated = task.tokens_read(max(lengths))
    raise ConfigError(
        f"task {task.name} trains on rows of up to {row} tokens (inputs of up to data.block_size {data.block_size} "
        f"symbols and their answers), more than the {backbone.pos_encoding.label()} encoding's table of {table} "
        f"positions; set learnable's max_positions to at least {row} "
        f"({ENCODING_FLAG}.max_positions {row}); evaluation lengths whose rows it does not "
        f"hold (the longest, {max(lengths)} symbols, reads {evaluated} tokens) are recorded as unsupported")


def carried_settings(args: list[str], encoding) -> Optional[str]:
    """One line naming the settings of ``encoding`` (the parsed one) that a switch of ``pos_encoding`` on the command
    line ``args`` carried over from an earlier config (jsonargparse keeps the earlier class's settings the new class
    also has: a base config's ``bias_activation`` survives a switch to a CABLE variant): those that differ from the
    new encoding's defaults and that the command line does not set itself. None without a switch or with nothing
    carried."""
    switched, given = None, set()
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key == ENCODING_FLAG:
            switched, given = value or (args[i + 1] if i + 1 < len(args) else None), set()
        elif key.startswith(ENCODING_FLAG + ".") and switched is not None:
            given.add(key[len(ENCODING_FLAG) + 1 :])
    if switched is None or named_class(switched) is not type(encoding):
        return None
    defaults = type(encoding)()
    carried = [f"{f.name}={getattr(encoding, f.name)!r} (its default: {getattr(defaults, f.name)!r})"
               for f in dataclasses.fields(encoding)
               if f.name not in given and getattr(encoding, f.name) != getattr(defaults, f.name)]
    if not carried:
        return None
    return (f"pos_encoding {encoding.name} (set on the command line) keeps settings of the earlier config: "
            f"{', '.join(carried)}; set them after it ({ENCODING_FLAG}.NAME VALUE) to change them")


def run_folder(config) -> str:
    """The parsed config's run folder (:func:`run_folder_of`), named by the encoding's weight-defining label and the
    backbone's switches, so a run evaluated with RoPE scaling is still found (``rope``, ``rope+attn_gate``)."""
    encoding = configured_backbone(config).label(runtime=False)
    if not config.get("folder_per_seed"):
        return run_folder_of(config.runs_dir, config.experiment, encoding)
    seed = config.get("seed_everything")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"--folder_per_seed true names the run folder by the seed, but seed_everything is {seed}; "
                          "give the run its seed (--seed_everything N)")
    return run_folder_of(config.runs_dir, config.experiment, encoding, seed)


def run_folder_of(runs_dir: str, experiment: str, encoding: str, seed: Optional[int] = None) -> str:
    """``<runs_dir>/<experiment>/<encoding>``, and ``.../<encoding>/seed<N>`` for one folder per seed
    (``--folder_per_seed true``, what ``sweep --seeds`` passes): TensorBoard versions and checkpoints live under it."""
    folder = f"{runs_dir}/{experiment}/{encoding}"
    return folder if seed is None else f"{folder}/seed{seed}"


def checkpoint_folder(config) -> str:
    return config.checkpoint.dirpath or f"{run_folder(config)}/checkpoints"


def accumulation_steps(global_batch_tokens: int, micro_batch: int, block_size: int, ranks: int) -> int:
    per_step = micro_batch * block_size * ranks
    if global_batch_tokens % per_step:
        raise ConfigError(
            f"global_batch_tokens={global_batch_tokens} is not a multiple of micro_batch_size x block_size x "
            f"world_size = {micro_batch} x {block_size} x {ranks} = {per_step}; pick a multiple of {per_step} "
            "or change the micro-batch"
        )
    return global_batch_tokens // per_step


def apply_global_batch(trainer, global_batch_tokens: Optional[int], micro_batch: int, block_size: int,
                       validate_every_n_steps: Optional[int]) -> None:
    """Gradient accumulation from the global batch, and the validation interval in batches, from the world size
    of the Trainer Lightning built (so devices as an int, a list, "0,1" or "auto", times num_nodes, all count)."""
    if global_batch_tokens is not None:
        trainer.accumulate_grad_batches = accumulation_steps(global_batch_tokens, micro_batch, block_size,
                                                             trainer.world_size)
    if validate_every_n_steps:
        trainer.val_check_interval = validate_every_n_steps * trainer.accumulate_grad_batches
