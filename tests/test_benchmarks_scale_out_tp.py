"""benchmarks/scale_out_tp.py helpers on the CPU."""

from script_loader import load_benchmark_script


def test_busy_time_is_the_union_of_kernel_spans():
    busy_us = load_benchmark_script("scale_out_tp.py").busy_us
    assert busy_us([]) == 0.0
    # overlapping (a collective on its own stream beside a GEMM), nested, touching and apart
    spans = [(10.0, 20.0), (15.0, 30.0), (16.0, 18.0), (30.0, 35.0), (50.0, 55.0)]
    assert busy_us(spans) == 30.0
    assert busy_us(list(reversed(spans))) == 30.0
