"""benchmarks/gemm_peak.py on the CPU (--dry-run: small shapes): the FP8 operands' layout and scales
give the right product, and the script runs end to end. The peaks themselves need a GPU."""

import torch
from capabilities import needs_cpu_fp8_gemm
from script_loader import load_benchmark_script


def _script():
    return load_benchmark_script("gemm_peak.py")


@needs_cpu_fp8_gemm
def test_fp8_operands_and_product():
    script = _script()
    operands = script.fp8_operands(64, 48, 32, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert operands.a.shape == (64, 32) and operands.b.shape == (32, 48)
    assert operands.a.dtype == operands.b.dtype == torch.float8_e4m3fn
    assert operands.b.stride() == (1, 32)  # column-major: the transpose of a row-major [N, K]
    assert operands.scale_a.shape == (64, 1) and operands.scale_b.shape == (1, 48)
    assert operands.product(use_fast_accum=False).dtype == torch.bfloat16
    assert script.check_fp8_product(operands, rows=32) < 0.02


@needs_cpu_fp8_gemm
def test_dry_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _script().main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "bf16 matmul" in out and "use_fast_accum=True" in out and "TFLOP/s median" in out
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_refuses_a_machine_without_fp8(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _script().main(["--out", "unused.json"]) == 2
    assert "compute capability 8.9" in capsys.readouterr().err


@needs_cpu_fp8_gemm
def test_decode_rows_dry_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _script().main(["--dry-run", "--decode-rows", "4,16"]) == 0
    out = capsys.readouterr().out
    assert "qkv [384, 256] x 4 rows: Fp8Linear" in out and "down [256, 512] x 16 rows" in out
    assert "a decoder layer's linears at 16 rows" in out
    assert list(tmp_path.iterdir()) == []
