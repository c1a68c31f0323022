"""Hypothesis strategies for the routes and fields request_strategies leaves out: structured
outputs (JSON schemas, regexes, grammars, choices), tools and tool choices, beam search and
prompt logprobs, Anthropic's /v1/messages and count_tokens, /v1/responses, /v1/embeddings and
the LoRA routes. Mostly plausible, with invalid specs mixed in (test_property)."""

from __future__ import annotations

from functools import partial

from hypothesis import strategies as st
from request_strategies import VOCAB, field_text, junk, surrogates
from request_strategies import field as any_field

# One time in 20 an invalid value per field (one in 10 in request_strategies): these bodies
# have many fields, and most requests should still get past validation.
field = partial(any_field, one_in=40)

text = field(field_text, surrogates, st.text())
token = field(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, 10**12, 2**70]))
max_tokens = field(st.integers(1, 4), st.sampled_from([0, -2, 10**20]), st.text(max_size=3))
booleans = field(st.booleans())
fn_name = field(
    st.sampled_from(["get_weather", "f", "a-b", "x" * 64]),
    st.sampled_from(["", "x" * 300]),
    st.text(max_size=8),
)
schema_leaf = st.sampled_from([
    {"type": "string"}, {"type": "integer"}, {"type": "number", "minimum": 3}, {"type": "null"},
    {"type": "boolean"}, {"enum": ["a", "b", 1]}, {"const": "x"}, {"type": ["string", "null"]},
    {"type": "string", "pattern": "[a-z]+"}, {"type": "string", "format": "date-time"},
    {"oneOf": [{"type": "string"}, {"type": "integer"}]}, {"not": {"type": "string"}},
    {"type": "object", "additionalProperties": False, "required": ["q"]},
    # impossible or invalid ones
    {"type": "string", "pattern": "("}, {"type": "string", "maxLength": -1}, {"type": "wizard"},
    {"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2},
    {"$ref": "#/definitions/nope"}, {"anyOf": []}, {"type": "integer", "minimum": 9, "maximum": 1},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
])  # fmt: skip
schema = st.recursive(
    schema_leaf,
    lambda inner: (
        st.fixed_dictionaries(
            {"type": st.just("object"),
             "properties": st.dictionaries(st.text(max_size=6), inner, max_size=3)},
            optional={"required": st.lists(st.text(max_size=6), max_size=3),
                      "additionalProperties": st.booleans() | inner},
        )  # fmt: skip
        | st.fixed_dictionaries({"type": st.just("array"), "items": inner})
    ),
    max_leaves=6,
)
any_schema = field(schema, junk, st.text(max_size=30))
regex = field(
    st.sampled_from(["[a-z]+", "\\d{3}", "(a|b)*c", "x{2,5}", ".*", "(?P<n>a)", "\\p{L}"]),
    st.sampled_from(["a{1000000}", "(", "[", "\\", "(?=a)", "a**", "[z-a]", "", "\\x"]),
    st.text(max_size=10),
)
grammar = field(
    st.sampled_from(['root ::= "yes" | "no"', "root ::= [a-z]+", 'root ::= ("a" | "b")* "c"']),
    st.sampled_from(["root ::= x", "", "root ::=", "::=", 'root ::= "a" root']),
    st.text(max_size=20),
)
choice = field(st.lists(text, min_size=1, max_size=3), st.sampled_from([[], [""], ["", ""]]))
json_schema_format = st.fixed_dictionaries(
    {"name": field(text)}, optional={"schema": any_schema, "strict": booleans, "description": text}
)
constraint = st.one_of(
    st.fixed_dictionaries({"response_format": field(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
        optional={"json_schema": field(json_schema_format)},
    ))}),
    st.fixed_dictionaries({"structured_outputs": field(st.fixed_dictionaries({}, optional={
        "json": any_schema, "regex": regex, "choice": choice, "grammar": grammar,
        "json_object": booleans, "disable_any_whitespace": booleans,
    }))}),
    st.fixed_dictionaries({}, optional={
        "guided_json": any_schema, "guided_regex": regex, "guided_choice": choice,
        "guided_grammar": grammar,
    }),
    st.fixed_dictionaries({}, optional={
        "allowed_token_ids": field(st.lists(token, max_size=4)),
        "bad_words": field(st.lists(text, max_size=3)),
    }),
)  # fmt: skip

tool = st.fixed_dictionaries({
    "type": field(st.just("function"), st.just("code_interpreter")),
    "function": field(st.fixed_dictionaries({"name": fn_name}, optional={
        "description": text, "parameters": any_schema, "strict": booleans})),
})  # fmt: skip
named = st.fixed_dictionaries({"name": fn_name})
tool_choice = field(
    st.sampled_from(["none", "auto", "required"])
    | st.fixed_dictionaries({"type": st.just("function"), "function": named})
)
arguments = field(st.sampled_from(['{"a": 1}', "{", "[]", "null", '"x"']))
tool_call = st.fixed_dictionaries({
    "id": field(text), "type": field(st.just("function")),
    "function": field(st.fixed_dictionaries({"name": fn_name, "arguments": arguments})),
})  # fmt: skip
part = st.fixed_dictionaries(
    {"type": field(st.just("text"), st.sampled_from(["image_url", "input_audio"])), "text": text}
)
content = field(text | st.lists(part, min_size=1, max_size=2), st.none())
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "user", "assistant"]),
         "content": content},
        optional={"name": field(text)}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "tool_calls": field(st.lists(tool_call, max_size=2))},
        optional={"content": content}),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": content, "tool_call_id": field(text)}),
    st.fixed_dictionaries(  # anything goes
        {"role": field(st.sampled_from(["system", "user", "assistant", "tool", "wizard"])),
         "content": field(text | st.none() | st.lists(part, max_size=2))},
        optional={"tool_calls": field(st.lists(tool_call, max_size=2)),
                  "tool_call_id": field(text), "reasoning_content": field(text)}),
)  # fmt: skip
template_keys = st.sampled_from(["enable_thinking", "tools", "messages", "x", "tokenize"])


def with_constraint(base: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(base, constraint).map(lambda t: {**t[0], **t[1]})


chat = with_constraint(st.fixed_dictionaries(
    {"messages": field(st.lists(message, min_size=1, max_size=3), st.just([])),
     "max_tokens": max_tokens},
    optional={
        "tools": field(st.lists(tool, max_size=2)), "tool_choice": tool_choice,
        "parallel_tool_calls": booleans, "stream": st.booleans(), "n": field(st.integers(1, 2)),
        "use_beam_search": booleans, "continue_final_message": booleans,
        "add_generation_prompt": booleans,
        "chat_template_kwargs": field(st.dictionaries(template_keys, junk, max_size=2)),
        "thinking_token_budget": field(st.integers(0, 5)),
        "prompt_logprobs": field(st.integers(0, 3)), "logprobs": booleans,
        "top_logprobs": field(st.integers(0, 3)),
        "truncate_prompt_tokens": field(st.integers(-2, 9)),
        "temperature": field(st.floats(0, 2)), "echo": booleans, "add_special_tokens": booleans,
    },
))  # fmt: skip
usage = st.fixed_dictionaries(
    {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
)
completion = with_constraint(st.fixed_dictionaries(
    {"prompt": field(text | st.lists(token, min_size=1, max_size=5)), "max_tokens": max_tokens},
    optional={
        "stream": st.booleans(), "stream_options": field(usage), "n": field(st.integers(1, 2)),
        "best_of": field(st.integers(1, 3)), "use_beam_search": booleans,
        "length_penalty": field(st.floats(-2, 2)), "prompt_logprobs": field(st.integers(0, 3)),
        "echo": booleans, "logprobs": field(st.integers(0, 3)),
        "truncate_prompt_tokens": field(st.integers(-2, 9)), "temperature": field(st.floats(0, 2)),
        "add_special_tokens": booleans,
    },
))  # fmt: skip

# ---- Anthropic /v1/messages -----------------------------------------------------------------
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text})
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}, optional={
        "cache_control": field(st.fixed_dictionaries({"type": st.just("ephemeral")}))}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": field(text), "name": fn_name, "input": junk}),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": field(text),
         "content": field(text | st.lists(text_block, max_size=2))},
        optional={"is_error": booleans}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text, "signature": text}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "document", "redacted_thinking", "wizard"])}),
)  # fmt: skip
a_message = st.fixed_dictionaries({
    "role": field(st.sampled_from(["user", "assistant"])),
    "content": field(text | st.lists(block, max_size=3)),
})  # fmt: skip
a_tool = st.fixed_dictionaries(
    {"name": fn_name},
    optional={"description": text, "input_schema": any_schema,
              "type": field(st.sampled_from(["custom", "web_search_20250305"]))},
)  # fmt: skip
a_tool_choice = st.fixed_dictionaries(
    {"type": st.sampled_from(["auto", "any", "tool", "none"])},
    optional={"name": fn_name, "disable_parallel_tool_use": booleans},
)
thinking = st.fixed_dictionaries(
    {"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
    optional={"budget_tokens": field(st.integers(0, 5000)),
              "display": field(st.sampled_from(["summarized", "omitted"]))},
)  # fmt: skip
count_tokens = st.fixed_dictionaries(
    {"model": field(st.just("tiny-llama")),
     "messages": field(st.lists(a_message, min_size=1, max_size=3))},
    optional={
        "system": field(text | st.lists(text_block, max_size=2)),
        "tools": field(st.lists(a_tool, max_size=2)), "tool_choice": field(a_tool_choice),
        "thinking": field(thinking),
    },
)  # fmt: skip
message_fields = st.fixed_dictionaries(
    {"max_tokens": max_tokens, "stream": st.booleans()},
    optional={
        "temperature": field(st.floats(0, 1)), "top_p": field(st.floats(0, 1)),
        "top_k": field(st.integers(0, 50)), "stop_sequences": field(st.lists(text, max_size=2)),
        "metadata": field(st.fixed_dictionaries({}, optional={"user_id": field(text)})),
        "output_config": field(st.fixed_dictionaries({"format": field(st.fixed_dictionaries(
            {"type": st.just("json_schema"), "schema": any_schema}))})),
    },
)  # fmt: skip
anthropic = st.tuples(count_tokens, message_fields).map(lambda t: {**t[0], **t[1]})

# ---- /v1/responses --------------------------------------------------------------------------
r_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": text}
)
r_item = st.one_of(
    st.fixed_dictionaries(
        {"role": field(st.sampled_from(["user", "assistant", "system", "developer"])),
         "content": field(text | st.lists(r_part, max_size=2))},
        optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": field(text),
                           "name": fn_name, "arguments": field(text)}),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": field(text), "output": field(text)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call", "x"])}),
)  # fmt: skip
r_tool = st.fixed_dictionaries(
    {"type": field(st.just("function"), st.just("web_search")), "name": fn_name},
    optional={"parameters": any_schema, "description": text, "strict": booleans},
)
r_named = st.fixed_dictionaries({"type": st.just("function"), "name": fn_name})
r_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema"])},
    optional={"name": field(text), "schema": any_schema, "strict": booleans},
)
responses = st.fixed_dictionaries(
    {"input": field(text | st.lists(r_item, max_size=3))},
    optional={
        "model": field(st.just("tiny-llama")), "instructions": field(text),
        "max_output_tokens": max_tokens, "temperature": field(st.floats(0, 2)),
        "top_p": field(st.floats(0, 1)), "stream": st.booleans(), "store": booleans,
        "previous_response_id": field(st.sampled_from(["resp_x", ""]), text),
        "tools": field(st.lists(r_tool, max_size=2)),
        "tool_choice": field(st.sampled_from(["none", "auto", "required"]) | r_named),
        "text": field(st.fixed_dictionaries({"format": field(r_format)})),
        "metadata": field(st.dictionaries(st.text(max_size=5), text, max_size=3)),
        "user": field(text), "parallel_tool_calls": booleans, "reasoning": junk,
        "truncation": junk, "include": junk,
    },
)  # fmt: skip

embeddings = st.fixed_dictionaries(
    {"input": field(text | st.lists(text, max_size=3) | st.lists(token, max_size=5)
                    | st.lists(st.lists(token, max_size=3), max_size=2))},
    optional={
        "model": field(st.just("tiny-llama")),
        "encoding_format": field(st.sampled_from(["float", "base64"])),
        "dimensions": field(st.integers(1, 100)), "user": field(text),
        "truncate_prompt_tokens": field(st.integers(-1, 10)), "normalize": booleans,
        "add_special_tokens": booleans,
    },
)  # fmt: skip
lora = st.fixed_dictionaries({}, optional={"lora_name": field(text), "lora_path": field(text)})

ROUTE_REQUESTS = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), chat),
    st.tuples(st.just("/v1/completions"), completion),
    st.tuples(st.just("/v1/messages"), anthropic),
    st.tuples(st.just("/v1/messages/count_tokens"), count_tokens),
    st.tuples(st.just("/v1/responses"), responses),
    st.tuples(st.just("/v1/embeddings"), embeddings),
    st.tuples(st.sampled_from(["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]), lora),
    st.tuples(st.sampled_from(["/v1/messages", "/v1/responses", "/v1/embeddings"]), junk),
)
