"""Command-line interface: `batchllm run | analyze | simulate | plot | bench`."""
