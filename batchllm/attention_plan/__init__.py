"""The attention planner (host side, numpy only, never torch): a step's per-sequence metadata ->
the work list of the prefix-shared attention kernels, its dense calls and merge lists, laid out
as one int32 buffer (docs/design.md, "Prefix-shared attention"). The device side (the plan on
the device, the SM count, the kernels) is in batchllm/ops/."""
