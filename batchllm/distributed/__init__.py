"""Scale-out: tensor parallelism on one host and prefix-aware data parallelism (docs/scale-out.md).

Nothing here is imported by the single-GPU engine.
"""
