"""fairseq's model base classes and registration decorators, on the toolkit's registry.

A fairseq plugin (``from fairseq.models import FairseqLanguageModel, register_model``) ports by
renaming the import to ``toolkit.models``. What differs underneath, and is bridged here:

- Options: a model may declare them in a dataclass or the legacy way (``add_args(parser)``);
  both become flags (:mod:`toolkit.compat.fairseq.plugins.legacy_args`). Architecture functions get
  fairseq's getattr-with-default behaviour.
- Initialization: the toolkit builds every model on the meta device and fills parameters from
  ``initial_value`` (:mod:`toolkit.models.init`). A fairseq model initializes itself in
  ``__init__``, so the registry runs the plugin's ``build_model`` once (as fairseq does, per process)
  on the CPU, seeded with the run's seed, keeps those values for
  :meth:`BaseFairseqModel.initial_value` and hands the model on on the meta device: a plugin's own
  init rules hold, and a ``build_model`` with side effects (logging, reading files) runs once.
- Decoding: toolkit generation passes a model only the new tokens with ``incremental_state``;
  a fairseq decoder takes the whole prefix and caches what it needs.
  :meth:`FairseqLanguageModel.forward` keeps the prefix and calls the decoder as fairseq does.
"""

from __future__ import annotations

import copy
import inspect
import uuid
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core import registry
from toolkit.compat.fairseq.plugins.dataclass import with_enum_choices
import toolkit.compat.fairseq.plugins.legacy_args as legacy_args

#: keys of the toolkit-side incremental state of a :class:`FairseqLanguageModel`
PREFIX_KEY, DECODER_STATE_KEY = "fairseq_prefix", "fairseq_decoder_state"
#: where a fairseq model keeps its own ``__init__``'s parameter values until ``init_weights`` has read them
INIT_VALUES_KEY = "_fairseq_init_values"


class BaseFairseqModel(nn.Module):
    """fairseq's base of every model: options, ``build_model``, normalized probabilities."""

    @classmethod
    def add_args(cls, parser) -> None:
        """Legacy option declaration (``parser.add_argument``); dataclass models leave it alone."""

    @classmethod
    def build_model(cls, args, task):
        raise NotImplementedError("Model must implement the build_model method")

    def get_targets(self, sample, net_output):
        return sample["target"]

    def get_normalized_probs(self, net_output, log_probs: bool, sample: Optional[Dict] = None) -> torch.Tensor:
        """(Log-)probabilities from ``forward``'s output: a ``(logits, extra)`` tuple or the logits alone."""
        if torch.is_tensor(net_output):
            net_output = (net_output, None)
        if hasattr(self, "decoder"):
            return self.decoder.get_normalized_probs(net_output, log_probs, sample)
        logits = net_output[0].float()
        return F.log_softmax(logits, dim=-1) if log_probs else F.softmax(logits, dim=-1)

    def max_positions(self):
        return None

    def set_num_updates(self, num_updates: int) -> None:
        for m in self.modules():
            if m is not self and hasattr(m, "set_num_updates"):
                m.set_num_updates(num_updates)

    def prepare_for_inference_(self, cfg=None) -> None:
        self.eval()

    # ---- the toolkit's initialization protocol (toolkit.models.init) ----

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """Parameter ``name`` of this model as its own ``__init__`` sets it, seeded with the run's seed.

        The toolkit materializes models built on the meta device, so ``__init__``'s values are
        lost; a CPU twin built the same way (``torch.manual_seed(torch.initial_seed())``, the
        run's ``--seed``) supplies them. It is kept until :meth:`reset_buffers` (the end of
        ``init_weights``), one CPU copy of the model at most.
        """
        values = self.__dict__.get(INIT_VALUES_KEY)
        if values is None:
            values = {n: p.detach() for n, p in self._build_twin().named_parameters()}
            self.__dict__[INIT_VALUES_KEY] = values
        return values[name].clone()

    def _build_twin(self) -> nn.Module:
        """A model built without the registry (the registry's builds keep their values, see
        ``_FairseqModelBuilder``): a copy re-initialized by its modules' ``reset_parameters``."""
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(torch.initial_seed())
            twin = copy.deepcopy(self).to_empty(device="cpu")
            for module in twin.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            return twin

    def reset_buffers(self) -> None:
        """Called last by ``init_weights`` (and before loading a checkpoint): the init values are no longer needed."""
        self.__dict__.pop(INIT_VALUES_KEY, None)


class FairseqDecoder(nn.Module):
    """fairseq's decoder base: ``forward`` = ``output_layer(extract_features(...))``."""

    def __init__(self, dictionary):
        super().__init__()
        self.dictionary = dictionary
        self.onnx_trace = False
        self.adaptive_softmax = None

    def forward(self, prev_output_tokens, encoder_out=None, **kwargs):
        x, extra = self.extract_features(prev_output_tokens, encoder_out=encoder_out, **kwargs)
        return self.output_layer(x), extra

    def extract_features(self, prev_output_tokens, encoder_out=None, **kwargs):
        raise NotImplementedError

    def output_layer(self, features, **kwargs):
        raise NotImplementedError

    def get_normalized_probs(self, net_output, log_probs: bool, sample: Optional[Dict] = None) -> torch.Tensor:
        return self.get_normalized_probs_scriptable(net_output, log_probs, sample)

    def get_normalized_probs_scriptable(self, net_output, log_probs: bool, sample: Optional[Dict] = None):
        if getattr(self, "adaptive_softmax", None) is not None:
            target = sample["target"] if sample is not None else None
            out = self.adaptive_softmax.get_log_prob(net_output[0], target=target)
            return out if log_probs else out.exp_()
        logits = net_output[0].float()
        return F.log_softmax(logits, dim=-1) if log_probs else F.softmax(logits, dim=-1)

    def max_positions(self) -> int:
        """fairseq's "arbitrary large number", as an int (the toolkit computes lengths with it)."""
        return 1_000_000

    def upgrade_state_dict_named(self, state_dict, name):
        return state_dict


class FairseqIncrementalState:
    """fairseq's per-module slot in a shared ``incremental_state`` dict (a uuid per instance)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_incremental_state()

    def init_incremental_state(self) -> None:
        self._incremental_state_id = str(uuid.uuid4())

    def _get_full_incremental_state_key(self, key: str) -> str:
        return f"{self._incremental_state_id}.{key}"

    def get_incremental_state(self, incremental_state: Optional[Dict], key: str):
        full_key = self._get_full_incremental_state_key(key)
        if incremental_state is None or full_key not in incremental_state:
            return None
        return incremental_state[full_key]

    def set_incremental_state(self, incremental_state: Optional[Dict], key: str, value):
        if incremental_state is not None:
            incremental_state[self._get_full_incremental_state_key(key)] = value
        return incremental_state


def with_incremental_state(cls):
    """fairseq's class decorator: give ``cls`` its own incremental-state slot."""
    cls.__bases__ = (FairseqIncrementalState,) + tuple(b for b in cls.__bases__ if b is not FairseqIncrementalState)
    return cls


@with_incremental_state
class FairseqIncrementalDecoder(FairseqDecoder):
    """A decoder that caches state between steps: ``forward(prev_output_tokens, ..., incremental_state)``
    receives the whole prefix and uses only what it has not cached (fairseq's contract)."""

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        raise NotImplementedError

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        raise NotImplementedError

    def reorder_incremental_state(self, incremental_state: Dict, new_order: torch.Tensor):
        """Keep (and repeat) the cached rows ``new_order``; a decoder with a cache overrides it."""

    def reorder_incremental_state_scripting(self, incremental_state: Dict, new_order: torch.Tensor) -> Dict:
        for module in self.modules():
            if hasattr(module, "reorder_incremental_state"):
                result = module.reorder_incremental_state(incremental_state, new_order)
                if result is not None:
                    incremental_state = result
        return incremental_state

    def set_beam_size(self, beam_size: int) -> None:
        self._beam_size = beam_size


class FairseqLanguageModel(BaseFairseqModel):
    """fairseq's decoder-only model: ``forward(src_tokens)`` returns the decoder's ``(logits, extra)``."""

    def __init__(self, decoder: FairseqDecoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, src_tokens, incremental_state: Optional[Dict] = None, **kwargs):
        """``incremental_state`` given: ``src_tokens`` are the tokens after the ones already seen
        (the toolkit's generation protocol); the decoder is called with the prefix, fairseq's way.

        ``src_lengths`` (from ``model(**sample["net_input"])``) reaches the decoder only when its
        ``forward`` names it or takes ``**kwargs``; a decoder without it (the tutorial's) still runs.
        """
        if "src_lengths" in kwargs and not _accepts(self.decoder.forward, "src_lengths"):
            kwargs.pop("src_lengths")
        if incremental_state is None:
            return self.decoder(src_tokens, **kwargs)
        return self._forward_new_tokens(src_tokens, incremental_state, **kwargs)

    def _forward_new_tokens(self, tokens: torch.Tensor, state: Dict, **kwargs):
        prefix = state.get(PREFIX_KEY)
        full = tokens if prefix is None else torch.cat([prefix, tokens], dim=1)
        state[PREFIX_KEY] = full
        if not isinstance(self.decoder, FairseqIncrementalDecoder):  # recompute the prefix, keep the new rows
            x, extra = self.decoder(full, **kwargs)
            return x[:, -tokens.size(1) :], extra
        decoder_state = state.setdefault(DECODER_STATE_KEY, {})
        outs, extra = [], None
        for end in range(full.size(1) - tokens.size(1) + 1, full.size(1) + 1):
            x, extra = self.decoder(full[:, :end], incremental_state=decoder_state, **kwargs)
            outs.append(x[:, -1:])
        return torch.cat(outs, dim=1), extra

    def reorder_incremental_state(self, incremental_state: Dict, new_order: torch.Tensor) -> None:
        """Beam search's reordering: the kept prefix and the decoder's caches follow ``new_order``."""
        if PREFIX_KEY in incremental_state:
            incremental_state[PREFIX_KEY] = incremental_state[PREFIX_KEY].index_select(0, new_order)
        decoder_state = incremental_state.get(DECODER_STATE_KEY)
        if decoder_state and isinstance(self.decoder, FairseqIncrementalDecoder):
            incremental_state[DECODER_STATE_KEY] = self.decoder.reorder_incremental_state_scripting(
                decoder_state, new_order
            )

    def forward_decoder(self, prev_output_tokens, **kwargs):
        return self.decoder(prev_output_tokens, **kwargs)

    def extract_features(self, src_tokens, **kwargs):
        return self.decoder.extract_features(src_tokens, **kwargs)

    def output_layer(self, features, **kwargs):
        return self.decoder.output_layer(features, **kwargs)

    def max_positions(self):
        return self.decoder.max_positions()

    def max_decoder_positions(self):
        return self.decoder.max_positions()

    @property
    def supported_targets(self):
        return {"future"}


def _accepts(fn, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class _FairseqModelBuilder:
    """The registry's entry for a fairseq-style model: hands ``build_model`` fairseq's ``args``.

    Everything else (``from_pretrained``, class attributes) is the model class's own.
    """

    def __init__(self, model_class: type, name: str):
        self.wrapped_class, self.name = model_class, name

    def build_model(self, section: Any, task):
        config = registry.MODEL_REGISTRY.get(self.name).config
        legacy = config is None or hasattr(config, legacy_args.UNSET_ATTR)  # options from add_args, or none
        args = legacy_args.legacy_args(section, task, legacy_args.unset_names(config)) if legacy else section
        if torch.empty(0).device.type != "meta":
            return self.wrapped_class.build_model(args, task)
        return self._build_on_cpu_keep_values(args, task)

    def _build_on_cpu_keep_values(self, args: Any, task) -> nn.Module:
        """``build_model`` under ``with torch.device("meta")`` (how the toolkit builds every model): the plugin's
        ``build_model`` runs once, as fairseq calls it once per process, on the CPU and seeded with the run's
        seed; its ``__init__``'s values are kept for :meth:`BaseFairseqModel.initial_value` (one CPU copy,
        dropped at the end of ``init_weights``) and the model handed back on the meta device, like any other."""
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(torch.initial_seed())
            model = self.wrapped_class.build_model(args, task)
        values = {name: p.detach() for name, p in model.named_parameters()}  # the storage outlives .to("meta")
        model = model.to("meta")
        if isinstance(model, BaseFairseqModel):
            model.__dict__[INIT_VALUES_KEY] = values
        return model

    def __getattr__(self, name: str):
        return getattr(self.wrapped_class, name)


def register_model(name: str, dataclass: Optional[type] = None):
    """fairseq's decorator: register a model class under ``name`` (options: ``dataclass``, or its ``add_args``)."""

    def decorator(cls):
        config = (
            with_enum_choices(dataclass)
            if dataclass
            else legacy_args.legacy_config(registry.MODEL_REGISTRY, "model", name, cls, BaseFairseqModel.add_args)
        )
        registry.MODEL_REGISTRY.register(name, config)(_FairseqModelBuilder(cls, name))
        return cls

    return decorator


def register_model_architecture(model_name: str, arch_name: str):
    """fairseq's decorator: a named architecture sets option values on ``args`` (the user's flags win)."""

    def decorator(fn):
        def apply(cfg) -> None:
            config = registry.MODEL_REGISTRY.get(model_name).config
            fn(legacy_args.UnsetHidden(cfg, legacy_args.unset_names(config)))

        registry.register_model_architecture(model_name, arch_name)(apply)
        return fn

    return decorator
