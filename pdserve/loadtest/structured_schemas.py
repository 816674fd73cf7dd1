"""Five small JSON schemas for the compile-time figures of ``pdserve bench structured``."""

BENCH_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "number"}, {"type": "string"}]},
                                      "n": {"type": "object", "properties": {"x": {"type": "boolean"}}}}},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 4, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "price": {"type": "number", "minimum": 0}},
        "required": ["id", "price"]}}}, "required": ["items"]},
]
