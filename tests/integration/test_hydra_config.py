"""fairseq's Hydra/YAML configs: ``toolkit-hydra-train`` and ``toolkit-train --config`` resolve to the
same TrainConfig as the equivalent flags, in fairseq's layout (docs/hydra_integration.md's wiki103.yaml
and fairseq/config/model/transformer_lm/transformer_lm_gpt.yaml, sizes made tiny)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.lm_fixtures import make_data_bin
from tests.helpers.cli import run_cli
from toolkit.compat.fairseq import yaml_config
from toolkit.train.config_file import expand_config_flag, hydra_train_argv
from toolkit.core.errors import UserError
from toolkit.train.resolve import parse_train_config

pytest.importorskip("omegaconf")

# docs/hydra_integration.md, "2. Replace bundled configs with an external config" (sizes made tiny;
# max_update and lr through ${...} as fairseq's II(...) fields do).
WIKI103 = """# @package _group_

model:
  _name: transformer_lm
  decoder_layers: 2
  decoder_embed_dim: 32
  decoder_ffn_embed_dim: 64
  decoder_attention_heads: 2
distributed_training:
  distributed_world_size: 1
dataset:
  batch_size: 2
  num_workers: 0
task:
  _name: language_modeling
  data: {data}
  add_bos_token: false
  max_target_positions: 64
  tokens_per_sample: 32
common:
  cpu: true
  log_format: json
  log_interval: 1
optimization:
  max_update: 3
  lr: [ 0.25 ]
  update_freq: [ 2 ]
checkpoint:
  save_dir: {save}
  save_interval_updates: ${{optimization.max_update}}
criterion: cross_entropy
optimizer:
  _name: adam
  adam_betas: [0.9, 0.98]
lr_scheduler:
  _name: cosine
  warmup_updates: 2
"""
WIKI103_FLAGS = [
    "{data}",
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "2",
    "--distributed-world-size",
    "1",
    "--batch-size",
    "2",
    "--num-workers",
    "0",
    "--task",
    "language_modeling",
    "--max-target-positions",
    "64",
    "--tokens-per-sample",
    "32",
    "--cpu",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--max-update",
    "3",
    "--lr",
    "0.25",
    "--update-freq",
    "2",
    "--save-dir",
    "{save}",
    "--save-interval-updates",
    "3",
    "--criterion",
    "cross_entropy",
    "--optimizer",
    "adam",
    "--adam-betas",
    "(0.9, 0.98)",
    "--lr-scheduler",
    "cosine",
    "--warmup-updates",
    "2",
]

# fairseq/config/model/transformer_lm/transformer_lm_gpt.yaml, every key as fairseq ships it
# (sizes made tiny), composed by Hydra with model=transformer_lm/transformer_lm_gpt.
GPT_GROUP = """# @package _group_
activation_fn: "gelu"
dropout: 0.1
attention_dropout: 0.1
activation_dropout: 0.0
relu_dropout: 0.0
decoder_embed_dim: 32
decoder_output_dim: 32
decoder_input_dim: 32
decoder_ffn_embed_dim: 64
decoder_layers: 2
decoder_attention_heads: 2
decoder_normalize_before: true
no_decoder_final_norm: false
adaptive_softmax_cutoff: null
adaptive_softmax_dropout: 0
adaptive_softmax_factor: 4
no_token_positional_embeddings: false
share_decoder_input_output_embed: false
character_embeddings: false
character_filters: "[(1, 64), (2, 128), (3, 192), (4, 256), (5, 256), (6, 256), (7, 256)]"
character_embedding_dim: 4
char_embedder_highway_layers: 2
adaptive_input: false
adaptive_input_factor: 4
adaptive_input_cutoff: null
tie_adaptive_weights: false
tie_adaptive_proj: false
decoder_learned_pos: false
decoder_layerdrop: 0
decoder_layers_to_keep: null
layernorm_embedding: false
no_scale_embedding: false
quant_noise_pq: 0
quant_noise_pq_block_size: 8
quant_noise_scalar: 0
"""
GPT_MAIN = """defaults:
  - model: null
  - _self_
task:
  _name: language_modeling
  tokens_per_sample: 32
common:
  cpu: true
  log_format: json
dataset:
  batch_size: 2
  num_workers: 0
optimization:
  max_update: 2
  lr: [0.0005]
optimizer: adam
lr_scheduler:
  _name: inverse_sqrt
  warmup_updates: 10
"""
GPT_FLAGS = [
    "{data}",
    "--arch",
    "transformer_lm_gpt",
    "--activation-fn",
    "gelu",
    "--dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
    "--decoder-embed-dim",
    "32",
    "--decoder-output-dim",
    "32",
    "--decoder-input-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-layers",
    "2",
    "--decoder-attention-heads",
    "2",
    "--decoder-normalize-before",
    "--adaptive-softmax-factor",
    "4",
    "--adaptive-input-factor",
    "4",
    "--task",
    "language_modeling",
    "--tokens-per-sample",
    "32",
    "--cpu",
    "--log-format",
    "json",
    "--batch-size",
    "2",
    "--num-workers",
    "0",
    "--max-update",
    "5",
    "--lr",
    "0.0005",
    "--optimizer",
    "adam",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "10",
    "--save-dir",
    "{save}",
]


@pytest.fixture
def data(tmp_path):
    lines = ["the cat sat on a mat", "a dog ran far away", "", "the game was released in japan"] * 20
    make_data_bin(tmp_path / "bin", {"train": lines, "valid": lines[:8]})
    return str(tmp_path / "bin")


def fill(items, **kw):
    return [item.format(**kw) for item in items]


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_config_file_resolves_as_the_flags(tmp_path, data):
    save = str(tmp_path / "ckpt")
    path = write(tmp_path / "wiki103.yaml", WIKI103.format(data=data, save=save))
    from_file = parse_train_config(expand_config_flag(["--config", path]))
    assert from_file == parse_train_config(fill(WIKI103_FLAGS, data=data, save=save))
    assert from_file.checkpoint.save_interval_updates == 3  # ${optimization.max_update}
    # A flag after --config overrides the file, as on fairseq-hydra-train's command line.
    assert parse_train_config(expand_config_flag(["--config", path, "--max-update", "7"])).optimization.max_update == 7
    # So does DATA: the command line's replaces task.data.
    other = str(tmp_path / "other")
    os.symlink(data, other)
    assert parse_train_config(expand_config_flag(["--config", path, "--cpu", other])).task.data == other


def test_pyyaml_reads_the_same_file_without_omegaconf(tmp_path, data, monkeypatch):
    path = write(tmp_path / "wiki103.yaml", WIKI103.format(data=data, save=str(tmp_path / "c")))
    with_omegaconf = yaml_config.load_config_file(path)
    monkeypatch.setitem(sys.modules, "omegaconf", None)
    assert yaml_config.load_config_file(path) == with_omegaconf
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(UserError, match=r"^--config FILE.yaml needs a YAML reader: pip install omegaconf"):
        yaml_config.load_config_file(path)


def test_hydra_composes_group_files_and_overrides_as_the_flags(tmp_path, data):
    confs = tmp_path / "configs"
    write(confs / "model" / "transformer_lm" / "transformer_lm_gpt.yaml", GPT_GROUP)
    write(confs / "lm.yaml", GPT_MAIN)
    save = str(tmp_path / "ckpt")
    argv = hydra_train_argv(
        str(confs),
        "lm",
        [
            "model=transformer_lm/transformer_lm_gpt",
            f"task.data={data}",
            "optimization.max_update=5",
            f"checkpoint.save_dir={save}",
        ],
    )
    assert parse_train_config(argv) == parse_train_config(fill(GPT_FLAGS, data=data, save=save))
    # task=NAME without a task/NAME.yaml names the component and keeps the group's options.
    again = hydra_train_argv(
        str(confs), "lm", ["model=transformer_lm/transformer_lm_gpt", "task=language_modeling", f"task.data={data}"]
    )
    assert parse_train_config(again).task.tokens_per_sample == 32


def test_unknown_keys_are_refused_unless_inert(tmp_path, data, caplog):
    base = WIKI103.format(data=data, save=str(tmp_path / "c"))
    inert = write(
        tmp_path / "inert.yaml",
        base + "  character_embeddings: false\n  quant_noise_scalar: 0\ngeneration:\n  beam: 5\n",
    )
    with caplog.at_level("INFO"):
        parse_train_config(expand_config_flag(["--config", inert]))
    assert f"{inert}: accepted, not read by training (no effect): generation" in caplog.messages
    bad = write(
        tmp_path / "bad.yaml", base.replace("  decoder_layers: 2", "  decoder_layers: 2\n  character_embeddings: true")
    )
    with pytest.raises(
        UserError,
        match=r"bad.yaml: model.character_embeddings=True: toolkit-train has no "
        r"--character-embeddings; remove the key \(or set it to null\)",
    ):
        expand_config_flag(["--config", bad])
    with pytest.raises(UserError, match=r"needs Hydra: run toolkit-hydra-train --config-dir"):
        expand_config_flag(["--config", write(tmp_path / "d.yaml", "defaults:\n  - model: x\n")])


def test_missing_hydra_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hydra", None)
    with pytest.raises(UserError, match=r"^toolkit-hydra-train needs Hydra: pip install hydra-core$"):
        hydra_train_argv(str(tmp_path), "config", [])


def test_toolkit_train_refuses_overrides_as_data(data):
    run = run_cli("toolkit_cli.train", [f"task.data={data}", "optimization.max_update=2"])
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        f"toolkit-train: error: task.data={data}: a Hydra override (key=value) is not a toolkit-train argument; "
        f"run toolkit-hydra-train --config-dir DIR --config-name NAME task.data={data} ..., or give "
        f"toolkit-train --config FILE.yaml and flags"
    ]


def test_hydra_train_runs_the_docs_config(tmp_path, data):
    save = str(tmp_path / "ckpt")
    write(tmp_path / "configs" / "wiki103.yaml", WIKI103.format(data="/nowhere", save="/nowhere"))
    run = run_cli(
        "toolkit_cli.hydra_train",
        [
            "--config-dir",
            str(tmp_path / "configs"),
            "--config-name",
            "wiki103",
            f"task.data={data}",
            f"checkpoint.save_dir={save}",
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert os.path.isfile(os.path.join(save, "checkpoint_last.pt"))
    assert '"num_updates": "3"' in run.stdout


def test_overrides_alone_as_in_the_docs_first_example(tmp_path, data):
    """docs/hydra_integration.md, "1. Override default values through command line" (max_update made tiny):
    model=transformer_lm/transformer_lm_gpt names fairseq's bundled config, here the architecture of that name."""
    argv = hydra_train_argv(
        None,
        "config",
        [
            "distributed_training.distributed_world_size=1",
            "dataset.batch_size=2",
            f"task.data={data}",
            "model=transformer_lm/transformer_lm_gpt",
            "task=language_modeling",
            "optimization.max_update=5",
            f"checkpoint.save_dir={tmp_path}",
            "common.cpu=true",
        ],
    )
    flags = [
        data,
        "--distributed-world-size",
        "1",
        "--batch-size",
        "2",
        "--arch",
        "transformer_lm_gpt",
        "--task",
        "language_modeling",
        "--max-update",
        "5",
        "--save-dir",
        str(tmp_path),
        "--cpu",
    ]
    assert parse_train_config(argv) == parse_train_config(flags)
    with pytest.raises(UserError, match=r"^the overrides: unknown group 'optimisation'"):
        hydra_train_argv(None, "config", ["optimisation.max_update=5"])


def test_broken_yaml_in_the_config_folder_names_its_file_and_line(tmp_path):
    """A syntax error in a group's file (task/lm.yaml) was reported against the primary config, without a line."""
    pytest.importorskip("hydra")
    (tmp_path / "task").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - task: lm\n  - _self_\ncommon:\n  seed: 1\n")
    (tmp_path / "task" / "lm.yaml").write_text(
        "# @package _group_\n_name: language_modeling\ndata: x\n  tokens_per_sample: [32\n"
    )
    with pytest.raises(
        UserError,
        match=r"^--config-dir .*task/lm\.yaml: line 4, column 20: invalid YAML "
        r"\(mapping values are not allowed here\); fix the file$",
    ):
        hydra_train_argv(str(tmp_path), "config", [])
