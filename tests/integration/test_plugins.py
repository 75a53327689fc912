"""fairseq plugins port by renaming the import: tests/plugins/tutorial_simple_lstm through --user-dir.

The plugin is fairseq's tutorial_simple_lstm as a language model (legacy ``add_args``, a
getattr-style architecture, an incremental decoder); it trains, evaluates with eval-lm and
generates through the command-line tools, and its pieces hold fairseq's semantics.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import pytest
import torch

from tests.helpers.lm_fixtures import make_data_bin
from tests.helpers.cli import REPO_ROOT, run_cli
from toolkit import options
from toolkit.core import registry
from toolkit.dataclass import ChoiceEnum, FairseqDataclass
from toolkit.core.errors import UserError

DEMO_MODE = ChoiceEnum(["none", "complete", "eos"])


@dataclass
class DemoConfig(FairseqDataclass):
    break_mode: DEMO_MODE = field(default="none", metadata={"help": "how samples break"})
    width: int = field(default=8, metadata={"help": "a width"})


PLUGIN = os.path.join(REPO_ROOT, "tests", "plugins", "tutorial_simple_lstm")
LINES = ["the cat sat on the mat", "a dog ran in the park", "the cat ran", "", "a dog sat on a mat"] * 8
TINY = [
    "--user-dir",
    PLUGIN,
    "--arch",
    "tutorial_simple_lstm_lm",
    "--decoder-embed-dim",
    "16",
    "--decoder-hidden-dim",
    "24",
    "--tokens-per-sample",
    "32",
    "--seed",
    "5",
]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    dest = tmp_path_factory.mktemp("plugin") / "bin"
    make_data_bin(dest, {"train": LINES, "valid": LINES[:10], "test": LINES[:10]})
    return str(dest)


@pytest.fixture(scope="module")
def task(data_bin):
    registry.import_user_module(PLUGIN)
    registry.import_all_components()
    from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

    return LanguageModelingTask.setup_task(LanguageModelingConfig(data=data_bin, tokens_per_sample=32))


def _parse(argv):
    parser, full = options.build_parser("toolkit-train", (), argv, arch=True)
    return parser, parser.parse_args(full)


def test_legacy_add_args_become_flags_and_the_architecture_fills_the_rest(data_bin):
    parser, args = _parse([data_bin, *TINY[:4], "--decoder-embed-dim", "40"])
    assert args.decoder_embed_dim == 40  # the user's flag
    assert args.decoder_hidden_dim == 256  # the architecture's getattr default (not given)
    assert args.decoder_dropout == 0.1  # add_args' own default
    assert "--decoder-hidden-dim" in parser.format_help()


def test_a_legacy_option_the_toolkit_cannot_carry_is_one_line():
    from toolkit.compat.fairseq.plugins import legacy_args

    class Plugin:
        @staticmethod
        def add_args(parser):
            parser.add_argument("--layers-list", nargs="+", type=int)

    with pytest.raises(UserError, match=r"model demo: add_args option --layers-list: nargs='\+' is not supported"):
        legacy_args.dataclass_from_add_args("model", "demo", Plugin, Plugin.add_args)


def _build(task, embed=16, hidden=24):
    from toolkit import models

    return models.build_model(
        "tutorial_simple_lstm_lm",
        argparse.Namespace(decoder_embed_dim=embed, decoder_hidden_dim=hidden, decoder_dropout=0.0),
        task,
    )


def test_meta_build_then_init_weights_equals_the_plugins_own_init(task, monkeypatch):
    """The toolkit materializes a meta-device model; values equal the plugin's __init__ under the run's seed,
    and the plugin's build_model runs once for it, as fairseq's train.py calls it once per process."""
    from toolkit.models.fairseq_model import INIT_VALUES_KEY
    from toolkit.models.init import init_weights

    plugin_class = registry.MODEL_REGISTRY.get("simple_lstm_lm").cls.wrapped_class
    calls = []
    own_build = plugin_class.build_model.__func__
    monkeypatch.setattr(
        plugin_class, "build_model", classmethod(lambda cls, args, task: calls.append(1) or own_build(cls, args, task))
    )
    torch.manual_seed(11)
    plain = _build(task)
    assert len(calls) == 1
    with torch.device("meta"):
        meta = _build(task)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(11)
    init_weights(meta, 11)
    assert len(calls) == 2  # one build each: the meta build's values come from its own build_model
    for (name, a), (_, b) in zip(plain.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name
    assert INIT_VALUES_KEY not in meta.__dict__  # the CPU values are dropped after init


def test_incremental_generation_equals_recomputing_the_prefix(task):
    """The tutorial's cached LSTM state (fed one token at a time) gives the full recompute's beams."""
    from toolkit.generation import GenerationConfig, SequenceGenerator

    torch.manual_seed(3)
    model = _build(task).eval()
    d = task.dictionary
    prompts = [
        d.encode_line("the cat", append_eos=False).long(),
        d.encode_line("a dog ran in", append_eos=False).long(),
    ]
    cfg = GenerationConfig(beam=3, nbest=3, max_len_b=6)
    fast = SequenceGenerator([model], d, cfg, incremental=True).generate(prompts)
    slow = SequenceGenerator([model], d, cfg, incremental=False).generate(prompts)
    for f_hyps, s_hyps in zip(fast, slow):
        assert [h["tokens"].tolist() for h in f_hyps] == [h["tokens"].tolist() for h in s_hyps]
        for f, s in zip(f_hyps, s_hyps):
            torch.testing.assert_close(f["positional_scores"], s["positional_scores"], rtol=1e-5, atol=1e-5)


def test_tutorial_plugin_trains_evaluates_and_generates(data_bin, tmp_path):
    save = str(tmp_path / "ck")
    run = run_cli(
        "toolkit_cli.train",
        [
            data_bin,
            *TINY,
            "--optimizer",
            "adam",
            "--lr",
            "0.01",
            "--batch-size",
            "4",
            "--max-update",
            "12",
            "--save-dir",
            save,
            "--cpu",
            "--num-workers",
            "0",
            "--log-format",
            "json",
            "--log-interval",
            "1",
        ],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    losses = run.losses()
    assert len(losses) == 12 and losses[12] < losses[1]  # it learns
    assert "SimpleLSTMLanguageModel" in run.stdout  # the plugin's model was built
    ckpt = os.path.join(save, "checkpoint_last.pt")
    ev = run_cli("toolkit_cli.eval_lm", [data_bin, "--path", ckpt, "--user-dir", PLUGIN, "--cpu"])
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "Loss (base 2):" in ev.stdout + ev.stderr
    gen = run_cli(
        "toolkit_cli.generate",
        [data_bin, "--path", ckpt, "--user-dir", PLUGIN, "--cpu", "--beam", "2", "--max-len-b", "5"],
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert sum(line.startswith("H-") for line in gen.stdout.splitlines()) == 2
    _script_scores_equal_the_hub(ckpt, data_bin)


def _script_scores_equal_the_hub(ckpt, data_bin):
    """A fairseq-style script (checkpoint_utils.load_model_ensemble_and_task, imports renamed) scores the plugin
    model by hand; the hub's scorer, another code path, gives the same sums."""
    from toolkit.inference.hub_utils import from_pretrained

    sentences = ["the cat sat on the mat", "a dog ran"]
    script = os.path.join(REPO_ROOT, "tests", "plugins", "score_sentences.py")
    run = run_cli(
        "tests.plugins.score_sentences", ["--path", ckpt, "--data", data_bin, "--user-dir", PLUGIN, *sentences]
    )
    assert run.returncode == 0 and os.path.isfile(script), run.stderr[-2000:]
    rows = [line.split("\t") for line in run.stdout.strip().splitlines()]
    assert [r[0] for r in rows] == sentences and {r[2] for r in rows} == {"tutorial_simple_lstm_lm"}
    hub = from_pretrained(os.path.dirname(ckpt), os.path.basename(ckpt), data_bin, device="cpu", user_dir=PLUGIN)
    for row, result in zip(rows, hub.score(sentences)):
        assert float(row[1]) == pytest.approx(result["positional_scores"].sum().item(), abs=1e-4)


def test_eval_without_the_plugin_says_what_to_add(data_bin, tmp_path):
    save = str(tmp_path / "ck")
    run = run_cli(
        "toolkit_cli.train",
        [
            data_bin,
            *TINY,
            "--optimizer",
            "adam",
            "--lr",
            "0.01",
            "--batch-size",
            "4",
            "--max-update",
            "1",
            "--save-dir",
            save,
            "--cpu",
            "--num-workers",
            "0",
        ],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    ev = run_cli("toolkit_cli.eval_lm", [data_bin, "--path", os.path.join(save, "checkpoint_last.pt"), "--cpu"])
    assert ev.returncode != 0
    assert "tutorial_simple_lstm_lm" in ev.stderr and "Traceback" not in ev.stderr


def test_legacy_task_and_criterion_options_reach_the_run(data_bin, tmp_path):
    """A task subclassing LanguageModelingTask and a FairseqCriterion, both declaring options with add_args:
    the flags parse, are saved with the checkpoint, and --loss-weight 2 doubles the first update's loss."""
    first = {}
    for weight in ("1", "2"):
        save = str(tmp_path / f"w{weight}")
        run = run_cli(
            "toolkit_cli.train",
            [
                data_bin,
                *TINY,
                "--task",
                "language_modeling_with_tag",
                "--run-tag",
                "abc",
                "--criterion",
                "weighted_cross_entropy",
                "--loss-weight",
                weight,
                "--optimizer",
                "adam",
                "--lr",
                "0.01",
                "--batch-size",
                "4",
                "--max-update",
                "1",
                "--save-dir",
                save,
                "--cpu",
                "--num-workers",
                "0",
                "--log-format",
                "json",
                "--log-interval",
                "1",
                "--disable-validation",
            ],
        )
        assert run.returncode == 0, run.stderr[-2000:]
        first[weight] = run.losses()[1]
    assert first["2"] == pytest.approx(2 * first["1"], rel=2e-3)
    saved = torch.load(os.path.join(save, "checkpoint_last.pt"), weights_only=True)["cfg"]
    assert (saved["run_tag"], saved["loss_weight"], saved["tokens_per_sample"]) == ("abc", 2.0, 32)


def test_two_gloo_ranks_train_the_plugin_as_one_process(data_bin, tmp_path):
    """DDP over 2 gloo ranks equals one process accumulating the same 2 batches (--update-freq 2):
    the plugin's initial values (its own __init__ under --seed) and its updates agree bit for bit."""
    common = [
        data_bin,
        *TINY,
        "--decoder-dropout",
        "0",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
        "--batch-size",
        "2",
        "--max-update",
        "2",
        "--cpu",
        "--num-workers",
        "0",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--disable-validation",
    ]
    runs = {}
    for name, extra in (("one", ["--update-freq", "2"]), ("two", ["--distributed-world-size", "2"])):
        run = run_cli("toolkit_cli.train", [*common, "--save-dir", str(tmp_path / name), *extra])
        assert run.returncode == 0, run.stderr[-2000:]
        runs[name] = run
    assert runs["one"].losses() == runs["two"].losses() and len(runs["one"].losses()) == 2
    one, two = (
        torch.load(str(tmp_path / n / "checkpoint_last.pt"), weights_only=True)["model"] for n in ("one", "two")
    )
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_block_wrapping_flags_are_refused_for_a_model_without_blocks(task):
    from toolkit.config import DistributedConfig
    from toolkit.distributed.parallelize import check_blocks

    model = _build(task)
    check_blocks(model, DistributedConfig())  # plain training: fine
    with pytest.raises(
        UserError,
        match="--checkpoint-activations: works on the blocks of model.layers, which "
        "SimpleLSTMLanguageModel does not have",
    ):
        check_blocks(model, DistributedConfig(checkpoint_activations=True))


def test_fairseq_dataclass_options_become_flags_with_choices(capsys):
    """A plugin declaring options fairseq's newer way (FairseqDataclass, ChoiceEnum) gets them as flags."""
    from toolkit.models import FairseqLanguageModel, register_model

    mode = DEMO_MODE

    @register_model("test_plugins_enum_demo", dataclass=DemoConfig)
    class Demo(FairseqLanguageModel):
        pass

    parser, argv = options.build_parser("demo", (), ["--arch", "test_plugins_enum_demo", "--break-mode", "eos"])
    args = parser.parse_args(argv)
    assert (args.break_mode, args.width) == ("eos", 8) and args.break_mode == mode.eos
    assert "--_name" not in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--arch", "test_plugins_enum_demo", "--break-mode", "zzz"])
    assert "invalid choice: 'zzz' (choose from 'none', 'complete', 'eos')" in capsys.readouterr().err
