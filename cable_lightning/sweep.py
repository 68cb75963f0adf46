"""Train and evaluate one base config across positional encodings (and training lengths), then report.

    python -m cable_lightning sweep --config configs/quickstart.yaml --pes cable alibi rope --experiment pe-sweep
    python -m cable_lightning sweep --config configs/paper/gpt2_tiny_fineweb.yaml \
        --config configs/trainer/ddp8_bf16.yaml --pes cable alibi kerple_log --print_only   # for a cluster, one a line

    python -m cable_lightning sweep --config configs/quickstart.yaml --pes cable alibi --seeds 0 1 2 --experiment seeds

An encoder study (the paper's Table 2) adds a stage after the masked-LM fits: for every run, export its last
checkpoint, fine-tune it contrastively on the retrieval set's training pairs at the first length, and evaluate
nDCG@10 at every length, recorded as the run's (``retrieval.jsonl``), then report:

    python -m cable_lightning sweep --config configs/encoder/mlm_pydocs.yaml --pes cable alibi --seeds 0 1 \
        --experiment enc
    python -m cable_lightning sweep --config configs/encoder/mlm_pydocs.yaml --pes cable alibi --seeds 0 1 \
        --experiment enc --stage retrieval --retrieval_set data/retrieval-1024 --retrieval_lengths 64 128 256 512 1024

The retrieval stage's settings can also be a YAML file, its keys the flags' names (``retrieval_set``,
``retrieval_lengths``, ``finetune_steps``, ``finetune_batch``, ``finetune_lr``, ``finetune_mini_batch``; paths from the
working directory, as on the command line), which flags on the command line override:

    python -m cable_lightning sweep --config configs/encoder/mlm_code.yaml --pes cable --seeds 0 \
        --experiment code-enc --stage fit+retrieval --retrieval_config configs/retrieval/code_v2.yaml

``--stage fit+retrieval`` runs both, run by run (each encoder run whole: its fit, export, fine-tuning and evaluations;
a set with a short-document check, the code set's, adds its evaluation), so one run is one command.

The Chomsky-hierarchy grid (docs/chomsky.md) adds learning rates: one experiment per rate, <experiment>-lr<rate>,
and the report's algorithmic table gives, per task and encoding, the mean, interval and maximum over seeds:

    python -m cable_lightning sweep --config configs/chomsky/base.yaml --config configs/chomsky/reverse_string.yaml \
        --pes nope rope alibi --seeds 0 1 2 --lrs 1e-4 3e-4 5e-4 --experiment chomsky-reverse

Runs go to runs/<experiment>/<pe>/ (with ``--train_lengths``: experiment <experiment>-T<L>; with ``--seeds``, one
run per seed in runs/<experiment>/<pe>/seed<N>/, trained with ``--seed_everything N``: seeds change the weights'
initialisation, not the data order, so the report can pair them across encodings), and the
report to runs/<experiment>/report_<mode>.{md,csv,png}. Each run is started with ``--ckpt_path auto``: running the
same sweep again continues the runs that were interrupted and leaves finished ones as they are (one line each). The
retrieval stage's commands do the same: an export of the same checkpoint, a fine-tuning with the same settings and an
evaluation whose rows the run's ``retrieval.jsonl`` already holds each say they are done and write nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys

import yaml

from cable_lightning.errors import ArgumentParser, ConfigError, RunFailedError
from cable_lightning.eval.report import report
from cable_lightning.models.config import split_switches, with_switches
from cable_lightning.positional import ENCODING_FLAG, from_label
from cable_lightning.run_setup import run_folder_of

COMMAND = [sys.executable, "-m", "cable_lightning"]  # this interpreter's package, as the sweep itself runs
BACKBONE_FLAG = ENCODING_FLAG.rsplit(".", 1)[0]  # --model.init_args.backbone: where a switch is set
MAX_SEED = 2**32 - 1  # seed_everything's largest seed (numpy's generators take 32 bits)


def seed(text: str) -> int:
    """A ``--seeds`` entry, checked before any run starts (a bad one would fail each run in seed_everything)."""
    if not text.isdigit() or int(text) > MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed is an integer from 0 to {MAX_SEED}, got {text!r}")
    return int(text)


def learning_rate(text: str) -> float:
    """An ``--lrs`` entry, checked before any run starts."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a learning rate is a positive number, got {text!r}")
    return value


def retrieval_commands(run: str, pe: str, seed, args) -> list[list[str]]:
    """The retrieval stage of one pre-trained run folder: export, fine-tune at the first length, evaluate at all; for
    a set with a short-document check (``short/``, the code set's), evaluate that at the first length too."""
    data = {name: os.path.join(args.retrieval_set, f"{name}.{ext}")
            for name, ext in (("corpus", "jsonl"), ("queries", "jsonl"), ("qrels", "tsv"), ("train_pairs", "jsonl"))}
    short = os.path.join(args.retrieval_set, "short")
    cached = [] if args.finetune_mini_batch is None else ["--mini_batch_size", str(args.finetune_mini_batch)]
    export, tuned = os.path.join(run, "export"), os.path.join(run, "export-tuned")
    checkpoint = os.path.join(run, "checkpoints", "last.ckpt")
    return [
        [*COMMAND, "export", "--ckpt_path", checkpoint, "--out", export, "--overwrite"],
        [*COMMAND, "retrieval", "finetune", "--model", export, "--triples", data["train_pairs"], "--out", tuned,
         "--max_seq_length", str(args.retrieval_lengths[0]), "--max_steps", str(args.finetune_steps),
         "--batch_size", str(args.finetune_batch), "--lr", str(args.finetune_lr), "--seed",
         str(0 if seed is None else seed), "--overwrite", "--trust_remote_code", *cached],
        [*COMMAND, "retrieval", "evaluate", "--models", f"{pe}={tuned}", "--lengths",
         *map(str, args.retrieval_lengths), "--corpus", data["corpus"], "--queries", data["queries"], "--qrels",
         data["qrels"], "--records", run, "--out", os.path.join(run, "retrieval"), "--trust_remote_code"],
    ] + ([[*COMMAND, "retrieval", "evaluate", "--models", f"{pe}={tuned}", "--lengths", str(args.retrieval_lengths[0]),
           "--corpus", os.path.join(short, "corpus.jsonl"), "--queries", os.path.join(short, "queries.jsonl"),
           "--qrels", os.path.join(short, "qrels.tsv"), "--records", run, "--out", os.path.join(run, "retrieval-short"),
           "--trust_remote_code"]] if os.path.isdir(short) else [])


def set_settings(encoding: dict) -> dict:
    """An encoding's dict without its unset (None) settings, which mean the same: jsonargparse (4.53) reads a null
    inside a model subclass's nested encoding as the string 'None' (learnable's max_positions)."""
    return {"class_path": encoding["class_path"],
            "init_args": {name: set_settings(value) if isinstance(value, dict) and "class_path" in value else value
                          for name, value in encoding["init_args"].items() if value is not None}}


def commands(args) -> list[tuple[str, list[str]]]:
    """Every run's command (for ``--stage retrieval``, every run's retrieval commands; for ``fit+retrieval``, its fit
    and then those); an unknown encoding label is an error
    before any run starts."""
    encodings, labels = {}, {}
    for pe in args.pes:
        try:
            encoding, switches = split_switches(pe)  # rope+attn_gate: RoPE, with the gate switched on
            encoding = from_label(encoding)
        except ConfigError as exc:
            raise ConfigError(f"--pes {pe}: {exc}") from None
        encodings[pe] = [ENCODING_FLAG, json.dumps(set_settings(encoding.to_dict()))]  # dape_v2+cable: over CABLE
        encodings[pe] += [arg for switch in switches for arg in (f"{BACKBONE_FLAG}.{switch}", "true")]
        labels[pe] = with_switches(encoding.label(runtime=False), switches)
    for flag, values in (("--pes", args.pes), ("--seeds", args.seeds), ("--train_lengths", args.train_lengths),
                         ("--lrs", args.lrs)):
        repeated = [value for i, value in enumerate(values or []) if value in values[:i]]
        if repeated:  # planned twice, the second run would train (or continue) the first's run folder again
            raise ConfigError(f"{flag} names {repeated[0]} twice: each is one run; give it once")
    runs = []
    grid = [(length, lr) for length in args.train_lengths or [None] for lr in args.lrs or [None]]
    for length, lr in grid:
        experiment = args.experiment + ("" if length is None else f"-T{length}") + ("" if lr is None else f"-lr{lr:g}")
        for seed in args.seeds or [None]:  # seed-major: a sweep stopped early has every encoding at its first seeds
            for pe in args.pes:
                run = run_folder_of(args.runs_dir, experiment, labels[pe], seed)
                retrieval = retrieval_commands(run, pe, seed, args) if "retrieval" in args.stage else []
                if args.stage == "retrieval":
                    runs += [(experiment, cmd) for cmd in retrieval]
                    continue
                cmd = [*COMMAND, "fit"]
                for config in args.config:
                    cmd += ["--config", config]
                # auto: running the sweep again continues interrupted runs (finished ones say so and do nothing)
                cmd += ["--experiment", experiment, "--runs_dir", args.runs_dir, *encodings[pe], "--ckpt_path", "auto"]
                if seed is not None:
                    cmd += ["--seed_everything", str(seed), "--folder_per_seed", "true"]
                if length is not None:
                    cmd += ["--data.block_size", str(length)]
                if lr is not None:
                    cmd += ["--model.init_args.lr", f"{lr:g}"]
                # {seed} in an override is the run's seed: a stage that starts from each seed's earlier run
                extra = [arg.replace("{seed}", str(seed)) for arg in args.extra] if seed is not None else args.extra
                runs.append((experiment, cmd + extra))
                runs += [(experiment, cmd) for cmd in retrieval]  # fit+retrieval: each run whole, one after another
    return runs


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_passing_signals(cmd: list[str]) -> tuple[int, int | None]:
    """Runs ``cmd`` in a process group of its own and passes it every SIGINT or SIGTERM the sweep gets, so a Ctrl-C at
    the terminal (which signals only the foreground group, the sweep's) or a SIGTERM to the sweep reaches the fit
    once, and the fit saves its step as a fit stopped on its own does; returns its exit status and the first signal
    passed on (None without one)."""
    child = subprocess.Popen(cmd, process_group=0)
    passed: list[int] = []

    def pass_on(signum, frame):
        passed.append(signum)
        child.send_signal(signum)  # a second Ctrl-C too: the fit then stops at once, as its own second Ctrl-C does

    previous = {signum: signal.signal(signum, pass_on) for signum in STOP_SIGNALS}
    try:
        status = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status, passed[0] if passed else None


RETRIEVAL_SETTINGS = ("retrieval_set", "retrieval_lengths", "finetune_steps", "finetune_batch", "finetune_lr",
                      "finetune_mini_batch")  # what a --retrieval_config file may set, by the flags' names


def retrieval_flags(path: str) -> list[str]:
    """The command-line flags a ``--retrieval_config`` file stands for (its ``key: value`` as ``--key value``), so
    that the sweep's one parser reads and checks them, and flags given after them win."""
    try:
        with open(path, encoding="utf-8") as f:
            settings = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--retrieval_config {path} cannot be read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--retrieval_config {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"--retrieval_config {path} holds {settings!r}, not a mapping of retrieval settings: "
                          f"{', '.join(RETRIEVAL_SETTINGS)}")
    flags = []
    for key, value in settings.items():
        if key not in RETRIEVAL_SETTINGS:
            raise ConfigError(f"--retrieval_config {path}: unknown setting {key!r}; valid: "
                              f"{', '.join(RETRIEVAL_SETTINGS)}")
        if value is not None:
            flags += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
    return flags


def parse_args(argv=None) -> argparse.Namespace:
    """The sweep's settings from its command line (errors in one line, before any run), as :func:`commands` takes
    them."""
    parser = ArgumentParser(prog="python -m cable_lightning sweep", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="base config(s), composed in order")
    parser.add_argument("--pes", nargs="+", required=True,
                        help="encoding labels; dape_v2+<pe> is DAPEv2 over <pe>, <pe>+attn_gate (+attn_sink, "
                             "+qk_norm) the encoding with that attention switch on")
    parser.add_argument("--train_lengths", type=int, nargs="*", help="also sweep the training length")
    parser.add_argument("--seeds", type=seed, nargs="*", help="one run per seed (seed_everything), each in its own "
                        "folder; the report gives means and 95%% intervals over them")
    parser.add_argument("--lrs", type=learning_rate, nargs="*", help="also sweep the learning rate "
                        "(model.init_args.lr; one experiment per rate, <experiment>-lr<rate>)")
    parser.add_argument("--experiment", default="sweep")
    parser.add_argument("--runs_dir", default="runs")
    parser.add_argument("--report", default=None, help="report prefix (default <runs_dir>/<experiment>/report)")
    parser.add_argument("--print_only", action="store_true", help="print the commands instead of running them")
    parser.add_argument("--stage", choices=("fit", "retrieval", "fit+retrieval"), default="fit",
                        help="fit: train (or continue) every run; retrieval: export, fine-tune and evaluate every "
                        "pre-trained encoder run on --retrieval_set; fit+retrieval: both, run by run")
    parser.add_argument("--retrieval_set", help="a folder from python -m cable_lightning retrieval-set")
    parser.add_argument("--retrieval_lengths", type=int, nargs="+",
                        help="evaluation lengths; the first is the fine-tuning length (the training length)")
    parser.add_argument("--finetune_steps", type=int, default=200)
    parser.add_argument("--finetune_batch", type=int, default=32)
    parser.add_argument("--finetune_lr", type=float, default=2e-5, help="the contrastive fine-tuning's learning rate")
    parser.add_argument("--finetune_mini_batch", type=int, help="CachedMultipleNegativesRankingLoss in mini-batches "
                        "of this size (retrieval finetune --mini_batch_size)")
    parser.add_argument("--retrieval_config", metavar="FILE", help="the retrieval settings above from a YAML file "
                        "(keys: their names); flags on the command line override it")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more CLI overrides for every run; {seed} "
                        "in them is the run's seed (--model.init_args.init_weights runs/e/rope/seed{seed}/...)")
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = argv[:argv.index("--")] if "--" in argv else argv  # after --: the fits' own overrides
    given = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    given.add_argument("--retrieval_config", "--retrieval-config")
    config = given.parse_known_args(ours)[0].retrieval_config
    try:
        from_file = retrieval_flags(config) if config else []
    except ConfigError as exc:
        parser.error(str(exc))
    args = parser.parse_args(from_file + argv)
    args.extra = [a for a in args.extra if a != "--"]
    if "retrieval" in args.stage:
        if not args.retrieval_set or not os.path.isfile(os.path.join(args.retrieval_set, "train_pairs.jsonl")):
            parser.error(f"--stage {args.stage} needs --retrieval_set, a folder from python -m "
                         f"cable_lightning retrieval-set; got {args.retrieval_set!r}")
        if not args.retrieval_lengths or min(args.retrieval_lengths) < 1:
            parser.error(f"--stage {args.stage} needs positive --retrieval_lengths, got {args.retrieval_lengths}")
        if args.train_lengths or args.lrs or (args.extra and args.stage == "retrieval"):
            parser.error(f"--stage {args.stage} takes the runs as the config trains them (the first "
                         "--retrieval_lengths is their training length): no --train_lengths or --lrs"
                         + (", and no overrides: they train nothing" if args.stage == "retrieval" else ""))
    return args


def main(argv=None):
    args = parse_args(argv)
    runs = commands(args)
    if args.print_only:
        print("\n".join(shlex.join(cmd) for _, cmd in runs))
        return
    for _, cmd in runs:
        print("+", shlex.join(cmd), flush=True)
        status, stopped = run_passing_signals(cmd)
        if stopped is not None:
            print(f"error: the sweep was stopped by {signal.Signals(stopped).name}, and so was its run `"
                  f"{shlex.join(cmd[1:])}` (exit status {status}, its last step saved where it says above); run the "
                  "same sweep again to continue", file=sys.stderr, flush=True)
            sys.exit(status if status > 128 else 128 + stopped)
        if status != 0:
            raise RunFailedError(f"the run `{shlex.join(cmd[1:])}` ended with exit status {status} (its error is "
                                 "above); running the sweep again continues it")
    out = args.report or f"{args.runs_dir}/{args.experiment}/report"
    for mode, table in report([f"{args.runs_dir}/{experiment}" for experiment in sorted({e for e, _ in runs})],
                              out).items():
        print(f"## {mode}\n{table}\n")


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
