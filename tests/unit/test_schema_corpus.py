"""The structured-output corpus (bench/schemas): valid schemas, valid examples, and what llguidance compiles.

Read by path: tests may not import the benchmarks."""

import json
from pathlib import Path

import jsonschema
import llguidance
import pytest

CORPUS = Path(__file__).parents[2] / "bench" / "schemas"
FILES = sorted(CORPUS.glob("*.json"))
ENTRY_KEYS = {"name", "title", "source", "schema", "expect", "example"}


def entry(path: Path) -> dict:
    return json.loads(path.read_text())


def llguidance_verdict(schema: dict) -> tuple[bool, list[str]]:
    """(is_error, messages) of compiling ``schema`` the way a server would (whitespace not flexible)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    return llguidance.LLMatcher.validate_grammar_with_warnings(grammar)


def test_corpus_has_at_least_55_schemas_with_unique_names():
    names = [entry(p)["name"] for p in FILES]
    assert len(FILES) >= 55
    assert len(set(names)) == len(names)
    assert [p.name[:3] for p in FILES] == [f"{k:02d}_" for k in range(1, len(FILES) + 1)]


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_entry_is_a_valid_schema_with_a_valid_example(path):
    e = entry(path)
    assert set(e) == ENTRY_KEYS
    assert e["name"].replace("_", "").isalnum() and len(e["name"]) <= 64
    assert e["expect"] == "enforced" or e["expect"].startswith("unsupported:")
    validator = jsonschema.validators.validator_for(e["schema"])
    validator.check_schema(e["schema"])
    validator(e["schema"], format_checker=validator.FORMAT_CHECKER).validate(e["example"])


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_llguidance_compiles_exactly_the_entries_marked_enforced(path):
    e = entry(path)
    is_error, messages = llguidance_verdict(e["schema"])
    if e["expect"] == "enforced":
        assert not is_error, messages
    else:
        keyword = e["expect"].removeprefix("unsupported:")
        assert is_error, f"{path.name} compiles: mark it enforced"
        assert keyword in messages[0]


def test_corpus_covers_the_features_apps_use():
    text = "\n".join(json.dumps(entry(p)["schema"]) for p in FILES)
    for feature in ['"minItems"', '"maxItems"', '"enum"', '"const"', '"anyOf"', '"oneOf"', '"$ref"', '"$defs"',
                    '"pattern"', '"minLength"', '"maxLength"', '"minimum"', '"maximum"', '"exclusiveMinimum"',
                    '"additionalProperties": false', '"type": ["string", "null"]', '"type": "integer"',
                    '"type": "number"']:
        assert feature in text, feature
    for fmt in ["date", "date-time", "time", "email", "uuid", "uri", "ipv4"]:
        assert f'"format": "{fmt}"' in text, fmt
    recursive = [p.name for p in FILES for k, d in entry(p)["schema"].get("$defs", {}).items()
                 if f'"#/$defs/{k}"' in json.dumps(d)]
    assert recursive, "no recursive $defs"
    unsupported = [entry(p)["expect"] for p in FILES if entry(p)["expect"] != "enforced"]
    assert 3 <= len(unsupported) <= 6
