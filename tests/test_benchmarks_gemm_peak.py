"""benchmarks/gemm_peak.py on the CPU (--dry-run: small shapes): the FP8 operands' layout and scales
give the right product, and the script runs end to end. The peaks themselves need a GPU."""

import sys
import time

import torch
from script_loader import load_benchmark_script


def _script():
    return load_benchmark_script("gemm_peak.py")


def test_fp8_operands_and_product():
    script = _script()
    operands = script.fp8_operands(64, 48, 32, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert operands.a.shape == (64, 32) and operands.b.shape == (32, 48)
    assert operands.a.dtype == operands.b.dtype == torch.float8_e4m3fn
    assert operands.b.stride() == (1, 32)  # column-major: the transpose of a row-major [N, K]
    assert operands.scale_a.shape == (64, 1) and operands.scale_b.shape == (1, 48)
    assert operands.product(use_fast_accum=False).dtype == torch.bfloat16
    assert script.check_fp8_product(operands, rows=32) < 0.02


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


def test_parse_smi_samples_skips_what_it_cannot_read():
    text = "1395, 552.46\n[N/A], 77.0\n\n1980, 85.27\ngarbage\n"
    assert _script().parse_smi_samples(text) == [(1395.0, 552.46), (1980.0, 85.27)]


def _fake_smi(tmp_path, lines):
    """An executable that prints `lines` in a loop, as `nvidia-smi --loop-ms` does, until killed."""
    path = tmp_path / "fake-smi"
    path.write_text("#!" + sys.executable + "\nimport time\nwhile True:\n"
                    + "".join(f"    print({line!r}, flush=True)\n" for line in lines) + "    time.sleep(0.01)\n")
    path.chmod(0o755)
    return str(path)


def test_clock_sampler_summarises_what_the_sampler_printed(tmp_path):
    script = _script()
    sampler = script.GpuClockSampler(0, executable=_fake_smi(tmp_path, ["1350, 500.5", "1395, 552.4"]))
    timing = script.TimingOptions(repeats=2, iters=2, warmup=1)
    a = torch.randn(64, 64)
    figures = script.measure_tflops(lambda: time.sleep(0.03) or a @ a, 2.0 * 64 ** 3, torch.device("cpu"), timing,
                                    sampler)
    clocks = figures["clocks"]
    assert clocks["samples"] >= 2
    assert (clocks["sm_mhz_min"], clocks["sm_mhz_max"]) == (1350.0, 1395.0)
    assert clocks["power_w_max"] == 552.4
    assert "SM 1350-1395 MHz, up to 552 W" in script._line("bf16 matmul", figures)
    assert sampler._process is None  # the sampler was stopped


def test_clock_sampler_without_the_executable(tmp_path):
    sampler = _script().GpuClockSampler(0, executable=str(tmp_path / "no-such-smi"))
    with sampler:
        pass
    assert sampler.summary() == {"samples": 0, "note": f"{tmp_path / 'no-such-smi'} not found"}
