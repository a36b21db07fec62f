"""The error of a structured output that cannot be followed (torch-free)."""

from __future__ import annotations


class StructuredOutputError(ValueError):
    """A schema, regex or grammar the grammar library refuses, or a model that cannot follow one;
    the message names the request field and the fix."""
