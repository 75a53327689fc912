"""fairseq's Python surface under toolkit's names: scripts port by renaming the import.

checkpoint_utils, options parsers, tasks.setup_task, data.Dictionary, utils, and the hub's
methods and keywords, each checked against fairseq's semantics on a tiny trained model.
"""

from __future__ import annotations

import collections
import os
import shutil

import pytest
import torch

from tests.helpers.lm_fixtures import make_data_bin
from tests.helpers.cli import REPO_ROOT, train
from toolkit.core.errors import UserError

LINES = ["the cat sat on the mat", "a dog ran in the park", "the cat ran", "", "a dog sat on a mat"] * 8
ARCH = "transformer_lm_gpt2_tiny"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data-bin, checkpoint, release folder holding model.pt + dict.txt) of a 3-update tiny model."""
    root = tmp_path_factory.mktemp("fsapi")
    data = str(root / "bin")
    make_data_bin(data, {"train": LINES, "valid": LINES[:10], "test": LINES[:10]})
    save = str(root / "ck")
    train(data, save, "--arch", ARCH, "--decoder-layers", "1", "--max-update", "3")
    release = root / "release"
    release.mkdir()
    shutil.copy(os.path.join(save, "checkpoint_last.pt"), release / "model.pt")
    return data, os.path.join(save, "checkpoint_last.pt"), str(release)


def test_load_model_ensemble_and_task_returns_fairseqs_shapes(trained):
    from toolkit import checkpoint_utils, tasks

    data, ckpt, _ = trained
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([ckpt], arg_overrides={"data": data})
    assert len(models) == 1 and not models[0].training
    assert cfg.task._name == "language_modeling" and cfg.model._name == ARCH and cfg["model"].arch == ARCH
    assert cfg.task.tokens_per_sample == 32 and cfg.common.seed == 3 and cfg.tokens_per_sample == 32
    again = tasks.setup_task(cfg.task)  # fairseq scripts rebuild the task from the saved config
    assert again.dictionary == task.dictionary and len(task.dictionary) == len(again.source_dictionary)
    models2, cfg2 = checkpoint_utils.load_model_ensemble([ckpt, ckpt], arg_overrides={"data": data})
    assert len(models2) == 2 and cfg2.model._name == ARCH
    with pytest.raises(IOError, match="Model file not found: .*nope.pt"):
        checkpoint_utils.load_model_ensemble_and_task([os.path.join(data, "nope.pt")])


def test_load_checkpoint_to_cpu_applies_overrides_to_the_saved_options(trained):
    from toolkit import checkpoint_utils

    _, ckpt, _ = trained
    state = checkpoint_utils.load_checkpoint_to_cpu(ckpt, arg_overrides={"data": "elsewhere"})
    assert state["cfg"]["data"] == "elsewhere" and state["cfg"]["arch"] == ARCH
    assert all(t.device.type == "cpu" for t in state["model"].values())


def test_a_script_scores_like_the_hub(trained):
    """fairseq's scoring idiom (get_normalized_probs(model(src))) on a loaded ensemble equals the hub's scorer."""
    from toolkit import checkpoint_utils
    from toolkit.inference.hub_utils import from_pretrained

    data, ckpt, _ = trained
    [model], _, task = checkpoint_utils.load_model_ensemble_and_task([ckpt], arg_overrides={"data": data})
    d = task.source_dictionary
    tokens = d.encode_line("the cat sat on a mat", add_if_not_exist=False).long()
    src = torch.cat([tokens.new_tensor([d.eos()]), tokens[:-1]])[None]
    with torch.no_grad():
        lprobs = model.get_normalized_probs(model(src), log_probs=True)[0].gather(-1, tokens[:, None])[:, 0]
    hub = from_pretrained(os.path.dirname(ckpt), os.path.basename(ckpt), data, device="cpu")
    torch.testing.assert_close(lprobs, hub.score("the cat sat on a mat")["positional_scores"])


def test_options_parsers_take_script_arguments_and_the_architectures_values(trained):
    from toolkit import options

    data = trained[0]
    parser = options.get_training_parser()
    parser.add_argument("--my-flag", type=int, default=3)
    args = options.parse_args_and_arch(parser, [data, "--arch", ARCH, "--decoder-layers", "3", "--my-flag", "5"])
    assert (args.arch, args.decoder_layers, args.decoder_embed_dim, args.my_flag) == (ARCH, 3, 64, 5)
    args, unknown = options.parse_args_and_arch(
        options.get_training_parser(), [data, "--no-such", "1"], parse_known=True
    )
    assert unknown == ["--no-such", "1"] and args.task == "language_modeling"
    given = options.parse_args_and_arch(options.get_training_parser(), [data, "--lr", "0.1"], suppress_defaults=True)
    assert vars(given) == {"arch": "transformer_lm", "lr": 0.1}  # --arch: toolkit-train's implied default
    ev = options.parse_args_and_arch(options.get_eval_lm_parser(), [data, "--path", "x.pt", "--remove-bpe"])
    assert (ev.path, ev.post_process, ev.gen_subset) == ("x.pt", "subword_nmt", "test")
    with pytest.raises(TypeError, match="get_training_parser"):
        options.parse_args_and_arch(options.OneLineErrorParser(), [])


def test_data_dictionary_and_utils_follow_fairseq():
    from toolkit import utils
    from toolkit.data import Dictionary
    from toolkit.data.dictionary import Dictionary as Own

    assert Dictionary is Own
    pad = 1
    t = torch.tensor([[5, 6, pad, pad], [7, 8, 9, pad]])
    assert utils.strip_pad(t[0], pad).tolist() == [5, 6]
    assert utils.make_positions(t, pad).tolist() == [[2, 3, 1, 1], [2, 3, 4, 1]]
    left = utils.convert_padding_direction(t, pad, right_to_left=True)
    assert left.tolist() == [[pad, pad, 5, 6], [pad, 7, 8, 9]]
    assert utils.convert_padding_direction(left, pad, left_to_right=True).tolist() == t.tolist()
    sample = collections.OrderedDict(net_input={"src_tokens": t.half(), "n": 3}, ids=[t[0]])
    moved = utils.move_to_cpu(sample)
    assert moved["net_input"]["src_tokens"].dtype == torch.float32 and moved["net_input"]["n"] == 3
    assert isinstance(moved, collections.OrderedDict)
    assert utils.apply_to_sample(lambda x: x + 1, {"a": (t[0],)})["a"][0].tolist() == [6, 7, 2, 2]
    assert utils.item(torch.tensor(2.5)) == 2.5 and utils.item(4) == 4
    assert utils.resolve_max_positions(None, 1024, (512, 2048)) == (512, 1024)
    assert utils.eval_str_list("[1, 2]", int) == [1, 2] and utils.eval_str_list("0.5") == [0.5]


def test_hub_methods_and_a_release_folder_with_model_pt(trained):
    from toolkit.models.transformer_lm import TransformerLanguageModel

    data, _, release = trained
    lm = TransformerLanguageModel.from_pretrained(release, data_name_or_path=data, device="cpu")  # finds model.pt
    assert lm.cfg.model._name == ARCH and lm.cfg.task.tokens_per_sample == 32
    assert lm.src_dict is lm.tgt_dict is lm.task.dictionary and lm.max_positions == 32
    ids = lm.binarize("the cat zebra")
    assert ids[-1].item() == lm.src_dict.eos() and ids[2].item() == lm.src_dict.unk()
    assert lm.string(lm.encode("the cat")) == "the cat" and lm.decode(lm.encode("a dog")) == "a dog"
    assert lm.tokenize("a b") == lm.apply_bpe("a b") == lm.detokenize("a b") == lm.remove_bpe("a b") == "a b"
    both = lm.score(["the cat sat", "a dog ran"])
    assert [r["score"] for r in both] == [lm.score("the cat sat")["score"], lm.score("a dog ran")["score"]]
    joined = lm.score("the cat\na dog", replace_newlines_with_eos=True)
    assert joined["tokens"].tolist() == torch.cat([lm.encode("the cat"), lm.encode("a dog")]).tolist()
    assert len(joined["positional_scores"]) == 6


def test_hub_keywords_refused_in_one_line(trained):
    from toolkit.inference.hub_utils import from_pretrained

    data, _, release = trained
    with pytest.raises(UserError, match=r"bpe='gpt2': .*pass gpt2_encoder_json=PATH, gpt2_vocab_bpe=PATH"):
        from_pretrained(release, data_name_or_path=data, bpe="gpt2")
    try:
        import sacremoses  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match="pip install sacremoses"):
            from_pretrained(release, data_name_or_path=data, tokenizer="moses")
    with pytest.raises(UserError, match="none of model.pt, checkpoint_best.pt"):
        from_pretrained(data, device="cpu")


def test_torch_hub_load_takes_fairseqs_keywords(trained):
    data, _, release = trained
    lm = torch.hub.load(
        REPO_ROOT,
        "transformer_lm",
        source="local",
        model_dir=release,
        data_name_or_path=data,
        tokenizer="space",
        bpe=None,
        device="cpu",
    )
    assert lm.score("the cat")["tokens"].tolist() == lm.encode("the cat").tolist()
