"""--optimizer muon in one process: torch.optim.Muon + torch.optim.AdamW on the family's role groups; the roles
and the weight-decay groups (--no-decay-norms-biases-embeddings)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from tests.helpers.models import tiny_model, tokens
from toolkit.core.errors import UserError
from toolkit.models.llama.config import LlamaConfig
from toolkit.models.llama.model import LlamaLanguageModel
from toolkit.optim import build_optimizer
from toolkit.optim import muon as muon_module
from toolkit.optim.param_groups import log_decay_choice, parameter_groups, skips_decay


def tiny_llama(seed=0):
    cfg = LlamaConfig(
        decoder_layers=2,
        decoder_embed_dim=32,
        decoder_attention_heads=4,
        decoder_ffn_embed_dim=64,
        max_target_positions=16,
    )
    return LlamaLanguageModel(cfg, 37, 1, seed=seed)


def loss_of(model, batch):
    logits = model(batch)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def train(model, step, zero, updates=4):
    losses = []
    for i in range(updates):
        loss = loss_of(model, tokens(seed=i))
        loss.backward()
        step()
        zero()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make_model", [tiny_model, tiny_llama], ids=["transformer_lm", "llama"])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_equals_torch_muon_plus_adamw(make_model, adjust):
    ours, ref = make_model(), make_model()
    ref.load_state_dict(ours.state_dict())
    groups = parameter_groups(ours, by_role=True, no_decay=False, purpose="test")
    opt = build_optimizer(
        {
            "optimizer": "muon",
            "lr": 0.02,
            "muon_adjust_lr": adjust,
            "muon_adamw_lr": 0.003,
            "weight_decay": 0.01,
            "adam_betas": "(0.9, 0.95)",
            "muon_momentum": 0.9,
        },
        groups,
    )
    roles = ref.parameter_roles()
    matrices = [p for n, p in ref.named_parameters() if roles[n] == "matrix"]
    others = [p for n, p in ref.named_parameters() if roles[n] != "matrix"]
    assert matrices and others
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01, momentum=0.9, nesterov=True, adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW(others, lr=0.003, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

    ours_losses = train(ours, opt.step, opt.zero_grad)
    ref_losses = train(ref, lambda: (muon.step(), adamw.step()), lambda: (muon.zero_grad(), adamw.zero_grad()))
    assert ours_losses[-1] < ours_losses[0]
    torch.testing.assert_close(ours_losses, ref_losses, rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    # torch's state names: a checkpoint's optimizer entry reads like Muon's and AdamW's
    ref_state = {**{id(p): s for p, s in muon.state.items()}, **{id(p): s for p, s in adamw.state.items()}}
    for p, state in opt.state.items():
        assert set(state) == set(ref_state[id(ref.get_parameter(name_of(ours, p)))])


def name_of(model, param):
    return next(n for n, p in model.named_parameters() if p is param)


def test_scheduled_lr_keeps_the_adamw_ratio_and_state_round_trips():
    model = tiny_llama()
    opt = build_optimizer(
        {"optimizer": "muon", "lr": 0.02, "muon_adamw_lr": 0.004},
        parameter_groups(model, by_role=True, no_decay=False, purpose="test"),
    )
    for group in opt.param_groups:
        group["lr"] = 0.01  # what a scheduler's set_lr does
    assert {g["role"]: g["lr"] * g["lr_ratio"] for g in opt.param_groups}["embedding"] == pytest.approx(0.002)
    train(model, opt.step, opt.zero_grad, updates=2)
    other = tiny_llama()
    other.load_state_dict(model.state_dict())
    opt2 = build_optimizer(
        {"optimizer": "muon", "lr": 0.02, "muon_adamw_lr": 0.004},
        parameter_groups(other, by_role=True, no_decay=False, purpose="test"),
    )
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    a = train(model, opt.step, opt.zero_grad, updates=2)
    b = train(other, opt2.step, opt2.zero_grad, updates=2)
    assert a == b


def test_bf16_momentum_is_stored_in_bf16_and_follows_fp32():
    losses = {}
    for dtype in ("fp32", "bf16"):
        model = tiny_llama()
        opt = build_optimizer(
            {"optimizer": "muon", "lr": 0.02, "muon_momentum_dtype": dtype},
            parameter_groups(model, by_role=True, no_decay=False, purpose="test"),
        )
        losses[dtype] = train(model, opt.step, opt.zero_grad, updates=4)
    assert losses["bf16"] != losses["fp32"]
    torch.testing.assert_close(losses["bf16"], losses["fp32"], rtol=1e-2, atol=0)
    buffers = [s["momentum_buffer"] for s in opt.state.values() if "momentum_buffer" in s]
    assert buffers and all(b.dtype == torch.bfloat16 for b in buffers)
    # a checkpoint's momentum converts to the loading run's precision, both ways
    for saved, wanted in (("bf16", torch.float32), ("fp32", torch.bfloat16)):
        model = tiny_llama()
        source = build_optimizer(
            {"optimizer": "muon", "lr": 0.02, "muon_momentum_dtype": saved},
            parameter_groups(model, by_role=True, no_decay=False, purpose="test"),
        )
        train(model, source.step, source.zero_grad, updates=1)
        target = build_optimizer(
            {"optimizer": "muon", "lr": 0.02, "muon_momentum_dtype": "fp32" if wanted == torch.float32 else "bf16"},
            parameter_groups(model, by_role=True, no_decay=False, purpose="test"),
        )
        target.load_state_dict(source.state_dict())
        loaded = [s["momentum_buffer"] for s in target.state.values() if "momentum_buffer" in s]
        assert loaded and all(b.dtype == wanted for b in loaded)
        train(model, target.step, target.zero_grad, updates=1)


def test_muon_needs_roles():
    with pytest.raises(UserError, match="grouped by the family's roles"):
        build_optimizer({"optimizer": "muon", "lr": 0.02}, list(tiny_llama().parameters()))

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)

    with pytest.raises(UserError, match="does not declare its parameter roles"):
        parameter_groups(Plain(), by_role=True, no_decay=False, purpose="--optimizer muon")
    with pytest.raises(UserError, match="--muon-momentum"):
        build_optimizer(
            {"optimizer": "muon", "lr": 0.02, "muon_momentum": 1.0},
            parameter_groups(tiny_llama(), by_role=True, no_decay=False, purpose="test"),
        )


def test_weight_decay_groups_by_role():
    llama, fairseq_lm = tiny_llama(), tiny_model()
    assert skips_decay(llama, False, False) and not skips_decay(fairseq_lm, False, False)
    assert skips_decay(fairseq_lm, True, False) and not skips_decay(llama, False, True)
    with pytest.raises(UserError, match="contradict"):
        skips_decay(llama, True, True)
    # transformer_lm keeps fairseq's one flat list: its optimizer state (and golden losses) unchanged
    assert all(isinstance(p, torch.nn.Parameter) for p in parameter_groups(fairseq_lm, False, False, "t"))
    groups = parameter_groups(llama, by_role=False, no_decay=True, purpose="--weight-decay")
    decay = {g["role"]: g.get("weight_decay") for g in groups}
    assert decay == {"matrix": None, "embedding": 0.0, "output": None, "norm": 0.0}
    opt = build_optimizer({"optimizer": "adam", "lr": 0.1, "weight_decay": 0.5}, groups)
    embed_before = llama.embed_tokens.weight.detach().clone()
    q_before = llama.layers[0].self_attn.q_proj.weight.detach().clone()
    opt.step()  # no gradients: only weight decay could move a parameter, and AdamW skips grad-less ones
    loss_of(llama, tokens()).backward()
    llama.embed_tokens.weight.grad.zero_()
    llama.layers[0].self_attn.q_proj.weight.grad.zero_()
    opt.step()
    torch.testing.assert_close(llama.embed_tokens.weight.detach(), embed_before)  # zero grad, no decay
    torch.testing.assert_close(llama.layers[0].self_attn.q_proj.weight.detach(), q_before * (1 - 0.1 * 0.5))


def test_decay_choice_logged_once_when_the_family_decides(caplog):
    logger = logging.getLogger("toolkit.optim")
    logger.disabled = False
    with caplog.at_level(logging.INFO, logger="toolkit.optim"):
        log_decay_choice(tiny_llama(), True, explicit=False, weight_decay=0.1)
        log_decay_choice(tiny_llama(), True, explicit=True, weight_decay=0.1)
    lines = [r.getMessage() for r in caplog.records if "not applied to norms" in r.getMessage()]
    assert len(lines) == 1 and "LlamaLanguageModel's default" in lines[0]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_pipelined_finishes_in_order_with_at_most_depth_in_flight(depth):
    events, in_flight = [], []

    def start(task):
        events.append(("start", task))
        in_flight.append(task)
        assert len(in_flight) <= depth + 1
        return task * 10

    def finish(task, handle):
        assert handle == task * 10 and in_flight[0] == task  # oldest first
        in_flight.pop(0)
        events.append(("finish", task))

    muon_module.pipelined(range(5), start, finish, depth)
    assert [t for kind, t in events if kind == "finish"] == list(range(5)) and not in_flight
    # task i starts before task i - depth finishes, and after task i - depth - 1 has finished
    for i in range(5):
        started = events.index(("start", i))
        if i - depth >= 0:
            assert started < events.index(("finish", i - depth))
        if i - depth - 1 >= 0:
            assert started > events.index(("finish", i - depth - 1))


class CpuStaging:
    """HostStaging's interface on the CPU (bf16 up, a deferred wait back), checking that no slot is written while
    a task using it is still in flight."""

    def __init__(self, slots):
        self.slots, self.busy, self.uploads = slots, set(), 0

    def upload(self, host, slot):
        assert 0 <= slot < self.slots and slot not in self.busy
        self.busy.add(slot)
        self.uploads += 1
        return host.to(torch.bfloat16)

    def download(self, device, slot):
        def wait():
            self.busy.remove(slot)
            return device.clone()

        return wait


@pytest.mark.parametrize("depth", [1, 2])
def test_staged_pipeline_takes_the_same_steps_as_the_plain_loop(monkeypatch, depth):
    """The offloaded path's order (momentum of i+1 before i's result is applied) and its bf16 upload change no
    number: Newton-Schulz casts to bf16 first."""
    losses, params = {}, {}
    for staged in (False, True):
        if staged:
            monkeypatch.setattr(muon_module, "HostStaging", CpuStaging)
            monkeypatch.setattr(muon_module, "needs_staging", lambda p: True)
        model = tiny_llama()
        opt = build_optimizer(
            {"optimizer": "muon", "lr": 0.02, "weight_decay": 0.01},
            parameter_groups(model, by_role=True, no_decay=False, purpose="test"),
        )
        opt.pipeline_depth = depth
        losses[staged] = train(model, opt.step, opt.zero_grad, updates=3)
        params[staged] = [p.detach().clone() for p in model.parameters()]
        assert (opt._staging is not None) == staged
    assert opt._staging.uploads == 3 * len(opt._matrices()) and not opt._staging.busy
    assert losses[True] == losses[False]
    for a, b in zip(params[True], params[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("momentum_dtype", ["fp32", "bf16"])
def test_plan_counts_muon_state_as_the_optimizer_holds_it(momentum_dtype):
    """toolkit-plan's optimizer-state bytes for --optimizer muon: one momentum per matrix (4 or 2 bytes a value),
    AdamW's step and two fp32 moments on the rest; against the tensors a real step leaves."""
    import dataclasses

    from toolkit.config.components import MuonConfig
    from toolkit.plan.measure import state_bytes
    from toolkit.plan.memory import optimizer_state_bytes
    from toolkit.plan.model_stats import param_infos
    from toolkit.plan.setup import Setup

    model = tiny_llama()
    opt = build_optimizer(
        {"optimizer": "muon", "lr": 0.02, "muon_momentum_dtype": momentum_dtype},
        parameter_groups(model, by_role=True, no_decay=False, purpose="test"),
    )
    train(model, opt.step, opt.zero_grad, updates=1)
    fields = {f.name: None for f in dataclasses.fields(Setup)}
    setup = Setup(**dict(fields, optimizer="muon", optimizer_options=MuonConfig(muon_momentum_dtype=momentum_dtype)))
    infos = param_infos(model, with_roles=True)
    assert {i.role for i in infos} == {"matrix", "embedding", "output", "norm"}
    planned = sum(optimizer_state_bytes(setup, i, i.shape) for i in infos)
    assert planned == state_bytes(model, opt)["optimizer"]
    as_adam = sum(optimizer_state_bytes(dataclasses.replace(setup, optimizer="adam"), i, i.shape) for i in infos)
    assert planned < as_adam


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    from tests.helpers import dist_helpers

    return dist_helpers.make_lm_data_bin(str(tmp_path_factory.mktemp("decay_groups") / "bin"))


@pytest.mark.parametrize(
    "saved, resumed, fix",
    [
        (
            ["--weight-decay", "0.1"],
            ["--weight-decay", "0.1", "--no-decay-norms-biases-embeddings"],
            "resume with --decay-all-parameters as saved",
        ),
        (
            ["--weight-decay", "0.1", "--no-decay-norms-biases-embeddings"],
            ["--weight-decay", "0.1"],
            "resume with --no-decay-norms-biases-embeddings --weight-decay 0.1 as saved",
        ),
        (
            [
                "--optimizer",
                "muon",
                "--weight-decay",
                "0.1",
                "--no-decay-norms-biases-embeddings",
                "--use-sharded-state",
            ],
            ["--optimizer", "muon", "--weight-decay", "0.1", "--use-sharded-state"],
            "resume with --no-decay-norms-biases-embeddings --weight-decay 0.1 as saved",
        ),
    ],
    ids=["adam_flat_to_groups", "adam_groups_to_flat", "muon_sharded_groups_lose_their_0"],
)
def test_resume_refuses_other_weight_decay_groups(data_bin, tmp_path, saved, resumed, fix):
    """A resume whose decay flags regroup the parameters: one line naming the flag (torch would raise a traceback
    or a DCP key error, or load the checkpoint's decay where the group count still matches)."""
    from tests.helpers.statefuls import resume, train_and_save

    train_and_save(data_bin, str(tmp_path), *saved)
    with pytest.raises(UserError) as refused:
        resume(data_bin, str(tmp_path), *resumed)
    message = str(refused.value)
    assert "\n" not in message and fix in message and "--reset-optimizer" in message
    trainer, _, _ = resume(data_bin, str(tmp_path), *resumed, "--reset-optimizer")
    assert trainer.num_updates == 2 and not trainer.optimizer.state
    trainer, _, _ = resume(data_bin, str(tmp_path), *saved)  # the checkpoint's own flags still resume it
    assert trainer.num_updates == 2 and trainer.optimizer.state


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from tests.helpers.dist_helpers import one_rank_cpu_mesh

    yield from one_rank_cpu_mesh(str(tmp_path_factory.mktemp("muon_pg")))


def test_staged_sharded_matrices_take_the_plain_step(mesh, monkeypatch):
    """The staged path of a DTensor (its host shard uploaded, rebuilt on the mesh, gathered, orthogonalized,
    scattered, downloaded) against the plain path, on a 1-rank gloo mesh with the CPU stand-in for the GPU."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    shapes = [(24, 16), (16, 24), (24, 16)]
    weights = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
    update = distribute_tensor(grads[0][0], mesh, [Shard(0)])
    staged = muon_module.start_orthogonalization(update, 5, 0, CpuStaging(2), slot=1)()
    assert torch.equal(staged, muon_module.orthogonalized_update(update, 5, 0))
    assert torch.equal(staged, muon_module.newton_schulz(grads[0][0], 5))
    params = {}
    for staging in (False, True):
        if staging:
            monkeypatch.setattr(muon_module, "HostStaging", CpuStaging)
            monkeypatch.setattr(muon_module, "needs_staging", lambda p: True)
        ps = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
        opt = muon_module.Muon([{"params": ps, "role": "matrix"}], lr=0.02, weight_decay=0.01)
        for step_grads in grads:
            for p, grad in zip(ps, step_grads):
                p.grad = distribute_tensor(grad, mesh, [Shard(0)])
            opt.step()
        assert (opt._staging is not None) == staging
        params[staging] = [p.full_tensor() for p in ps]
    for a, b in zip(params[True], params[False]):
        assert torch.equal(a, b)


def test_a_stack_of_expert_matrices_takes_each_matrix_own_muon_step():
    """A MoE layer's [E, out, in] expert weights: Muon's step equals the step of E separate 2-D matrices (each
    orthogonalized alone, the learning rate adjusted by one matrix's shape, not the stack's)."""
    from toolkit.optim.muon import Muon

    torch.manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 8, 5))
    apart = [torch.nn.Parameter(m.detach().clone()) for m in stack]
    grads = torch.randn(2, 3, 8, 5)
    together = Muon([{"params": [stack], "role": "matrix"}], lr=0.02, weight_decay=0.1)
    separate = Muon([{"params": apart, "role": "matrix"}], lr=0.02, weight_decay=0.1)
    for g in grads:
        stack.grad = g.clone()
        for p, part in zip(apart, g):
            p.grad = part.clone()
        together.step()
        separate.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in apart]), rtol=0, atol=0)
    assert not torch.equal(stack.detach()[0], apart[1].detach())
