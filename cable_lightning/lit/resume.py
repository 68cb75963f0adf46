"""The resume contract, in one file: what a fit checkpoint records about its run, what a run that loads it may change,
what it refuses, what it carries over, and which checkpoints a run writes.

- **Recorded** (:func:`record_run`): the run's seed, its recipe (what its records carry: ``LanguageModel.recipe``),
  its global batch (processes x micro-batch x block x accumulation) and its data (:func:`run_data`: the data folder,
  the corpus's content hash, the tasks), beside Lightning's weights, optimizer, schedule, loop counters and stream
  position.
- **Refused**, one line naming each setting with both values and how to go on: another model (weight-defining settings,
  tokenizer, training length: :func:`check_same_model`, :func:`check_same_length`), initial weights from another
  training length without saying so (:func:`check_lineage`), another data.layout or global batch on resume
  (:func:`check_same_training`), another recipe on resume (learning rate, warm-up, floor, optimizer, clipping,
  precision: :func:`check_same_recipe`; a longer max_steps trains on), another data folder, corpus or task on resume and
  another corpus in validate and test (:func:`check_same_data`), a world size and micro-batch that cannot make the
  checkpoint's global batch (:func:`unkeepable_batch`, before any step); in validate and test, another data.layout, or a
  task that weights trained on tasks alone were not trained on (:func:`evaluated_as_trained`). What the parsed command
  line already tells (the model, the training length, the data folder and tasks, the corpus of a folder prepared
  already) is checked before anything is built or prepared (:func:`check_before_building`); the corpus of a folder
  prepared first by this run, once it is prepared.
- **May change**: evaluation settings, and the processes and micro-batch at the same global batch; the loop's
  micro-batch counters are then re-expressed in the new accumulation (:func:`carry_accumulation`), so the first
  resumed optimizer step trains on a whole global batch, and the run says so in one line.
- **Written** (:class:`RunCheckpoint`): every checkpoint is a state at an optimizer-step boundary; a step already
  saved is never saved again by the run that resumed from it (a requeue after a kill finds the file unchanged); the
  last step of every fit is saved in ``last.ckpt``; a resume of a finished run does nothing (:func:`finished_run`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint

from ..checkpoints import checkpoint_step
from ..data.layouts import TrainingLayout
from ..data.manifest import MANIFEST, read_manifest
from ..data.remote import is_remote
from ..errors import ConfigError
from ..models import BackboneConfig
from ..models.config import SWITCHES
from ..tasks.generation import TaskMix
from .checkpoint_format import saved_backbone
from .optim import OptimizerRecipe


def global_batch(trainer, block_size: int) -> Optional[dict]:
    """Tokens per optimizer step and what makes them (processes x micro-batch x block x accumulation); None without
    a trainer and a data module that has micro-batches."""
    micro = getattr(trainer.datamodule, "micro_batch_size", None) if trainer is not None else None
    if not micro:
        return None
    parts = dict(world_size=trainer.world_size, micro_batch_size=int(micro), block_size=block_size,
                 accumulate_grad_batches=trainer.accumulate_grad_batches)
    return dict(tokens=math.prod(parts.values()), **parts)


def processes(batch: dict) -> str:
    return f"{batch['world_size']} process" + ("es" if batch["world_size"] != 1 else "")


def describe_batch(batch: dict) -> str:
    return (f"{batch['tokens']} tokens ({processes(batch)} x {batch['micro_batch_size']} x "
            f"{batch['block_size']} tokens x accumulation {batch['accumulate_grad_batches']})")


def record_run(checkpoint: dict, run_seed: Optional[int], batch: Optional[dict], recipe: Optional[dict] = None,
               data: Optional[dict] = None) -> None:
    """What a checkpoint carries beside Lightning's state: the run's seed and recipe (a validation of these weights
    is recorded as the same run, trained the same way), its global batch and its data (:func:`run_data`; a resume
    must keep both)."""
    checkpoint["run_seed"] = run_seed
    if batch is not None:
        checkpoint["global_batch"] = batch
    if recipe is not None:
        checkpoint["recipe"] = recipe
    if data is not None:
        checkpoint["run_data"] = data


def data_folder(path: Optional[str]) -> Optional[str]:
    """A data.path as a checkpoint keeps it: absolute (a resume from another working folder names the same one); a
    URL as given; None for a run of tasks alone."""
    return path if path is None or is_remote(path) else os.path.abspath(path)


def run_data(datamodule) -> Optional[dict]:
    """What a checkpoint keeps of the data its run trains on, which a resume must keep: the data folder (the stream
    position belongs to it), the corpus's content hash (its manifest's ``corpus_hash``; None without one) and the
    tasks with every setting (None without tasks). None without a token data module."""
    if datamodule is None or not hasattr(datamodule, "corpus_hash"):
        return None
    return {"path": data_folder(datamodule.path), "corpus_hash": datamodule.corpus_hash(),
            "tasks": datamodule.tasks.settings() if datamodule.tasks is not None else None}


def configured_data(data) -> dict:
    """:func:`run_data` of a parsed data section, before anything is built or prepared: the corpus hash only of a
    local folder prepared already (a folder this run prepares first, or a URL, is checked once it is read)."""
    path, tasks = data.get("path"), data.get("tasks")
    folder, corpus = data_folder(path), None
    if folder is not None and not is_remote(folder) and os.path.isfile(os.path.join(folder, MANIFEST)):
        source = read_manifest(folder, check_files=False).get("source")
        corpus = source.get("corpus_hash") if isinstance(source, dict) else None
    tasks = tasks.as_dict() if hasattr(tasks, "as_dict") else tasks
    return {"path": folder, "corpus_hash": corpus, "tasks": TaskMix(tasks).settings() if tasks else None}


def described_tasks(tasks: Optional[dict]) -> str:
    return json.dumps(tasks) if tasks else "no tasks"


def check_same_data(saved: Optional[dict], configured: dict, verb: str, path: str) -> None:
    """A resumed fit trains on the data its run trained on: the same data folder (its stream position is that
    folder's), the same corpus (a folder prepared again from another corpus holds other text under the same name)
    and the same tasks (a score on another task would be recorded as that task's, for weights trained on the
    first), else one line naming both and how to go on. Validate and test measure weights on the corpus they were
    trained on (their records name that corpus), from any folder; their tasks are :func:`evaluated_as_trained`'s.
    A corpus hash unknown on either side is not compared; checkpoints written before the data was recorded are not
    checked."""
    if not saved:
        return
    new_run = new_run_from(path)
    if verb == "fit" and saved.get("path") != configured["path"]:
        raise ConfigError(f"{path} was trained on data.path {saved.get('path')} and this resume reads "
                          f"{configured['path']}: a resume continues its run on the same data (its stream position "
                          f"is that folder's); resume with --data.path {saved.get('path')}, or {new_run}")
    old, new = saved.get("corpus_hash"), configured.get("corpus_hash")
    if old and new and old != new:
        advice = (f"resume on the corpus it was trained on, or {new_run}" if verb == "fit" else
                  f"{verb} measures weights on the corpus they were trained on (its records name that one): point "
                  "--data.path at a folder prepared from it")
        raise ConfigError(f"{path} was trained on corpus {old[:12]} and {configured['path']} holds corpus "
                          f"{new[:12]} (prepared again from another source?); {advice}")
    if verb == "fit" and (saved.get("tasks") or None) != (configured["tasks"] or None):
        flag = (f"--data.tasks '{json.dumps(saved['tasks'])}'" if saved.get("tasks") else
                "no --data.tasks")
        raise ConfigError(f"{path} was trained on {described_tasks(saved.get('tasks'))} and this resume asks "
                          f"data.tasks {described_tasks(configured['tasks'])}: a resume continues its run on the same "
                          f"tasks (a score on another would be recorded as that task's); resume with {flag} (the "
                          f"run's configs), or {new_run}")


def check_before_building(checkpoint: dict, backbone: BackboneConfig, data, verb: str, path: str) -> None:
    """What a resume (``verb`` fit) or an evaluation of ``checkpoint`` can be refused for from the parsed command
    line alone, before any class is built or any corpus prepared: another model, training length or data
    (:func:`check_same_model`, :func:`check_same_length`, :func:`check_same_data`). ``data`` is the parsed data
    section (None without one)."""
    check_same_model(checkpoint, backbone, None, "the checkpoint's model differs from the configured one in settings "
                     "that define the weights: ", SAME_MODEL)
    if data is None:
        return
    check_same_length(checkpoint, data.get("block_size"))
    check_same_data(checkpoint.get("run_data"), configured_data(data), verb, path)


def weight_setting_differences(saved: dict, config: BackboneConfig) -> list[tuple[str, object, object]]:
    """(name, saved, configured) for each backbone setting that defines the weights and differs
    (:meth:`BackboneConfig.weight_settings`); runtime settings (attention backend, dropout, an encoding's own, such
    as RoPE scaling) may change freely."""
    off = dict.fromkeys(SWITCHES, False)  # a switch left off is no weight setting (runs without one keep their key)
    old, new = off | saved_backbone(saved).weight_settings(), off | config.weight_settings()
    differ = [name for name in {**old, **new} if old.get(name) != new.get(name)]
    # Another encoding altogether is one difference, not one per setting it has or lacks.
    return [(name, old.get(name), new.get(name)) for name in differ if name.rpartition(".")[0] not in differ]


SAME_MODEL = "; remove them from the command line and the config files to use the checkpoint's"
# What a resume must keep, beside the model: the module's settings (hyper_parameters) and the trainer's (the recipe).
RECIPE_HPARAMS = OptimizerRecipe.names()
RECIPE_TRAINER = {"precision": "precision", "gradient_clip_val": "gradient_clip"}


def check_same_recipe(checkpoint: dict, config, path: str) -> None:
    """A resume continues one experiment: the learning rate, warm-up and floor, the optimizer's settings, clipping and
    precision must be the checkpoint's, else its records would show one run's later evaluations as another run (a
    learning-rate comparison between a run and itself). A longer ``max_steps`` is how a run trains on, and is kept.
    Checked from the parsed command line (``config``, the fit's section), before anything is built."""
    from lightning.fabric.connector import _convert_precision_to_unified_args

    hparams, recipe = checkpoint.get("hyper_parameters") or {}, checkpoint.get("recipe") or {}
    init = config.model.get("init_args") or {}
    pairs = [(f"model.init_args.{name}", hparams.get(name), init.get(name)) for name in RECIPE_HPARAMS]
    pairs += [(f"trainer.{name}", recipe.get(key), config.trainer.get(name)) for name, key in RECIPE_TRAINER.items()]

    def same(name: str, saved, configured) -> bool:
        if name == "trainer.precision":
            unified = [_convert_precision_to_unified_args(p if p is not None else "32-true")  # Lightning's default
                       for p in (saved, configured)]
            return unified[0] == unified[1]
        if isinstance(saved, (list, tuple)) or isinstance(configured, (list, tuple)):
            return list(saved or ()) == list(configured or ())
        return saved == configured

    differ = [(name, saved, configured) for name, saved, configured in pairs
              if saved is not None and not same(name, saved, configured)]
    if differ:
        raise ConfigError(f"{path} was trained by another recipe than this resume gives: "
                          + ", ".join(f"{name} (checkpoint {saved!r}, configured {configured!r})"
                                      for name, saved, configured in differ)
                          + "; a resume continues its run by the same recipe (its later evaluations would be "
                          "recorded as another run's); resume without them (the run's configs), or "
                          + new_run_from(path))


def check_same_model(checkpoint: dict, config: BackboneConfig, data_info, problem: str, advice: str) -> None:
    """The checkpoint's tokenizer and weight-defining backbone settings must be this model's; a difference is one
    line: ``problem``, each setting with both values, ``advice``."""
    hparams = checkpoint.get("hyper_parameters") or {}
    saved_data = hparams.get("data") or {}
    if data_info is not None and saved_data.get("tokenizer"):
        data_info.check_tokenizer(saved_data["tokenizer"])
    if isinstance(hparams.get("backbone"), dict):
        differ = weight_setting_differences(hparams["backbone"], config)
        if differ:
            raise ConfigError(problem + ", ".join(f"{name} (checkpoint {old!r}, configured {new!r})"
                                                  for name, old, new in differ) + advice)


def check_same_length(checkpoint: dict, block_size: Optional[int]) -> None:
    """A checkpoint is loaded at the training length it was trained at (evaluation lengths are set apart)."""
    saved = ((checkpoint.get("hyper_parameters") or {}).get("data") or {}).get("block_size")
    if block_size is not None and saved not in (None, block_size):
        raise ConfigError(f"the checkpoint was trained at block_size {saved} but data.block_size is "
                          f"{block_size}; set --data.block_size {saved} (data.eval_lengths sets the "
                          "evaluation lengths)")


def check_lineage(checkpoint: dict, config: BackboneConfig, path: str) -> None:
    """Initial weights trained at another length than this run's are a context extension, which must say so:
    ``backbone.trained_length`` is the length they were first trained at (what YaRN's original length and the
    records read)."""
    hparams = checkpoint.get("hyper_parameters") or {}
    saved = hparams.get("backbone") if isinstance(hparams.get("backbone"), dict) else {}
    trained = saved.get("trained_length") or (hparams.get("data") or {}).get("block_size")
    if trained is None or trained == config.original_length:
        return
    if config.trained_length is None:
        raise ConfigError(f"model.init_weights {path} was trained at {trained} tokens and this run trains at "
                          f"{config.block_size}: a context extension; say so with "
                          f"--model.init_args.backbone.trained_length {trained} (RoPE's scalings and the records "
                          "read it)")
    raise ConfigError(f"model.init_weights {path} was trained at {trained} tokens, not backbone.trained_length "
                      f"{config.trained_length}; set --model.init_args.backbone.trained_length {trained}")


def new_run_from(path: str) -> str:
    return f"start a new run from its weights (--model.init_args.init_weights {path}, another --experiment)"


def unkeepable_batch(saved: Optional[dict], world_size: int, micro_batch: int, path: str) -> Optional[str]:
    """Why a checkpoint's global batch cannot be kept on ``world_size`` processes of ``micro_batch`` rows (a step is
    processes x micro-batch x accumulation rows, so that product must divide the checkpoint's rows a step) and what
    would keep it, in one line; None when it can be kept (or the checkpoint does not record it). So the refusals of a
    resume never advise each other: the world size that cannot keep the batch is said to, with what can."""
    if not saved:
        return None
    rows, block = saved["tokens"] // saved["block_size"], saved["block_size"]
    if rows % (world_size * micro_batch) == 0:
        return None
    here = f"{world_size} process" + ("es" if world_size != 1 else "")
    divisors = lambda n: [d for d in range(1, n + 1) if n % d == 0]  # noqa: E731
    if rows % world_size:
        fix = f"{here} can never keep it, whatever the micro-batch ({rows} is not a multiple of {world_size})"
        keeps = divisors(rows // micro_batch) if rows % micro_batch == 0 else []
        if keeps:
            fix += (f"; resume it on {', '.join(map(str, keeps[:-1]))}{' or ' if len(keeps) > 1 else ''}{keeps[-1]} "
                    f"process{'es' if keeps != [1] else ''} (micro-batch {micro_batch})")
    else:
        fix = ("resume it with --data.micro_batch_size "
               + " or ".join(map(str, [m for m in divisors(rows // world_size) if m < micro_batch][-2:])))
    per_step = world_size * micro_batch * block
    tokens = max(per_step, round(saved["tokens"] / per_step) * per_step)
    return (f"this run's global batch of {describe_batch(saved)}, checkpoint {path}, cannot be kept on {here} with "
            f"micro-batch {micro_batch}: its {rows} rows a step are not a multiple of processes x micro-batch = "
            f"{world_size} x {micro_batch}; {fix}; or {new_run_from(path)} with --global_batch_tokens {tokens}: a new "
            "run, not a resume")


def layout_differences(saved: TrainingLayout, configured: TrainingLayout) -> tuple[str, str]:
    """(each setting of ``configured`` that differs from ``saved`` with both values, the flags that give the saved
    ones); empty strings when they agree."""
    old, new = saved.as_dict(), configured.as_dict()
    differ = [name for name in old if new[name] != old[name]]
    return (", ".join(f"data.layout.{name} (checkpoint {old[name]!r}, configured {new[name]!r})" for name in differ),
            " ".join(f"--data.layout.{name} {old[name] if old[name] is not None else 'null'}" for name in differ))


def evaluated_as_trained(saved_data: dict, layout: TrainingLayout, tasks: Optional[dict], verb: str,
                         path: str, named: bool = False) -> TrainingLayout:
    """What ``validate`` and ``test`` may ask of a checkpoint (``saved_data``: its data description), checked before
    anything is built. Weights are evaluated at the data.layout they were trained with, which their records name:
    the default layout (no --data.layout flags) stands for it, and another one would be recorded as the trained one
    (randomized positions asked of contiguous weights changed nothing). Weights trained on tasks alone are scored only
    on those tasks (a reverse-string checkpoint would be recorded as a duplicate-string score). Returns the layout to
    evaluate with; anything else is one line naming both and the flags that fit, also the default layout when the
    command line ``named`` it (``--data.layout.positions contiguous`` asked of randomized weights was dropped without
    a word). Checkpoints written before the layout or the tasks were recorded are not checked for them."""
    trained = TrainingLayout.from_dict(saved_data["layout"]) if "layout" in saved_data else layout
    differ, flags = layout_differences(trained, layout)
    if differ and (layout.active or named):
        described = trained.label(saved_data.get("block_size")) or "the default (packed blocks, contiguous positions)"
        raise ConfigError(f"{path} was trained with data.layout {described} and {verb} asks another: {differ}; "
                          f"{verb} evaluates weights at the layout they were trained with (its records name that "
                          f"one): drop the --data.layout flags or give the checkpoint's ({flags})")
    alone, asked = saved_data.get("tasks_alone"), TaskMix(tasks).settings() if tasks else {}
    if alone is not None and any(alone.get(name) != settings for name, settings in asked.items()):
        raise ConfigError(f"{path} was trained on tasks alone, {json.dumps(alone)}, and {verb} asks data.tasks "
                          f"{json.dumps(asked)}: weights trained on tasks alone are scored only on those (a score on "
                          f"another would be recorded as that task's); give --data.tasks '{json.dumps(alone)}' (the "
                          "run's configs)")
    return trained


def check_same_training(checkpoint: dict, layout: TrainingLayout, batch: Optional[dict], path: str) -> None:
    """A resumed fit trains as the run it continues did: the same data.layout (what training sees of a block) and
    global batch, else one line naming the setting, both values and how to go on. (Records label a run by one
    layout; a layout or batch changed half-way would be reported as the run's.)"""
    new_run = f"or {new_run_from(path)}"
    saved = TrainingLayout.from_dict(((checkpoint.get("hyper_parameters") or {}).get("data") or {}).get("layout"))
    differ, flags = layout_differences(saved, layout)
    if differ:
        raise ConfigError(f"the checkpoint was trained with another data.layout: {differ}; a resumed run keeps its "
                          f"layout: resume with {flags} (or drop the flags that change it), {new_run}")
    saved_batch = checkpoint.get("global_batch")
    if batch and (unkeepable := unkeepable_batch(saved_batch, batch["world_size"], batch["micro_batch_size"], path)):
        raise ConfigError(unkeepable)
    if saved_batch and batch and saved_batch["tokens"] != batch["tokens"]:
        raise ConfigError(f"the checkpoint was trained with a global batch of {describe_batch(saved_batch)} and "
                          f"this run's is {describe_batch(batch)}; resume with --global_batch_tokens "
                          f"{saved_batch['tokens']} to keep it (the accumulation follows the processes and "
                          f"micro-batch), {new_run}")


def carry_accumulation(checkpoint: dict, batch: Optional[dict], path: str) -> Optional[str]:
    """A resume with the checkpoint's global batch made another way (other processes or micro-batch): Lightning
    decides when to step the optimizer from the epoch's micro-batch count (a multiple of the accumulation), which the
    checkpoint holds in its own accumulation's units. Re-expressed in this run's (the same optimizer steps, the same
    windows read), the first resumed step accumulates a whole global batch and every later step, validation and epoch
    end falls where the uninterrupted run's does. Rewrites the checkpoint's loop counters before Lightning restores
    them; returns the line that says how the run goes on (None when nothing changed)."""
    saved = checkpoint.get("global_batch")
    if not saved or not batch or saved == batch:
        return None
    old, new = saved["accumulate_grad_batches"], batch["accumulate_grad_batches"]
    progress = ((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("epoch_loop.batch_progress")
    if old != new and progress is not None:
        # Saved at a step's last micro-batch: ready is a multiple of the accumulation, and the other counters trail
        # it by what Lightning had not yet counted (completed by one); the offsets are kept.
        ready = {part: progress[part]["ready"] for part in ("current", "total")}
        ragged = [value for value in ready.values() if value % old]
        if ragged:
            raise ConfigError(f"checkpoint {path} stands at micro-batch {ragged[0]}, not a whole number of its "
                              f"optimizer steps of accumulation {old} (an epoch ended inside one): it resumes exactly "
                              f"only as it was trained, {describe_batch(saved)}; run on {processes(saved)} with "
                              f"--data.micro_batch_size {saved['micro_batch_size']}, or resume from another "
                              "checkpoint")
        for part, value in ready.items():
            progress[part] = {key: value // old * new - (value - count) for key, count in progress[part].items()}
    return (f"resuming step {checkpoint.get('global_step')} of a run trained with {describe_batch(saved)} as "
            f"{describe_batch(batch)}: the same global batch, every step a whole one")


def finished_run(path: str, max_steps: Optional[int]) -> Optional[str]:
    """The line that says a resume has nothing to train (the checkpoint is at or past ``max_steps``), else None: a
    requeued job of a finished run must not validate again, write records or rewrite ``last.ckpt``."""
    if not max_steps or max_steps < 0:
        return None
    step = checkpoint_step(path)
    if step < max_steps:
        return None
    return (f"the run is finished: {path} is at step {step} and trainer.max_steps is {max_steps}; nothing to train "
            "(raise --trainer.max_steps to train on, or validate it with the validate verb)")


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` with two rules of the resume contract. A resumed run does not save the step it
    resumed from again: Lightning does not restore the step it last saved, so under gradient accumulation the resumed
    run's first micro-batch (still at that step) rewrote ``step*.ckpt`` and ``last.ckpt`` with the stream one
    micro-batch on and that micro-batch's gradient gone, and a kill before the next save left a requeue to train
    another run. And every fit saves its last step in ``last.ckpt`` (Lightning's saves it only when the run saved
    nothing), so a ``max_steps`` off the checkpoint interval loses no steps."""

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step  # 0 for a new run, as Lightning starts; else saved already

    def on_train_end(self, trainer, pl_module):
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
