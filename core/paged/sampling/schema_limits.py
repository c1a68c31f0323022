"""The JSON Schema keywords xgrammar accepts but does not enforce, found before a request runs.

xgrammar 0.2.9 compiles these into a grammar that ignores them (a log line at most), so an
output could break the schema the client sent. A request field is honoured or refused: such
a schema is refused with a 400 naming the keyword and where it is (as vLLM refuses them under
its xgrammar backend). What is found (each checked against xgrammar's grammar in
tests/structured/test_schema_limits.py): `multipleOf` on a number (an integer's is enforced),
`minLength` / `maxLength` beside a `pattern` or `format`, `uniqueItems: true`, `allOf` with
more than one branch, `not`, `if` / `then` / `else`, and `contains` (min/maxContains).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# where a schema keeps subschemas: {name: schema}, one schema, or [schema, ...]
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "contains",
               "propertyNames", "if", "then", "else", "unevaluatedItems",
               "unevaluatedProperties")  # fmt: skip
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")


def unenforced(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(where, what) for each keyword of `schema` that xgrammar would not enforce; `where` is
    a dotted path from the schema's root ("" for the root itself)."""
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "multipleOf" in schema and "number" in types:
        yield path, "'multipleOf' on a number (an integer's is enforced)"
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    beside = [k for k in ("pattern", "format") if k in schema]
    if lengths and beside:
        yield path, f"'{lengths[0]}' beside '{beside[0]}'"
    if schema.get("uniqueItems") is True:
        yield path, "'uniqueItems' (a grammar cannot compare items)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield path, "'allOf' with more than one branch (only one is enforced)"
    for key in ("not", "if", "contains", "minContains", "maxContains"):
        if key in schema:
            yield path, f"'{key}'"
    for key in _SCHEMA_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                yield from unenforced(sub, _join(path, f"{key}.{name}"))
    for key in _SCHEMA_ONE:
        yield from unenforced(schema.get(key), _join(path, key))
    for key in _SCHEMA_LISTS:
        subs = schema.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                yield from unenforced(sub, f"{_join(path, key)}[{i}]")


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part
