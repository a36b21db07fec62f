"""Scale-out: tensor parallelism on one host and prefix-aware data parallelism.

- tensor parallelism (torch.distributed: NCCL on GPU, gloo on CPU): `tp_engine.TPEngine`,
  `sharding.shard_model` / `sharding.load_shard`, `layers` (row-parallel linear, vocab-parallel
  embedding, gathered LM head), `step_broadcast` (one packed int64 tensor per step).
- data parallelism: `dp_plan.assign_groups` (torch-free: global plan -> whole groups per replica,
  longest-processing-time first) and `ray_dp` (Ray actors, optional extra `batchllm[ray]`).

Nothing here is imported by the single-GPU engine.
"""
