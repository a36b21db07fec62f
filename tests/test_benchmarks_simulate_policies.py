"""benchmarks/simulate_policies.py on small sets: one row per workload and policy, and the batchllm
policy reaches the planner's optimal saving ratio without preemption."""

from script_loader import load_benchmark_script

from batchllm.perf.workloads import micro_workload
from batchllm.prefix.planner import plan_prefix_arrays


def test_table_rows_and_the_batchllm_optimum(tmp_path, capsys):
    script = load_benchmark_script("simulate_policies.py")
    markdown = tmp_path / "sim.md"
    assert script.main(["--num-requests", "32", "--industrial-requests", "32", "--kv-cache-tokens", "215000",
                        "--markdown", str(markdown)]) == 0
    table = markdown.read_text().splitlines()
    assert table == capsys.readouterr().out.splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert len(rows) == 7 * 3 and [row[1] for row in rows[:3]] == ["batchllm", "vllm", "sglang"]
    # micro 2000/200 sd16 (the second set): 32 requests are two groups of 16
    optimum = plan_prefix_arrays(list(micro_workload(2000, 200, 16, num_requests=32).prompts)).stats.saving_ratio
    batchllm = rows[3]
    assert batchllm[:2] == ["micro-2000/200-sd16", "batchllm"]
    assert batchllm[5] == f"{100 * optimum:.1f}%" and batchllm[7] == "0"
