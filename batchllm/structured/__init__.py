"""Structured outputs: a request's JSON schema, regex, choice or grammar becomes a token mask on
every step it samples (docs/design.md, "Structured outputs"). xgrammar compiles the grammars over
the engine's vocabulary and tracks each request's position in its grammar."""
