"""Torch-free scheduling: requests, KV block pool, policies and the SchedulerOutput contract."""
