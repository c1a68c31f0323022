"""The JSON Schema keywords xgrammar would silently ignore are found (and so refused with a
400) wherever they sit, and nothing else is."""

from __future__ import annotations

import pytest

from paged.sampling.params import StructuredOutputsParams
from paged.sampling.schema_limits import malformed, unenforced
from paged.sampling.structured import check_spec

TAGS = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}}


def test_each_ignored_keyword_is_found_where_it_is():
    schema = {"type": "object", "properties": {"tags": TAGS, "ratio": {"type": "number",
              "multipleOf": 0.5}, "ids": {"type": "array", "uniqueItems": True}},
              "$defs": {"d": {"anyOf": [{"type": "string", "format": "email",
                                         "minLength": 3}]}}}  # fmt: skip
    found = [where for where, _ in unenforced(schema)]
    assert found == ["properties.tags.items", "properties.ratio", "properties.ids",
                     "$defs.d.anyOf[0]"]  # fmt: skip


def test_what_xgrammar_enforces_passes():
    fine = {"type": "object", "properties": {
        "pattern": {"type": "integer", "multipleOf": 3},  # a property named like a keyword
        "name": {"type": "string", "maxLength": 8},  # a length without a pattern
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "set": {"type": "array", "uniqueItems": False}}}  # fmt: skip
    assert list(unenforced(fine)) == []


def test_check_spec_names_the_field_and_the_place():
    import json

    sp = StructuredOutputsParams(json=json.dumps({"type": "object", "properties": {"t": TAGS}}))
    with pytest.raises(ValueError, match=r"^guided_json: at properties\.t\.items: 'maxLength' "
                       r"beside 'pattern': .*cannot enforce it"):  # fmt: skip
        check_spec(sp, "guided_json")


def test_malformed_shapes_are_found_where_they_are():
    """What xgrammar would skip (an unreferenced `$defs: [1]` compiles) or our own walks would
    trip on: refused, with where it is."""
    cases = [
        ({"type": "object", "$defs": [1]}, "$defs"),
        ({"definitions": {"X": 3}}, "definitions.X"),
        ({"properties": {"a": {"items": [{"anyOf": {}}]}}}, "properties.a.items[0].anyOf"),
        ({"$ref": 5}, "$ref"),
        ({"required": "a"}, "required"),
        ({"not": "x"}, "not"),
        ([1], ""),
    ]
    assert [(malformed(s) or ("ok",))[0] for s, _ in cases] == [w for _, w in cases]
    fine = {"type": "object", "properties": {"required": {"type": "string"}, "a": True},
            "$defs": {"X": {"anyOf": [{"$ref": "#/$defs/X"}, False]}}, "items": [{}]}  # fmt: skip
    assert malformed(fine) is None
    sp = StructuredOutputsParams(json={"type": "object", "$defs": {"X": 3}})
    with pytest.raises(ValueError, match=r"^guided_json: invalid JSON schema: at \$defs\.X: "):
        check_spec(sp, "guided_json")


IGNORED = [  # (schema, JSON the schema does not allow but xgrammar's grammar takes)
    ({"type": "number", "multipleOf": 0.5}, "0.3"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"'),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
     "7"),
    ({"not": {"type": "integer"}}, "1"),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 3}}, "[1]"),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}, "3"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "3"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"$ref": "http://example.com/x.json"}}},
     '{"a": 1}'),
]  # fmt: skip


def test_one_of_is_refused_unless_its_branches_are_disjoint():
    """oneOf is enforced as anyOf: exact only where no value matches two branches."""
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}
    dog = {"type": "object", "properties": {"kind": {"enum": ["dog"]}, "n": {}},
           "required": ["kind", "n"]}  # fmt: skip
    fine = [
        {"oneOf": [{"type": "string"}]},
        {"oneOf": [{"const": 1}, {"enum": ["1", True]}]},
        {"oneOf": [{"type": "string", "maxLength": 3}, {"type": ["integer", "null"]}]},
        {"$defs": {"Cat": cat, "Dog": dog},
         "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]},
    ]  # fmt: skip
    assert [list(unenforced(s)) for s in fine] == [[]] * len(fine)
    overlap = [
        {"oneOf": [{"const": 1}, {"enum": [1.0, 2]}]},
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        {"oneOf": [cat, cat | {"required": ["kind", "n"]}]},
        {"oneOf": [{"type": "string"}, {"minimum": 1}]},
    ]
    assert [[w for w, _ in unenforced(s)] for s in overlap] == [[""]] * len(overlap)


def test_external_refs_are_refused():
    sp = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"$ref": "other.json#/x"}}})  # fmt: skip
    with pytest.raises(ValueError, match=r"^guided_json: at properties\.a: '\$ref' to "
                       r"'other\.json#/x'"):  # fmt: skip
        check_spec(sp, "guided_json")


@pytest.mark.parametrize(("schema", "wrong"), IGNORED)
def test_what_is_refused_is_what_xgrammar_ignores(schema, wrong):
    """Each refused keyword, compiled anyway, gives a grammar that takes JSON the schema does
    not allow: the refusal is needed (if xgrammar learns one, this says so)."""
    import json

    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    assert list(unenforced(schema))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert _is_grammar_accept_string(grammar, wrong)
