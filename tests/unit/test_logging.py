"""Logging: fairseq-format lines (json/simple), metrics aggregation, state, TensorBoard, MFU."""

import io
import json
import logging
import math
import os
import re
from collections import OrderedDict

import pytest
import torch

from toolkit.logging import meters as meters_mod
from toolkit.logging import metrics, progress_bar, setup_logging, throughput
from toolkit.logging import setup as logging_setup
from toolkit.logging.setup import remove_handlers
from toolkit.logging.progress_bar import close_tensorboard_writers, format_stat

LINE_RE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| INFO \| (train_inner|valid|train) \| (\{.*\})$")

FAIRSEQ_TRAIN_KEYS = [
    "loss",
    "ppl",
    "wps",
    "ups",
    "wpb",
    "bsz",
    "num_updates",
    "lr",
    "gnorm",
    "loss_scale",
    "train_wall",
    "gb_free",
    "wall",
]


class FakeClock:
    """Replaces the meters' clock so speeds and times are exact."""

    def __init__(self):
        self.t = 1000.0

    def perf_counter(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(meters_mod, "time", c)
    return c


@pytest.fixture(autouse=True)
def clean_state():
    root = logging.getLogger()
    level = root.level
    metrics.reset()
    yield
    metrics.reset()
    remove_handlers()
    root.setLevel(level)
    close_tensorboard_writers()


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def parse_json_lines(path):
    out = []
    for line in read_lines(path):
        m = LINE_RE.match(line)
        if m:
            out.append((m.group(1), json.loads(m.group(2), object_pairs_hook=OrderedDict)))
    return out


def fake_update(
    clock,
    num_updates,
    ntokens,
    bits_per_token,
    nsentences=8,
    lr=2e-05,
    grad_norm=20.7512341,
    loss_scale=4.0,
    gb_free=9.3123,
    seconds=1.0,
):
    """What a trainer does for one update (inside the train_inner aggregator)."""
    metrics.log_start_time("train_wall", priority=800, round=0)
    clock.t += seconds
    metrics.log_stop_time("train_wall")
    # criterion: summed loss in nats over ntokens tokens
    metrics.log_loss_metrics(bits_per_token * ntokens * math.log(2), ntokens, ntokens)
    metrics.log_standard_update_metrics(
        ntokens=ntokens,
        nsentences=nsentences,
        num_updates=num_updates,
        lr=lr,
        grad_norm=torch.tensor(grad_norm),
        clip_norm=0.0,
        loss_scale=loss_scale,
        gb_free=gb_free,
    )


def run_fake_epoch(tmp_path, clock, log_format="json", tensorboard_logdir=None, spec=None):
    log_file = str(tmp_path / "train.log")
    setup_logging(log_file=log_file)
    metrics.log_wall_start()
    ntokens = [1000, 3000, 2000, 2000]
    bits = [4.0, 2.0, 3.0, 5.0]
    with metrics.aggregate("train"):
        progress = progress_bar.progress_bar(
            list(range(4)), log_format=log_format, log_interval=2, epoch=1, tensorboard_logdir=tensorboard_logdir
        )
        for i, _ in enumerate(progress):
            with metrics.aggregate("train_inner"):
                fake_update(clock, i + 1, ntokens[i], bits[i])
                if spec is not None:
                    metrics.log_throughput(ntokens[i], spec)
            num_updates = i + 1
            if num_updates % 2 == 0:
                stats = metrics.get_training_stats("train_inner")
                progress.log(stats, tag="train_inner", step=num_updates)
                metrics.reset_meters("train_inner")
        # validation, as fairseq: a new root aggregator, logged per batch
        valid = progress_bar.progress_bar(
            list(range(3)),
            log_format=log_format,
            log_interval=2,
            epoch=1,
            prefix="valid on 'valid' subset",
            tensorboard_logdir=tensorboard_logdir,
        )
        with metrics.aggregate(new_root=True) as agg:
            for _ in valid:
                clock.t += 0.5
                metrics.log_loss_metrics(3.0 * 100 * math.log(2), 100, 100)
                metrics.log_batch_metrics(100, 2)
        vstats = metrics.get_valid_stats(agg.get_smoothed_values(), num_updates=4)
        valid.print(vstats, tag="valid", step=4)
    stats = metrics.get_training_stats("train")
    progress.print(stats, tag="train", step=4)
    metrics.reset_meters("train")
    return log_file


# --- JSON lines --------------------------------------------------------------------------


def test_json_lines_match_fairseq(tmp_path, clock):
    log_file = run_fake_epoch(tmp_path, clock)
    lines = parse_json_lines(log_file)
    assert [tag for tag, _ in lines] == ["train_inner", "train_inner", "valid", "train"]
    assert len(lines) == len(read_lines(log_file))  # every line has the fairseq shape

    (_, first), (_, second), (_, valid), (_, train) = lines
    assert list(first) == ["epoch", "update"] + FAIRSEQ_TRAIN_KEYS
    assert first["epoch"] == 1 and first["update"] == 0.5  # numbers, not strings
    assert all(isinstance(v, str) for k, v in first.items() if k not in ("epoch", "update"))
    # interval 1: loss weighted by sample size (4*1000 + 2*3000) / 4000 = 2.5 bits
    assert first == OrderedDict(
        [
            ("epoch", 1),
            ("update", 0.5),
            ("loss", "2.5"),
            ("ppl", "5.66"),
            ("wps", "3000"),
            ("ups", "1"),
            ("wpb", "2000"),
            ("bsz", "8"),
            ("num_updates", "2"),
            ("lr", "2e-05"),
            ("gnorm", "20.751"),
            ("loss_scale", "4"),
            ("train_wall", "2"),
            ("gb_free", "9.3"),
            ("wall", "2"),
        ]
    )
    # interval 2 after reset_meters("train_inner"): only updates 3 and 4
    assert second["update"] == 1.0
    assert (second["loss"], second["ppl"], second["wps"], second["wpb"], second["num_updates"]) == (
        "4",
        "16",
        "2000",
        "2000",
        "4",
    )
    assert (second["train_wall"], second["wall"]) == ("2", "4")

    assert valid == OrderedDict(
        [
            ("epoch", 1),
            ("valid_loss", "3"),
            ("valid_ppl", "8"),
            ("valid_wps", "200"),
            ("valid_wpb", "100"),
            ("valid_bsz", "2"),
            ("valid_num_updates", "4"),
        ]
    )

    assert list(train) == ["epoch"] + ["train_" + k for k in FAIRSEQ_TRAIN_KEYS]
    # epoch: (4*1000 + 2*3000 + 3*2000 + 5*2000) / 8000 = 3.25 bits; wps counts updates 2-4 (7000 tokens)
    # from update 1 (t=1 s) to the end of validation (t=5.5 s)
    assert train["train_loss"] == "3.25" and train["train_ppl"] == "9.51"
    assert train["train_wps"] == f"{round(7000 / 4.5, 1):g}" == "1555.6"
    assert train["train_ups"] == "0.67"
    assert train["train_wpb"] == "2000" and train["train_train_wall"] == "4" and train["train_wall"] == "6"


def test_json_line_example_format(tmp_path, clock):
    """The example line of fairseq's README-style logs, byte for byte after the timestamp."""
    log_file = str(tmp_path / "log.txt")
    setup_logging(log_file=log_file)
    metrics.log_wall_start()
    clock.t += 6.0
    with metrics.aggregate("train"):
        bar = progress_bar.progress_bar(list(range(100000)), log_format="json", log_interval=1, epoch=1)
        for _ in bar:
            with metrics.aggregate("train_inner"):
                fake_update(
                    clock, 1, 16384, 16.4751234, lr=2e-05, grad_norm=20.7512, loss_scale=4.0, gb_free=9.3, seconds=99.2
                )
            bar.log(metrics.get_training_stats("train_inner"), tag="train_inner", step=1)
            break
    (line,) = read_lines(log_file)
    expected = (
        '| INFO | train_inner | {"epoch": 1, "update": 0.0, "loss": "16.475", "ppl": "91097.5", '
        '"wps": "0", "ups": "0", "wpb": "16384", "bsz": "8", "num_updates": "1", "lr": "2e-05", '
        '"gnorm": "20.751", "loss_scale": "4", "train_wall": "99", "gb_free": "9.3", "wall": "105"}'
    )
    assert line[len("2021-03-08 12:31:36 ") :] == expected
    assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line)


def test_format_stat_like_fairseq():
    assert format_stat(round(16.4751234, 3)) == "16.475"
    assert format_stat(round(2**16.4751234, 2)) == "91097.5"
    assert format_stat(2e-05) == "2e-05"
    assert format_stat(0.0005) == "0.0005"
    assert format_stat(16384.0) == "16384"
    assert format_stat(16384) == "16384"
    assert format_stat(1234567) == "1.23457e+06"  # fairseq's "{:g}" quirk, kept
    assert format_stat(round(0.0, 1)) == "0"
    assert format_stat("abc") == "abc"


def test_our_keys_come_after_fairseq_keys(tmp_path, clock):
    spec = throughput.ThroughputSpec(flops_per_token=6e6, peak_flops=1e12, world_size=2)
    log_file = run_fake_epoch(tmp_path, clock, spec=spec)
    (_, first), (_, second), (_, valid), (_, train) = parse_json_lines(log_file)
    assert list(first) == ["epoch", "update"] + FAIRSEQ_TRAIN_KEYS + ["tps", "mfu"]
    assert list(train)[-3:] == ["train_wall", "train_tps", "train_mfu"]
    assert "valid_tps" not in valid
    # tokens/s per device = wps / world_size; mfu% = 100 * tps * flops_per_token / peak
    assert first["tps"] == "1500"
    assert first["mfu"] == f"{round(100 * 1500 * 6e6 / 1e12, 2):g}" == "0.9"


# --- simple / none / tqdm -------------------------------------------------------------------


def test_simple_format_lines(tmp_path, clock):
    log_file = run_fake_epoch(tmp_path, clock, log_format="simple")
    lines = read_lines(log_file)
    head = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| INFO \| "
    assert re.match(
        head + r"train_inner \| epoch 001:      2 / 4 loss=2\.5, ppl=5\.66, wps=3000, ups=1, wpb=2000, "
        r"bsz=8, num_updates=2, lr=2e-05, gnorm=20\.751, loss_scale=4, train_wall=2, gb_free=9\.3, "
        r"wall=2$",
        lines[0],
    ), lines[0]
    assert re.match(head + r"train_inner \| epoch 001:      4 / 4 loss=4, ", lines[1]), lines[1]
    assert re.match(
        head + r"valid \| epoch 001 \| valid on 'valid' subset \| loss 3 \| ppl 8 \| wps 200 \| "
        r"wpb 100 \| bsz 2 \| num_updates 4$",
        lines[2],
    ), lines[2]
    assert re.match(head + r"train \| epoch 001 \| loss 3\.25 \| ppl 9\.51 \| ", lines[3]), lines[3]


def test_none_and_tqdm_formats(tmp_path):
    setup_logging(log_file=str(tmp_path / "x.log"))
    bar = progress_bar.progress_bar([1, 2, 3], log_format="none", epoch=1)
    assert list(bar) == [1, 2, 3]
    bar.log({"loss": 1.0}, tag="train_inner", step=1)
    bar.print({"loss": 1.0}, tag="train")
    tq = progress_bar.progress_bar([1, 2], log_format="tqdm", epoch=2)  # not a tty here: simple
    assert type(tq).__name__ in ("SimpleProgressBar", "TqdmProgressBar")
    assert list(tq) == [1, 2]
    with pytest.raises(ValueError):
        progress_bar.progress_bar([1], log_format="xml")
    assert read_lines(str(tmp_path / "x.log")) == []


def test_logger_name_restored_and_rank_levels(tmp_path):
    from toolkit.logging.progress_bar import logger as bar_logger

    setup_logging(log_file=str(tmp_path / "r0.log"))
    bar = progress_bar.progress_bar([1], log_format="json", epoch=1)
    bar.print({"loss": 1.0}, tag="valid")
    assert bar_logger.name == "toolkit.logging.progress_bar"
    assert logging.getLogger().level == logging.INFO
    setup_logging(log_file=str(tmp_path / "r1.log"), rank=1)
    assert logging.getLogger().level == logging.WARNING
    bar.print({"loss": 1.0}, tag="valid")  # not written on rank 1
    assert not os.path.exists(tmp_path / "r1.log")
    assert len(read_lines(str(tmp_path / "r0.log"))) == 1


# --- metrics aggregation ----------------------------------------------------------------------


def test_weighted_average_priorities_and_derived():
    with metrics.aggregate("a") as agg:
        metrics.log_scalar("z_late", 1.0, priority=50)
        metrics.log_scalar("loss", 2.0, weight=1, round=3)
        metrics.log_scalar("loss", 5.0, weight=3, round=3)
        metrics.log_scalar("lr", 0.1, weight=0, priority=300)
        metrics.log_scalar("lr", 0.2, weight=0, priority=300)
        metrics.log_derived("double", lambda m: m["loss"].avg * 2)
        metrics.log_scalar("_hidden", 1.0)
        metrics.log_scalar_sum("count", 2, priority=60)
        metrics.log_scalar_sum("count", 3, priority=60)
    vals = metrics.get_smoothed_values("a")
    assert list(vals) == ["loss", "double", "z_late", "count", "lr"]
    assert vals["loss"] == 4.25 and vals["double"] == 8.5 and vals["lr"] == 0.2 and vals["count"] == 5
    assert agg is metrics.get_meters("a")
    assert metrics.get_smoothed_value("a", "loss") == 4.25
    assert isinstance(metrics.get_meter("a", "loss"), meters_mod.AverageMeter)
    assert metrics.get_meter("nope", "loss") is None


def test_nested_aggregators_new_root_and_reset():
    with metrics.aggregate("train"):
        for step in range(4):
            with metrics.aggregate("train_inner"):
                metrics.log_scalar("x", float(step))
            if step == 1:
                assert metrics.get_smoothed_values("train_inner")["x"] == 0.5
                metrics.reset_meters("train_inner")
        with metrics.aggregate(new_root=True) as tmp:
            metrics.log_scalar("x", 100.0)
        assert tmp.get_smoothed_values()["x"] == 100.0
    assert metrics.get_smoothed_values("train_inner")["x"] == 2.5
    assert metrics.get_smoothed_values("train")["x"] == 1.5
    assert metrics.get_smoothed_values("default")["x"] == 1.5  # new_root bypassed default too
    metrics.reset_meters("train")
    assert metrics.get_smoothed_values("train")["x"] is None
    metrics.log_scalar("y", 1.0)  # outside: default only
    assert "y" not in metrics.get_meters("train")
    assert [type(a) for a in metrics.get_active_aggregators()] == [meters_mod.MetersDict]


def test_aggregate_as_decorator_and_exception_safety():
    @metrics.aggregate("valid")
    def step(v):
        metrics.log_scalar("v", v)

    step(1.0)
    step(3.0)
    assert metrics.get_smoothed_values("valid")["v"] == 2.0
    with pytest.raises(RuntimeError):
        with metrics.aggregate("boom"):
            raise RuntimeError("x")
    assert len(metrics.get_active_aggregators()) == 1


def test_speed_and_stopwatch(clock):
    with metrics.aggregate("t"):
        metrics.log_speed("wps", 100, round=1)  # first call only starts the clock
        clock.t += 2
        metrics.log_speed("wps", 100, round=1)
        metrics.log_speed("wps", 300, round=1)
        metrics.log_start_time("wall_time", round=0)
        clock.t += 1.4
        metrics.log_stop_time("wall_time")
    assert metrics.get_smoothed_values("t")["wps"] == round(400 / 3.4, 1)
    assert metrics.get_smoothed_values("t")["wall_time"] == 1.0


def test_loss_metrics_sentence_avg_and_zero_sample_size():
    with metrics.aggregate("c"):
        metrics.log_loss_metrics(10 * math.log(2), sample_size=2, ntokens=5)  # --sentence-avg
    vals = metrics.get_smoothed_values("c")
    assert list(vals) == ["loss", "nll_loss", "ppl"]
    assert vals["loss"] == 5.0 and vals["nll_loss"] == 2.0 and vals["ppl"] == 4.0
    with metrics.aggregate("z"):
        metrics.log_loss_metrics(0.0, 0, 0)
    assert metrics.get_smoothed_values("z")["loss"] == 0.0
    assert metrics.get_perplexity(2000.0) == float("inf")


def test_update_metrics_clip_and_nonfinite():
    with metrics.aggregate("u"):
        metrics.log_update_metrics(1, lr=1e-3, grad_norm=torch.tensor(2.0), clip_norm=1.0)
        metrics.log_update_metrics(2, lr=1e-3, grad_norm=0.5, clip_norm=1.0)
        metrics.log_update_metrics(3, lr=1e-3, grad_norm=float("inf"), clip_norm=1.0)
    vals = metrics.get_smoothed_values("u")
    assert list(vals) == ["ups", "num_updates", "lr", "gnorm", "clip"]
    assert vals["clip"] == 50.0 and vals["gnorm"] == 1.25 and vals["num_updates"] == 3
    assert isinstance(vals["gnorm"], float)


# --- state -------------------------------------------------------------------------------------


def test_state_dict_round_trip_weights_only(tmp_path, clock):
    metrics.log_wall_start()
    with metrics.aggregate("train"):
        with metrics.aggregate("train_inner"):
            metrics.log_scalar("loss", torch.tensor(3.0), weight=2, round=3)
            metrics.log_derived("ppl", lambda m: 2 ** m["loss"].avg)
            metrics.log_speed("wps", 10.0)
            clock.t += 1
            metrics.log_speed("wps", 10.0)
            metrics.log_start_time("train_wall", priority=800, round=0)
            clock.t += 2
            metrics.log_stop_time("train_wall")
            metrics.log_scalar_sum("n", 4)
            metrics.log_scalar("lr", 1e-4, weight=0, priority=300)
    before = metrics.get_smoothed_values("train")
    path = tmp_path / "m.pt"
    torch.save({"metrics": metrics.state_dict()}, path)
    loaded = torch.load(path, map_location="cpu", weights_only=True)["metrics"]

    metrics.reset()
    metrics.load_state_dict(loaded)
    after = metrics.get_smoothed_values("train")
    assert list(after) == [k for k in before if k != "ppl"]  # derived meters are not saved
    assert after == {k: v for k, v in before.items() if k != "ppl"}
    clock.t += 3
    assert metrics.get_meter("default", "wall").elapsed_time == pytest.approx(6.0)  # the wall clock continues
    with metrics.aggregate("train"):
        metrics.log_scalar("loss", 5.0, weight=2, round=3)
        metrics.log_scalar("bsz", 1.0, priority=190)
    assert list(metrics.get_smoothed_values("train")) == ["loss", "n", "wps", "bsz", "lr", "train_wall"]
    assert metrics.get_smoothed_values("train")["loss"] == 4.0


# --- TensorBoard -------------------------------------------------------------------------------


def test_tensorboard_scalars(tmp_path, clock):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    run_fake_epoch(tmp_path, clock, tensorboard_logdir=tb)
    close_tensorboard_writers()
    assert sorted(os.listdir(tb)) == ["train", "train_inner", "valid"]

    def scalars(tag):
        ea = EventAccumulator(os.path.join(tb, tag))
        ea.Reload()
        return {key: [(e.step, e.value) for e in ea.Scalars(key)] for key in ea.Tags()["scalars"]}

    inner = scalars("train_inner")
    assert inner["loss"] == [(2, 2.5), (4, 4.0)]
    assert inner["wpb"] == [(2, 2000.0), (4, 2000.0)]
    assert [s for s, _ in inner["lr"]] == [2, 4] and inner["lr"][0][1] == pytest.approx(2e-05)
    assert "num_updates" not in inner
    assert scalars("valid")["loss"] == [(4, 3.0)]
    assert scalars("train")["ppl"] == [(4, pytest.approx(9.51))]


# --- throughput / MFU ------------------------------------------------------------------------------


def test_cpu_peak_flops_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "_cpu_peak_cache", {})
    peak = throughput.measure_cpu_peak_flops(torch.float32, threads=1, duration=0.2)
    assert 1e8 < peak < 1e13  # 0.1 GFLOP/s .. 10 TFLOP/s for one CPU thread
    assert torch.get_num_threads() >= 1

    def no_measurement(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(throughput, "measure_matmul_flops", no_measurement)
    assert throughput.measure_cpu_peak_flops(torch.float32, threads=1) == peak  # this process's cache
    monkeypatch.setattr(throughput, "_cpu_peak_cache", {})  # a later run on this machine: the file
    assert throughput.measure_cpu_peak_flops(torch.float32, threads=1) == peak
    kept = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert [entry["flops"] for entry in kept.values()] == [peak]
    with pytest.raises(AssertionError, match="measured again"):  # another thread count is another entry
        throughput.measure_cpu_peak_flops(torch.float32, threads=2)


def test_cpu_peak_cache_cut_short_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "_cpu_peak_cache", {})
    (tmp_path / "cpu_peak.json").write_text('{"half a fi')
    monkeypatch.setattr(throughput, "measure_matmul_flops", lambda *a, **k: 5e10)
    assert throughput.measure_cpu_peak_flops(torch.float32, threads=1) == 5e10
    assert [e["flops"] for e in json.loads((tmp_path / "cpu_peak.json").read_text()).values()] == [5e10]


def test_gpu_datasheet_peaks():
    peak = throughput.gpu_datasheet_peak_flops
    assert peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756e12)
    assert peak("NVIDIA H200", torch.float16) == pytest.approx(989.4e12)
    assert peak("NVIDIA GH200 480GB", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == pytest.approx(312e12)
    assert peak("NVIDIA A100-SXM4-80GB", torch.float32) == pytest.approx(19.5e12)
    assert peak("NVIDIA A100-SXM4-80GB", torch.float32, allow_tf32=True) == pytest.approx(156e12)
    assert peak("Tesla V100-SXM2-16GB", torch.float16) == pytest.approx(125e12)
    assert peak("Tesla V100-SXM2-16GB", torch.bfloat16) is None
    assert peak("NVIDIA A10", torch.bfloat16) == pytest.approx(125e12)
    assert peak("NVIDIA L4", torch.bfloat16) == pytest.approx(121e12)
    assert peak("NVIDIA L40S", torch.bfloat16) == pytest.approx(362.05e12)
    assert peak("Some Future GPU", torch.bfloat16) is None


def test_mfu_and_cpu_peak_share():
    assert throughput.mfu(50e12, 100e12) == 0.5
    assert throughput.mfu(1.0, None) is None
    # two processes on one machine each get half of the peak measured with both their threads
    assert throughput.per_process_cpu_peak(200e9, 2) == 100e9
    assert throughput.per_process_cpu_peak(200e9, 0) == 200e9


# --- the CLI's ways of calling ------------------------------------------------------------------


def test_valid_metrics_logged_once_from_totals(tmp_path, clock):
    """Validation that sums its batches and logs once gives fairseq's per-batch numbers."""
    log_file = str(tmp_path / "v.log")
    setup_logging(log_file=log_file)
    bar = progress_bar.progress_bar(list(range(3)), log_format="json", epoch=2, prefix="valid on 'valid' subset")
    with metrics.aggregate("train"):
        with metrics.aggregate(new_root=True) as agg:
            for _ in bar:
                clock.t += 0.5  # three batches of 100 tokens, 2 sentences
            metrics.log_loss_metrics(3.0 * 300 * math.log(2), 300, 300)
            metrics.log_valid_metrics(ntokens=300, nsentences=6, num_batches=3)
        bar.print(metrics.get_valid_stats(agg.get_smoothed_values(), 7, best=2.5), tag="valid", step=7)
    assert "wpb" not in metrics.get_meters("train")
    ((tag, valid),) = parse_json_lines(log_file)
    assert tag == "valid"
    assert valid == OrderedDict(
        [
            ("epoch", 2),
            ("valid_loss", "3"),
            ("valid_ppl", "8"),
            ("valid_wps", "200"),
            ("valid_wpb", "100"),
            ("valid_bsz", "2"),
            ("valid_num_updates", "7"),
            ("valid_best_loss", "2.5"),
        ]
    )


def test_wall_clock_always_present(clock):
    metrics.reset()  # the wall clock starts with the metrics
    clock.t += 7
    assert round(metrics.get_meter("default", "wall").elapsed_time, 0) == 7
    metrics.log_wall_start()  # restart, as fairseq's trainer does
    clock.t += 2
    with metrics.aggregate("train_inner"):
        metrics.log_scalar("loss", 1.0, round=3)
    assert metrics.get_training_stats("train_inner") == OrderedDict([("loss", 1.0), ("wall", 2.0)])
    assert metrics.get_training_stats({"a": 1}) == OrderedDict([("a", 1), ("wall", 2.0)])


def test_grouped_iterator_and_module_paths():
    from toolkit.data.iterators import CountingIterator, GroupedIterator
    from toolkit.logging.setup import setup_logging as setup_from_module

    assert setup_from_module is setup_logging
    itr = CountingIterator(range(5), start=3, total=8)  # resumed after one update of 3 batches
    grouped = GroupedIterator(itr, 3)
    assert len(grouped) == 3 and grouped.n == 1
    bar = progress_bar.progress_bar(grouped, log_format="json", epoch=1)
    assert list(bar) == [[0, 1, 2], [3, 4]]
    assert bar.i == 2 and grouped.n == 3 and not grouped.has_next()
    assert progress_bar.progress_bar(list(range(2)), log_format="none").__class__.__name__ == "NoopProgressBar"


# ---- errors raised inside a log write ----------------------------------------------------------------


def log_to_a_stream_raising(error: Exception) -> None:
    """The toolkit's console handler, writing to a stream whose every write raises ``error``."""
    logging_setup.setup_logging(None)
    handler = [h for h in logging.getLogger().handlers if isinstance(h, logging_setup.StreamHandler)][0]

    class Raising(io.StringIO):
        def write(self, s):
            raise error

    handler.setStream(Raising())


def test_a_dataloader_error_raised_inside_a_log_write_reaches_the_caller(capsys):
    log_to_a_stream_raising(RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed."))
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        logging.getLogger("x").info("hello")
    logging_setup.remove_handlers()
    assert "Logging error" not in capsys.readouterr().err


def test_other_write_errors_stay_logging_errors(capsys):
    log_to_a_stream_raising(ValueError("closed"))
    logging.getLogger("x").info("hello")  # logging's own handling: reported, not raised
    logging_setup.remove_handlers()
    assert "Logging error" in capsys.readouterr().err
