"""StructuredOutputsParams -> an xgrammar Grammar (no vocabulary needed: the check made when a
request is prepared, and the input of the compile)."""

from __future__ import annotations

import json
import re

import xgrammar

from batchllm.sampling_params import StructuredOutputsParams
from batchllm.structured.errors import StructuredOutputError

# xgrammar's messages start with a time and its source file: "[02:32:12] /project/cpp/x.cc:94: "
_MESSAGE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


def build_grammar(spec: StructuredOutputsParams) -> xgrammar.Grammar:
    """The grammar of a structured output; StructuredOutputError names the field and xgrammar's reason."""
    try:
        return _build(spec)
    except (RuntimeError, ValueError) as error:
        message = _MESSAGE_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else "")
        raise StructuredOutputError(f"{spec.source}: invalid {_what(spec)}: {message or type(error).__name__}") from None


def _what(spec: StructuredOutputsParams) -> str:
    if spec.kind == "grammar":
        return "EBNF grammar" if is_ebnf(spec.grammar) else "Lark grammar"
    return _WHAT[spec.kind]


def is_ebnf(grammar: str) -> bool:
    """GBNF/EBNF rules are written `name ::= ...`; a grammar without "::=" is read as Lark (`name: ...`)."""
    return "::=" in grammar


def _build(spec: StructuredOutputsParams) -> xgrammar.Grammar:
    any_whitespace = not spec.disable_any_whitespace
    if spec.json is not None:
        # strict_mode: properties and items the schema does not name are never generated.
        return xgrammar.Grammar.from_json_schema(spec.json, any_whitespace=any_whitespace, strict_mode=True)
    if spec.json_object:
        return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                 strict_mode=False)
    if spec.regex is not None:
        return xgrammar.Grammar.from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
        return xgrammar.Grammar.from_ebnf(f"root ::= {alternatives}")
    if is_ebnf(spec.grammar):
        return xgrammar.Grammar.from_ebnf(spec.grammar)
    return xgrammar.Grammar.from_lark(spec.grammar)
