"""End-to-end benchmark: several policies in ONE process on the same model (`batchllm bench`);
runner.py runs it, the other modules are torch-free except hf_peer.py and plot.py (matplotlib)."""
