"""Execution: SchedulerOutput -> tensors -> model -> sampled token ids."""
