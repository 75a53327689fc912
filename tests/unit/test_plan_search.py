"""toolkit-plan's layout search (toolkit.plan.search): what it proposes fits, toolkit-train's resolver takes it and
reads back the layout that was priced, the update stays the size given, and what toolkit-train refuses (the model's
splits, composition's pairs) is never proposed; the host memory a plan assumes is this machine's unless given; the
optimizer state is what each optimizer declares where it registers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.plan_checks import check_proposals, resolved
from toolkit.core.registry import OPTIMIZER_REGISTRY, ParameterPiece, import_all_components
from toolkit.plan import hardware
from toolkit.plan.hardware import GIB, PRESETS, hardware_from_args, split_hardware_args
from toolkit.plan.search import Search, plan_command

TINY_MOE = ["--arch", "moe_tiny", "--tokens-per-sample", "64", "--batch-size", "4", "--distributed-world-size", "4"]


def _search(argv, hw):
    import_all_components()
    plan, found = plan_command(argv, hw)
    return plan, found, Search(resolved(argv), plan.setup, lambda dtype: plan.stats, hw)


def test_a_small_gpu_gets_layouts_that_fit_and_keep_the_update(monkeypatch):
    """moe_tiny on 4 ranks of a GPU too small for it as given: every fitting layout keeps the update's tokens, and
    the printed ones resolve to what was priced; the MoE family's 4 experts allow EP 2 and 4, its 2 key/value
    heads TP 2 at most."""
    hw = dataclasses.replace(PRESETS["h100"], gpu_memory=int(1.06 * GIB), host_memory=64 * GIB)
    plan, found, search = _search(TINY_MOE + ["--bf16"], hw)
    assert not plan.fits
    check_proposals(TINY_MOE + ["--bf16"], hw, found, plan)
    candidates = search.candidates()
    assert {c.plan.time.tokens_per_step for c in candidates} == {plan.time.tokens_per_step}
    assert {c.plan.setup.ep for c in candidates} <= {1, 2, 4} and max(c.plan.setup.mp for c in candidates) <= 2
    assert all(c.plan.fits for c in candidates)


@pytest.mark.parametrize(
    "given,kept,gpu",
    [
        (["--checkpoint-activations"], lambda s: s.checkpoint, 1.1),
        (["--offload-activations"], lambda s: s.offload_activations, 1.1),
        (
            ["--ddp-backend", "fully_sharded", "--cpu-offload"],
            lambda s: s.cpu_offload and s.backend == "fully_sharded",
            80,
        ),
        (["--ddp-backend", "fully_sharded", "--no-reshard-after-forward"], lambda s: s.backend == "fully_sharded", 80),
    ],
    ids=["checkpoint", "offload_activations", "cpu_offload", "no_reshard"],
)
def test_the_memory_settings_given_stay_on(given, kept, gpu):
    """A setting the command turns on stays on in every layout priced (and a layout toolkit-train refuses with it,
    DDP under --cpu-offload or --no-reshard-after-forward, is not priced): the proposals resolve as priced."""
    hw = dataclasses.replace(PRESETS["h100"], gpu_memory=int(gpu * GIB), host_memory=64 * GIB)
    plan, found, search = _search(TINY_MOE + given, hw)
    candidates = search.candidates()
    assert candidates and all(kept(c.plan.setup) for c in candidates)
    check_proposals(TINY_MOE + given, hw, found, plan)


def test_an_fp32_run_offloaded_on_a_gpu_is_ranked_after_the_layouts_that_keep_fp32():
    """Offloading an fp32 run computes in bf16 on a GPU (toolkit-train's choice), so such a layout is marked as
    changing the numbers and comes after every layout that does not."""
    hw = dataclasses.replace(PRESETS["h100"], gpu_memory=int(1.1 * GIB), host_memory=64 * GIB)
    plan, found, search = _search(TINY_MOE + ["--checkpoint-activations"], hw)
    candidates = sorted(search.candidates(), key=lambda c: c.rank())
    lossy = [c.lossy for c in candidates]
    assert lossy == sorted(lossy) and True in lossy and False in lossy
    assert all(c.plan.setup.compute_bytes == 2 for c in candidates if c.plan.setup.cpu_offload)


def test_a_pair_composition_refuses_is_never_proposed():
    """--compile --no-sequence-parallel with attention dropout refuses tensor parallelism (composition.py): the
    search proposes none, though it would save memory."""
    argv = [
        "--arch",
        "transformer_lm_gpt3_small",
        "--decoder-layers",
        "2",
        "--tokens-per-sample",
        "256",
        "--batch-size",
        "8",
        "--distributed-world-size",
        "4",
        "--compile",
        "--no-sequence-parallel",
        "--attention-dropout",
        "0.1",
    ]
    hw = dataclasses.replace(PRESETS["h100"], gpu_memory=3 * GIB, host_memory=64 * GIB)
    plan, found, search = _search(argv, hw)
    candidates = search.candidates()
    assert candidates and all(c.plan.setup.mp == 1 for c in candidates)
    assert not any("--model-parallel-size" in c.flags for c in found.shown)


def test_without_host_memory_the_plan_takes_this_machines(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "machine_memory", lambda: 3 << 40)
    hw = hardware_from_args(split_hardware_args([])[0])
    assert hw.host_memory == 3 << 40 and hw.host_memory_source == "this machine's"
    given = hardware_from_args(split_hardware_args(["--host-memory", "1TiB"])[0])
    assert given.host_memory == 1 << 40 and given.host_memory_source == "--host-memory"


def test_machine_memory_reads_sysconf_then_meminfo_under_the_container_limit(monkeypatch, tmp_path):
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1000}
    monkeypatch.setattr(hardware.os, "sysconf", lambda name: pages[name])
    monkeypatch.setattr(hardware, "CGROUP_MEMORY_MAX", str(tmp_path / "absent"))
    assert hardware.machine_memory() == 4096 * 1000
    (tmp_path / "memory.max").write_text("2048000\n")
    monkeypatch.setattr(hardware, "CGROUP_MEMORY_MAX", str(tmp_path / "memory.max"))
    assert hardware.machine_memory() == 2048000
    (tmp_path / "memory.max").write_text("max\n")  # no limit
    assert hardware.machine_memory() == 4096 * 1000

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(hardware.os, "sysconf", no_sysconf)
    (tmp_path / "meminfo").write_text("MemTotal:       1024 kB\nMemFree:  12 kB\n")
    monkeypatch.setattr(hardware, "MEMINFO", str(tmp_path / "meminfo"))
    assert hardware.machine_memory() == 1024 * 1024


@pytest.mark.parametrize(
    "name,options",
    [
        ("adam", {}),
        ("cpu_adam", {}),
        ("cpu_adam", {"adam_state_precision": "bf16"}),
        ("cpu_adam", {"adam_state_precision": "8bit"}),
        ("cpu_adam", {"fp16_adam_stats": True}),
        ("sgd", {}),
        ("sgd", {"momentum": 0.9}),
        ("nag", {}),
    ],
)
def test_each_optimizer_declares_the_state_it_keeps(name, options):
    """The bytes each built-in optimizer declares where it registers equal its state tensors after a step (an
    8-bit-eligible matrix, a matrix too small for 8 bits, biases); muon's: tests/unit/test_muon.py."""
    from toolkit.config.options import config_from_args
    from toolkit.optim import build_optimizer
    from toolkit.plan.measure import state_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Linear(4096, 3))
    values = dict(optimizer=name, lr=0.01, **options)
    optimizer = build_optimizer(values, model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    entry = OPTIMIZER_REGISTRY.get(name)
    section = config_from_args(entry.config, values)
    state = OPTIMIZER_REGISTRY.state(name)
    declared = sum(state.bytes_of(section, ParameterPiece(tuple(p.shape), tuple(p.shape))) for p in model.parameters())
    assert declared == state_bytes(model, optimizer)["optimizer"]


def test_an_optimizer_that_declares_no_state_is_refused_and_training_goes_on(monkeypatch):
    """The planner refuses to price an optimizer without a declaration (one line naming --optimizer and what to
    add) instead of pricing it as Adam; toolkit-train --plan's line says the plan is not available."""
    from toolkit.core.errors import UserError
    from toolkit.plan.planner import make_plan
    from toolkit.plan.report import summary_for_train

    import_all_components()
    assert OPTIMIZER_REGISTRY.state("sgd") is not None
    monkeypatch.delitem(OPTIMIZER_REGISTRY._states, "sgd")  # as a --user-dir optimizer registered without one
    cfg = resolved(["--arch", "llama_tiny", "--optimizer", "sgd"])
    with pytest.raises(UserError, match=r"^--optimizer sgd: declares no optimizer state, .*state=OptimizerState\("):
        make_plan(cfg, PRESETS["cpu"])
    assert summary_for_train(cfg).startswith("plan: not available (--optimizer sgd: declares no optimizer state")


@pytest.mark.parametrize(
    "lengths,sizes",
    [
        (["--tokens-per-sample", "64"], {1, 2, 4}),  # 64 cuts into 4 and 8 chunks
        (["--tokens-per-sample", "63"], {1}),  # cuts into neither: toolkit-train refuses cp 2 and 4
        (["--tokens-per-sample", "63", "--max-target-positions", "64"], {1, 2, 4}),  # padded to 64: it runs
    ],
    ids=["cuts", "does-not-cut", "padded-within-positions"],
)
def test_context_parallel_sizes_are_those_toolkit_train_takes(lengths, sizes):
    """The search asks toolkit-train's own check (context_parallel.check_sequence_split) of every CP size: it never
    proposes one whose samples do not cut into 2 x cp chunks, and does propose one that pads within the positions."""
    argv = ["--arch", "llama_tiny", "--batch-size", "4", "--distributed-world-size", "4", *lengths]
    hw = dataclasses.replace(PRESETS["h100"], host_memory=64 * GIB)
    plan, found, search = _search(argv, hw)
    assert {c.plan.setup.cp for c in search.candidates()} == sizes
    check_proposals(argv, hw, found, plan)
