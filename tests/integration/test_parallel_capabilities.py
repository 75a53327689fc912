"""Every registered family's parallel capabilities, each exercised: a family cannot claim a split it does not do.

A family declares what ``toolkit-train`` may split it over (toolkit/core/protocols.py): ``supports_context_parallel``
(its attention exchanges keys and values across the cp ranks), ``supports_expert_parallel`` (expert layers to spread)
and ``tensor_parallel_plan`` (its Megatron split, as data). The resolver lets a run through on the declaration
alone, and the declaration belongs to the model class, so each class's declarations are tested here on one tiny
architecture of the family (``TRAINED``: the one with the most options its splits must carry, such as Qwen3's
per-head QK-norm) that trains on 2 gloo ranks through them for 2 updates against one process: context
parallelism (``--context-parallel-size 2``) and expert parallelism (``--expert-parallel-size 2``) in one run where
the family declares both (cp 2 and ep 2 carved from the same 2 ranks, each exchange under the other), tensor
parallelism (``--model-parallel-size 2``) in another (once for families with one plan, ``SAME_PLAN``). Every other tiny architecture goes through the resolver for
each split its family declares: accepted, or refused with ``toolkit/config/composition.py``'s ``MODEL`` reason
(OLMoE's QK-norm over all heads and Qwen3.5's split projections under tensor parallelism), checked in-process.

The optimizer is plain SGD: its update is the gradient times the learning rate, so the weights after 2 updates
compare the gradients themselves (Adam would turn a gradient's rounding into a learning-rate-sized step and hide a
gradient scaled by the wrong factor). Checked: the logged losses (within float noise plus one unit in the last
logged place), every saved weight, rtol 1e-4 / atol 1e-6 (fp32; the split only reorders sums), and the log line of
the expert and tensor splits. A context-, expert- or tensor-parallel pair of ranks here is one data-parallel
replica, so both it and the one process take ``--update-freq 2`` (a split that stayed off would make two replicas
training on twice the batches; the expert split under cp would not, hence its log line). Dropouts are off (one process draws other masks than two
ranks), and an architecture with an odd head count gets 2 heads where tensor parallelism splits them.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch

from tests.helpers import dist_helpers as H

UPDATES = 2
TWO = ["--distributed-world-size", "2", "--update-freq", "2"]
# capability: (what the class declares, the flags that split over it on 2 ranks, the log line that shows it is on)
CAPABILITIES: Dict[str, Tuple[str, List[str], Optional[str]]] = {
    "context": ("supports_context_parallel", ["--context-parallel-size", "2"], None),
    "expert": ("supports_expert_parallel", ["--expert-parallel-size", "2"], "MoE layers' experts over 2 ranks"),
    "tensor": ("tensor_parallel_plan", ["--model-parallel-size", "2"], "tensor parallel: 2 ranks per replica"),
}
# The capabilities that share one 2-rank run where a family declares them together: cp 2 and ep 2 over the same
# ranks (tensor parallelism with either needs 4 ranks).
RUNS_TOGETHER = [("context", "expert"), ("tensor",)]
# family: the tiny architecture that trains its splits
TRAINED = {
    "deepseek_v3": "deepseek_v3_tiny",
    "gemma3": "gemma3_tiny",
    "glm4_moe": "glm4_moe_tiny",  # partial rotary, q/k/v biases, DeepSeekMoE routing with a dense first layer
    "gpt_oss": "gpt_oss_tiny",  # sinks split by heads under tp, a local layer, biased attention and experts
    "llama": "qwen3_tiny",  # GQA, heads of 32 on a width of 64, per-head QK-norm
    "moe": "moe_tiny",  # Qwen3-MoE: per-head QK-norm, GQA
    "olmo2": "olmo2_tiny",  # its tensor-parallel split trained as OLMo 3's (SAME_PLAN)
    "olmo3": "olmo3_tiny",  # QK-norm over all heads under tp, a local layer, YaRN on the global one
    "qwen3_next": "qwen3_next_tiny",  # gated DeltaNet: its state crosses the cp ranks, its heads the tp ranks
    "smollm3": "smollm3_tiny",  # a NoPE layer
    "transformer_lm": "transformer_lm_gpt2_tiny",
}

# family: the trained family whose tensor-parallel plan it has (the same function on blocks built alike), whose run
# trains it (OLMo 3's model is OLMo 2's with other rotary tables)
SAME_PLAN = {"olmo2": "olmo3"}


def declares(model_cls, capability: str) -> bool:
    """The class says it can be split this way: a capability flag set True, or the tensor-parallel plan's method."""
    from toolkit.core.protocols import supports

    name = CAPABILITIES[capability][0]
    return callable(getattr(model_cls, name, None)) if name == "tensor_parallel_plan" else supports(model_cls, name)


def families() -> Dict[str, Tuple[type, List[str]]]:
    """Every registered family: its model class and its tiny named architectures (``tiny`` a word of the name:
    ``llama_tiny_gqa``, not ``tinyllama_1_1b``)."""
    from toolkit.core import registry

    registry.import_all_components()
    return {
        name: (
            registry.MODEL_REGISTRY.get(name).cls,
            sorted(a for a, m in registry.ARCH_MODEL_NAME.items() if m == name and "tiny" in a.split("_")),
        )
        for name in registry.MODEL_REGISTRY.names()
    }


FAMILIES = families()
DECLARED = {name: [c for c in CAPABILITIES if declares(cls, c)] for name, (cls, _) in FAMILIES.items()}
RESOLVED = [(arch, c) for name, (_, archs) in sorted(FAMILIES.items()) for c in DECLARED[name] for arch in archs]


def split_flags(capabilities: Tuple[str, ...]) -> List[str]:
    return [f for c in capabilities for f in CAPABILITIES[c][1]]


def comparable(arch: str, capabilities: Tuple[str, ...]) -> List[str]:
    """Flags that make the architecture's run comparable with one process: its dropouts off, and 2 heads where
    tensor parallelism splits an odd number of them."""
    from toolkit.train.resolve import parse_train_config

    model = vars(parse_train_config(["data", "--arch", arch, "--max-update", "1"]).model)
    flags = [f for name, v in model.items() if "dropout" in name and v for f in (f"--{name.replace('_', '-')}", "0")]
    if "tensor" in capabilities and model.get("decoder_attention_heads", 2) % 2:
        flags += ["--decoder-attention-heads", "2"]
    return flags


def model_refusal(arch: str, flags: List[str], splits: List[str]) -> Optional[str]:
    """What ``toolkit/config/composition.py`` says the family refuses of this split of this architecture."""
    import dataclasses

    from toolkit.config import composition
    from toolkit.core.registry import resolve_arch
    from toolkit.train.resolve import parse_train_config

    cfg = parse_train_config(["data", "--arch", arch, "--max-update", "1", *flags])
    sizes = {f[2:].replace("-", "_"): int(v) for f, v in zip(splits[::2], splits[1::2])}
    split = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, **sizes))
    return composition.model_refusal(split, resolve_arch(arch).cls)


def trained_runs() -> List[Tuple[str, Tuple[str, ...]]]:
    """(architecture, capabilities) of each 2-rank run: the family's declared capabilities in ``RUNS_TOGETHER``'s
    groups, less a split the architecture's options cannot take (checked refused in the resolver test)."""
    runs = []
    for name, arch in sorted(TRAINED.items()):
        for group in RUNS_TOGETHER:
            together = tuple(c for c in group if c in DECLARED[name] and not (c == "tensor" and name in SAME_PLAN))
            if together and not model_refusal(arch, comparable(arch, together), split_flags(together)):
                runs.append((arch, together))
    return runs


RUNS = trained_runs()


def test_every_declared_capability_of_every_family_has_a_trained_run():
    for name, (cls, archs) in FAMILIES.items():
        assert name in TRAINED or not DECLARED[name], f"family {name} declares {DECLARED[name]}: add it to TRAINED"
        if DECLARED[name]:
            assert TRAINED[name] in archs, f"TRAINED[{name!r}] is not one of its tiny architectures {archs}"
            trained = {c for arch, caps in RUNS if arch == TRAINED[name] for c in caps}
            if name in SAME_PLAN and FAMILIES[name][0].PLAN is FAMILIES[SAME_PLAN[name]][0].PLAN:
                trained |= {c for arch, caps in RUNS if arch == TRAINED[SAME_PLAN[name]] for c in caps if c == "tensor"}
            refused = set(DECLARED[name]) - trained
            assert all(model_refusal(TRAINED[name], [], CAPABILITIES[c][1]) for c in refused), (name, refused)
    assert {c for _, caps in RUNS for c in caps} == set(CAPABILITIES), "every capability trains in some family"


@pytest.mark.parametrize("arch,capability", RESOLVED, ids=[f"{a}-{c}" for a, c in RESOLVED])
def test_each_tiny_architecture_is_accepted_or_refused_with_its_model_reason(arch, capability):
    from toolkit.core.errors import UserError
    from toolkit.train.resolve import parse_train_config

    flags, splits = comparable(arch, (capability,)), CAPABILITIES[capability][1]
    argv = ["data", "--arch", arch, "--max-update", "1", *flags, "--distributed-world-size", "2", *splits]
    refused = model_refusal(arch, flags, splits)
    if refused is None:
        parse_train_config(argv)
        return
    with pytest.raises(UserError) as stopped:
        parse_train_config(argv)
    assert str(stopped.value) == refused


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("capabilities") / "bin"))


def train(data_bin, save_dir, arch, *flags):
    args = H.llama_args(save_dir)
    args[args.index("--arch") + 1] = arch
    args[args.index("--optimizer") + 1 : args.index("--optimizer") + 4] = ["sgd", "--lr", "0.5"]
    proc = H.run_train([data_bin, *args, "--disable-validation", "--max-update", str(UPDATES), *flags], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def one_process(data_bin, tmp_path_factory):
    """The one-process runs by (architecture, flags), trained once for the runs that share them."""
    runs = {}

    def run(arch: str, flags: List[str]):
        key = (arch, tuple(flags))
        if key not in runs:
            save_dir = tmp_path_factory.mktemp(f"one_{arch}")
            runs[key] = (train(data_bin, save_dir, arch, *flags, "--update-freq", "2"), save_dir)
        return runs[key]

    return run


def weights(save_dir):
    return torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]


@pytest.mark.parametrize("arch,capabilities", RUNS, ids=[f"{a}-{'+'.join(c)}" for a, c in RUNS])
def test_each_declared_capability_trains_as_one_process(data_bin, one_process, tmp_path, arch, capabilities):
    flags = comparable(arch, capabilities)
    one, one_dir = one_process(arch, flags)
    split = train(data_bin, tmp_path, arch, *flags, *TWO, *split_flags(capabilities))
    for capability in capabilities:
        assert (CAPABILITIES[capability][2] or "") in split.stdout + split.stderr, capability
    H.assert_logged_losses_match(H.losses(split.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    got, want = weights(tmp_path), weights(one_dir)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
