"""JSON schemas of many shapes for structured-output tests (host walks, engine, server), and
the tools of the tool_choice tests with the openai client's view of their calls."""

# Random walks need bounded languages: objects close their keys (additionalProperties false)
# and strings have a maxLength or a pattern, else a walk may never end.
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "deep": {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"],
                 "additionalProperties": False}},
        "required": ["deep"], "additionalProperties": False}}, "required": ["inner"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "string", "maxLength": 12},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "boolean"},
    {"enum": ["yes", "no", 3, None]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"], "additionalProperties": False}}}, "required": ["points"],
     "additionalProperties": False},
    {"type": "object", "properties": {"opt": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["opt"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
               {"type": "string", "enum": ["none"]}]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0,
                                                "maximum": 1000}}, "required": ["price"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"const": "fixed"}, "b": {"type": "integer"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 4}, {"type": "integer"}],
     "items": False},
    {"type": "object", "properties": {"m": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer"}}}}, "required": ["m"],
     "additionalProperties": False},
    {"$defs": {"leaf": {"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": False}},
     "type": "object", "properties": {"l": {"$ref": "#/$defs/leaf"}}, "required": ["l"],
     "additionalProperties": False},
]


def bounded_integers(schema, lo=-99, hi=999):
    """A copy of ``schema`` whose integers without bounds get ``[lo, hi]``: a model (unlike the
    nudged walks of test_grammar) may repeat digits until ``max_tokens``."""
    if isinstance(schema, list):
        return [bounded_integers(s, lo, hi) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_integers(v, lo, hi) for k, v in schema.items()}
    if out.get("type") == "integer":
        out.setdefault("minimum", lo)
        out.setdefault("maximum", hi)
    return out


# What a model's outputs are checked against (engine and server tests).
MODEL_SCHEMAS = [bounded_integers(s) for s in SCHEMAS]


# Two tools with bounded arguments (a forced call always ends inside a small max_tokens).
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


async def chat_tool_calls(oa, stream: bool, **kw):
    """``([[name, arguments], ...], finish_reason, content)`` of one chat completion through
    the openai client ``oa``; streamed calls are assembled from their deltas as a client does
    (the first delta of a call has its id and name, the arguments follow in pieces)."""
    if not stream:
        choice = (await oa.chat.completions.create(**kw)).choices[0]
        return ([[c.function.name, c.function.arguments]
                 for c in choice.message.tool_calls or []], choice.finish_reason,
                choice.message.content)
    calls, finish, content = {}, None, ""
    async for chunk in await oa.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, tc.function.arguments]
                else:
                    calls[tc.index][1] += tc.function.arguments
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    return list(calls.values()), finish, content
