"""JSON schemas for the structured-output tests: small (a 135M model answers each within ~80 tokens), covering
nested objects, arrays with minItems/maxItems, enums, patterns, anyOf, numbers with bounds. Strings carry a
maxLength so a greedy answer cannot run past the token budget."""

from __future__ import annotations

S = {"type": "string", "maxLength": 12}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: dict[str, dict] = {
    "person": obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "city": obj({"city": S, "country": S}),
    "boolean flag": obj({"ok": {"type": "boolean"}}),
    "integer bounds": obj({"n": {"type": "integer", "minimum": 10, "maximum": 20}}),
    "number exclusive bounds": obj({"x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    "negative integer": obj({"t": {"type": "integer", "maximum": -1, "minimum": -50}}),
    "enum of strings": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "enum of numbers": obj({"size": {"enum": [1, 2, 3]}}),
    "const": obj({"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 9}}),
    "pattern hex colour": obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    "pattern date": obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    "pattern code": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}),
    "array exact two": obj({"xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                   "minItems": 2, "maxItems": 2}}),
    "array one to three strings": obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    "array of enums": obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1,
                                    "maxItems": 3}}),
    "array of booleans": obj({"bits": {"type": "array", "items": {"type": "boolean"}, "minItems": 3,
                                       "maxItems": 3}}),
    "array of objects": obj({"items": {"type": "array", "maxItems": 2, "minItems": 1, "items": obj(
        {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}})}}),
    "nested object": obj({"user": obj({"name": S, "admin": {"type": "boolean"}})}),
    "nested twice": obj({"a": obj({"b": obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})}),
    "anyOf number or string": obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, S]}}),
    "anyOf objects": obj({"shape": {"anyOf": [obj({"r": {"type": "integer", "minimum": 1, "maximum": 9}}),
                                              obj({"w": {"type": "integer", "minimum": 1, "maximum": 9},
                                                   "h": {"type": "integer", "minimum": 1, "maximum": 9}})]}}),
    "nullable": obj({"note": {"anyOf": [S, {"type": "null"}]}}),
    "type list": obj({"id": {"type": ["integer", "null"], "minimum": 0, "maximum": 999}}),
    "optional property": obj({"name": S, "nick": S}, required=["name"]),
    "no required": obj({"a": {"type": "integer", "minimum": 0, "maximum": 9}}, required=[]),
    "string length bounds": obj({"word": {"type": "string", "minLength": 3, "maxLength": 5}}),
    "top-level array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2, "maxItems": 4},
    "top-level enum": {"enum": ["yes", "no", "maybe"]},
    "top-level integer": {"type": "integer", "minimum": 100, "maximum": 200},
    "top-level string pattern": {"type": "string", "pattern": "^[a-z]{2,6}$"},
    "defs and ref": {"$defs": {"pt": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
                     **obj({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}})},
    "mixed record": obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                         "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]}, "minItems": 1,
                                    "maxItems": 2}, "rating": {"type": "number", "minimum": 0, "maximum": 10}}),
}
