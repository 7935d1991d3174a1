"""What a request's structured-output fields become: one engine StructuredOutputsParams, whichever spelling the
client used. All of these are accepted, in OpenAI and native jobs alike (native: under sampling_params):
- OpenAI's `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}} ({"type": "text"}: no constraint);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object"};
- the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` that worker-vllm users still send.
At most one may be given. The params' `field` is the request field's dotted path, so a schema that does not
compile fails its request with a 400 naming that field."""

from __future__ import annotations

import json
from typing import Any

from engine import InvalidRequestError, StructuredOutputsParams
from handler.schemas import JobError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)


def structured_params(values: dict[str, Any], where: str) -> StructuredOutputsParams | None:
    """The constraint the request's fields ask for (None: none). `values` maps field names to the request's values."""
    given = [(k, v) for k, v in values.items() if k in FIELDS and v is not None]
    given = [(k, v) for k, v in given if not (k == "response_format" and v.get("type") in (None, "text"))]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(f"{where}.{k}" for k, _ in given)
        raise JobError(f"give one structured-output constraint, not several ({names})", param=f"{where}.{given[0][0]}")
    key, value = given[0]
    field = f"{where}.{key}"
    try:
        if key == "response_format":
            return _response_format(value, field)
        if key == "structured_outputs":
            if not isinstance(value, dict):
                raise JobError(f"{field} must be an object such as {{'json': {{...}}}}", param=field)
            unknown = set(value) - {"json", "regex", "choice", "grammar", "json_object"}
            if unknown:
                raise JobError(f"{field}: unknown keys {sorted(unknown)}", param=field)
            return StructuredOutputsParams(**value, field=field)
        return StructuredOutputsParams(
            **{GUIDED[key]: _schema(value, field) if key == "guided_json" else value}, field=field
        )
    except InvalidRequestError as e:
        raise JobError(str(e), param=field) from None
    except TypeError as e:
        raise JobError(f"{field}: {e}", param=field) from None


def _response_format(rf: dict, field: str) -> StructuredOutputsParams:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, field=field)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise JobError(f"{field}.json_schema needs a 'schema' (a JSON schema object)", param=field)
        return StructuredOutputsParams(json=_schema(spec["schema"], field), field=field)
    raise JobError(f"{field}.type must be text, json_object or json_schema, not {kind!r}", param=field)


def _schema(schema: Any, field: str) -> dict:
    """A JSON schema given as an object or as its text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise JobError(f"{field}: the schema is not valid JSON: {e}", param=field) from None
    if not isinstance(schema, dict):
        raise JobError(f"{field}: the schema must be a JSON object", param=field)
    return schema
