"""The encoding contract: every registered encoding parses from the CLI and round-trips through the form checkpoints
hold, owns its settings (checked before anything expensive starts), has its README row; earlier checkpoints and
exports still load; an encoding added in a file of its own needs nothing else."""

import dataclasses
import json
import os
import re
import sys
import textwrap

import pytest
import torch
import yaml
from conftest import printed_backbone

from cable_lightning.cli import main
from cable_lightning.lit.checkpoint_format import saved_backbone, saved_weights, upgrade_backbone_dict
from cable_lightning.lit.resume import weight_setting_differences
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.positional import Encoding, available, encoding_class, encoding_from, from_label
from cable_lightning.positional.cable import Cable
from cable_lightning.positional.dape import DapeV2
from cable_lightning.positional.rope import Rope

ROOT = os.path.join(os.path.dirname(__file__), "..")
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
SHAPE = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=97, block_size=16)




@pytest.mark.parametrize("name", available())
def test_every_encoding_parses_from_the_cli_and_round_trips(name, capsys):
    backbone = printed_backbone(capsys, "--model.init_args.backbone.pos_encoding", name)
    config = BackboneConfig.from_dict(backbone)
    assert config.pos_encoding == encoding_class(name)()
    assert encoding_from(config.pos_encoding.to_dict()) == config.pos_encoding
    assert BackboneConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config  # as config.json holds it


def test_an_encodings_settings_are_set_by_name_on_the_command_line(capsys):
    backbone = printed_backbone(capsys, "--model.init_args.backbone.pos_encoding", "dape_v2",
                                "--model.init_args.backbone.pos_encoding.base", "kerple_log",
                                "--model.init_args.backbone.pos_encoding.width", "8")
    encoding = BackboneConfig.from_dict(backbone).pos_encoding
    assert (encoding.label(), encoding.width, encoding.kernel) == ("dape_v2+kerple_log", 8, 3)
    backbone = printed_backbone(capsys, "--model.init_args.backbone.pos_encoding", "rope",
                                "--model.init_args.backbone.pos_encoding.scaling", "yarn",
                                "--model.init_args.backbone.pos_encoding.scaling_factor", "4")
    assert BackboneConfig.from_dict(backbone).pos_encoding == Rope(scaling="yarn", scaling_factor=4.0)


@pytest.mark.parametrize("overrides, expected", [
    (["--model.init_args.backbone.pos_encoding", "ropee"],
     "unknown positional encoding 'ropee'; valid names: " + ", ".join(available())),
    (["--model.init_args.backbone.pos_encoding", "rope", "--model.init_args.backbone.pos_encoding.scaling_factor",
      "0.5"], "rope.scaling_factor must be >= 1, got 0.5"),
    (["--model.init_args.backbone.pos_encoding", "learnable", "--model.init_args.backbone.pos_encoding.max_positions",
      "0"], "learnable.max_positions must be >= 1"),
    (["--model.init_args.backbone.pos_encoding", "cope", "--model.init_args.backbone.attention_backend", "fold"],
     "attention_backend 'fold' cannot run cope (causal); valid: auto, chunked, materialized"),
    (["--model.init_args.backbone.pos_encoding", "dape_v2", "--model.init_args.backbone.pos_encoding.base", "rope"],
     "dape_v2 augments a score bias and 'rope' has none"),
    (["--model.init_args.backbone.pos_encoding", "rope", "--model.init_args.backbone.n_embd", "60",
      "--model.init_args.backbone.n_head", "4"], "head size 15 (n_embd 60 / n_head 4) must be even"),
    (["--model.init_args.backbone.pos_encoding.scaling", "linear"],
     "positional encoding 'cable' has no setting 'scaling' (its settings: bias_activation); name the encoding"),
    (["--model.init_args.backbone.rope_scaling", "linear"],
     "unknown backbone setting 'rope_scaling'; it moved into the rope encoding: "
     "--model.init_args.backbone.pos_encoding rope --model.init_args.backbone.pos_encoding.scaling VALUE"),
    (["--model.init_args.backbone.dape_width", "8"],
     "unknown backbone setting 'dape_width'; it moved into the dape_v2 encoding: "
     "--model.init_args.backbone.pos_encoding dape_v2 --model.init_args.backbone.pos_encoding.width VALUE"),
    (["--model.init_args.backbone.n_layers", "2"],
     "unknown backbone setting 'n_layers'; its settings: preset, pos_encoding, n_layer, n_head, n_embd"),
    (["--model.init_args.learning_rate", "0.1"],
     "unknown CausalLM setting 'learning_rate'; its settings: backbone, data, lr, min_lr"),
    (["--model.init_args.backbone.attention_backend", "chunkd"],
     "error: unknown value 'chunkd' for attention_backend; choose one of 'auto', 'sdpa', 'fold', 'flex', 'chunked', "
     "'materialized'"),
], ids=["unknown", "rope-factor", "learnable-size", "backend", "dape-base", "rope-shape", "no-such-setting",
        "moved-rope-setting", "moved-dape-setting", "no-such-backbone-setting", "no-such-model-setting",
        "backend-typo"])
def test_bad_settings_stop_the_run_in_one_line_before_the_data_is_prepared(tmp_path, capsys, overrides, expected):
    """The quickstart's data would be prepared first (tens of seconds); a bad setting must stop the run before."""
    from conftest import user_error_line

    data = tmp_path / "never-prepared"
    line = user_error_line(capsys, ["fit", "--config", QUICKSTART, "--data.path", str(data), "--runs_dir",
                                    str(tmp_path / "runs"), *overrides])
    assert expected in line, line
    assert not data.exists()


def test_an_old_spelling_in_yaml_points_to_where_the_setting_went(tmp_path, capsys):
    from conftest import user_error_line

    old = tmp_path / "old.yaml"
    old.write_text("model:\n  init_args:\n    backbone:\n      cable_bias_activation: relu\n")
    line = user_error_line(capsys, ["fit", "--config", QUICKSTART, "--config", str(old), "--data.path",
                                    str(tmp_path / "never-prepared"), "--runs_dir", str(tmp_path / "runs")])
    assert line == ("error: unknown backbone setting 'cable_bias_activation'; it moved into the cable/cable_nw/k_cable "
                    "encoding: --model.init_args.backbone.pos_encoding cable "
                    "--model.init_args.backbone.pos_encoding.bias_activation VALUE"), line


def test_literal_settings_are_checked_outside_the_cli_too():
    with pytest.raises(ValueError,
                       match=r"rope.scaling='lin' is not valid; valid: none, linear, ntk, yarn, yarn_paper"):
        Rope(scaling="lin")
    with pytest.raises(ValueError, match=r"cable has no setting 'activation'; its settings: bias_activation"):
        encoding_from({"class_path": "cable", "init_args": {"activation": "relu"}})


def test_runtime_settings_label_records_but_not_runs_and_may_differ_from_the_checkpoint():
    scaled = Rope(scaling="linear", scaling_factor=4.0)
    assert (scaled.label(), scaled.label(runtime=False)) == ("rope+linear4", "rope")
    saved = BackboneConfig(pos_encoding=Rope(), **SHAPE).to_dict()
    assert weight_setting_differences(saved, BackboneConfig(pos_encoding=scaled, **SHAPE)) == []
    differ = weight_setting_differences(saved, BackboneConfig(pos_encoding=Rope(base=500.0), **SHAPE))
    assert differ == [("pos_encoding.base", 10000.0, 500.0)]
    differ = weight_setting_differences(saved, BackboneConfig(pos_encoding="dape_v2+cable", **SHAPE))
    assert ("pos_encoding", "rope", "dape_v2") in differ


def test_the_readme_has_one_row_per_registered_encoding():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("## Positional encodings", 1)[1].split("| attention backend |", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)
    assert sorted(rows) == available()


# --- earlier checkpoints and exports ---------------------------------------------------------------------

def legacy_form(config: BackboneConfig, state: dict) -> tuple[dict, dict]:
    """What the version before encodings owned their settings wrote for this model: flat prefixed settings, and
    DAPEv2's convolutions inside each attention layer (written out by hand, as that version named them)."""
    saved = {k: v for k, v in config.to_dict().items() if k != "pos_encoding"}
    encoding, old_state = config.pos_encoding, dict(state)
    saved.update(dape="none", dape_width=32, dape_kernel=3, rope_base=10000.0, rope_scaling="none",
                 rope_scaling_factor=1.0, cable_bias_activation="relu", cope_positions=64, max_positions=None)
    if isinstance(encoding, DapeV2):
        saved.update(dape="v2", dape_width=encoding.width, dape_kernel=encoding.kernel)
        old_state = {}
        for key, value in state.items():
            key = re.sub(r"^pe\.layers\.(\d+)\.", r"blocks.\1.attn.dape.", key)
            old_state[key.replace("pe.base.", "pe.")] = value
        encoding = encoding.base
    saved["pos_encoding"] = encoding.name
    if isinstance(encoding, Rope):
        saved.update(rope_base=encoding.base, rope_scaling=encoding.scaling,
                     rope_scaling_factor=encoding.scaling_factor)
    if isinstance(encoding, Cable):
        saved.update(cable_bias_activation=encoding.bias_activation)
    return saved, old_state


@pytest.mark.parametrize("encoding", [DapeV2(base=Cable(bias_activation="softplus"), width=4),
                                      Rope(base=500.0, scaling="linear", scaling_factor=2.0), "learnable", "cope"],
                         ids=str)
def test_an_earlier_versions_checkpoint_loads_with_the_same_weights(encoding):
    torch.manual_seed(0)
    model = build_backbone(BackboneConfig(pos_encoding=encoding, **SHAPE)).eval()
    saved, old_state = legacy_form(model.config, model.state_dict())
    assert "blocks.0.attn.dape.expand.weight" in old_state or not isinstance(model.config.pos_encoding, DapeV2)
    checkpoint = {"hyper_parameters": {"backbone": saved},
                  "state_dict": {f"backbone.{k}": v for k, v in old_state.items()}}
    loaded_config = saved_backbone(saved)
    assert loaded_config == model.config
    loaded = build_backbone(loaded_config).eval()
    loaded.load_state_dict({k.removeprefix("backbone."): v for k, v in saved_weights(checkpoint).items()})
    x = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_a_current_backbone_dict_is_left_as_it_is():
    current = BackboneConfig(pos_encoding="dape_v2+kerple_log", **SHAPE).to_dict()
    assert upgrade_backbone_dict(current) is current


# --- adding an encoding ------------------------------------------------------------------------------------

TOY = '''
"""A toy bias (-0.1 h |i - j|, fixed): an encoding added in one file."""
from dataclasses import dataclass

from cable_lightning.positional.base import Encoding, PositionalBias, PositionalEncoding


class ToyBias(PositionalBias):
    def at(self, h, i, j):
        return -0.1 * (h + 1) * (i - j).abs()


class Toy(PositionalEncoding):
    def score_bias(self, h, layer, offset, state):
        return ToyBias(offset, self.causal)


@dataclass
class ToyDistance(Encoding):
    """A fixed distance penalty per head."""

    slope: float = 0.1

    name = "toy_distance"
    module = Toy
    scores = "bias"
'''


def test_an_encoding_in_a_file_of_its_own_is_registered_and_runs_everywhere(tmp_path, monkeypatch, capsys):
    (tmp_path / "toy_encoding.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(Encoding, "registered", dict(Encoding.registered))  # forgotten after the test
    import toy_encoding  # noqa: F401

    try:
        assert "toy_distance" in available()
        assert from_label("dape_v2+toy_distance").label() == "dape_v2+toy_distance"
        model = build_backbone(BackboneConfig(pos_encoding="dape_v2+toy_distance", **SHAPE))
        assert model(torch.randint(0, 97, (1, 9))).shape == (1, 9, 97)
        backbone = printed_backbone(capsys, "--model.init_args.backbone.pos_encoding", "toy_distance",
                                    "--model.init_args.backbone.pos_encoding.slope", "0.5")
        assert dataclasses.asdict(BackboneConfig.from_dict(backbone).pos_encoding) == {"slope": 0.5}
    finally:
        sys.modules.pop("toy_encoding", None)


def test_validate_reads_an_earlier_versions_checkpoint_through_the_cli(tiny_corpus_dir, tmp_path):
    """A DAPEv2 run, its checkpoint rewritten as the earlier version wrote it (flat settings, convolutions inside
    the attention layers): validate takes the model from it and measures the same perplexities."""
    from conftest import args as cli_args

    runs = str(tmp_path / "runs")
    main(["fit", *cli_args(tiny_corpus_dir, runs, pe="dape_v2", steps=2, every=2)])
    current = os.path.join(runs, "test", "dape_v2+cable", "checkpoints", "last.ckpt")
    checkpoint = torch.load(current, weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    config = BackboneConfig.from_dict(hparams["backbone"])
    weights = {k.removeprefix("backbone."): v for k, v in checkpoint["state_dict"].items() if k.startswith("backbone.")}
    hparams["backbone"], old_weights = legacy_form(config, weights)
    checkpoint["state_dict"] = {**{k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone.")},
                                **{f"backbone.{k}": v for k, v in old_weights.items()}}
    legacy = str(tmp_path / "legacy.ckpt")
    torch.save(checkpoint, legacy)
    data_only = cli_args(tiny_corpus_dir, str(tmp_path / "validate"))[14:]  # no model settings: the checkpoint's
    measured = {}
    for name, path in [("current", current), ("legacy", legacy)]:
        cli = main(["validate", "--model", "cable_lightning.lit.CausalLM", *data_only, "--ckpt_path", path])
        assert cli.model.config.pos_encoding.label() == "dape_v2+cable"
        measured[name] = [(r.length, r.ppl) for r in cli.model.length_results]
    assert measured["legacy"] == measured["current"] and measured["current"][0][1] > 1


@pytest.mark.parametrize("switch, extra, expected", [
    ("cable_dir", [], "pos_encoding cable_dir (set on the command line) keeps settings of the earlier config: "
                      "bias_activation='softplus' (its default: 'relu'); set them after it "
                      "(--model.init_args.backbone.pos_encoding.NAME VALUE) to change them"),
    ("cable_dir", ["--model.init_args.backbone.pos_encoding.bias_activation", "softplus"], None),  # set, not carried
    ("alibi", [], None),  # no setting in common
    # naming the config's own encoding again keeps its settings too, and says so
    ("cable", [], "pos_encoding cable (set on the command line) keeps settings of the earlier config: "
                  "bias_activation='softplus' (its default: 'relu'); set them after it "
                  "(--model.init_args.backbone.pos_encoding.NAME VALUE) to change them"),
])
def test_a_switch_of_encoding_on_the_command_line_names_the_settings_it_carried_over(tmp_path, capsys, switch, extra,
                                                                                      expected):
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({"model": {"class_path": "cable_lightning.lit.CausalLM", "init_args": {
        "backbone": {"pos_encoding": {"class_path": "cable", "init_args": {"bias_activation": "softplus"}}}}}}))
    # max_steps 0 stops the run in one line right after the config is checked, before any data is read
    with pytest.raises(Exception, match="max_steps"):
        main(["fit", "--config", str(config), "--model.init_args.backbone.pos_encoding", switch, *extra,
              "--trainer.max_steps", "0", "--data.path", "null", "--data.tasks", '{"needle": {}}',
              "--runs_dir", str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if "keeps settings" in line]
    assert lines == ([expected] if expected else [])


def test_t5s_bidirectional_bias_is_directional_as_probes_md_says():
    """docs/probes.md: T5's bidirectional buckets are half per direction (not |i - j|): a key d tokens to the right
    falls in another bucket than one d tokens to the left, so the learned bias can differ."""
    from cable_lightning.positional.t5 import NUM_BUCKETS, relative_bucket

    d = torch.arange(1, 200)
    left, right = relative_bucket(d, causal=False), relative_bucket(-d, causal=False)
    assert not set(left.tolist()) & set(right.tolist())
    assert max(left.tolist()) < NUM_BUCKETS // 2 <= min(right.tolist())
    text = open(os.path.join(ROOT, "docs", "probes.md")).read()
    assert "T5 is not\n  symmetric: its bidirectional buckets are directional" in text
