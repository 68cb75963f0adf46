"""Hugging Face export: every positional encoding round-trips through transformers, loaded where cable_lightning
cannot be imported (a subprocess whose import system refuses it), with the same logits at the training length and
at 4x, the same greedy generation (transformers' generate on our KV cache) and the same tokenizer ids."""

import json
import os
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")  # the hf extra: tools/install.sh installs it, so this runs in CI

from cable_lightning.data.tokenizers import get_tokenizer
from cable_lightning.hf import export_backbone, load_backbone
from cable_lightning.hf.export import hf_tokenizer, write_tiktoken_ranks
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.models.config import split_switches
from cable_lightning.positional import available, from_label, score_bias_encodings
from cable_lightning.records.io import content_hash

SEPARATED = "one document<|endoftext|>the next"
# Every registered encoding, DAPEv2 over every encoding it wraps, and a pattern of windowed layers.
EXPORTED = sorted({from_label(pe).label() for pe in available() + [f"dape_v2+{pe}" for pe in score_bias_encodings()]}
                  | {"ssmax+layers-cable@5-stick_breaking@3-rope"}  # windows shorter than the 4x length
                  | {f"{pe}+attn_gate+attn_sink+qk_norm" for pe in ("cable", "rope")})  # every attention switch
BEAM_PES = ("cable", "rope")
TRAIN_LEN, PROMPT, NEW_TOKENS = 16, 6, 14  # generation runs to 20 tokens, past the training length
SAMPLE = "The os module provides a portable way of using operating system dependent functionality, 42 times."

# Run in a fresh interpreter: cable_lightning is refused by the import system itself (the editable install's
# finder and any path entry included), so the folder must carry everything it needs.
LOADER = r'''
import importlib.abc, json, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "cable_lightning":
            raise ImportError(f"{name} is hidden from this process")
sys.meta_path.insert(0, Refuse())
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer
job = json.load(open(sys.argv[1]))
results = {}
for name, spec in job["models"].items():
    head = AutoModelForCausalLM if spec["causal"] else AutoModelForMaskedLM
    model = head.from_pretrained(spec["folder"], trust_remote_code=True).eval()
    ids = torch.tensor(job["ids"])
    out = {"train": model(ids[:, : spec["train_len"]]).logits}
    try:
        out["long"] = model(ids).logits
    except ValueError as err:
        out["long_error"] = str(err)
    if spec["causal"]:
        prompt = ids[:1, : job["prompt"]]
        out["generated"] = model.generate(prompt, max_new_tokens=spec["new_tokens"], do_sample=False)
        if spec.get("beams"):  # a loaded model saved again is a whole folder (the copied model code included)
            model.save_pretrained(spec["folder"] + "-resaved")
            again = AutoModelForCausalLM.from_pretrained(spec["folder"] + "-resaved", trust_remote_code=True).eval()
            out["resaved"] = again(ids).logits
        if spec.get("beams"):  # one cached step, the cache passed under each name transformers 5.x has used
            whole = model(ids[:1, : job["prompt"] + 1]).logits[:, -1]
            out["cached_step"] = {"whole": whole}
            for keyword in ("cache", "past_key_values"):
                cache = model(prompt, use_cache=True).to_tuple()[1]  # (logits, cache): the field's name varies
                step = model(ids[:1, job["prompt"] : job["prompt"] + 1], **{keyword: cache}, use_cache=True)
                out["cached_step"][keyword] = step.logits[:, -1]
        if spec.get("beams"):  # beam search reorders the cache (PE state included): it must match running without one
            out["beams"] = [model.generate(prompt, max_new_tokens=spec["new_tokens"], num_beams=3, do_sample=False,
                                           use_cache=use_cache) for use_cache in (True, False)]
    else:
        encoder = AutoModel.from_pretrained(spec["folder"], trust_remote_code=True).eval()
        mask = torch.tensor(job["padding_mask"])
        out["hidden_padded"] = encoder(input_ids=ids[:, : mask.shape[1]], attention_mask=mask).last_hidden_state
    results[name] = out
tok = AutoTokenizer.from_pretrained(job["tokenizer_folder"], trust_remote_code=True)
results["tokenizer"] = {"ids": tok(job["text"]).input_ids, "eos": tok.eos_token_id, "pad": tok.pad_token_id,
                        "separated": tok(job["separated"]).input_ids}
results["cable_lightning_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "cable_lightning")
torch.save(results, job["out"])
'''


def load_without_package(job: dict, tmp_path) -> dict:
    """Run LOADER on ``job`` in a subprocess that cannot import cable_lightning; returns its results."""
    job = {**job, "out": str(tmp_path / "results.pt")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "loader.py").write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(tmp_path / "loader.py"), str(tmp_path / "job.json")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(job["out"], weights_only=False)


def tiny_backbone(pe: str, causal: bool, vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(sum(map(ord, pe)) + causal)
    encoding, switches = split_switches(pe)
    config = BackboneConfig(preset="gpt2-tiny", pos_encoding=encoding, n_layer=2, n_head=2, n_embd=64,
                            vocab_size=vocab_size, causal=causal, block_size=TRAIN_LEN,
                            **{switch: True for switch in switches})
    backbone = build_backbone(config).eval()
    with torch.no_grad():  # move every weight off its initial value, so that each one matters to the comparison
        for p in backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return backbone


@pytest.fixture(scope="module")
def round_trip(tiny_corpus_dir, tmp_path_factory):
    """Every registered PE (and DAPEv2 variant), causal and bidirectional, exported and loaded back through
    transformers."""
    root = tmp_path_factory.mktemp("exports")
    tok = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    ids = torch.tensor(tok.encode_batch([SAMPLE * 8])[0][: 4 * TRAIN_LEN]).view(1, -1).repeat(2, 1)
    ids[1] = ids[1].roll(7)
    backbones, models = {}, {}
    for pe in EXPORTED:
        for causal in (True, False):
            name = f"{pe}-{'causal' if causal else 'bidirectional'}"
            backbones[name] = tiny_backbone(pe, causal, tok.vocab_size)
            folder = export_backbone(backbones[name], str(root / name), tok)
            new_tokens = TRAIN_LEN - PROMPT if pe == "learnable" else NEW_TOKENS
            models[name] = {"folder": folder, "causal": causal, "train_len": TRAIN_LEN, "new_tokens": new_tokens,
                            "beams": causal and pe in BEAM_PES}
    padding_mask = [[1] * 12 + [0] * 4, [0] * 3 + [1] * 13]  # right and left padding
    job = {"models": models, "ids": ids.tolist(), "prompt": PROMPT, "padding_mask": padding_mask, "text": SAMPLE,
           "separated": SEPARATED,
           "tokenizer_folder": models[f"{available()[0]}-causal"]["folder"]}
    return backbones, models, ids, tok, load_without_package(job, tmp_path_factory.mktemp("loader"))


@pytest.mark.parametrize("pe", EXPORTED)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_transformers_logits_equal_the_backbone_at_1x_and_4x(round_trip, pe, causal):
    backbones, _, ids, _, results = round_trip
    name = f"{pe}-{'causal' if causal else 'bidirectional'}"
    backbone, got = backbones[name], results[name]
    with torch.no_grad():
        torch.testing.assert_close(got["train"], backbone(ids[:, :TRAIN_LEN]), rtol=0, atol=1e-5)
        if pe == "learnable":  # the table cannot go past its size: the same one-line error, through transformers
            with pytest.raises(ValueError) as ours:
                backbone(ids)
            assert got["long_error"] == str(ours.value) and "exceeds the learnable encoding's" in got["long_error"]
        else:
            torch.testing.assert_close(got["long"], backbone(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pe", EXPORTED)
def test_greedy_generate_through_transformers_equals_backbone_generate(round_trip, pe):
    backbones, models, ids, _, results = round_trip
    name = f"{pe}-causal"
    ours = backbones[name].generate(ids[:1, :PROMPT], max_new_tokens=models[name]["new_tokens"], temperature=0)
    assert results[name]["generated"].tolist() == ours.tolist()
    assert ours.shape[1] == PROMPT + models[name]["new_tokens"]


@pytest.mark.parametrize("pe", BEAM_PES)
@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_a_cached_step_reads_the_cache_under_either_transformers_name(round_trip, pe, keyword):
    """transformers 5.24 passes the cache as ``cache``, earlier 5.x releases as ``past_key_values``: a step on the
    prompt's cache must give the logits of running the whole sequence, whichever name carries it."""
    step = round_trip[4][f"{pe}-causal"]["cached_step"]
    torch.testing.assert_close(step[keyword], step["whole"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("pe", BEAM_PES)
def test_beam_search_reorders_the_cache_with_the_pe_state(round_trip, pe):
    with_cache, without_cache = round_trip[4][f"{pe}-causal"]["beams"]
    assert with_cache.tolist() == without_cache.tolist()


@pytest.mark.parametrize("pe", BEAM_PES)
def test_a_loaded_model_saved_again_loads_with_the_same_logits(round_trip, pe):
    backbones, _, ids, _, results = round_trip
    with torch.no_grad():
        expected = backbones[f"{pe}-causal"](ids)
    torch.testing.assert_close(results[f"{pe}-causal"]["resaved"], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pe", ["cable", "rope", "t5"])
def test_padded_encoder_batch_gives_each_row_its_unpadded_hidden_states(round_trip, pe):
    """sentence-transformers pads batches: the wrapper hands the attention mask to the backbone as its padding mask,
    and rows must not see the pads."""
    backbones, _, ids, _, results = round_trip
    backbone, got = backbones[f"{pe}-bidirectional"], results[f"{pe}-bidirectional"]["hidden_padded"]
    with torch.no_grad():
        torch.testing.assert_close(got[0, :12], backbone.hidden_states(ids[:1, :12])[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[1, 3:16], backbone.hidden_states(ids[1:, 3:16])[0], rtol=0, atol=1e-5)
    assert not got[0, 12:].any() and not got[1, :3].any()


def test_loaded_folder_never_imported_cable_lightning_and_tokenizer_ids_match(round_trip):
    _, _, _, tok, results = round_trip
    assert results["cable_lightning_modules"] == []
    assert results["tokenizer"]["ids"] == tok.encode_batch([SAMPLE])[0]
    assert results["tokenizer"]["eos"] == tok.eot_id == results["tokenizer"]["pad"]
    # transformers' convention: a special token written in the text is that token (our data keeps it as text)
    assert tok.eot_id in results["tokenizer"]["separated"] and tok.eot_id not in tok.encode_batch([SEPARATED])[0]


@pytest.mark.parametrize("pe", ["cable", "learnable"])
def test_load_backbone_gives_back_the_same_weights(round_trip, pe):
    backbones, models, *_ = round_trip
    for causal in ("causal", "bidirectional"):
        original, loaded = backbones[f"{pe}-{causal}"], load_backbone(models[f"{pe}-{causal}"]["folder"])
        assert loaded.config == original.config
        assert original.state_dict().keys() == loaded.state_dict().keys()
        assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in original.state_dict().items())


def test_export_replaces_only_its_own_folder_and_leaves_no_partial_one(tmp_path):
    backbone = tiny_backbone("nope", True, 300)
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # a folder export did not write: never replaced, --overwrite or not
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="already exists and was not written by export .*; choose another --out"):
            export_backbone(backbone, str(out), overwrite=overwrite)
    assert list(tmp_path.iterdir()) == [out] and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    export_backbone(backbone, str(out))  # an empty folder is filled
    with pytest.raises(ValueError, match=r"already exists \(written by export\); pass --overwrite"):
        export_backbone(backbone, str(out))
    first = (out / "model.safetensors").stat().st_ino
    export_backbone(backbone, str(out), overwrite=True)
    assert (out / "model.safetensors").stat().st_ino != first and list(tmp_path.iterdir()) == [out]
    with pytest.raises(ValueError, match=f"--out {out} holds this command's input {out / 'model.safetensors'}"):
        export_backbone(backbone, str(out), overwrite=True, inputs=(str(out / "model.safetensors"),))


def test_an_export_that_cannot_be_written_is_one_error_naming_the_limit_and_replaces_nothing(tmp_path):
    """safetensors reports a full disk (here the file-size limit, EFBIG) as its own SafetensorError."""
    import resource

    from cable_lightning.errors import RunFailedError

    backbone, out = tiny_backbone("nope", True, 300), tmp_path / "model"
    export_backbone(backbone, str(out))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
    try:
        with pytest.raises(RunFailedError) as failed:
            export_backbone(backbone, str(out), overwrite=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(failed.value).startswith(f"could not write the export {out} (SafetensorError: "), failed.value
    assert str(failed.value).endswith("file-size limit (ulimit -f) 0.0625 MiB); nothing was replaced")
    assert list(tmp_path.iterdir()) == [out] and load_backbone(str(out)).config == backbone.config


EDITED_LOADER = """
import sys
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
except ValueError as exc:
    sys.exit(f"refused: {exc}")
"""


def test_weights_that_do_not_fit_an_edited_config_json_are_refused_by_transformers(tmp_path):
    out = tmp_path / "model"
    export_backbone(tiny_backbone("nope", True, 300), str(out))
    config = json.loads((out / "config.json").read_text())
    config["backbone"]["n_layer"] = 3  # the third layer's weights are not in the file
    (out / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    done = subprocess.run([sys.executable, "-c", EDITED_LOADER, str(out)], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"refused: the weights in {out} do not fit its config.json (missing keys backbone.blocks.2.attn.out.bias, "
        "backbone.blocks.2.attn.out.weight, backbone.blocks.2.attn.qkv.bias ...); undo the edit to config.json or "
        "export the checkpoint again"), done.stderr[-3000:]


def test_tiktoken_and_wordpiece_tokenizers_export_to_the_same_ids(tmp_path):
    text = "the theme of the thesis: then, there! 42"
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"th", b"the", b" the", b"he", b"er", b" th"):
        ranks[merge] = len(ranks)
    write_tiktoken_ranks(ranks, str(tmp_path / "tiny.tiktoken"))
    gpt2_like = get_tokenizer(f"gpt2:{tmp_path / 'tiny.tiktoken'}")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "theme", "of", "the", "##sis", "then", "there",
             ":", ",", "!", "4", "##2", "t", "##h", "##e", "<", ">", "|"]
    (tmp_path / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    wordpiece = get_tokenizer(f"bert:{tmp_path / 'vocab.txt'}")
    for tok in (gpt2_like, wordpiece):
        exported = hf_tokenizer(tok, max_length=TRAIN_LEN)
        assert exported(text).input_ids == tok.encode_batch([text])[0], type(tok).__name__
        assert exported.eos_token_id == tok.eot_id and exported.mask_token_id in (tok.mask_id, None)


def test_export_command_writes_a_folder_from_a_fit_checkpoint(tiny_corpus_dir, tmp_path, monkeypatch, capsys):
    from cable_lightning.cli import main as cli
    from cable_lightning.hf.export import main as export
    from cable_lightning.lit.checkpoint_format import checkpoint_backbone

    cli(["fit", "--model", "cable_lightning.lit.CausalLM", "--model.init_args.backbone.n_layer", "2",
         "--model.init_args.backbone.n_head", "2", "--model.init_args.backbone.n_embd", "32",
         "--data.path", tiny_corpus_dir, "--data.block_size", "32", "--data.micro_batch_size", "2",
         "--data.eval_tokens", "64", "--trainer.max_steps", "2", "--trainer.accelerator", "cpu",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.num_sanity_val_steps", "0", "--runs_dir", str(tmp_path / "runs"), "--experiment", "export"])
    ckpt = tmp_path / "runs" / "export" / "cable" / "checkpoints" / "last.ckpt"
    out = tmp_path / "hf"
    export(["--ckpt_path", str(ckpt), "--out", str(out)])  # the data path comes from the run's config.yaml
    trained, _, provenance = checkpoint_backbone(str(ckpt))
    exported = load_backbone(str(out))
    assert all(torch.equal(v, exported.state_dict()[k]) for k, v in trained.state_dict().items())
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 32 and config["auto_map"]["AutoModelForCausalLM"]
    assert config["provenance"] == provenance and provenance["step"] == 2 and provenance["checkpoint"] == str(ckpt)
    assert (out / "tokenizer.json").is_file() and (out / "cable_core" / "positional" / "registry.py").is_file()
    # the run's identity, as its length records name it, for the retrieval rows measured on the export
    saved = torch.load(ckpt, weights_only=True)
    assert provenance["checkpoint_hash"] == content_hash([str(ckpt)]) and provenance["lr"] == 6e-4
    assert provenance["recipe"] == saved["recipe"] and provenance["recipe"]["steps"] == 2
    assert provenance["corpus_hash"] == saved["run_data"]["corpus_hash"]
    assert provenance["settings"]["dropout"] == 0.0 and provenance["settings"]["n_layer"] == 2
    # exported again from the same checkpoint (a sweep run again): nothing to do, nothing rewritten
    written = os.stat(out / "model.safetensors").st_mtime_ns
    capsys.readouterr()
    export(["--ckpt_path", str(ckpt), "--out", str(out), "--overwrite"])
    assert capsys.readouterr().out == (
        f"{out} is an export of {ckpt} (the same checkpoint): already done; nothing to do\n")
    assert os.stat(out / "model.safetensors").st_mtime_ns == written

    # `python -m cable_lightning export` (the module's __main__, in this process): an existing folder of another
    # checkpoint (the same bytes elsewhere: records name the path) is a one-line error with exit status 2
    other = tmp_path / "other.ckpt"
    shutil.copyfile(ckpt, other)
    monkeypatch.setattr(sys, "argv", ["cable_lightning", "export", "--ckpt_path", str(other), "--out", str(out),
                                      "--data_path", tiny_corpus_dir])
    with pytest.raises(SystemExit) as exit_status:
        runpy.run_module("cable_lightning", run_name="__main__")
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {out} already exists (written by export); pass --overwrite to replace it or choose another --out"]

    # --overwrite never replaces the run's own folder (it holds the checkpoint being exported): one line, exit 2
    run_folder = tmp_path / "runs" / "export" / "cable"
    before = sorted(p.name for p in run_folder.rglob("*"))
    monkeypatch.setattr(sys, "argv", ["cable_lightning", "export", "--ckpt_path", str(ckpt), "--out", str(run_folder),
                                      "--overwrite"])
    with pytest.raises(SystemExit) as exit_status:
        runpy.run_module("cable_lightning", run_name="__main__")
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --out {run_folder} holds this command's input {ckpt}; replacing it would delete the input: choose "
        "another --out"]
    assert sorted(p.name for p in run_folder.rglob("*")) == before

    # `last` is not a file: said first, not advice about the data
    with pytest.raises(SystemExit):
        export(["--ckpt_path", "last", "--out", str(tmp_path / "hf2")])
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: checkpoint last does not exist; give an existing checkpoint file"]
    # the run's data.path, relative to the folder it started in, is not there from here: --data_path is the fix
    config = next(run_folder.glob("version_*/config.yaml"))
    config.write_text(config.read_text().replace(f"path: {tiny_corpus_dir}", "path: data/tiny-bpe512"))
    with pytest.raises(SystemExit):
        export(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "hf2")])
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: the run's data.path data/tiny-bpe512 (from {config}) is not there from {os.getcwd()}; pass "
        "--data_path <the prepared folder the run trained on> (its tokenizer is exported)"]
