"""fairseq's plugin API (toolkit.compat.fairseq.plugins, above the families) under fairseq's import paths."""

from __future__ import annotations

import argparse

import pytest
import torch

from toolkit import criterions, dataclass, models, tasks
from toolkit.compat.fairseq.plugins import criterion, model, task
from toolkit.compat.fairseq.plugins import dataclass as plugin_dataclass
from toolkit.data.dictionary import Dictionary


def test_fairseqs_import_paths_name_the_plugin_apis_objects():
    from toolkit.criterions import fairseq_criterion
    from toolkit.models import fairseq_model
    from toolkit.tasks import fairseq_task

    assert models.FairseqLanguageModel is fairseq_model.FairseqLanguageModel is model.FairseqLanguageModel
    assert models.register_model is model.register_model and fairseq_model.INIT_VALUES_KEY == model.INIT_VALUES_KEY
    assert tasks.FairseqTask is fairseq_task.FairseqTask is task.FairseqTask and tasks.setup_task is task.setup_task
    assert criterions.FairseqCriterion is fairseq_criterion.FairseqCriterion is criterion.FairseqCriterion
    assert dataclass.FairseqDataclass is plugin_dataclass.FairseqDataclass
    from toolkit.models.fairseq_model import FairseqIncrementalDecoder, with_incremental_state  # noqa: F401
    from toolkit.tasks.fairseq_task import LegacyFairseqTask

    assert LegacyFairseqTask is task.LegacyFairseqTask and FairseqIncrementalDecoder is model.FairseqIncrementalDecoder
    for module in (models, fairseq_model, tasks, criterions):
        with pytest.raises(AttributeError, match="has no attribute 'FairseqEncoder'"):
            module.FairseqEncoder  # a name fairseq has and the toolkit does not


def test_fairseqs_script_modules_are_re_exports_of_compat():
    """``toolkit.options``, ``toolkit.checkpoint_utils`` and ``toolkit.utils`` hand out compat/fairseq's objects."""
    from toolkit import checkpoint_utils, options, utils
    from toolkit.compat.fairseq import checkpoint_utils as compat_checkpoint_utils
    from toolkit.compat.fairseq import options as compat_options
    from toolkit.compat.fairseq import utils as compat_utils
    from toolkit.config import options as config_options

    assert options.parse_args_and_arch is compat_options.parse_args_and_arch
    assert options.get_training_parser is compat_options.get_training_parser
    assert options.build_parser is config_options.build_parser  # the toolkit's parser functions too
    assert checkpoint_utils.load_model_ensemble_and_task is compat_checkpoint_utils.load_model_ensemble_and_task
    assert utils.import_user_module is compat_utils.import_user_module and utils.strip_pad is compat_utils.strip_pad


def test_a_fairseq_tasks_build_model_is_the_models_layers():
    """FairseqTask.build_model reaches toolkit.models.build_model by name (core.registry.build_model): the same
    architecture, options and parameters as a direct build."""
    vocab = Dictionary()
    for word in ("a", "b", "c"):
        vocab.add_symbol(word)

    class Task(task.FairseqTask):
        source_dictionary = target_dictionary = dictionary = vocab  # `dictionary`: what the families read

    cfg = argparse.Namespace(
        arch="transformer_lm",
        decoder_layers=1,
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_attention_heads=2,
        tokens_per_sample=8,
    )
    plugin_task = Task(cfg)
    with torch.device("meta"):
        built, direct = plugin_task.build_model(cfg), models.build_model("transformer_lm", cfg, plugin_task)
    assert type(built) is type(direct)
    assert {k: v.shape for k, v in built.state_dict().items()} == {k: v.shape for k, v in direct.state_dict().items()}
    assert len(built.layers) == 1  # the options reached the model (the architecture default is 6 or more)
