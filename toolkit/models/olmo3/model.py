"""The OLMo 3 decoder: OLMo 2's (``toolkit.models.olmo2.model``: norms after attention and the MLP, QK-norm over the
projections) whose local layers rotate with the unscaled frequencies of ``--rope-theta`` when the global ones are
scaled (``--rope-scaling-factor``, the published models' YaRN), as ``Olmo3ForCausalLM`` computes them."""

from __future__ import annotations

from typing import Optional

from toolkit.core.registry import register_model
from toolkit.models.olmo2.model import Olmo2LanguageModel
from toolkit.models.olmo3.config import Olmo3Config
from toolkit.models.olmo3.hf import Olmo3Adapter
from toolkit.models.olmo3.parallel import tensor_parallel_plan


@register_model("olmo3", dataclass=Olmo3Config)
class Olmo3LanguageModel(Olmo2LanguageModel):
    """The decoder-only OLMo 3 language model behind the toolkit's model interface."""

    HF_ADAPTER = Olmo3Adapter
    PLAN = staticmethod(tensor_parallel_plan)

    @staticmethod
    def local_rope_theta(cfg: Olmo3Config) -> Optional[float]:
        """The local layers' own tables only where they differ from the global ones: unscaled under a scaling."""
        return cfg.rope_theta if cfg.rope_scaling_factor is not None else None
