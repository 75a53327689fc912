"""The MoE families' toolkit-train harness (``test_moe_train``, ``test_deepseek_v3_train``): a tiny MoE run's
flags (DeepSeek-V3's router on ``moe_tiny_sigmoid``; a later ``--arch`` replaces it), the run, and the router terms
its log lines hold."""

import pytest

from tests.helpers import dist_helpers as H

UPDATES = 4
ROUTER_TERMS = ("moe_aux_loss", "moe_z_loss", "moe_max_load_0", "moe_max_load_1", "moe_dropped")
LOGGED_TERMS = ROUTER_TERMS + ("mtp_loss",)  # and the multi-token prediction loss of a run with --mtp-depth


def args(save_dir):
    """DeepSeek-V3's router (sigmoid, aux-loss-free bias with a large rate, so that it moves) and a shared expert,
    with the balance and z losses on as well."""
    return [
        "--task",
        "language_modeling",
        "--arch",
        "moe_tiny_sigmoid",
        "--moe-bias-update-rate",
        "0.05",
        "--moe-aux-loss-coef",
        "0.01",
        "--moe-z-loss-coef",
        "0.001",
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
        "--batch-size",
        "4",
        "--tokens-per-sample",
        "32",
        "--seed",
        "3",
        "--num-workers",
        "0",
        "--cpu",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--save-dir",
        str(save_dir),
        "--disable-validation",
    ]


def train(data_bin, save_dir, *flags):
    proc = H.run_train([data_bin] + args(save_dir) + list(flags), timeout=300)
    assert proc.returncode == 0, f"toolkit-train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def logged(stdout):
    """{update: {name: value}} of the train_inner lines."""
    import json

    out = {}
    for line in stdout.splitlines():
        if "| train_inner |" in line:
            record = json.loads(line.split("| train_inner |", 1)[1])
            out[int(record["num_updates"])] = {k: float(v) for k, v in record.items() if k in LOGGED_TERMS}
    return out


def assert_router_terms_match(terms, reference, updates=range(1, UPDATES + 1)):
    """The balance and z losses (and the multi-token prediction loss where logged) of every update as one process
    logged them."""
    assert sorted(terms) == list(updates)
    for u in updates:
        for name in ("moe_aux_loss", "moe_z_loss", "mtp_loss"):
            if name not in reference[u]:
                continue
            assert terms[u][name] == pytest.approx(reference[u][name], abs=2e-4), (u, name)
