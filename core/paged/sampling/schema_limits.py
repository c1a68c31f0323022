"""The JSON Schema keywords xgrammar accepts but does not enforce, found before a request runs.

xgrammar 0.2.9 compiles these into a grammar that ignores them (a log line at most), so an
output could break the schema the client sent. A request field is honoured or refused: such
a schema is refused with a 400 naming the keyword and where it is (as vLLM refuses them under
its xgrammar backend). What is found (each checked against xgrammar's grammar in
tests/structured/test_schema_limits.py): `multipleOf` on a number (an integer's is enforced),
`minLength` / `maxLength` beside a `pattern` or `format`, `uniqueItems: true`, `allOf` with
more than one branch, `not`, `if` / `then` / `else`, `contains` (min/maxContains),
`dependentRequired` / `dependentSchemas` / `dependencies`, a `$ref` outside the schema (not
"#..."), and `oneOf` whose branches may overlap: xgrammar enforces oneOf as anyOf, which is
exact only when no value matches two branches. That is taken as proven when the branches are
all `const` / `enum` with disjoint values, all typed with disjoint `type`s (integer is a
number), or all objects requiring one property whose `const` / `enum` values are disjoint (a
tagged union); local `$ref` branches are followed. Any other oneOf of two or more branches is
refused.

Also here: `malformed`, the shape checks xgrammar skips (an unreferenced `$defs: [1]` compiles),
and `rebase_refs`, which keeps a schema's `$ref`s pointing at the right place once the schema is
nested in another (tool_choice "required").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# where a schema keeps subschemas: {name: schema}, one schema, or [schema, ...]
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "contains",
               "propertyNames", "if", "then", "else", "unevaluatedItems",
               "unevaluatedProperties")  # fmt: skip
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")


def unenforced(schema: Any, path: str = "", root: Any = None) -> Iterator[tuple[str, str]]:
    """(where, what) for each keyword of `schema` that xgrammar would not enforce; `where` is
    a dotted path from the schema's root ("" for the root itself)."""
    if not isinstance(schema, dict):
        return
    root = schema if root is None else root
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield path, f"'$ref' to {ref[:100]!r} (only refs within the schema, '#...', are resolved)"
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
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of, root):
        yield path, "'oneOf' whose branches may overlap (it is enforced as anyOf)"
    for key in ("not", "if", "contains", "minContains", "maxContains", "dependentRequired",
                "dependentSchemas", "dependencies"):  # fmt: skip
        if key in schema:
            yield path, f"'{key}'"
    for key in _SCHEMA_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                yield from unenforced(sub, _join(path, f"{key}.{name}"), root)
    for key in _SCHEMA_ONE:
        yield from unenforced(schema.get(key), _join(path, key), root)
    for key in _SCHEMA_LISTS:
        subs = schema.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                yield from unenforced(sub, f"{_join(path, key)}[{i}]", root)


def _deref(schema: Any, root: Any) -> Any:
    """`schema`, its local `$ref` followed (a few hops); None where it cannot be."""
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str):
            return schema
        if not ref.startswith("#"):
            return None
        schema = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(schema, dict) or part not in schema:
                return None
            schema = schema[part]
    return None


def _values(schema: Any) -> set[str] | None:
    """The JSON values a schema's `const` / `enum` allows (as canonical text), else None."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        vals = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        vals = schema["enum"]
    else:
        return None
    # numbers compare as numbers (1 == 1.0), booleans apart from them
    return {json.dumps(float(v) if type(v) is int else v, sort_keys=True) for v in vals}


def _types(schema: Any) -> set[str] | None:
    t = schema.get("type") if isinstance(schema, dict) else None
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if types and "integer" in types:  # an integer is a number
        types.add("number")
    return types or None


def _pairwise_disjoint(sets: list[set[str] | None]) -> bool:
    seen: set[str] = set()
    for s in sets:
        if s is None or s & seen:
            return False
        seen |= s
    return True


def _disjoint(branches: list[Any], root: Any) -> bool:
    """No JSON value can match two of `branches` (see the module's docstring)."""
    subs = [_deref(b, root) for b in branches]
    if _pairwise_disjoint([_values(s) for s in subs]):
        return True
    if _pairwise_disjoint([_types(s) for s in subs]):
        return True
    if not all(isinstance(s, dict) and isinstance(s.get("required"), list) for s in subs):
        return False
    common = set.intersection(*(set(s["required"]) for s in subs))
    return any(
        _pairwise_disjoint([_values(_deref(s.get("properties", {}).get(k), root)) for s in subs])
        for k in sorted(common)
    )


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
