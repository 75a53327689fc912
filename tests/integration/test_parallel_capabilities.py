"""Every registered family's parallel capabilities, each exercised: a family cannot claim a split it does not do.

A family declares what ``toolkit-train`` may split it over (toolkit/core/protocols.py): ``supports_context_parallel``
(its attention exchanges keys and values across the cp ranks), ``supports_expert_parallel`` (expert layers to spread)
and ``tensor_parallel_plan`` (its Megatron split, as data). The resolver lets a run through on the declaration
alone, so each declaration is tested here: every tiny named architecture of every registered family (``--arch
*tiny*``) that declares a capability trains on 2 gloo ranks through it (``--context-parallel-size 2``,
``--expert-parallel-size 2``, ``--model-parallel-size 2``) for 2 updates against one process.

The optimizer is plain SGD: its update is the gradient times the learning rate, so the weights after 2 updates
compare the gradients themselves (Adam would turn a gradient's rounding into a learning-rate-sized step and hide a
gradient scaled by the wrong factor). Checked: the logged losses (within float noise plus one unit in the last
logged place) and every saved weight, rtol 1e-4 / atol 1e-6 (fp32; the split only reorders sums). A context- or
tensor-parallel pair of ranks is one data-parallel replica, so both it and the one process take ``--update-freq 2``;
two expert-parallel ranks are two replicas, against the one process's ``--update-freq 2``. Dropouts are off (one
process draws other masks than two ranks), and an architecture with an odd head count gets 2 heads where tensor
parallelism splits them. An architecture whose option its family's split cannot take (OLMo 2's and OLMoE's QK-norm
over all heads under tensor parallelism) is refused by the resolver with ``toolkit/config/composition.py``'s
``MODEL`` reason, checked here, rather than trained.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch

from tests.helpers import dist_helpers as H

UPDATES = 2
TWO = ["--distributed-world-size", "2"]
# capability: (what the class declares, the flags that split over it on 2 ranks, --update-freq of those ranks)
CAPABILITIES: Dict[str, Tuple[str, List[str], int]] = {
    "context": ("supports_context_parallel", TWO + ["--context-parallel-size", "2"], 2),
    "expert": ("supports_expert_parallel", TWO + ["--expert-parallel-size", "2"], 1),
    "tensor": ("tensor_parallel_plan", TWO + ["--model-parallel-size", "2"], 2),
}


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
CASES = [
    (arch, capability)
    for _, (cls, archs) in sorted(FAMILIES.items())
    for capability in CAPABILITIES
    if declares(cls, capability)
    for arch in archs
]


def test_every_family_that_declares_a_capability_has_a_tiny_architecture_to_test_it():
    for name, (cls, archs) in FAMILIES.items():
        claimed = [c for c in CAPABILITIES if declares(cls, c)]
        assert archs or not claimed, f"family {name} declares {claimed} but registers no tiny architecture to test"
    assert {c for _, c in CASES} == set(CAPABILITIES), "every capability is declared by some family"


def comparable(arch: str, capability: str) -> List[str]:
    """Flags that make the architecture's run comparable with one process: its dropouts off, and 2 heads where
    tensor parallelism splits an odd number of them."""
    from toolkit.train.resolve import parse_train_config

    model = vars(parse_train_config(["data", "--arch", arch, "--max-update", "1"]).model)
    flags = [f for name, v in model.items() if "dropout" in name and v for f in (f"--{name.replace('_', '-')}", "0")]
    if capability == "tensor" and model.get("decoder_attention_heads", 2) % 2:
        flags += ["--decoder-attention-heads", "2"]
    return flags


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("capabilities") / "bin"))


def model_refusal(arch: str, flags: List[str], split_flags: List[str]) -> Optional[str]:
    """What ``toolkit/config/composition.py`` says the family refuses of this split of this architecture."""
    import dataclasses

    from toolkit.config import composition
    from toolkit.core.registry import resolve_arch
    from toolkit.train.resolve import parse_train_config

    cfg = parse_train_config(["data", "--arch", arch, "--max-update", "1", *flags])
    sizes = {f[2:].replace("-", "_"): int(v) for f, v in zip(split_flags[::2], split_flags[1::2])}
    split = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, **sizes))
    return composition.model_refusal(split, resolve_arch(arch).cls)


def train(data_bin, save_dir, arch, *flags):
    args = H.llama_args(save_dir)
    args[args.index("--arch") + 1] = arch
    args[args.index("--optimizer") + 1 : args.index("--optimizer") + 4] = ["sgd", "--lr", "0.5"]
    proc = H.run_train([data_bin, *args, "--disable-validation", "--max-update", str(UPDATES), *flags], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def one_process(data_bin, tmp_path_factory):
    """The one-process runs by (architecture, flags), trained once for the capabilities that share them."""
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


@pytest.mark.parametrize("arch,capability", CASES, ids=[f"{a}-{c}" for a, c in CASES])
def test_each_declared_capability_trains_as_one_process(data_bin, one_process, tmp_path, arch, capability):
    _, split_flags, update_freq = CAPABILITIES[capability]
    flags = comparable(arch, capability)
    refused = model_refusal(arch, flags, split_flags)
    if refused:  # the option, not the family, cannot be split: the resolver stops the run with the reason
        from toolkit.core.errors import UserError
        from toolkit.train.resolve import parse_train_config

        with pytest.raises(UserError) as stopped:
            parse_train_config(["data", "--arch", arch, "--max-update", "1", *flags, *split_flags])
        assert str(stopped.value) == refused
        return
    one, one_dir = one_process(arch, flags)
    split = train(data_bin, tmp_path, arch, *flags, *split_flags, "--update-freq", str(update_freq))
    H.assert_logged_losses_match(H.losses(split.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    got, want = weights(tmp_path), weights(one_dir)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
