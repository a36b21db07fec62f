"""A request's structured-output fields -> StructuredOutputsParams (torch-free).

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict", "description"}}) and vLLM's `structured_outputs` and `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar` all become one StructuredOutputsParams. Only
their shape is checked here; whether a schema, regex or grammar compiles is checked when the
request is prepared (batchllm/structured).
"""

from __future__ import annotations

import json

from batchllm.sampling_params import SamplingParamsError, StructuredOutputsParams, short_repr

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# vLLM's StructuredOutputsParams fields: the constraints, then options (null always counts as unset)
_STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                            "disable_additional_properties", "whitespace_pattern", "structural_tag"}


class StructuredFieldError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # "invalid_request" | "unsupported_feature"


def parse_structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The request's structured output, or None (none asked for, or response_format text)."""
    given = [name for name in STRUCTURED_FIELDS if body.get(name) is not None and not _is_text_format(name, body[name])]
    if not given:
        return None
    if len(given) > 1:
        raise StructuredFieldError("invalid_request", f"give only one of {', '.join(given)}: each constrains the "
                                   "whole answer")
    name = given[0]
    value = body[name]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        if name == "guided_json":
            return StructuredOutputsParams(json=_schema(value, name), source=name)
        if name == "guided_choice" and not isinstance(value, list):
            raise StructuredFieldError("invalid_request", f"guided_choice must be a list of strings, "
                                       f"got {short_repr(value)}")
        kind = name.removeprefix("guided_")
        return StructuredOutputsParams(**{kind: value}, source=name)
    except SamplingParamsError as error:
        raise StructuredFieldError("invalid_request", str(error)) from None


def _is_text_format(name: str, value: object) -> bool:
    return name == "response_format" and isinstance(value, dict) and value.get("type") == "text"


def _response_format(value: object) -> StructuredOutputsParams:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StructuredFieldError("invalid_request", "response_format must be an object with a type: text, "
                                   f"json_object or json_schema, got {short_repr(value)}")
    kind = value["type"]
    if kind == "structural_tag":
        raise StructuredFieldError("unsupported_feature", "response_format type structural_tag is not supported: "
                                   "use json_schema, json_object or text")
    if kind not in ("json_object", "json_schema"):
        raise StructuredFieldError("invalid_request", f"response_format type must be text, json_object or "
                                   f"json_schema, got {short_repr(kind)}")
    allowed = {"type"} if kind == "json_object" else {"type", "json_schema"}
    _no_other_keys(value, allowed, f"response_format ({kind})")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredFieldError("invalid_request", "response_format json_schema needs \"json_schema\": "
                                   "{\"name\": ..., \"schema\": {...}}")
    _no_other_keys(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema")
    if "schema" not in spec or spec["schema"] is None:
        raise StructuredFieldError("invalid_request", "response_format.json_schema has no schema: give "
                                   "\"schema\": {...} (or use type json_object for any JSON object)")
    for key, kinds, expected in (("name", str, "a string"), ("description", str, "a string"),
                                 ("strict", bool, "true or false")):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise StructuredFieldError("invalid_request", f"response_format.json_schema.{key} must be {expected}, "
                                       f"got {short_repr(spec[key])}")
    # strict true or false: the schema is enforced either way (see README, "Structured outputs").
    return StructuredOutputsParams(json=_schema(spec["schema"], "response_format.json_schema.schema"),
                                   source="response_format")


def _structured_outputs(value: object) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise StructuredFieldError("invalid_request", f"structured_outputs must be an object, got {short_repr(value)}")
    _no_other_keys(value, _STRUCTURED_OUTPUTS_KEYS, "structured_outputs")
    for key in ("whitespace_pattern", "structural_tag"):
        if value.get(key) is not None:
            raise StructuredFieldError("unsupported_feature", f"structured_outputs.{key} is not supported: remove it")
    for key in ("disable_any_whitespace", "disable_additional_properties"):
        if value.get(key) is not None and not isinstance(value[key], bool):
            raise StructuredFieldError("invalid_request", f"structured_outputs.{key} must be true or false, "
                                       f"got {short_repr(value[key])}")
    kwargs = {key: value[key] for key in ("json", "regex", "choice", "grammar", "json_object")
              if value.get(key) is not None}
    if "json" in kwargs:
        kwargs["json"] = _schema(kwargs["json"], "structured_outputs.json")
    if "choice" in kwargs and not isinstance(kwargs["choice"], list):
        raise StructuredFieldError("invalid_request", f"structured_outputs.choice must be a list of strings, "
                                   f"got {short_repr(kwargs['choice'])}")
    # disable_additional_properties: properties a schema does not name are never generated anyway.
    return StructuredOutputsParams(**kwargs, disable_any_whitespace=bool(value.get("disable_any_whitespace")),
                                   source="structured_outputs")


def _schema(value: object, name: str) -> dict:
    """A JSON schema given as an object, or as the text of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as error:
            raise StructuredFieldError("invalid_request", f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise StructuredFieldError("invalid_request", f"{name} must be a JSON schema object, got {short_repr(value)}")
    return value


def _no_other_keys(value: dict, allowed: set[str], name: str) -> None:
    unknown = sorted(key for key in value if key not in allowed)
    if unknown:
        known = ", ".join(sorted(allowed)) if len(allowed) < 5 else "json, regex, choice, grammar, json_object, ..."
        raise StructuredFieldError("invalid_request", f"{name} has unknown key {short_repr(unknown[0], 24)} "
                                   f"(known: {known})")
