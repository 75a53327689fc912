"""Registries of named components (tasks, models, architectures, criterions, ...).

Each component registers its class together with the dataclass that declares its
options; the command line is generated from those dataclasses (see
``toolkit.config.options``), so an option is declared exactly once.
"""

from __future__ import annotations

import difflib
import importlib
import math
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple


class UnknownComponentError(ValueError):
    """A name given on the command line is not registered."""


class RegistryEntry:
    """One component: its class and its options dataclass (or None when it takes none).

    A built-in component is declared first (:data:`BUILTIN_COMPONENTS`): its name, the module that registers
    its class and the torch-free module holding its options. ``config`` then imports only the options module
    and ``cls`` the component's module (whose decorator fills the entry in), so the command line (``--help``,
    every argument error) is built without importing torch."""

    def __init__(
        self,
        name: str,
        cls: Any = None,
        config: Optional[type] = None,
        module: Optional[str] = None,
        options: Optional[str] = None,
    ):
        self.name = name
        self._cls = cls
        self._config = config
        self.module = module  # imported at the first use of ``cls`` (None: registered already)
        self.options = options  # "module:Class" of the options dataclass, imported at the first use of ``config``

    @property
    def cls(self) -> Any:
        if self._cls is None and self.module is not None:
            importlib.import_module(self.module)  # its decorator fills ``_cls`` in (see Registry.register)
        if self._cls is None:
            raise ValueError(f"{self.module} does not register '{self.name}'")
        return self._cls

    @property
    def config(self) -> Optional[type]:
        if self._config is None and self.options is not None:
            module, _, name = self.options.partition(":")
            self._config = getattr(importlib.import_module(module), name)
        return self._config


class Registry:
    """A name -> (class, options dataclass) table for one kind of component."""

    def __init__(self, kind: str, flag: str, default: Optional[str] = None):
        self.kind = kind
        self.flag = flag
        self.default = default
        self.entries: Dict[str, RegistryEntry] = {}

    def register(self, name: str, dataclass: Optional[type] = None) -> Callable:
        def decorator(cls):
            declared = self.entries.get(name)
            if declared is None:
                self.entries[name] = RegistryEntry(name, cls, dataclass)
            elif declared._cls is None and declared.module is not None:  # the declared module, imported now
                declared._cls, declared._config = cls, dataclass
            else:
                raise ValueError(f"cannot register duplicate {self.kind} ({name})")
            return cls

        return decorator

    def declare(self, name: str, module: str, options: Optional[str]) -> None:
        """A built-in component by module name: listed (``--help``, choices) before its module is imported."""
        if name not in self.entries:
            self.entries[name] = RegistryEntry(name, module=module, options=options)

    def names(self) -> List[str]:
        return sorted(self.entries)

    def get(self, name: str) -> RegistryEntry:
        if name not in self.entries:
            raise UnknownComponentError(unknown_name_message(self.flag, name, self.names()))
        return self.entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self.entries


def unknown_name_message(flag: str, name: str, choices: List[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{flag}: unknown name '{name}'.{hint} Registered: {', '.join(choices)}"


@dataclass(frozen=True)
class ParameterPiece:
    """One parameter as its optimizer state is sized: the whole tensor's shape, the piece of it this rank keeps and
    updates (a tensor-parallel, expert-parallel and FSDP2 shard of it, or all of it), and the family's role for it
    (``'matrix'`` takes Muon's update; ``""`` where the family names none)."""

    shape: Tuple[int, ...]
    local: Tuple[int, ...]
    role: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def local_numel(self) -> int:
        return math.prod(self.local) if self.local else 1


def _no_note(options: Any) -> str:
    return ""


@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per parameter, declared where it registers (``@register_optimizer(name,
    dataclass=..., state=OptimizerState(...))``), so that ``toolkit-plan`` prices an optimizer by its own account
    and refuses one that gives none instead of guessing.

    ``bytes_of(options, piece)``: the bytes of state the optimizer holds for ``piece`` (:class:`ParameterPiece`)
    under ``options`` (its options dataclass as resolved, None for an optimizer without options), step counters
    and scales included; ``note(options)``: the few words a plan prints beside the total (e.g. ``8bit moments``)."""

    bytes_of: Callable[[Any, ParameterPiece], int]
    note: Callable[[Any], str] = _no_note


class OptimizerRegistry(Registry):
    """The ``--optimizer`` table, whose entries also declare their state (:class:`OptimizerState`)."""

    def __init__(self, kind: str, flag: str, default: Optional[str] = None):
        super().__init__(kind, flag, default)
        self._states: Dict[str, OptimizerState] = {}

    def register(self, name: str, dataclass: Optional[type] = None, state: Optional[OptimizerState] = None) -> Callable:
        register_class = super().register(name, dataclass)

        def decorator(cls):
            register_class(cls)
            if state is not None:
                self._states[name] = state
            return cls

        return decorator

    def state(self, name: str) -> Optional[OptimizerState]:
        """The state ``name`` declares (its module imported first: the declaration sits on its registration), or
        None for an optimizer registered without one (a plugin written before the declaration existed)."""
        self.get(name).cls
        return self._states.get(name)


TASK_REGISTRY = Registry("task", "--task", default="language_modeling")
MODEL_REGISTRY = Registry("model", "--arch")
CRITERION_REGISTRY = Registry("criterion", "--criterion", default="cross_entropy")
OPTIMIZER_REGISTRY = OptimizerRegistry("optimizer", "--optimizer", default="adam")
LR_SCHEDULER_REGISTRY = Registry("lr_scheduler", "--lr-scheduler", default="fixed")
TOKENIZER_REGISTRY = Registry("bpe", "--bpe", default=None)

register_task = TASK_REGISTRY.register
register_model = MODEL_REGISTRY.register
register_criterion = CRITERION_REGISTRY.register
register_optimizer = OPTIMIZER_REGISTRY.register
register_lr_scheduler = LR_SCHEDULER_REGISTRY.register
register_bpe = TOKENIZER_REGISTRY.register

# Named architectures: arch name -> model name, and arch name -> function that
# sets the architecture's values on a model config (user flags override them).
ARCH_MODEL_NAME: Dict[str, str] = {}
ARCH_CONFIG_FN: Dict[str, Callable[[Any], None]] = {}
PUBLISHED_VOCAB_SIZE: Dict[str, int] = {}
"""arch -> the vocabulary its published weights use (a family fills it in; parameter counts and ``toolkit-plan``
without a data-bin count at it)."""


def register_model_architecture(model_name: str, arch_name: str) -> Callable:
    def decorator(fn: Callable[[Any], None]):
        if arch_name in ARCH_MODEL_NAME:
            raise ValueError(f"cannot register duplicate architecture ({arch_name})")
        ARCH_MODEL_NAME[arch_name] = model_name
        ARCH_CONFIG_FN[arch_name] = fn
        return fn

    return decorator


def architecture_names() -> List[str]:
    return sorted(ARCH_MODEL_NAME)


def registered_arch(arch: Optional[str]) -> Optional[RegistryEntry]:
    """The model entry that serves ``arch`` (a named architecture or a bare model name), or None when no
    imported module registers it: the one "is this arch registered" test (training, loading, overrides)."""
    if arch in ARCH_MODEL_NAME:
        model = ARCH_MODEL_NAME[arch]
        return MODEL_REGISTRY.get(model) if model in MODEL_REGISTRY else None
    if arch is not None and arch in MODEL_REGISTRY:
        return MODEL_REGISTRY.get(arch)
    return None


def unknown_arch_message(arch: Optional[str]) -> str:
    """One line for an architecture nothing registers: the closest registered names (a typo), and
    ``--user-dir`` (an architecture from a plugin, whose folder was not given)."""
    names = sorted(set(ARCH_MODEL_NAME) | set(MODEL_REGISTRY.names()))
    close = difflib.get_close_matches(str(arch), names, n=3)
    hint = f"closest registered: {', '.join(close)}" if close else f"registered: {', '.join(names)}"
    return (
        f"--arch {arch}: no module registers this architecture ({hint}); fix the name, or pass --user-dir "
        f"with the plugin folder that registers it"
    )


def resolve_arch(arch: Optional[str]) -> RegistryEntry:
    """The model entry that serves a named architecture (or a bare model name); refused in one line when
    nothing registers it (:func:`unknown_arch_message`)."""
    entry = registered_arch(arch)
    if entry is None:
        raise UnknownComponentError(unknown_arch_message(arch))
    return entry


def import_submodules(package_name: str) -> None:
    """Import every module of a package so that its decorators run."""
    package = importlib.import_module(package_name)
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package_name}.{info.name}")


# The hub interface (a trained model with encode/decode/score/sample) is built by the inference layer,
# above models; a model class's fairseq-style ``from_pretrained`` reaches it by this name, the way
# components are found by package name, so models never import upward.
HUB_MODULE = "toolkit.inference.hub_utils"


def hub_from_pretrained(model_name_or_path: str, checkpoint_file: Optional[str], data_name_or_path: str, **kwargs):
    """The inference layer's ``from_pretrained`` (see ``HUB_MODULE``)."""
    return importlib.import_module(HUB_MODULE).from_pretrained(
        model_name_or_path, checkpoint_file, data_name_or_path, **kwargs
    )


# fairseq's ``FairseqTask.build_model`` builds through the models layer's one path from an architecture to a
# model, reached by name the same way.
MODELS_MODULE = "toolkit.models"


def build_model(arch: str, section: Any, task: Any):
    """The models layer's ``build_model`` (see ``MODELS_MODULE``)."""
    return importlib.import_module(MODELS_MODULE).build_model(arch, section, task)


# fairseq's plugin API (``FairseqLanguageModel``, ``FairseqTask``, ``FairseqCriterion``, ...) lives with the rest of
# fairseq's compatibility, above the families; their fairseq import paths (``from toolkit.models import
# FairseqLanguageModel``, ``toolkit.tasks.fairseq_task``, ...) reach it by this name, so they never import upward.
FAIRSEQ_PLUGIN_API = "toolkit.compat.fairseq.plugins"


def fairseq_plugin_name(name: str) -> Any:
    """One name of fairseq's plugin API (see ``FAIRSEQ_PLUGIN_API``)."""
    return getattr(importlib.import_module(FAIRSEQ_PLUGIN_API), name)


def fairseq_plugin_getattr(module: str, names: Tuple[str, ...]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` serving ``names`` from fairseq's plugin API (see ``FAIRSEQ_PLUGIN_API``)."""

    def module_getattr(name: str) -> Any:
        if name in names:
            return fairseq_plugin_name(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return module_getattr


# fairseq's ``checkpoint_utils.load_model_ensemble_and_task`` (toolkit.compat.fairseq, below the inference layer,
# which reads fairseq's files through it) loads each model with the inference layer's ``load_model``, reached by
# this name.
INFERENCE_MODULE = "toolkit.inference"


def load_model_for_eval(path: str, data_dir: Optional[str], device: Any, overrides: Optional[Dict[str, Any]]):
    """The inference layer's ``load_model`` (see ``INFERENCE_MODULE``): ``(model, task, args)``."""
    return importlib.import_module(INFERENCE_MODULE).load_model(path, data_dir, device, overrides)


_COMPONENT_PACKAGES = (
    "toolkit.tasks",
    "toolkit.models",
    "toolkit.criterions",
    "toolkit.optim",
    "toolkit.optim.lr_scheduler",
    "toolkit.tokenizers",
)
_imported = False


def import_all_components() -> None:
    """Populate every registry with its classes (idempotent)."""
    global _imported
    if _imported:
        return
    declare_builtin_components()
    for package in _COMPONENT_PACKAGES:
        import_submodules(package)
    _imported = True


# The built-in components by name: {registry: {name: (module that registers the class, "options module:class")}}.
# The options modules import no torch, so the command line (every name, the chosen components' options) is
# built before torch is imported; ``tests/integration/test_startup.py`` checks this table against what the modules
# register.
BUILTIN_COMPONENTS: Dict[Registry, Dict[str, Tuple[str, Optional[str]]]] = {
    TASK_REGISTRY: {
        "language_modeling": ("toolkit.tasks.language_modeling", "toolkit.config.components:LanguageModelingConfig"),
        "sft": ("toolkit.tasks.sft", "toolkit.config.components:SFTConfig"),
    },
    CRITERION_REGISTRY: {
        name: (module, "toolkit.config.components:CrossEntropyCriterionConfig")
        for name, module in (
            ("cross_entropy", "toolkit.criterions.cross_entropy"),
            ("vocab_parallel_cross_entropy", "toolkit.criterions.cross_entropy"),
            ("adaptive_loss", "toolkit.criterions.adaptive_loss"),
        )
    },
    OPTIMIZER_REGISTRY: {
        "adam": ("toolkit.optim.adam", "toolkit.config.components:AdamConfig"),
        "cpu_adam": ("toolkit.optim.cpu_adam", "toolkit.config.components:CPUAdamConfig"),
        "muon": ("toolkit.optim.muon", "toolkit.config.components:MuonConfig"),
        "sgd": ("toolkit.optim.sgd", "toolkit.config.components:SGDConfig"),
        "nag": ("toolkit.optim.nag", "toolkit.config.components:NAGConfig"),
    },
    LR_SCHEDULER_REGISTRY: {
        name: (f"toolkit.optim.lr_scheduler.{name}", f"toolkit.config.components:{options}")
        for name, options in (
            ("fixed", "FixedLRScheduleConfig"),
            ("inverse_sqrt", "InverseSquareRootLRScheduleConfig"),
            ("polynomial_decay", "PolynomialDecayLRScheduleConfig"),
            ("cosine", "CosineLRScheduleConfig"),
            ("tri_stage", "TriStageLRScheduleConfig"),
            ("reduce_lr_on_plateau", "ReduceLROnPlateauLRScheduleConfig"),
            ("wsd", "WSDLRScheduleConfig"),
        )
    },
    TOKENIZER_REGISTRY: {
        "sentencepiece": (
            "toolkit.tokenizers.sentencepiece_bpe",
            "toolkit.tokenizers.sentencepiece_bpe:SentencepieceBpeConfig",
        ),
        "gpt2": ("toolkit.tokenizers.gpt2_bpe", "toolkit.tokenizers.gpt2_bpe:Gpt2BpeConfig"),
        "hf_byte_bpe": ("toolkit.tokenizers.hf_byte_bpe", "toolkit.tokenizers.hf_byte_bpe:HfByteBpeConfig"),
    },
}
# The model families: a family is a folder toolkit/models/<name>/ (config.py its options class, named here;
# archs.py its named sizes; model.py the class that registers as <name>; parallel.py; hf.py), and this table's
# line for it is all that registers it. Torch-free: the options and sizes are read for the command line.
BUILTIN_FAMILIES: Dict[str, str] = {
    "transformer_lm": "TransformerLMConfig",
    "llama": "LlamaConfig",
    "gemma3": "Gemma3Config",
    "olmo2": "Olmo2Config",
    "olmo3": "Olmo3Config",
    "smollm3": "SmolLM3Config",
    "moe": "MoEConfig",
    "deepseek_v3": "DeepSeekV3Config",
    "gpt_oss": "GptOssConfig",
    "qwen3_next": "Qwen3NextConfig",
    "glm4_moe": "Glm4MoeConfig",
}


def family_modules(name: str, options_class: str, package: str = "toolkit.models") -> Dict[str, str]:
    """Where family ``name``'s parts are (its folder ``package.name``): the model module that registers its class,
    its options class as "module:Class" and the (torch-free) module of its named sizes."""
    folder = f"{package}.{name}"
    return {"model": f"{folder}.model", "options": f"{folder}.config:{options_class}", "archs": f"{folder}.archs"}


def declare_family(name: str, options_class: str, package: str = "toolkit.models") -> None:
    """Register model family ``name`` from its folder (see ``BUILTIN_FAMILIES``): its class and options by module
    name, its named sizes at once (their module imports no torch)."""
    parts = family_modules(name, options_class, package)
    MODEL_REGISTRY.declare(name, parts["model"], parts["options"])
    importlib.import_module(parts["archs"])


BUILTIN_COMPONENTS[MODEL_REGISTRY] = {
    name: (parts["model"], parts["options"])
    for name, parts in ((name, family_modules(name, options)) for name, options in BUILTIN_FAMILIES.items())
}
_declared = False


def declare_builtin_components() -> None:
    """Every built-in name and architecture, without importing a component's code (idempotent)."""
    global _declared
    if _declared:
        return
    _declared = True
    for reg, components in BUILTIN_COMPONENTS.items():
        if reg is not MODEL_REGISTRY:
            for name, (module, options) in components.items():
                reg.declare(name, module, options)
    for name, options in BUILTIN_FAMILIES.items():
        declare_family(name, options)


def import_user_module(user_dir: str) -> None:
    """``--user-dir``: import a folder of plugins as a package so they can register."""
    import os
    import sys

    path = os.path.abspath(user_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--user-dir: no such folder: {user_dir}")
    parent, name = os.path.split(path)
    if name in sys.modules:
        return
    sys.path.insert(0, parent)
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.pop(0)
    if hasattr(module, "__path__"):
        for info in pkgutil.iter_modules(module.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{name}.{info.name}")
