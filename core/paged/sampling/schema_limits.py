"""The JSON Schema keywords xgrammar accepts but does not enforce, found before a request runs.

xgrammar 0.2.9 compiles these into a grammar that ignores them (a log line at most), so an
output could break the schema the client sent. A request field is honoured or refused: such
a schema is refused with a 400 naming the keyword and where it is (as vLLM refuses them under
its xgrammar backend). What is found (each checked against xgrammar's grammar in
tests/structured/test_schema_limits.py): `multipleOf` on a number (an integer's is enforced),
`minLength` / `maxLength` beside a `pattern` or `format`, `uniqueItems: true`, `allOf` with
more than one branch, `not`, `if` / `then` / `else`, and `contains` (min/maxContains).

Also here: `malformed`, the shape checks xgrammar skips (an unreferenced `$defs: [1]` compiles),
and `rebase_refs`, which keeps a schema's `$ref`s pointing at the right place once the schema is
nested in another (tool_choice "required").
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


def malformed(schema: Any, path: str = "") -> tuple[str, str] | None:
    """(where, why) of the first part of `schema` not shaped as JSON Schema says (a subschema
    that is neither an object nor a boolean, `$defs` / `properties` / ... not an object of
    subschemas, `anyOf` / ... not an array of them, a `$ref` not a string, `required` not an
    array of strings), else None. Keyword values are xgrammar's to check."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return path, "a schema must be an object or a boolean"
    if "$ref" in schema and not isinstance(schema["$ref"], str):
        return _join(path, "$ref"), "must be a string"
    req = schema.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        return _join(path, "required"), "must be an array of property names"
    for key in _SCHEMA_MAPS:
        if key not in schema:
            continue
        if not isinstance(schema[key], dict):
            return _join(path, key), "must be an object of named schemas"
        for name, sub in schema[key].items():
            if found := malformed(sub, _join(path, f"{key}.{name}")):
                return found
    for key in _SCHEMA_LISTS:
        subs = schema.get(key)
        if key in schema and not isinstance(subs, list) and key != "items":
            return _join(path, key), "must be an array of schemas"
        for i, sub in enumerate(subs if isinstance(subs, list) else ()):
            if found := malformed(sub, f"{_join(path, key)}[{i}]"):
                return found
    for key in _SCHEMA_ONE:  # (items: one schema, or a list walked above)
        if key not in schema or isinstance(schema[key], list):
            continue
        if found := malformed(schema[key], _join(path, key)):
            return found
    return None


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` whose document-root `$ref`s ("#", "#/...") point below `base` (a
    fragment such as "#/items/anyOf/0/properties/parameters"): where the schema sits once
    nested in another. Other refs and data keywords (`const`, `enum`, ...) stay as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: rebase_refs(sub, base) for name, sub in out[key].items()}
    for key in dict.fromkeys((*_SCHEMA_ONE, *_SCHEMA_LISTS)):  # items is in both: once
        if isinstance(out.get(key), list):
            out[key] = [rebase_refs(sub, base) for sub in out[key]]
        elif key in out:
            out[key] = rebase_refs(out[key], base)
    return out


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part
