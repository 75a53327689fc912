"""fairseq recipe command lines and flags (issue 24 items 4-5): quant_noise, layerdrop, megatron_11b's eval,
the flags accepted with one INFO line, and the smaller fixes. Commands are fairseq's READMEs' with sizes shrunk."""

from __future__ import annotations

import logging
import os
import random
import re
import shlex
import shutil

import pytest
import torch

from tests.helpers.lm_fixtures import make_data_bin
from tests.helpers.cli import run_cli
from toolkit.core.errors import UserError
from toolkit.models import quant_noise
from toolkit.train.resolve import parse_train_config

WORDS = [f"w{i}" for i in range(60)]
TINY = [
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-input-dim",
    "32",
    "--decoder-output-dim",
    "32",
    "--decoder-attention-heads",
    "2",
    "--cpu",
    "--num-workers",
    "0",
    "--log-format",
    "simple",
    "--log-interval",
    "1",
]
SMALL_RUN = [
    "--arch",
    "transformer_lm",
    "--tokens-per-sample",
    "32",
    "--batch-size",
    "4",
    "--optimizer",
    "adam",
    "--lr",
    "0.001",
    *TINY,
]

# examples/quant_noise/README.md, "Training with Quant-Noise", Language Modeling (fairseq 0.12.2).
QUANT_NOISE_COMMAND = """fairseq-train --task language_modeling /path/to/wikitext-103/data \
    --save-dir checkpoints/transformer_wikitext-103 \
    --adaptive-input --adaptive-input-cutoff 20000,60000 --adaptive-input-factor 4 \
    --adaptive-softmax-cutoff 20000,60000 --adaptive-softmax-dropout 0.2 --adaptive-softmax-factor 4.0 \
    --tie-adaptive-proj --tie-adaptive-weights \
    --arch transformer_lm_gbw \
    --attention-dropout 0.1 --dropout 0.2 --relu-dropout 0.1 \
    --clip-norm 0.1 --criterion adaptive_loss \
    --ddp-backend legacy_ddp \
    --decoder-attention-heads 8 --decoder-embed-dim 1024 --decoder-ffn-embed-dim 4096 --decoder-input-dim 1024 \
    --decoder-layers 16 --decoder-normalize-before --decoder-output-dim 1024 \
    --min-lr 0.0001 --lr-period-updates 270000 --lr-scheduler cosine --lr-shrink 0.75 --lr 1.0 --t-mult 2.0 \
    --max-tokens 3072 --tokens-per-sample 3072 --momentum 0.99 --optimizer nag \
    --sample-break-mode none --update-freq 3 \
    --warmup-init-lr 1e-07 --warmup-updates 16000 \
    --weight-decay 0 --seed 1 --stop-min-lr 1e-09 \
    --quant-noise-pq 0.05 --quant-noise-pq-block-size 8"""


def lines(rng, n, longest=20):
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, longest))) for _ in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = random.Random(0)
    dest = str(tmp_path_factory.mktemp("recipes") / "bin")
    make_data_bin(dest, {"train": lines(rng, 200), "valid": lines(rng, 20), "test": lines(rng, 20)})
    return dest


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """4 layers trained with LayerDrop (examples/layerdrop: --decoder-layerdrop 0.2), 3 updates."""
    save = str(tmp_path_factory.mktemp("layerdrop") / "ck")
    argv = [
        data,
        "--save-dir",
        save,
        *SMALL_RUN,
        "--decoder-layers",
        "4",
        "--decoder-layerdrop",
        "0.2",
        "--max-update",
        "3",
        "--ddp-backend",
        "no_c10d",
    ]
    run = run_cli("toolkit_cli.train", argv)
    assert run.returncode == 0, run.stderr[-3000:]
    return save, argv, run


def test_quant_noise_readme_command(data, tmp_path):
    text = QUANT_NOISE_COMMAND.replace("/path/to/wikitext-103/data", data).replace(
        "checkpoints/transformer_wikitext-103", str(tmp_path)
    )
    text = re.sub(r"--(max-tokens|tokens-per-sample) 3072", r"--\1 32", text).replace("20000,60000", "20,40")
    # 128 wide: the adaptive input's bands are 128, 32 and 8 wide, each a multiple of the block size 8
    wide = ["--decoder-embed-dim", "128", "--decoder-input-dim", "128", "--decoder-output-dim", "128"]
    argv = shlex.split(text)[1:] + TINY + wide + ["--max-update", "2"]
    run = run_cli("toolkit_cli.train", argv)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "num_updates: 2 >= max_update: 2" in run.stdout
    saved = torch.load(os.path.join(tmp_path, "checkpoint_last.pt"), weights_only=True)
    assert saved["cfg"]["quant_noise_pq"] == 0.05 and saved["cfg"]["relu_dropout"] == 0.1


def test_quant_noise_drops_whole_blocks_only_in_training():
    torch.manual_seed(0)
    w = torch.randn(64, 32)
    noisy = quant_noise.noisy_weight(w, 0.25, 8)
    blocks = noisy.view(64, 4, 8)
    dropped = (blocks == 0).all(-1)
    kept = torch.isclose(blocks, w.view(64, 4, 8) / 0.75).all(-1)
    assert bool((dropped | kept).all()) and 0.1 < dropped.float().mean().item() < 0.4
    from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

    cfg = TransformerLMConfig(
        decoder_layers=1,
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_attention_heads=2,
        max_target_positions=8,
        dropout=0.0,
        quant_noise_pq=0.5,
        quant_noise_pq_block_size=4,
    )
    model = TransformerLanguageModel(cfg, vocab_size=24, padding_idx=1, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(4, 24, (2, 8))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))  # a fresh mask each forward
    model.eval()
    assert torch.equal(model(tokens), model(tokens))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the weights are not rewritten
    assert sorted(n for n, _ in quant_noise.covered_modules(model)) == [
        "layers.0.fc1",
        "layers.0.fc2",
        "layers.0.self_attn.out_proj",
        "layers.0.self_attn.qkv_proj",
    ]
    with pytest.raises(UserError, match=r"--quant-noise-pq-block-size 3: layers.0.self_attn.qkv_proj has 16 input"):
        TransformerLanguageModel(TransformerLMConfig(**{**cfg.__dict__, "quant_noise_pq_block_size": 3}), 24, 1)


def test_quant_noise_trains_under_fully_sharded_on_two_gloo_ranks(data, tmp_path):
    """FSDP2 gathers each block's weights before its forward: the noise applies to the whole weight there."""
    run = run_cli(
        "toolkit_cli.train",
        [
            data,
            "--save-dir",
            str(tmp_path),
            *SMALL_RUN,
            "--quant-noise-pq",
            "0.1",
            "--distributed-world-size",
            "2",
            "--ddp-backend",
            "fully_sharded",
            "--max-update",
            "3",
            "--disable-validation",
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "num_updates: 3 >= max_update: 3" in run.stdout
    saved = torch.load(os.path.join(tmp_path, "checkpoint_last.pt"), weights_only=True)
    assert all(bool(torch.isfinite(v).all()) for v in saved["model"].values())


def test_relu_dropout_is_fairseqs_fallback_for_activation_dropout():
    from toolkit.models.transformer_lm import TransformerBlock, TransformerLMConfig

    assert (
        TransformerBlock(
            TransformerLMConfig(
                decoder_embed_dim=8, decoder_attention_heads=2, decoder_ffn_embed_dim=8, relu_dropout=0.3
            )
        ).activation_dropout
        == 0.3
    )
    assert (
        TransformerBlock(
            TransformerLMConfig(
                decoder_embed_dim=8,
                decoder_attention_heads=2,
                decoder_ffn_embed_dim=8,
                relu_dropout=0.3,
                activation_dropout=0.1,
            )
        ).activation_dropout
        == 0.1
    )


def test_recipe_flags_accepted_with_one_line_each(data, tmp_path, caplog, monkeypatch):
    for name in ("WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    base = [data, "--save-dir", str(tmp_path), *SMALL_RUN]
    with caplog.at_level(logging.INFO):
        cfg = parse_train_config(
            base
            + [
                "--empty-cache-freq",
                "2",
                "--all-gather-list-size",
                "32768",
                "--distributed-no-spawn",
                "--memory-efficient-bf16",
            ]
        )
    assert cfg.common.bf16 and not cfg.common.fp16 and cfg.common.empty_cache_freq == 2
    for flag in (
        "--memory-efficient-bf16: training with --bf16",
        "--empty-cache-freq 2: accepted, no effect",
        "--all-gather-list-size 32768: accepted, no effect",
        "--distributed-no-spawn: accepted, no effect",
    ):
        assert sum(m.startswith(flag) for m in caplog.messages) == 1, (flag, caplog.messages)
    with pytest.raises(UserError, match="--distributed-no-spawn with --distributed-world-size 2 and no launcher"):
        parse_train_config(base + ["--distributed-no-spawn", "--distributed-world-size", "2"])
    with pytest.raises(UserError, match="--memory-efficient-bf16 and --fp16"):
        parse_train_config(base + ["--memory-efficient-bf16", "--fp16"])
    from toolkit.train.train_loop import empty_cache_due

    assert [n for n in range(1, 8) if empty_cache_due(cfg.common, n)] == [1, 3, 5, 7]  # fairseq's (n + f - 1) % f


def test_wiki103_arch_needs_adaptive_loss(data, tmp_path):
    with pytest.raises(
        UserError,
        match=r"^--arch transformer_lm_wiki103 has an adaptive softmax "
        r"\(--adaptive-softmax-cutoff 20000,60000\): it must be used with "
        r"--criterion adaptive_loss, got --criterion cross_entropy$",
    ):
        parse_train_config([data, "--save-dir", str(tmp_path), "--arch", "transformer_lm_wiki103", "--cpu"])


def test_mfu_never_above_100():
    from toolkit.logging.metrics import mfu_percent

    assert mfu_percent(1000.0, 6e6, 1e10) == 60.0
    assert mfu_percent(1000.0, 6e6, 4e9) == 100.0  # a peak sample that read low


def test_help_lists_arch_and_optimizer_choices():
    from toolkit import options
    from toolkit.config import TRAIN_CONFIGS

    text = " ".join(options.build_parser("toolkit-train", TRAIN_CONFIGS, [])[0].format_help().split())
    assert "--optimizer OPTIMIZER registered optimizer to use: adam, cpu_adam, muon, nag, sgd" in text
    assert re.search(r"model architecture: .*transformer_lm_gpt3_small", text)


def test_save_line_is_fairseqs(trained):
    _, _, run = trained
    assert re.search(
        r"\| INFO \| toolkit\.checkpoint\.consolidated \| Saved checkpoint \S+checkpoint_best\.pt "
        r"\(epoch 1 @ 3 updates, score \d+\.\d+\) \(writing took \d+\.\d+(e-\d+)? seconds\)$",
        run.stdout,
        re.M,
    ), run.stdout[-2000:]
    assert "also as" not in run.stdout


def test_layers_to_keep_added_to_a_run_loads_the_checkpoint_pruned(trained, tmp_path):
    save, argv, _ = trained
    full = torch.load(os.path.join(save, "checkpoint_last.pt"), weights_only=True)
    shutil.copytree(save, tmp_path / "ck")
    argv = [a if a != save else str(tmp_path / "ck") for a in argv]
    run = run_cli(
        "toolkit_cli.train",
        argv[:-4] + ["--max-update", "4", "--ddp-backend", "no_c10d", "--decoder-layers-to-keep", "0,2"],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (
        run.stdout.count(
            "Pruning model to specified layer configuration - this works best if the model was trained with LayerDrop"
        )
        == 1
    )
    pruned = torch.load(str(tmp_path / "ck" / "checkpoint_last.pt"), weights_only=True)
    assert {k.split(".")[1] for k in pruned["model"] if k.startswith("layers.")} == {"0", "1"}
    assert pruned["cfg"]["decoder_layers_to_keep"] == "0,2"
    assert {k.split(".")[1] for k in full["model"] if k.startswith("layers.")} == {"0", "1", "2", "3"}


def test_prune_checkpoint_renumbers_model_and_optimizer_state():
    from types import SimpleNamespace

    from toolkit.checkpoint.layer_pruning import prune_checkpoint

    model = {f"layers.{i}.fc1.weight": torch.full((2,), float(i)) for i in range(4)}
    model["embed_tokens.weight"] = torch.zeros(3)
    optimizer = {
        "state": {k: {"exp_avg": v + 10} for k, v in model.items()},
        "param_groups": [{"lr": 0.1, "params": list(model)}],
    }
    out = prune_checkpoint(
        {"model": model, "last_optimizer_state": optimizer, "cfg": {"decoder_layers": 4}},
        SimpleNamespace(decoder_layers_to_keep="1,3"),
    )
    assert sorted(out["model"]) == ["embed_tokens.weight", "layers.0.fc1.weight", "layers.1.fc1.weight"]
    assert out["model"]["layers.1.fc1.weight"][0] == 3.0
    assert out["last_optimizer_state"]["state"]["layers.0.fc1.weight"]["exp_avg"][0] == 11.0
    assert out["last_optimizer_state"]["param_groups"][0]["params"] == [
        "layers.0.fc1.weight",
        "layers.1.fc1.weight",
        "embed_tokens.weight",
    ]


def test_megatron_11b_eval_command_and_unknown_overrides(data, trained):
    """examples/megatron_11b/README.md's eval-lm command (--context-window 992 -> 16)."""
    save, _, _ = trained
    command = [
        "--path",
        os.path.join(save, "checkpoint_best.pt"),
        "--task",
        "language_modeling",
        "--gen-subset",
        "test",
        "--batch-size",
        "8",
        "--criterion",
        "cross_entropy",
        "--context-window",
        "16",
        "--cpu",
    ]
    plain = run_cli("toolkit_cli.eval_lm", [data, *command])
    run = run_cli(
        "toolkit_cli.eval_lm",
        [
            data,
            *command,
            "--distributed-world-size",
            "8",
            "--model-parallel-size",
            "8",
            "--required-batch-size-multiple",
            "8",
            "--model-overrides",
            "{'dropout': 0.0, 'decoder_layrs': 3}",
        ],
    )
    assert plain.returncode == 0 and run.returncode == 0, run.stderr[-3000:]
    loss = re.compile(r"Loss \(base 2\): [\d.]+, Perplexity: [\d.]+")
    assert loss.search(run.stdout).group(0) == loss.search(plain.stdout).group(0)
    for flag in ("--distributed-world-size", "--model-parallel-size"):
        assert run.stdout.count(f"{flag} accepted for fairseq compatibility, no effect") == 1
    assert "--required-batch-size-multiple" not in run.stdout  # its default value: nothing to say
    assert re.search(
        r"WARNING \| toolkit\.inference \| --model-overrides: decoder_layrs not an option of "
        r"\S+'s model or task \(--arch transformer_lm\); ignored",
        run.stdout,
    )


def test_generate_results_path_and_hint(data, trained, tmp_path):
    save, _, _ = trained
    path = os.path.join(save, "checkpoint_best.pt")
    base = [
        data,
        "--path",
        path,
        "--task",
        "language_modeling",
        "--sample-break-mode",
        "eos",
        "--cpu",
        "--beam",
        "2",
        "--max-len-b",
        "3",
    ]
    run = run_cli("toolkit_cli.generate", base + ["--prefix-size", "2", "--results-path", str(tmp_path / "res")])
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / "res" / "generate-test.txt") as f:
        text = f.read()
    assert text.count("\nH-") + text.startswith("H-") == 20 and "Translated 20 sentences" in text
    assert "H-0\t" not in run.stdout and not [p for p in os.listdir(tmp_path / "res") if p.endswith(".tmp")]
    # A sample longer than the model's positions: the hint does not repeat --sample-break-mode eos.
    from tests.helpers.lm_fixtures import encode_lines, write_split
    from toolkit.data.dictionary import Dictionary

    long_data = tmp_path / "long"
    long_data.mkdir()
    shutil.copy(os.path.join(data, "dict.txt"), long_data / "dict.txt")
    dictionary = Dictionary.load(os.path.join(data, "dict.txt"))
    write_split(str(long_data / "test"), encode_lines(dictionary, [" ".join(WORDS[:50])]), len(dictionary))
    failed = run_cli("toolkit_cli.generate", [str(long_data)] + base[1:])
    assert failed.returncode == 1
    assert "give --prefix-size N)" in failed.stderr and "--sample-break-mode eos for" not in failed.stderr, (
        failed.stderr
    )


def test_generate_beam_without_prefix_size_forces_each_whole_sample_as_fairseq(data, trained):
    """fairseq's language_modeling task without --prefix-size passes each sample (as long as the model's
    positions here: --sample-break-mode none) as prefix_tokens: the search is forced through it up to max_len,
    then ends with </s>. It was refused ("prompt of 32 tokens does not fit")."""
    save, _, _ = trained
    run = run_cli(
        "toolkit_cli.generate",
        [
            data,
            "--path",
            os.path.join(save, "checkpoint_best.pt"),
            "--task",
            "language_modeling",
            "--cpu",
            "--beam",
            "5",
            "--max-len-b",
            "3",
            "--batch-size",
            "4",
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    sources = dict(line.split("\t", 1) for line in run.stdout.splitlines() if line.startswith("S-"))
    hypos = [line.split("\t") for line in run.stdout.splitlines() if line.startswith("H-")]
    assert hypos and len(sources) == len({h[0] for h in hypos})
    for name, _score, text in hypos:
        source = sources["S-" + name[2:]].split()
        words = text.split()  # the sample's first 3 tokens; a </s> among them (a line end) prints as nothing
        assert len(source) > 3 and 1 <= len(words) <= 3 and words == source[: len(words)], (source, text)


def test_preprocess_joined_dictionary(tmp_path):
    src = tmp_path / "train.txt"
    src.write_text("a b c\nb c d\n")
    run = run_cli(
        "toolkit_cli.preprocess",
        ["--only-source", "--joined-dictionary", "--trainpref", str(src), "--destdir", str(tmp_path / "bin")],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (run.stdout + run.stderr).count("--joined-dictionary: accepted, no effect") == 1
    assert os.path.isfile(tmp_path / "bin" / "train.bin")
