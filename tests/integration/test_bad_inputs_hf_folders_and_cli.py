"""The bad-input catalogue: malformed Hugging Face folders and command lines, each one line.

Every case keeps the catalogue's promise (``tests.helpers.bad_inputs.check_bad_input``): exit 1, one
``prog: error:`` line with the fragment, no traceback, every prepared file byte-identical. The Hugging Face
folders are the Llama one of ``tests/helpers/hf_llama.py`` damaged each way ``MALFORMED`` lists.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.helpers.bad_inputs import MODEL, check_bad_input

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests.helpers.hf_llama import MALFORMED, make_hf, malformed_copy  # noqa: E402

TRAIN, EXPORT, PLAN, HARNESS = "toolkit_cli.train", "toolkit_cli.export", "toolkit_cli.plan", "toolkit_cli.eval_harness"
PLAN_MODEL = ["--arch", "transformer_lm", "--decoder-layers", "2", "--decoder-embed-dim", "32", "--vocab-size", "100"]

CASES = [
    # --- 9. tracebacks ------------------------------------------------------------------------------
    *[
        (
            f"import-hf-{name}",
            EXPORT,
            ["--from", "hf", "--path", f"{{hf}}/{name}", "--out", "{root}/imported"],
            f"{{hf}}/{name}/{file}: ",
        )
        for name, (_, file, _) in MALFORMED.items()
    ],
    (
        "import-gpt2-layers-a-string",
        EXPORT,
        ["--from", "hf", "--path", "{hf}/gpt2_layers_str", "--out", "{root}/imported"],
        "{hf}/gpt2_layers_str/config.json: StrictDataclassFieldValidationError: Validation error for field 'n_layer'",
    ),
    (
        "import-gpt2-config-without-n-layer",
        EXPORT,
        ["--from", "hf", "--path", "{hf}/gpt2_no_layers", "--out", "{root}/imported"],
        "the weights do not match config.json (missing ['transformer.h.1.",
    ),  # not 12 layers, 11 of them random
    (
        "harness-limit-0",
        HARNESS,
        ["--path", "{save}/checkpoint_last.pt", "--tasks", "x", "--limit", "0"],
        "argument --limit: 0: give a fraction between 0 and 1 or a whole number of examples >= 1",
    ),
    (
        "harness-limit-minus-3",
        HARNESS,
        ["--path", "{save}/checkpoint_last.pt", "--tasks", "x", "--limit", "-3"],
        "argument --limit: -3: give a fraction",
    ),
    (
        "harness-batch-size-0",
        HARNESS,
        ["--path", "{save}/checkpoint_last.pt", "--tasks", "x", "--batch-size", "0"],
        "argument --batch-size: 0: must be at least 1",
    ),
    (
        "plan-gpu-memory-1e400",
        PLAN,
        [*PLAN_MODEL, "--gpu-memory", "1e400"],
        "--gpu-memory 1e400: must be between 1 byte and 1PiB",
    ),
    (
        "plan-tokens-per-sample-0",
        PLAN,
        [*PLAN_MODEL, "--tokens-per-sample", "0"],
        "--tokens-per-sample: 0: must be at least 1",
    ),  # refused at parse time
    (
        "train-model-parallel-one-process",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{root}/mp", "--model-parallel-size", "2", "--ddp-backend", "fully_sharded"],
        "--model-parallel-size 2: each layer is split over that many ranks and this run has 1 process(es)",
    ),
    # --- 10. argparse errors: one line, exit 1 (not ten lines of usage and exit 2) -----------------------
    ("train-unknown-flag", TRAIN, ["{bin}", MODEL, "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("train-bad-choice", TRAIN, ["{bin}", MODEL, "--ddp-backend", "nccl_magic"], "argument --ddp-backend"),
    ("plan-hardware-flag-without-value", PLAN, [*PLAN_MODEL, "--gpu"], "argument --gpu: expected one argument"),
    (
        "plan-vocab-size-not-a-number",
        PLAN,
        ["--arch", "transformer_lm", "--vocab-size", "many"],
        "argument --vocab-size: invalid int value: 'many'",
    ),
    (
        "export-unknown-dtype",
        EXPORT,
        ["--path", "{save}/checkpoint_last.pt", "--format", "safetensors", "--dtype", "int3", "--out", "{root}/x"],
        "argument --dtype: invalid choice: 'int3'",
    ),
]


@pytest.fixture(scope="module")
def paths(prepared, tmp_path_factory):
    hf = str(tmp_path_factory.mktemp("hf"))
    make_hf(f"{hf}/good", "llama")
    for name in MALFORMED:
        malformed_copy(f"{hf}/good", f"{hf}/{name}", name)
    _gpt2_folders(hf)
    return {**prepared, "hf": hf}


def _gpt2_folders(hf: str) -> None:
    import json

    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(f"{hf}/gpt2")
    for name, change in (
        ("gpt2_layers_str", lambda c: dict(c, n_layer="two")),
        ("gpt2_no_layers", lambda c: {k: v for k, v in c.items() if k != "n_layer"}),
    ):
        shutil.copytree(f"{hf}/gpt2", f"{hf}/{name}")
        with open(f"{hf}/{name}/config.json", encoding="utf-8") as f:
            values = change(json.load(f))
        with open(f"{hf}/{name}/config.json", "w", encoding="utf-8") as f:
            json.dump(values, f)


def test_catalogue_cases_are_named_once():
    assert len({c[0] for c in CASES}) == len(CASES) >= 20


@pytest.mark.parametrize("name,module,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, module, argv, fragment, paths, tmp_path):
    check_bad_input(module, argv, fragment, paths, tmp_path)
    assert not os.path.exists(f"{paths['root']}/imported") and not os.path.exists(f"{paths['root']}/mp")
