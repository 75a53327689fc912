"""What a family's Hugging Face adapter is (``toolkit-export --from hf`` and ``--format hf``): a class with its
``config.json`` <-> options mapping and its state-dict key map as data.

A family's ``hf.py`` subclasses :class:`HFAdapter` (``CLASSES``: the ``model_type`` values it reads and the
transformers class of each; ``read`` a folder, ``write`` a model); the model class names it (``HF_ADAPTER``) and
answers the exporter's protocols through it. A rotary decoder family subclasses :class:`DecoderHFAdapter`:
``options_from_hf`` (a ``config.json`` as the family's options, or a one-line refusal), ``hf_config`` (the class
and ``config.json`` computing a model's options) and ``KEY_MAP`` (our tensor names <-> theirs, a :class:`KeyMap`;
``key_map(model_type)`` where a class names them otherwise); ``state_from_hf`` / ``state_to_hf`` rename through
the key map, and a family whose tensors are not one-to-one (stacked experts) overrides them. The folders
themselves (tokenizer, dictionary, safetensors files, checkpoint) are read and written once, by
``common/hf_folder.py``.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Dict, Iterable, Optional, Pattern, Sequence, Tuple

import torch

from toolkit.core.errors import UserError, malformed_file
from toolkit.core.protocols import HFCheckpoint, HFWeights
from toolkit.models.common import hf_config, hf_folder
from toolkit.models.common.hf_config import DecoderClass

PLACEHOLDER = re.compile(r"\{(\w+)\}")


def template_pattern(template: str) -> Pattern[str]:
    """The regex of a name template: ``{x}`` matches one or more characters (dots included), the rest literally."""
    parts, end = [], 0
    for m in PLACEHOLDER.finditer(template):
        parts += [re.escape(template[end : m.start()]), f"(?P<{m.group(1)}>.+?)"]
        end = m.end()
    parts.append(re.escape(template[end:]))
    return re.compile("".join(parts))


class KeyMap:
    """Our state-dict names <-> a transformers class's, as data: ``rules`` are (ours, theirs) name templates tried
    in order (the first that matches renames), ``{x}`` a placeholder both sides share; ``dropped`` their names
    we do not keep (computed buffers of older transformers). A name no rule matches is not ours (None)."""

    def __init__(self, rules: Sequence[Tuple[str, str]], dropped: Sequence[str] = ()):
        self.rules = tuple(rules)
        self._ours = [(template_pattern(ours), theirs) for ours, theirs in self.rules]
        self._theirs = [(template_pattern(theirs), ours) for ours, theirs in self.rules]
        self._dropped = [template_pattern(name) for name in dropped]

    def to_hf(self, name: str) -> str:
        for pattern, theirs in self._ours:
            m = pattern.fullmatch(name)
            if m is not None:
                return theirs.format(**m.groupdict())
        raise KeyError(f"{name}: no Hugging Face name for this tensor")

    def from_hf(self, name: str) -> Optional[str]:
        if any(pattern.fullmatch(name) for pattern in self._dropped):
            return None
        for pattern, ours in self._theirs:
            m = pattern.fullmatch(name)
            if m is not None:
                return ours.format(**m.groupdict())
        return None


# A decoder whose tensors are Hugging Face's under ``model.``, the untied output layer ``lm_head``.
DECODER_KEYS = KeyMap(
    rules=(("output_projection.weight", "lm_head.weight"), ("{name}", "model.{name}")),
    dropped=("{prefix}rotary_emb.inv_freq",),
)


class HFAdapter:
    """A family's Hugging Face adapter: the classes it reads and how (``read``: a folder as our checkpoint) and how
    it writes a model as one of them (``write``); built where it is asked for, for one read or write."""

    FAMILY: ClassVar[str]  # the family's model name (its bare --arch), whose named sizes an import matches
    CLASSES: ClassVar[Dict[str, str]]  # model_type -> transformers class, of the folders --from hf reads
    QUANTIZATIONS: ClassVar[Tuple[str, ...]] = ()  # the --quantize storages ``write`` offers (its releases')
    quantize: Optional[str] = None  # the storage the export asks of ``write`` (one of QUANTIZATIONS), else plain

    def read(
        self, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance
    ) -> HFCheckpoint:
        """``--from hf``: the folder as our checkpoint (``toolkit.core.protocols.HFImportable.from_hf``)."""
        raise NotImplementedError

    def write(self, model: Any, hf_class: str, dictionary: Any, first_symbol: int, data_dir: str) -> HFWeights:
        """``--format hf``: the model as a class of the family (``toolkit.core.protocols.HFExportable``)."""
        raise NotImplementedError


class HFConvertible:
    """What a family's model class gives ``toolkit-export`` through its adapter (``HF_ADAPTER``): ``HF_CLASSES`` and
    ``from_hf`` (``toolkit.core.protocols.HFImportable``), ``hf_weights`` (``HFExportable``)."""

    HF_ADAPTER: ClassVar[type]  # the family's HFAdapter subclass (its hf.py)
    HF_CLASSES: ClassVar[Dict[str, str]]  # --from hf reads these config.json model_types: the adapter's CLASSES
    HF_QUANTIZATIONS: ClassVar[Tuple[str, ...]] = ()  # --format hf --quantize writes these: the adapter's

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        adapter = cls.__dict__.get("HF_ADAPTER")
        if adapter is not None:
            cls.HF_CLASSES, cls.HF_QUANTIZATIONS = adapter.CLASSES, adapter.QUANTIZATIONS

    @classmethod
    def from_hf(cls, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance):
        """``--from hf``: a folder of one of the family's classes (``HF_CLASSES``) as our checkpoint."""
        return cls.HF_ADAPTER().read(folder, config, out_dir, tokens_per_sample, advance)

    def hf_weights(
        self, hf_class: str, dictionary: Any, first_symbol: int, data_dir: str, quantize: Optional[str] = None
    ) -> HFWeights:
        """``--format hf``: the model as the class of the family that computes it (the adapter's choice), with
        ``quantize`` (one of ``HF_QUANTIZATIONS``) the tensors the family's release quantizes stored so."""
        adapter = self.HF_ADAPTER()
        adapter.quantize = quantize
        return adapter.write(self, hf_class, dictionary, first_symbol, data_dir)


class DecoderHFAdapter(HFAdapter):
    """The adapter of a rotary decoder family (see the module docstring): the folders are read and written by
    ``common/hf_folder.py`` through ``options_from_hf``, ``hf_config`` and the state conversions."""

    KEY_MAP: ClassVar[KeyMap] = DECODER_KEYS
    HF_KEYS: ClassVar[Dict[str, str]] = hf_config.HF_KEYS  # option -> config.json key; a family adds its own
    KINDS: ClassVar[Dict[str, DecoderClass]]  # model_type -> what its class computes of the shared settings
    FAMILY_NAME: ClassVar[str]  # as the refusals name it: "the Llama family"
    MLP: ClassVar[str]  # what the family's MLP is, for the refusal of another activation

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "KINDS" in cls.__dict__:
            cls.CLASSES = {kind: traits.name for kind, traits in cls.KINDS.items()}

    def read(
        self, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance
    ) -> HFCheckpoint:
        return hf_folder.read_folder(self, folder, config, out_dir, tokens_per_sample, advance)

    def write(self, model: Any, hf_class: str, dictionary: Any, first_symbol: int, data_dir: str) -> HFWeights:
        return hf_folder.hf_weights(self, model, hf_class, dictionary, first_symbol, data_dir)

    def options_from_hf(self, config: Dict[str, Any], where: str) -> Dict[str, Any]:
        """The family's option values of a ``config.json`` (a dict), or a one-line refusal naming the setting."""
        kind = config.get("model_type")
        if kind not in self.KINDS:
            raise UserError(
                f"{where}: model_type {kind!r}; {self.FAMILY_NAME} reads {', '.join(self.CLASSES.values())} "
                "folders (toolkit-export --from hf picks the family by model_type)"
            )
        config = self.complete(config)
        hf_config.check_counts(config, where)
        with malformed_file(where, "give the config.json transformers saved with the model"):  # e.g. a str for a float
            hf_config.refuse_unsupported(config, self.KINDS[kind], self.FAMILY_NAME, self.MLP, where)
            return self.options(config, kind, where)

    def config_keys(self, config: Dict[str, Any]) -> Dict[str, str]:
        """config.json's key of each option read from ``config``, as it spells them: what the import's refusal of
        a value names (``hf_folder``'s check with toolkit-train's flag types)."""
        return hf_config.rope_keys(self.HF_KEYS, config)

    def complete(self, config: Dict[str, Any]) -> Dict[str, Any]:
        """``config`` with the shared settings a class keeps under its own key."""
        return config

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The options of a checked ``config.json``: the shared ones (a family adds its own)."""
        return {
            **hf_config.attention_options(config, self.KINDS[kind], where),
            **hf_config.shape_options(config, self.KINDS[kind]),
            **hf_config.rope_options(config, where),
        }

    def hf_config(self, cfg: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict]:
        """(class name, config.json values) computing exactly ``cfg``. ``base`` (the imported model's own
        config.json) keeps its class where that class computes ``cfg``, and every setting we do not model."""
        raise NotImplementedError

    def key_map(self, model_type: str) -> KeyMap:
        """The tensor names of class ``model_type``."""
        return self.KEY_MAP

    def state_from_hf(
        self, tensors: Iterable[Tuple[str, torch.Tensor]], given: Dict[str, Any], model_type: str
    ) -> Dict[str, torch.Tensor]:
        """Our fp32 state dict from their (name, tensor) pairs, taken one at a time (the import holds one copy);
        the untied output layer is left out when the embedding is tied (``given``: the options read)."""
        keys = self.key_map(model_type)
        state: Dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            self.put_from_hf(state, name, tensor, given, keys)
        return state

    def put_from_hf(
        self, state: Dict[str, torch.Tensor], name: str, tensor: torch.Tensor, given: Dict[str, Any], keys: KeyMap
    ) -> None:
        """One of their tensors into ``state`` under our name, in fp32 (nothing for what we do not keep)."""
        ours = keys.from_hf(name)
        if ours is not None and not (given["share_decoder_input_output_embed"] and ours == "output_projection.weight"):
            state[ours] = tensor.float()

    def state_to_hf(self, state: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
        """Their tensors of our state dict, renamed by the key map."""
        keys = self.key_map(model_type)
        return {keys.to_hf(name): tensor for name, tensor in state.items()}
