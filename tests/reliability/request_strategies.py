"""Hypothesis strategies for generated requests to the OpenAI routes (completions, chat,
tokenize, detokenize): mostly-plausible bodies with wrong types, out-of-range numbers, odd
Unicode and random JSON mixed in (test_property)."""

from __future__ import annotations

from hypothesis import strategies as st

VOCAB = 49152

_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
junk = st.recursive(
    _scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
surrogates = st.sampled_from(["\ud800", "a\udfff", "\udbff\udbff"])
odd = st.sampled_from(["\x00", "\u202e", "<|im_end|>", "{{ x }}", "é" * 3, "\U0001f600"])
field_text = st.one_of(st.text(max_size=24), st.text(max_size=24), odd)


def field(
    good: st.SearchStrategy,
    bad: st.SearchStrategy | None = None,
    junk: st.SearchStrategy = junk,
    one_in: int = 20,
) -> st.SearchStrategy:
    """Mostly a valid value; one time in `one_in` an out-of-range one, one in `one_in` any
    JSON at all (one in ten either way by default)."""
    bad = bad if bad is not None else junk
    return st.integers(0, one_in - 1).flatmap(
        lambda i: junk if i == 0 else bad if i == 1 else good
    )


text = field(field_text, surrogates, st.text())


good_token = st.integers(0, VOCAB - 1)
token = field(good_token, st.sampled_from([-1, VOCAB, 10**12, 2**70]), st.integers())
prob = st.floats(0.01, 1.0)
bad_prob = st.sampled_from([-0.5, 0.0, 1.5, 1e-300, 1e308])
max_tokens = field(
    st.integers(1, 4),
    st.sampled_from([0, -2, 256, 10**20]),
    junk.filter(lambda v: v is not None),  # null would mean the whole context (slow)
)

SAMPLING = {
    "model": field(st.just("tiny-llama"), st.just("gpt-4")),
    "n": field(st.integers(1, 3), st.sampled_from([0, -1, 129, 10**9])),
    "temperature": field(st.floats(0, 2), st.sampled_from([-1.0, 1e308, 1e-300])),
    "top_p": field(prob, bad_prob),
    "top_k": field(st.integers(-1, 50), st.sampled_from([-5, 10**6, 2**63, 10**30])),
    "min_p": field(st.floats(0, 1), bad_prob),
    "repetition_penalty": field(st.floats(0.5, 2), st.sampled_from([0, -1, 1e-30, 1e30])),
    "presence_penalty": field(st.floats(-2, 2), st.sampled_from([-3, 2.5, 1e9])),
    "frequency_penalty": field(st.floats(-2, 2), st.sampled_from([-3, 2.5, -1e9])),
    "seed": field(st.integers(-(2**63), 2**63 - 200), st.sampled_from([2**63, -(2**64)])),
    "stop": field(text | st.lists(text, max_size=3), st.just(["x"] * 65) | st.just([""])),
    "stop_token_ids": st.lists(token, max_size=3),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(0, 3), st.sampled_from([-1, 5, 10**9])),
    "logit_bias": st.dictionaries(
        field(good_token.map(str), token.map(str), text), field(st.floats(-100, 100)), max_size=3
    ),
    "skip_special_tokens": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "user": field(text),
    "stream": st.booleans(),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "some_unknown_field": junk,
}
prompt = st.one_of(
    text,
    st.lists(text, min_size=0, max_size=3),
    st.lists(token, min_size=0, max_size=8),
    st.lists(st.lists(token, min_size=0, max_size=4), min_size=0, max_size=2),
)
completion = st.fixed_dictionaries(
    {"prompt": field(prompt), "max_tokens": max_tokens},
    optional={
        **SAMPLING,
        "echo": field(st.booleans()),
        "logprobs": field(st.integers(0, 5), st.sampled_from([-1, 21])),
        "best_of": field(st.integers(1, 3)),
        "suffix": field(text),
    },
)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text})
message = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["system", "user", "assistant", "tool", "wizard"])),
        "content": field(text | st.none() | st.lists(part, max_size=2)),
    },
    optional={"name": field(text), "tool_calls": junk},
)
chat = st.fixed_dictionaries(
    {"messages": field(st.lists(message, min_size=0, max_size=3)), "max_tokens": max_tokens},
    optional={
        **SAMPLING,
        "max_completion_tokens": max_tokens,
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 5), st.sampled_from([-1, 21])),
        "add_generation_prompt": field(st.booleans()),
        "response_format": field(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json"])})
        ),
    },
)
tokenize = st.one_of(
    st.fixed_dictionaries({"prompt": field(text)}, optional={"add_special_tokens": junk}),
    st.fixed_dictionaries({"messages": field(st.lists(message, max_size=2))}),
)
detokenize = st.fixed_dictionaries({"tokens": field(st.lists(token, max_size=6))})
REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), completion),
    st.tuples(st.just("/v1/completions"), completion),
    st.tuples(st.just("/v1/chat/completions"), chat),
    st.tuples(st.just("/v1/chat/completions"), chat),
    st.tuples(st.just("/tokenize"), tokenize),
    st.tuples(st.just("/detokenize"), detokenize),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]), junk),
)
