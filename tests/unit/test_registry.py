"""The one "is this --arch registered" test (toolkit.core.registry.registered_arch) and its one-line refusal,
shared by the command line, model building and checkpoint loading (eval-lm, generate, the hub)."""

from __future__ import annotations

import pytest
import torch

from toolkit.core import registry
from toolkit.core.errors import UserError
from toolkit.core.registry import UnknownComponentError


@pytest.fixture(autouse=True)
def components():
    registry.import_all_components()


def test_registered_arch_knows_named_architectures_and_bare_model_names():
    assert registry.registered_arch("transformer_lm_gpt3_small").cls is registry.resolve_arch("transformer_lm").cls
    assert registry.registered_arch("transformer_lm") is registry.MODEL_REGISTRY.get("transformer_lm")
    assert registry.registered_arch("no_such_lm") is None
    assert registry.registered_arch(None) is None


def test_unknown_arch_names_the_closest_and_the_user_dir_fix():
    with pytest.raises(UnknownComponentError) as e:
        registry.resolve_arch("transformer_lm_gpt3_smal")
    message = str(e.value)
    assert message.startswith("--arch transformer_lm_gpt3_smal: no module registers this architecture")
    assert "closest registered: transformer_lm_gpt3_small" in message and "--user-dir" in message
    assert "\n" not in message


def test_unknown_arch_without_a_close_name_lists_the_registered_ones():
    message = registry.unknown_arch_message("zzz")
    assert "registered: " in message and "transformer_lm_gpt3_small" in message and "--user-dir" in message


def test_loading_a_checkpoint_of_an_unregistered_arch_gives_the_same_line(tmp_path):
    from toolkit import inference

    path = str(tmp_path / "plugin.pt")
    torch.save(
        {
            "cfg": {
                "arch": "tutorial_simple_lstm_lm",
                "task": "language_modeling",
                "data": "x",
                "user_dir": "plugins/lstm",
            },
            "model": {},
        },
        path,
    )
    with pytest.raises(UserError) as e:
        inference.load_model(path)
    assert str(e.value) == (
        f"{path}: {registry.unknown_arch_message('tutorial_simple_lstm_lm')} (the run used --user-dir plugins/lstm)"
    )
    assert inference.model_option_names("tutorial_simple_lstm_lm") == []  # no crash before the refusal
    assert "decoder_layers" in inference.model_option_names("transformer_lm_gpt3_small")
