"""Batch input parsing and output writing (OpenAI Batch format), torch-free."""
