"""``benchmarks/gpu.sh --dry-run``: every GPU figure's entry, run on the CPU with tiny shapes.

A GPU session has minutes of device time; an entry that fails on a flag that no longer parses, a
preset that moved, or a log line ``benchmarks.figure`` no longer finds would waste them. The dry
run is the same entry (same script, same flags, the same JSON line) with tiny shapes appended and
the flags that need a GPU (``--compile``, ``--fp8``, ``--fp8-experts``) dropped. Entries whose CPU commands then
coincide (the float8 recipes, OLMoE eager, compiled and with float8 experts) run once and share that log.
``plan_calibration`` reads the recorded GPU sessions' lines (``benchmarks/results/gpu_figures_*.jsonl``) and
plans their layouts again; ``gpu.sh --print`` gives each entry's GPU command. The figures go to two
``gpu.sh --dry-run`` invocations side by side, each family of entries in one of them so that shared runs stay
shared. An entry's time on tiny shapes is mostly its interpreter's imports: the dry runs' ``python3``
(``TOOLKIT_PY``) is tests/helpers/fork_python.py, which forks each ``-m`` command from one process that imported
torch and the toolkit once (the memory-measured entries, under ``benchmarks.peak_memory``, start real interpreters).
"""

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.helpers import processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_SH = os.path.join(ROOT, "benchmarks", "gpu.sh")


def _start_dry_run(folder, data_bin, entries, python_env=None):
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        DATA=str(data_bin),
        GPU_LOG_DIR=str(folder / "logs"),
        GPU_RESULTS=str(folder),
        TOOLKIT_PY=sys.executable,
        PYTHONPATH=ROOT,
    )
    env.update(python_env or {})
    env.pop("OUT", None)
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:  # files: no pipe to fill
        return processes.start(
            ["bash", GPU_SH, "--dry-run", *entries], cwd=str(folder), env=env, stdout=out, stderr=err
        )


def _finish_dry_run(proc, folder):
    proc.wait(timeout=900)
    out, err = (folder / "stdout").read_text(), (folder / "stderr").read_text()
    results = folder / "gpu_figures.jsonl"
    lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), lines


def _dry_run(tmp_path, data_bin, *entries):
    return _finish_dry_run(_start_dry_run(tmp_path, data_bin, entries), tmp_path)


def _two_halves(listed):
    """The entries in two lists of about equal length, each family (the name's first word) whole."""
    families = {}
    for name in listed:
        families.setdefault(name.split("_")[0], []).append(name)
    halves = ([], [])
    for family in sorted(families.values(), key=len, reverse=True):
        min(halves, key=len).extend(family)
    return halves


@pytest.fixture
def forked_python(tmp_path):
    """The environment of ``TOOLKIT_PY`` for the dry runs: tests/helpers/fork_python.py, whose server (killed with
    the test) has imported the toolkit once; its ``-m`` commands fork from it instead of importing it again each."""
    from tests.helpers import fork_python

    with fork_python.serving(str(tmp_path)) as env:
        yield env


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory, wikitext_dir):
    from tests.helpers.lm_fixtures import make_wikitext_data_bin

    path = tmp_path_factory.mktemp("gpu_sh") / "data-bin"
    make_wikitext_data_bin(str(path), wikitext_dir, max_train_lines=200, max_valid_lines=20)
    return path


def test_every_figure_runs_on_cpu_with_tiny_shapes(tmp_path, data_bin, forked_python):
    listed = subprocess.run(["bash", GPU_SH, "--list"], capture_output=True, text=True, check=True).stdout.split()
    assert {"offload_13", "mfu_xl", "fp8_d4096_tensorwise", "decode_xl", "profile_13", "plan_calibration"} <= set(
        listed
    )
    assert {"moe_olmoe_fp8", "moe_olmoe_profile", "decode_llama3_1b_hf"} <= set(listed)
    halves = _two_halves(listed)
    started = [_start_dry_run(tmp_path / str(i), data_bin, half, forked_python) for i, half in enumerate(halves)]
    lines, logs = [], {}
    for i, (proc, half) in enumerate(zip(started, halves)):
        done, half_lines = _finish_dry_run(proc, tmp_path / str(i))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert [line["figure"] for line in half_lines] == half  # one JSON line per figure, in order
        lines += half_lines
        logs.update({name: (tmp_path / str(i) / "logs" / f"{name}.log").read_text() for name in half})
    assert sorted(line["figure"] for line in lines) == sorted(listed)
    shared = {name for name, log in logs.items() if "the same command on the CPU as" in log}
    # GPU-only flags apart, these ran the command of another entry
    assert shared == {"fp8_d4096_tensorwise", "fp8_d4096_rowwise", "moe_olmoe_compile", "moe_olmoe_fp8"}
    for line in lines:
        assert line["rc"] == 0 and line["dry_run"] and line["command"], line
        check_line(line)
    by_name = {line["figure"]: line for line in lines}
    assert by_name["mfu_xl_fsdp"]["result"]["ddp_backend"] == "fully_sharded"
    assert by_name["fp8_d4096_bf16"]["result"]["arch"] == "llama3_8b"
    assert by_name["moe_olmoe"]["result"]["arch"] == "olmoe_1b_7b"
    assert by_name["cp_llama3_1b_32k"]["result"]["batch_size"] == 2  # the dry run's shapes win


def check_line(line):
    """What each kind of entry's line holds (beyond its status)."""
    name, result = line["figure"], line.get("result", {})
    if "offload" in name:  # toolkit-train under peak_memory, with --plan
        assert line["updates"] == 2 and line["words_per_s"] > 0, line
        assert line["plan"].startswith("0.00B params") and line["params"] > 0, line
        assert line["peak_host_gib"] > 0 and line["host_bytes_per_param"] > 0, line
    elif name == "decode_xl":
        assert result["benchmark"] == "generate" and result["rows"][0]["batch"] == 1, line
    elif name == "decode_llama3_1b_hf":  # both sides timed on the same tiny Llama
        assert result["benchmark"] == "decode_vs_transformers", line
        assert set(result["contestants"]) == {"toolkit", "transformers"} and result["ratios"]["transformers"] == 1
    elif name == "profile_13":  # the host side of an offloaded 8-bit update (no GPU rows on a CPU)
        assert result["benchmark"] == "offload_profile" and result["adam_state_precision"] == "8bit", line
        assert result["cpu_adam_s"] > 0 and 0 < result["fused_8bit_s"] <= result["moments_s"] <= result["cpu_adam_s"]
        assert result["gpu_compute_s"] == 0 and result["h2d_bytes"] == 0
    elif name == "plan_calibration":  # the recorded H200 sessions: 13B, the MoE slice and llama3_1b's cpu_adam
        assert result["benchmark"] == "plan_calibration", line
        assert {r["figure"] for r in result["layouts"]} >= {"offload_13", "moe_30b_a3b_offload"}, result["layouts"]
        fit = result["fits"]["NVIDIA H200"]
        assert fit["host_link_gbps"] > 0 and fit["cpu_adam_gparams"] > 0 and fit["layouts"] >= 3, fit
    elif name == "pipeline_schedules":  # 2 gloo CPU ranks: each stage's live peak beside the plan's
        assert result["benchmark"] == "pipeline_schedules" and len(result["rows"]) == 2, line
        assert all(r["measured"] > 0 and r["planned"] > 0 for r in result["rows"]), line
    else:
        assert result["benchmark"] == "train_step" and result["layers"] == 2 and result["tokens_per_s"] > 0, line


def test_print_gives_each_entry_its_gpu_command():
    """``gpu.sh --print`` (plan_calibration's source for lines older than their ``command``): the GPU command,
    its flags as given (--compile kept), nothing run."""
    printed = subprocess.run(
        ["bash", GPU_SH, "--print", "offload_13", "moe_olmoe_fp8"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(printed) == 2
    offload, moe = (shlex.split(line) for line in printed)
    assert offload[offload.index("--arch") + 1] == "transformer_lm_gpt3_13" and "toolkit_cli.train" in offload
    assert offload[offload.index("--adam-betas") + 1] == "(0.9, 0.98)"  # quoted so that it reads back whole
    assert {"--compile", "--fp8-experts"} <= set(moe) and moe[moe.index("--device") + 1] == "cuda"
    unknown = subprocess.run(["bash", GPU_SH, "--print", "nope"], capture_output=True, text=True)
    assert unknown.returncode == 1 and "no figure named nope" in unknown.stderr


def test_an_unknown_figure_fails_in_one_line(tmp_path, data_bin):
    done, lines = _dry_run(tmp_path, data_bin, "no_such_figure")
    assert done.returncode == 1 and lines == []
    assert "no figure named no_such_figure" in done.stderr
