"""Model code (Llama-family decoder on a flat token batch), weight loaders and tokenizers.

Nothing is imported here, so the torch-free modules (tokenizer, default_model) load without torch."""
