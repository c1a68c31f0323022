"""The JSON Schema keywords xgrammar would silently ignore are found (and so refused with a
400) wherever they sit, and nothing else is."""

from __future__ import annotations

import pytest

from paged.sampling.params import StructuredOutputsParams
from paged.sampling.schema_limits import unenforced
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
