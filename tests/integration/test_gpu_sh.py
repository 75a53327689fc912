"""``benchmarks/gpu.sh --dry-run``: every GPU figure's entry, run on the CPU with tiny shapes.

A GPU session has minutes of device time; an entry that fails on a flag that no longer parses, a
preset that moved, or a log line ``benchmarks/figure.py`` no longer finds would waste them. The dry
run is the same entry (same script, same flags, the same JSON line) with tiny shapes appended and
the flags that need a GPU (``--compile``, ``--fp8``) dropped.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_SH = os.path.join(ROOT, "benchmarks", "gpu.sh")


def _dry_run(tmp_path, data_bin, *entries):
    env = dict(os.environ, DATA=str(data_bin), GPU_LOG_DIR=str(tmp_path / "logs"), GPU_RESULTS=str(tmp_path),
               TOOLKIT_PY=sys.executable, PYTHONPATH=ROOT)
    env.pop("OUT", None)
    done = subprocess.run(["bash", GPU_SH, "--dry-run", *entries], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=900)
    results = tmp_path / "gpu_figures.jsonl"
    lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    return done, lines


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory, wikitext_dir):
    from tests.helpers.lm_fixtures import make_wikitext_data_bin

    path = tmp_path_factory.mktemp("gpu_sh") / "data-bin"
    make_wikitext_data_bin(str(path), wikitext_dir, max_train_lines=200, max_valid_lines=20)
    return path


def test_every_figure_runs_on_cpu_with_tiny_shapes(tmp_path, data_bin):
    listed = subprocess.run(["bash", GPU_SH, "--list"], capture_output=True, text=True, check=True).stdout.split()
    assert {"offload_13", "mfu_xl", "fp8_d4096_tensorwise", "decode_xl"} <= set(listed)
    done, lines = _dry_run(tmp_path, data_bin)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line["figure"] for line in lines] == listed  # one JSON line per figure, in order
    for line in lines:
        assert line["rc"] == 0 and line["dry_run"], line
        if "offload" in line["figure"]:  # toolkit-train under peak_memory.py, with --plan
            assert line["updates"] == 2 and line["words_per_s"] > 0, line
            assert line["plan"].startswith("0.00B params") and line["params"] > 0, line
            assert line["peak_host_gib"] > 0 and line["host_bytes_per_param"] > 0, line
        elif line["figure"] == "decode_xl":
            assert line["result"]["benchmark"] == "generate" and line["result"]["rows"][0]["batch"] == 1, line
        else:
            assert "result" in line, line
            result = line["result"]
            assert result["benchmark"] == "train_step" and result["layers"] == 2 and result["tokens_per_s"] > 0
    by_name = {line["figure"]: line for line in lines}
    assert by_name["mfu_xl_fsdp"]["result"]["ddp_backend"] == "fully_sharded"
    assert by_name["fp8_d4096_bf16"]["result"]["arch"] == "llama3_8b"
    assert by_name["moe_olmoe"]["result"]["arch"] == "olmoe_1b_7b"
    assert by_name["cp_llama3_1b_32k"]["result"]["batch_size"] == 2  # the dry run's shapes win


def test_an_unknown_figure_fails_in_one_line(tmp_path, data_bin):
    done, lines = _dry_run(tmp_path, data_bin, "no_such_figure")
    assert done.returncode == 1 and lines == []
    assert "no figure named no_such_figure" in done.stderr
