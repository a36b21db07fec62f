"""prefix/ and workloads.py must never import torch (docs/design.md, "Architecture")."""

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
assert not any(name.startswith('torch') and sys.modules[name] is not None for name in sys.modules)
print('ok')
"""


def test_prefix_and_workloads_import_without_torch():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
