"""Checks that need a CUDA GPU (``pytest -m gpu``; skipped on machines without one, such as CI).

They run the GPU paths the CPU suite can only emulate: float8 matmuls on the tensor cores,
inductor's GPU kernels, FSDP2 with parameters in host memory and DeepSpeed's CPU Adam beside a GPU.
"""

import pytest
import torch

from tests.helpers.cli import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_MODEL = [
    "--decoder-embed-dim",
    "128",
    "--decoder-input-dim",
    "128",
    "--decoder-output-dim",
    "128",
    "--decoder-ffn-embed-dim",
    "512",
    "--decoder-attention-heads",
    "4",
    "--tokens-per-sample",
    "128",
    "--batch-size",
    "8",
    "--dropout",
    "0",
    "--disable-validation",
    "--log-interval",
    "5",
]


def gpu_train(data, save_dir, *extra):
    return train(data, str(save_dir), *GPU_MODEL, *extra, env={"CUDA_VISIBLE_DEVICES": "0"})


@pytest.fixture(scope="module")
def data(tmp_path_factory, wikitext_dir):
    from tests.helpers.lm_fixtures import make_wikitext_data_bin

    path = str(tmp_path_factory.mktemp("gpu") / "bin")
    make_wikitext_data_bin(path, wikitext_dir, max_train_lines=1000, max_valid_lines=40)
    return path


@pytest.fixture(autouse=True)
def on_the_gpu(monkeypatch):
    """TINY_MODEL says --cpu; these tests train on the GPU."""
    import tests.helpers.cli as helpers

    monkeypatch.setattr(helpers, "TINY_MODEL", [a for a in helpers.TINY_MODEL if a != "--cpu"])


def test_float8_matmuls_on_the_gpu_track_bf16():
    pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9+")
    from toolkit.distributed import float8
    from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

    cfg = TransformerLMConfig(
        decoder_layers=2,
        decoder_embed_dim=256,
        decoder_ffn_embed_dim=1024,
        decoder_attention_heads=4,
        decoder_normalize_before=True,
        max_target_positions=128,
        dropout=0.0,
    )
    model = TransformerLanguageModel(cfg, 512, 1, seed=0).cuda()
    reference = TransformerLanguageModel(cfg, 512, 1, seed=0).cuda()
    float8.apply_float8(model)
    tokens = torch.randint(4, 512, (4, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = model(tokens)[0].float(), reference(tokens)[0].float()
    assert (got - want).norm() / want.norm() < 0.05


def test_compiled_bf16_training_equals_eager(data, tmp_path):
    eager = gpu_train(data, tmp_path / "eager", "--bf16", "--max-update", "10", "--no-save").losses()
    compiled = gpu_train(data, tmp_path / "compiled", "--bf16", "--compile", "--max-update", "10", "--no-save").losses()
    assert sorted(eager) == sorted(compiled)
    for update, loss in eager.items():
        assert abs(compiled[update] - loss) / loss < 1e-2, (update, compiled[update], loss)


def test_fp8_training_tracks_bf16(data, tmp_path):
    pytest.importorskip("torchao.float8")
    bf16 = gpu_train(data, tmp_path / "bf16", "--bf16", "--max-update", "20", "--no-save").losses()
    fp8 = gpu_train(data, tmp_path / "fp8", "--bf16", "--fp8", "--max-update", "20", "--no-save").losses()
    for update, loss in bf16.items():
        assert abs(fp8[update] - loss) / loss < 2e-2, (update, fp8[update], loss)


def test_cpu_offload_with_cpu_adam_saves_resumes_and_evaluates(data, tmp_path):
    pytest.importorskip("deepspeed")
    from tests.helpers.cli import run_cli

    offload = [
        "--ddp-backend",
        "fully_sharded",
        "--cpu-offload",
        "--optimizer",
        "cpu_adam",
        "--fp16",
        "--checkpoint-activations",
    ]
    first = gpu_train(data, tmp_path / "ck", *offload, "--max-update", "10")
    assert "Stopping training due to num_updates: 10" in first.stdout
    resumed = gpu_train(data, tmp_path / "ck", *offload, "--max-update", "15")
    assert 15 in resumed.losses()
    run = run_cli(
        "toolkit_cli.eval_lm",
        [
            data,
            "--path",
            str(tmp_path / "ck" / "checkpoint_last.pt"),
            "--tokens-per-sample",
            "128",
            "--batch-size",
            "8",
            "--gen-subset",
            "valid",
        ],
    )
    assert run.returncode == 0 and "Perplexity" in run.stdout + run.stderr, run.stderr[-2000:]


def test_bf16_host_grads_and_8bit_moments_under_cpu_offload_track_fp32_state(data, tmp_path):
    """The 13B recipe's host-memory savings on a GPU: gradients and moments stay in host memory (a
    DTensor built on a CUDA mesh must not move its local shard to the GPU) and the losses track
    fp32 gradients and moments."""
    pytest.importorskip("deepspeed")
    offload = [
        "--ddp-backend",
        "fully_sharded",
        "--cpu-offload",
        "--optimizer",
        "cpu_adam",
        "--fp16",
        "--checkpoint-activations",
        "--max-update",
        "12",
        "--no-save",
    ]
    plain = gpu_train(data, tmp_path / "fp32", *offload).losses()
    small = gpu_train(
        data, tmp_path / "small", *offload, "--bf16-host-grads", "--adam-state-precision", "8bit"
    ).losses()
    assert sorted(small) == sorted(plain)
    for update, loss in plain.items():
        assert abs(small[update] - loss) / loss < 2e-2, (update, small[update], loss)
