"""Shared fixtures. ``tiny_corpus_dir`` is a small prepared corpus (real English from the offline python-docs
source, a bpe:512 tokenizer) that model, CLI and data tests can train and evaluate on without the network."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys

import pytest

# Tokenizers is used before litdata forks its workers in these tests; say up front that it may not use threads
# there (otherwise it prints a warning per fork).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (the README's `-n 2`) each worker, and every process a test starts, computes on one thread: two
# workers on two cores, not four threads contending for them. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

TINY_CORPUS_CHARS = 330_000  # about 170k bpe:512 tokens, a third of them held out
TINY_VAL_FRACTION = 0.25


def write_tiny_corpus(folder: str, chars: int = TINY_CORPUS_CHARS) -> tuple[str, list[str]]:
    """Write the first python-docs documents (about ``chars`` characters) as jsonl; returns (path, documents)."""
    from cable_lightning.data.sources import python_docs

    docs, total = [], 0
    for doc in python_docs():
        if total >= chars:
            break
        docs.append(doc)
        total += len(doc)
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return path, docs


@pytest.fixture(autouse=True)
def compiles_fail_past_the_limit():
    """Every compile in the suite fails at Dynamo's recompile limit instead of running uncompiled (a fallback the run
    would only warn about), and each test starts with Dynamo's caches empty: what one test (one encoding) compiled
    counts toward no other's limit."""
    import torch

    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


@pytest.fixture(scope="session")
def tiny_corpus_docs(tmp_path_factory) -> tuple[str, list[str]]:
    """(jsonl path, documents) of the tiny corpus's raw text."""
    return write_tiny_corpus(str(tmp_path_factory.mktemp("tiny_corpus_raw")))


@pytest.fixture(scope="session")
def tiny_corpus_dir(tiny_corpus_docs, tmp_path_factory) -> str:
    """Path of a prepared folder (manifest.json, tokenizer.json, train/, val/): bpe:512, >= 60k train and
    >= 20k val tokens, deterministic. Read it with ``TokenDataModule(path=tiny_corpus_dir, ...)``."""
    from cable_lightning.data.prepare import prepare

    jsonl, _ = tiny_corpus_docs
    out = str(tmp_path_factory.mktemp("tiny_corpus") / "tiny-bpe512")
    manifest = prepare(
        source=jsonl,
        tokenizer="bpe:512",
        out=out,
        val_fraction=TINY_VAL_FRACTION,
        num_workers=1,
        start_method="fork",  # a spawned worker re-imports torch (~3 s); a forked one starts at once
        verbose=False,
    )
    assert manifest["splits"]["train"]["tokens"] >= 60_000, manifest["splits"]
    assert manifest["splits"]["val"]["tokens"] >= 20_000, manifest["splits"]
    return out


@pytest.fixture(scope="session")
def small_corpus_dir(tiny_corpus_dir, tmp_path_factory) -> str:
    """A prepared folder of the first ~40k characters (about 13k train tokens) with the tiny corpus's tokenizer: at
    block_size 128 and 16 windows a step, an epoch is 6 steps, so a fit crosses epochs in seconds."""
    from cable_lightning.data.prepare import prepare

    raw = tmp_path_factory.mktemp("small_corpus_raw")
    jsonl, _ = write_tiny_corpus(str(raw), chars=40_000)
    out = str(tmp_path_factory.mktemp("small_corpus") / "small")
    manifest = prepare(source=jsonl, tokenizer=os.path.join(tiny_corpus_dir, "tokenizer.json"), out=out,
                       val_fraction=TINY_VAL_FRACTION, num_workers=1, start_method="fork", verbose=False)
    assert 6 * 16 * 129 <= manifest["splits"]["train"]["tokens"] < 7 * 16 * 129, manifest["splits"]
    return out


class S3Server:
    """A real S3-compatible server (moto's server mode) on the loopback address. ``env`` is what a client needs
    (endpoint, credentials, region); in :meth:`checking_signatures` only ``key``/``secret`` are accepted."""

    BUCKET = "cable-tests"

    def __init__(self):
        import logging

        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        # Moto accepts any request until told to check them: a user with a key that may do anything, for then.
        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="tests")
        iam.put_user_policy(UserName="tests", PolicyName="all", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        made = iam.create_access_key(UserName="tests")["AccessKey"]
        self.key, self.secret = made["AccessKeyId"], made["SecretAccessKey"]
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key,
                    "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=self.key,
                     aws_secret_access_key=self.secret).create_bucket(Bucket=self.BUCKET)

    @contextlib.contextmanager
    def checking_signatures(self):
        """Requests are checked (signed with ``key``/``secret``) only inside this block: moto 5.2's check refuses
        correctly signed listings whose prefix holds a '/', which every prepared-data listing does."""
        import requests

        requests.post(f"{self.endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        try:
            yield
        finally:
            requests.post(f"{self.endpoint}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=self.key,
                            aws_secret_access_key=self.secret)

    def stop(self):
        self.server.stop()


@pytest.fixture(scope="session")
def s3_server():
    """One server for the whole test run, its endpoint and credentials in the environment (where boto3 and LitData
    read them, also in the processes tests start), stopped at the run's end."""
    server, env = S3Server(), pytest.MonkeyPatch()
    for name, value in server.env.items():
        env.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        env.delenv(name, raising=False)
    yield server
    env.undo()
    server.stop()


@pytest.fixture
def s3_url(s3_server, request) -> str:
    """A fresh ``s3://cable-tests/<test name>`` prefix."""
    return f"s3://{S3Server.BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"


@pytest.fixture(scope="session")
def tiny_corpus_s3(s3_server, tiny_corpus_docs) -> str:
    """The tiny corpus prepared into the server (the same request as ``tiny_corpus_dir``)."""
    from cable_lightning.data.prepare import prepare

    url = f"s3://{S3Server.BUCKET}/tiny-bpe512"
    prepare(source=tiny_corpus_docs[0], tokenizer="bpe:512", out=url, val_fraction=TINY_VAL_FRACTION, num_workers=1,
            start_method="fork", verbose=False)
    return url


# --- functions shared by the test modules (imported as `from conftest import ...`) ---------------------------------

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
ROW = {"pe": "cable", "train_length": 32, "stage": "fit", "step": 4, "length": 32, "mode": "nonoverlap", "ppl": 9.5}


def args(data, runs, pe="cable", model="CausalLM", steps=4, every=2, extra=()):
    """A fit's settings for a tiny model on the tiny corpus (``data``), run under ``runs``/test/<pe>."""
    preset = "bert-base" if model == "MaskedLM" else "gpt2-tiny"
    return [
        "--model", f"cable_lightning.lit.{model}",
        "--model.init_args.backbone.preset", preset,
        "--model.init_args.backbone.pos_encoding", pe,
        "--model.init_args.backbone.n_layer", "2",
        "--model.init_args.backbone.n_head", "2",
        "--model.init_args.backbone.n_embd", "32",
        "--model.init_args.warmup_steps", "2",
        "--data.path", data,
        "--data.block_size", "32",
        "--data.micro_batch_size", "4",
        "--data.eval_lengths", "[32, 64]",
        "--data.eval_tokens", "256",
        "--trainer.accelerator", "cpu",
        "--trainer.devices", "1",
        "--trainer.max_steps", str(steps),
        "--trainer.log_every_n_steps", "1",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--checkpoint.every_n_train_steps", str(every),
        "--runs_dir", runs,
        "--experiment", "test",
        "--seed_everything", "7",
        *extra,
    ]


def checkpoints(runs, pe="rope"):
    return os.path.join(runs, "test", pe, "checkpoints")


def jsonl_rows(runs, pe="rope"):
    return [json.loads(line)
            for f in sorted(glob.glob(os.path.join(runs, "test", pe, "version_*", "length_eval.jsonl")))
            for line in open(f)]


def one_error_line(capsys, call, status=2) -> str:
    """Calls ``call``; asserts it exits with ``status`` and that stderr holds one ``error:`` line and no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


def user_error_line(capsys, argv, status=2):
    """Runs the command line; asserts the exit status and that stderr holds one ``error:`` line and no traceback."""
    from cable_lightning.cli import run

    return one_error_line(capsys, lambda: run(argv), status)


def only_line(capsys, argv, status=2) -> str:
    """Runs a verb; asserts the exit status and that stderr is one ``error:`` line (no usage text, no traceback)."""
    from cable_lightning.__main__ import main as verbs

    with pytest.raises(SystemExit) as stop:
        verbs(argv)
    err = capsys.readouterr().err
    assert stop.value.code == status and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def tool(*argv: str) -> subprocess.CompletedProcess:
    """A tool as its user runs it (this checkout's package first on the path, no debug variable)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("CABLE_LIGHTNING_DEBUG", None)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT)


def error_lines(done: subprocess.CompletedProcess, status: int = 2) -> list[str]:
    """The ``error:`` lines of a finished tool, asserted to have exited with ``status`` and no traceback."""
    assert done.returncode == status and "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def randomised(module, scale=0.3, seed=0):
    """``module`` with every parameter moved by scaled noise, so that no weight sits at its initial value."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module


DOCS = [{"context": "The os module provides", "choices": [" a portable way", " zebra zebra", " of the"], "label": 0},
        {"context": "Return the value of", "choices": [" the key", " xyzzy"], "label": 0},
        {"context": "import sys and", "choices": [" os", " qqq"], "label": 1}]


def write_task(folder) -> None:
    """tiny_mc: a multiple-choice task over DOCS, in ``folder``."""
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')


def printed_backbone(capsys, *overrides) -> dict:
    """The backbone section ``fit --print_config`` prints for the quickstart config with ``overrides``."""
    import yaml

    from cable_lightning.cli import main

    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", os.path.join(ROOT, "configs", "quickstart.yaml"), *overrides, "--print_config"])
    assert done.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["backbone"]


# --- the data tests' corpora and checks (test_prepare, test_sources, test_tokenizers, test_datamodule) ---------------

@pytest.fixture
def no_network(monkeypatch):
    """Refuses internet sockets: a test that would reach the network fails, naming the address."""
    import socket

    real_connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"test tried to open a network connection to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def read_split_tokens(path: str, split: str):
    """Every token of a split in stream order: the held-out arrays as saved; train through litdata, in windows
    whose length divides every chunk's token count, so none is lost at a chunk's end."""
    import math

    import numpy as np
    from litdata import StreamingDataset, TokensLoader

    from cable_lightning.data.manifest import read_manifest

    manifest = read_manifest(path)
    if split != "train":
        return np.load(os.path.join(path, manifest["splits"][split]["file"]))
    chunks = json.loads(open(os.path.join(path, "train", "index.json")).read())["chunks"]
    window = math.gcd(*[chunk["dim"] for chunk in chunks])
    dataset = StreamingDataset(os.path.join(path, "train"), item_loader=TokensLoader(block_size=window), shuffle=False)
    tokens = np.concatenate([np.asarray(dataset[i]) for i in range(len(dataset))])
    assert len(tokens) == manifest["splits"]["train"]["tokens"]
    return tokens


def joined(docs: list[str]) -> str:
    """Documents as prepare streams them: each followed by the end-of-text token."""
    from cable_lightning.data.tokenizers import EOT_TOKEN

    return "".join(doc + EOT_TOKEN for doc in docs)


def one_line(exc: pytest.ExceptionInfo) -> str:
    """The error's message, asserted to be one line."""
    message = str(exc.value)
    assert "\n" not in message, message
    return message


SMALL_DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 40,
    "Unicode survives: naïve café, 東京, emoji 🙂, tabs\tand\nnewlines.\n" * 30,
    "A document that mentions <|endoftext|> literally must keep it as text. " * 30,
    "def f(x):\n    return x * 2  # code is text too\n" * 40,
]


@pytest.fixture
def small_txt_dir(tmp_path):
    """A folder of four small .txt documents (and a .md file that is not corpus)."""
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, doc in enumerate(SMALL_DOCS):
        (folder / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    (folder / "notes.md").write_text("ignored: not a corpus file")
    return str(folder)


def work_folders(out: str) -> list[str]:
    """What a prepare of ``out`` builds or retires beside it (``.<out>.partial-*``, ``.<out>.old-*``)."""
    parent, base = os.path.split(out)
    return [name for name in os.listdir(parent) if name.startswith((f".{base}.partial-", f".{base}.old-"))]


def fast_prepare(**kwargs):
    """prepare() on one forked worker, quietly."""
    from cable_lightning.data.prepare import prepare

    kwargs.setdefault("num_workers", 1)
    kwargs.setdefault("start_method", "fork")
    kwargs.setdefault("verbose", False)
    return prepare(**kwargs)


# --- two-process fits on CPU over gloo (test_fsdp, test_fsdp_compiled) ------------------------------------------------

MODEL = ["--model", "cable_lightning.lit.CausalLM", "--model.init_args.backbone.pos_encoding", "cable",
         "--model.init_args.backbone.n_layer", "2", "--model.init_args.backbone.n_head", "2",
         "--model.init_args.backbone.n_embd", "32", "--model.init_args.warmup_steps", "2"]
QUIET = ["--diagnostics.enabled", "false", "--length_eval.figure", "false"]  # no attention statistics or figures
STRATEGY = {"fsdp2": ["--config", f"{ROOT}/configs/trainer/fsdp8_bf16.yaml"], "ddp": ["--trainer.strategy", "ddp"]}


def two_process_data(path):
    """Each rank's epoch is 6 steps of 8 x 129 tokens of the small corpus."""
    return ["--data.path", path, "--data.block_size", "128", "--data.micro_batch_size", "8",
            "--data.eval_lengths", "[32]", "--data.eval_tokens", "128"]


def two_process_fit(runs, losses, strategy, *extra, steps=12, every=3):
    """A fit on two CPU processes (``strategy``: fsdp2 or ddp), its per-step losses read back from ``losses``."""
    cmd = [sys.executable, "-m", "cable_lightning", "fit", *STRATEGY[strategy],
           "--trainer.accelerator", "cpu", "--trainer.devices", "2", *MODEL, *extra, *QUIET,
           "--trainer.max_steps", str(steps), "--checkpoint.every_n_train_steps", str(every),
           "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
           "--trainer.enable_model_summary", "false",
           "--trainer.callbacks+=ddp_probe.Losses", f"--trainer.callbacks.out_dir={losses}",
           "--trainer.callbacks+=ddp_probe.Windows", f"--trainer.callbacks.out_dir={losses}",
           "--runs_dir", str(runs), "--seed_everything", "5"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in open(losses / "losses.jsonl")]


# After the settings at the top of this file: torch is imported here, not before them.
from torch import Tensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator produces, and the largest whose last dim is ``width``."""

    def __init__(self, width):
        super().__init__()
        self.width, self.largest, self.largest_with_width = width, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel())
                if t.dim() and t.shape[-1] == self.width:
                    self.largest_with_width = max(self.largest_with_width, t.numel())
        return out


def dense_attention(q, k, v, bias_rows, allowed):
    """softmax(q.k / sqrt(d) + bias) v with every key where ``allowed`` is False masked: the obvious formula the
    window and chunk masks of every backend are checked against."""
    import math

    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias_rows
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
