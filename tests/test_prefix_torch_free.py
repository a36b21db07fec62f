"""prefix/, the attention planner and workloads.py must never import torch (docs/design.md,
"Architecture"); the import contracts in pyproject.toml say the same statically."""

import subprocess
import sys

CODE = """
import sys
sys.modules['torch'] = None  # any 'import torch' now raises ImportError
import batchllm.prefix
import batchllm.perf.workloads
import batchllm.cli.analyze
plan = batchllm.prefix.plan_prefix_groups([[1, 2, 3], [1, 2, 4]])
assert plan.saved_num_tokens == 2
from batchllm.attention_plan.work_list import build_prefix_shared_plan
attention = build_prefix_shared_plan([0, 3, 4], [3, 4], [0, 3], [[0, 0], [0, 1]], [0, 0], [True, False], block_size=16,
                                     num_kv_heads=1, num_heads=2, kv_split_tokens=16)
assert attention.work.shape[0] > 0 and attention.num_tokens == 4
assert not any(name.startswith('torch') and sys.modules[name] is not None for name in sys.modules)
print('ok')
"""


def test_prefix_planner_and_workloads_run_without_torch():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
