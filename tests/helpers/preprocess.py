"""toolkit-preprocess run in-process, its one-line refusals, and the bytes of what it wrote."""

from __future__ import annotations

import os

import pytest

from toolkit_cli.preprocess import cli_main, main

PROG = "toolkit-preprocess"


def run(*argv):
    return main(["--only-source", "--no-progress-bar", *map(str, argv)])


def model_tokenizer_flags(folder):
    """The flags of the import's binarize command: the dictionary and tokenizer ``toolkit-export --from hf`` wrote."""
    dictionary, tokenizer = os.path.join(folder, "dict.txt"), os.path.join(folder, "tokenizer.json")
    return ["--srcdict", dictionary, "--bpe", "hf_byte_bpe", "--bpe-model", tokenizer]


def files_of(folder):
    return {
        name: open(os.path.join(folder, name), "rb").read()
        for name in sorted(os.listdir(folder))
        if name != "preprocess.log"
    }


def expect_error(capsys, argv, *fragments, code=1):
    """The refusal promise: exit ``code``, exactly one ``toolkit-preprocess: error:`` line holding each fragment."""
    with pytest.raises(SystemExit) as e:
        cli_main(["--only-source", "--no-progress-bar", *map(str, argv)])
    assert e.value.code == code
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{PROG}: error: "), err
    for fragment in fragments:
        assert str(fragment) in lines[0], (fragment, err)
    return lines[0]
