"""End-to-end benchmark: several policies in ONE process on the same model (`batchllm bench`).

  workload.py    generated workloads (micro:P:D:SD, industrial) and --input JSONL files  (no torch)
  policies.py    'NAME@SEQS/TOKENS+eager+sync' policy labels                            (no torch)
  flop_bound.py  FLOPs of a workload with optimal prefix sharing / bf16 peak             (no torch)
  runner.py      load the model once, run each policy, one row per (workload, policy)
  hf_peer.py     HF transformers `generate` (static batch, sdpa), time scaled to the workload
  markdown.py    the rows as a Markdown table                                          (no torch)
  plot.py        tokens-per-iteration timelines of step traces (matplotlib)
"""
