"""``toolkit-export --from peft``'s reading of adapter_config.json and of the adapters' layers
(toolkit/export/peft_import.py): what maps onto the toolkit's --lora-* options, and the one-line refusals of what
does not. The import end to end (peft's log-probs, training on) is tests/integration/test_lora.py."""

from __future__ import annotations

import math

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.export.peft_import import lora_settings, lora_targets

BASE = {"peft_type": "LORA", "r": 4, "lora_alpha": 6, "lora_dropout": 0.05, "bias": "none", "use_dora": False}


def test_settings_map_onto_the_lora_options_with_rslora_as_a_larger_alpha():
    assert (lora_settings(BASE, "a.json").rank, lora_settings(BASE, "a.json").alpha) == (4, 6.0)
    rs = lora_settings({**BASE, "use_rslora": True}, "a.json")
    assert math.isclose(rs.alpha / rs.rank, 6 / math.sqrt(4)) and rs.dropout == 0.05


@pytest.mark.parametrize(
    "setting, named",
    [
        ({"use_dora": True}, "use_dora True: DoRA's magnitude vectors"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"bias": "all"}, "bias 'all'"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'; --from peft imports LORA adapters"),
    ],
)
def test_what_has_no_toolkit_lora_is_refused_naming_the_setting(setting, named):
    with pytest.raises(UserError, match=r"^a.json: ") as e:
        lora_settings({**BASE, **setting}, "a.json")
    assert named in str(e.value) and "\n" not in str(e.value)


def test_targets_are_the_last_names_and_must_cover_every_block():
    state = {f"layers.{i}.attn.{m}.weight": torch.zeros(4, 4) for i in (0, 1) for m in ("q_proj", "v_proj")}
    state["layers.0.norm.weight"] = torch.zeros(4)
    assert lora_targets(["layers.0.attn.q_proj", "layers.1.attn.q_proj"], state, "a.json") == "q_proj"
    with pytest.raises(UserError, match=r"leaves out layers.1.attn.q_proj \(1 layers in all\)"):
        lora_targets(["layers.0.attn.q_proj"], state, "a.json")  # layers_to_transform's effect
