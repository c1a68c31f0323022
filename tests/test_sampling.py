"""Sampling and stopping: seeds, stop strings and ids, lengths, penalties, errors."""

from __future__ import annotations

import dataclasses

import pytest

from paged import BeamSearchParams, SamplingParams
from paged.sampling.params import RequestOutputKind

PROMPT = [{"role": "user", "content": "Write a story about a dragon."}]


def text_of(llm, params, conv=PROMPT):
    return llm.chat(conv, params, use_tqdm=False)[0].outputs[0]


def test_seed_reproducible_whatever_the_batch(smollm):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    alone = text_of(smollm, p).token_ids
    others = [[{"role": "user", "content": f"Count to {i}."}] for i in range(5)]
    unseeded = SamplingParams(temperature=1.2, max_tokens=24)
    outs = smollm.chat(
        others[:2] + [PROMPT] + others[2:], [unseeded] * 2 + [p] + [unseeded] * 3, use_tqdm=False
    )
    assert outs[2].outputs[0].token_ids == alone
    other_seed = text_of(
        smollm, SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24)
    ).token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(smollm):
    greedy = text_of(smollm, SamplingParams(temperature=0, max_tokens=16)).token_ids
    topk1 = text_of(smollm, SamplingParams(temperature=0.8, top_k=1, max_tokens=16)).token_ids
    assert greedy == topk1


def test_max_tokens_and_length_reason(smollm):
    out = text_of(smollm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


def test_stop_string_not_in_text(smollm):
    full = text_of(smollm, SamplingParams(temperature=0, max_tokens=40)).text
    words = full.split()
    assert len(words) > 4
    stop = words[3]
    out = text_of(smollm, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert stop not in out.text
    assert full.startswith(out.text)
    assert out.text == full[: full.index(stop)]


def test_stop_token_ids(smollm):
    greedy = text_of(smollm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tok = greedy.token_ids[6]
    out = text_of(smollm, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok]))
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok


def test_min_tokens_and_ignore_eos(smollm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    short = text_of(smollm, SamplingParams(temperature=0, max_tokens=64), conv)
    assert short.finish_reason == "stop"  # the model ends on its own
    n = len(short.token_ids)
    longer = text_of(smollm, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 5), conv)
    assert len(longer.token_ids) >= n + 5
    ignore = text_of(smollm, SamplingParams(temperature=0, max_tokens=n + 8, ignore_eos=True), conv)
    assert len(ignore.token_ids) == n + 8


def test_penalties_change_output(smollm):
    base = text_of(smollm, SamplingParams(temperature=0, max_tokens=32)).token_ids
    pen = text_of(
        smollm,
        SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.5, frequency_penalty=1.0),
    ).token_ids
    assert pen != base
    assert len(set(pen)) >= len(set(base))


def test_n_samples(smollm):
    out = smollm.chat(
        PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12), use_tqdm=False
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_prompt_too_long_is_refused(smollm):
    with pytest.raises(ValueError, match="context length"):
        smollm.generate([[5] * 2000], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not smollm.engine.has_unfinished()


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: "x"}}, r"logit_bias\[5\]"),
        ({"logit_bias": {5.5: 1}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\]"),
        ({"seed": "1"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids"),
        ({"stop": [5]}, "stop"),
        ({"max_tokens": "2"}, "max_tokens"),
        ({"n": "2"}, "n"),
        ({"temperature": "0.5"}, "temperature"),
        ({"bad_words": "the"}, "bad_words"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"output_kind": "bogus"}, "output_kind"),
    ],
)
def test_wrongly_typed_params_name_the_field(kw, field):
    """Refused up front: the engine's step (every request of it) would fail on them."""
    with pytest.raises((TypeError, ValueError), match=f"^{field}: "):
        SamplingParams(**kw)


def test_beam_search_params_refuse_a_non_finite_length_penalty():
    with pytest.raises(ValueError, match="^length_penalty"):
        BeamSearchParams(2, 2, length_penalty=float("nan"))


def test_a_failed_request_leaves_nothing_behind(smollm):
    bad = SamplingParams(max_tokens=2)
    bad.stop = [5]  # set past validate(): fails while the call submits its requests
    with pytest.raises(TypeError):
        smollm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=3), bad], use_tqdm=False)
    assert not smollm.engine.requests
    out = smollm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_interleaved_streams_and_generate_each_get_their_outputs(smollm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in smollm.generate([[5, 6, 7], [8, 9]], greedy)]
    delta = dataclasses.replace(greedy, output_kind=RequestOutputKind.DELTA)
    a, b = smollm.stream([[5, 6, 7]], delta), smollm.stream([[8, 9]], delta)
    got_a = list(next(a).outputs[0].token_ids)
    got_b = [t for o in b for t in o.outputs[0].token_ids]  # while a is open
    mid = smollm.generate([[8, 9]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    got_a += [t for o in a for t in o.outputs[0].token_ids]
    assert (got_a, got_b, mid) == (ref[0], ref[1], ref[1])
    it = smollm.stream([[5, 6, 7]], greedy)
    next(it)
    it.close()  # closed early: its request is aborted
    assert not smollm.engine.requests and not smollm._routes


def test_chat_joins_text_parts(smollm):
    p = SamplingParams(temperature=0, max_tokens=4)
    texts = ["Write a story", "about a dragon."]
    parts = [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]
    joined = [{"role": "user", "content": "\n".join(texts)}]  # as the server (and vLLM) join
    assert text_of(smollm, p, parts).token_ids == text_of(smollm, p, joined).token_ids


def test_a_named_tokenizer_that_cannot_load_is_an_error(tiny_models):
    from paged import LLM

    with pytest.raises(ValueError, match="^tokenizer: "):
        LLM(tiny_models["llama"], tokenizer="/nonexistent", kv_cache_memory="8MiB")


def test_bad_token_ids_refused(smollm):
    with pytest.raises(ValueError, match="^prompt"):
        smollm.generate([[10**7]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        smollm.generate(
            [[1, 2, 3]], SamplingParams(max_tokens=2, stop_token_ids=[-1]), use_tqdm=False
        )
    assert smollm.engine.kv.num_free_blocks == smollm.engine.num_blocks


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda llm: llm.generate({"text": "hi"}), ValueError,
         r"^prompts\[0\]: a dict prompt needs"),
        (lambda llm: llm.generate(5), TypeError, "^prompts: expected"),
        (lambda llm: list(llm.stream({"text": "hi"})), ValueError, r"^prompts\[0\]: a dict"),
        (lambda llm: list(llm.stream("hi", {"n": 2})), TypeError, "^sampling_params: "),
        (lambda llm: llm.embed([[1, None]]), TypeError, r"^prompts\[0\]: .* \[1\] is NoneType"),
        (lambda llm: llm.beam_search([{"text": "hi"}], BeamSearchParams(2, 2)), ValueError,
         r"^prompts\[0\]: a dict"),
        (lambda llm: llm.generate([{"prompt_token_ids": [1, "a"]}]), TypeError,
         r"^prompts\[0\]\.prompt_token_ids: .* \[1\] is str"),
        (lambda llm: llm.generate("hi", {"max_tokens": 3}), TypeError,
         r"^sampling_params: .*got dict \(build SamplingParams\(\*\*d\)"),
        (lambda llm: llm.generate(["a", "b"], [SamplingParams(), {}]), TypeError,
         r"^sampling_params\[1\]: "),
        (lambda llm: llm.chat([{"role": "user"}]), ValueError, r"^messages\[0\]\.content: missing"),
        (lambda llm: llm.chat([{"role": "wizard", "content": "hi"}]), ValueError,
         r"^messages\[0\]\.role: must be one of system, developer, user, assistant, tool"),
        (lambda llm: llm.chat([PROMPT, [{"role": "user", "content": 5}]]), TypeError,
         r"^messages\[1\]\[0\]\.content: expected a string"),
        (lambda llm: llm.chat("hi"), TypeError, "^messages: expected a list"),
        (lambda llm: llm.chat(PROMPT, {"max_tokens": 1}), TypeError, "^sampling_params: "),
        (lambda llm: llm.chat(PROMPT, chat_template="no-such.jinja"), ValueError,
         "^chat_template: cannot read the file 'no-such.jinja'"),
        (lambda llm: llm.chat(PROMPT, chat_template="{{ raise_exception('roles') }}"), ValueError,
         "^messages: cannot apply the chat template: roles"),
        (lambda llm: llm.chat(PROMPT, chat_template_kwargs=["x"]), TypeError,
         "^chat_template_kwargs: expected a dict"),
        (lambda llm: llm.beam_search([[1, 2]], SamplingParams()), TypeError,
         "^params: beam_search takes BeamSearchParams"),
        (lambda llm: llm.embed([[1, 2]], SamplingParams()), TypeError, "^pooling_params: "),
        (lambda llm: llm.generate([[1, 2]], lora_request="a"), TypeError, "^lora_request: "),
        (lambda llm: llm.chat([[]]), ValueError, r"^messages\[0\]: an empty conversation"),
        (lambda llm: llm.chat(PROMPT, tools="x"), TypeError, "^tools: expected a list"),
        (lambda llm: llm.chat(PROMPT, tools=[{"type": "function"}]), ValueError,
         r"^tools\[0\]\.function: "),
        (lambda llm: llm.chat([{"role": "user", "content": [{"type": "image_url"}]}]),
         ValueError, r"^messages\[0\]\.content: only text parts are supported"),
    ],
)
def test_bad_offline_arguments_name_the_argument(smollm, call, error, message):
    """A ValueError or TypeError naming the argument, never a raw KeyError/AttributeError or a
    Jinja error; nothing is left in the engine."""
    with pytest.raises(error, match=message):
        call(smollm)
    assert not smollm.engine.has_unfinished()


def test_offline_chat_takes_the_roles_the_server_takes():
    from typing import get_args

    from paged.engine.llm_inputs import CHAT_ROLES
    from paged.server.protocol import ChatMessage

    assert get_args(ChatMessage.model_fields["role"].annotation) == CHAT_ROLES


def test_logprobs_match_a_full_forward(smollm):
    import torch

    out = text_of(smollm, SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert next(iter(entry)) == tok  # the sampled token comes first
        assert len(entry) >= 3
        values = {t: lp.logprob for t, lp in entry.items()}
        assert max(values.values()) == values[tok]  # greedy: the sampled token is the top one
        assert entry[tok].rank == 1 and entry[tok].decoded_token
        assert all(v <= 0 for v in values.values())
    total = sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids))
    assert abs(out.cumulative_logprob - total) < 1e-6
    assert torch.isfinite(torch.tensor(out.cumulative_logprob))
