"""lm-evaluation-harness on an export, offline: a local multiple-choice task (a task YAML over a jsonl written here)
through the harness's own evaluation at two maximum lengths, and the harness's log-likelihood of one continuation
checked against our model's summed token log-probabilities, with and without the harness cutting the context."""

import json
import math
import os

import pytest
import torch
from conftest import DOCS, write_task

pytest.importorskip("lm_eval")  # the hf extra: tools/install.sh installs it, so this runs in CI

from cable_lightning.data.tokenizers import get_tokenizer
from cable_lightning.hf import export_backbone, lm_eval_lengths
from cable_lightning.models import BackboneConfig, build_backbone

TRAIN_LEN = 16


@pytest.fixture(scope="module")
def export(tiny_corpus_dir, tmp_path_factory):
    tok = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    torch.manual_seed(0)
    backbone = build_backbone(BackboneConfig(pos_encoding="cable", n_layer=2, n_head=2, n_embd=64,
                                             vocab_size=tok.vocab_size, block_size=TRAIN_LEN)).eval()
    with torch.no_grad():
        for p in backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = export_backbone(backbone, str(tmp_path_factory.mktemp("lm_eval") / "model"), tok)
    return backbone, tok, folder


def our_loglikelihood(backbone, tok, context: str, continuation: str, max_length: int) -> tuple[float, bool]:
    """log p(continuation | context) summed over its tokens, with the context cut on the left so that the model sees
    at most ``max_length`` tokens (the harness's rule), and whether each token is the argmax."""
    context_ids = tok.encode_batch([context])[0]
    whole = tok.encode_batch([context + continuation])[0]
    n_cont = len(whole) - len(context_ids)
    window = torch.tensor([whole[-(max_length + 1):]])
    with torch.no_grad():
        logprobs = backbone(window[:, :-1]).log_softmax(-1)[0, -n_cont:]
    targets = window[0, -n_cont:]
    return logprobs.gather(-1, targets[:, None]).sum().item(), bool((logprobs.argmax(-1) == targets).all())


@pytest.mark.parametrize("max_length", [None, 8])
def test_harness_loglikelihood_equals_our_summed_token_logprobs(export, max_length):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    backbone, tok, folder = export
    lm = HFLM(pretrained=folder, trust_remote_code=True, batch_size=1, device="cpu", max_length=max_length)
    assert lm.max_length == (max_length or TRAIN_LEN)  # the export's max_position_embeddings: its training length
    context, continuation = "The os module provides a portable way of using the operating", " system"
    assert len(tok.encode_batch([context + continuation])[0]) > TRAIN_LEN + 1  # the harness cuts the context
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=0)]
    (got, greedy), = lm.loglikelihood(requests)
    expected, expected_greedy = our_loglikelihood(backbone, tok, context, continuation, lm.max_length)
    assert got == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy


@pytest.mark.parametrize("case", ["missing-model", "malformed-task-file", "missing-include-path", "unknown-task"])
def test_a_bad_model_task_or_task_folder_is_one_error_before_the_model_loads(export, tmp_path, case):
    from cable_lightning.errors import ConfigError

    _, _, folder = export
    write_task(tmp_path)
    (tmp_path / "broken.yaml").write_text("task: broken\n  - : [\n")
    model, task, include = folder, "tiny_mc", tmp_path
    expected = {"missing-model": f"--model {tmp_path / 'nope'} is not a folder and does not load from the hub (",
                "malformed-task-file": f"unknown lm-eval task 'broken'; {tmp_path / 'broken.yaml'} does not load "
                                       "(ScannerError: mapping values are not allowed",
                "missing-include-path": f"--include_path {tmp_path / 'none'} is not a folder; give the folder of your "
                                        "task YAMLs",
                "unknown-task": f"unknown lm-eval task 'nosuchtask'; {tmp_path / 'broken.yaml'} does not load "}[case]
    if case == "missing-model":
        model = str(tmp_path / "nope")
    elif case == "malformed-task-file":
        task = "broken"
    elif case == "missing-include-path":
        include = tmp_path / "none"
    else:
        (tmp_path / "broken.yaml").unlink()
        task, expected = "nosuchtask", "unknown lm-eval task 'nosuchtask'; valid: the tasks of --include_path " \
                                       f"{tmp_path}: tiny_mc"
    with pytest.raises(ConfigError) as error:
        lm_eval_lengths.main(["--model", model, "--tasks", task, "--include_path", str(include),
                              "--only_include_path", "--out", str(tmp_path / "out"), "--trust_remote_code"])
    assert str(error.value).startswith(expected), error.value
    assert not (tmp_path / "out").exists()


def test_local_multiple_choice_task_at_two_lengths_gives_finite_accuracy(export, tmp_path):
    _, _, folder = export
    write_task(tmp_path)
    lm_eval_lengths.main(["--model", folder, "--tasks", "tiny_mc", "--lengths", "16", "12", "--batch_size", "2",
                          "--include_path", str(tmp_path), "--only_include_path", "--out", str(tmp_path / "out"),
                          "--bootstrap_iters", "0", "--trust_remote_code"])
    scores = {length: json.loads((tmp_path / "out" / f"len_{length}.json").read_text()) for length in (16, 12)}
    for per_task in scores.values():
        for metric in ("acc", "acc_norm"):
            value = per_task["tiny_mc"][metric]
            assert math.isfinite(value) and value * len(DOCS) == pytest.approx(round(value * len(DOCS)))
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert table[0] == "| length | tiny_mc/acc | tiny_mc/acc_norm |"
    assert [row.split(" | ")[0] for row in table[2:]] == ["| 16", "| 12"]
