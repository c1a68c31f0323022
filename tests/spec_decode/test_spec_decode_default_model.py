"""Speculative decoding on the default model (SmolLM2-135M GGUF, float32): n-gram proposals on
a "repeat this text" prompt are accepted, greedy output and stop strings cut inside an
accepted run are identical to plain decoding; the /metrics families."""

from __future__ import annotations

import pytest

from paged import LLM, SamplingParams

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with "
    "a single step. All that glitters is not gold. Actions speak louder than words."
)
PROMPTS = [
    f"Copy the text.\nText: {TEXT}\nCopy: {TEXT}\nText: {TEXT}\nCopy:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]


@pytest.fixture(scope="module")
def spec_smollm(default_model_path):
    return LLM(default_model_path, dtype="float32", max_model_len=1024, kv_cache_memory="64MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip


def test_greedy_identical_and_accepted(smollm, spec_smollm):
    params = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0] for o in smollm.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec_smollm.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    m = spec_smollm.engine.metrics()
    # a copy task: many proposals are right, several tokens per step
    assert m["spec_decode_num_accepted_tokens"] > 0.3 * m["spec_decode_num_draft_tokens"]
    assert m["spec_decode_num_accepted_tokens_per_pos_3"] > 0
    eng = spec_smollm.engine
    eng.kv.check_invariants(list(eng.requests.values()))
    assert eng.kv.num_free_blocks == eng.num_blocks


def test_stop_string_inside_an_accepted_run(smollm, spec_smollm):
    plain = smollm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=20),
                            use_tqdm=False)[0].outputs[0].text  # fmt: skip
    stop = plain[len(plain) // 2 : len(plain) // 2 + 6]
    params = SamplingParams(temperature=0, max_tokens=20, stop=[stop])
    want = smollm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    got = spec_smollm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert got.stop_reason == stop


def test_metrics_families():
    from paged.server.metrics import ServerMetrics

    stats = {
        "spec_decode_num_drafts": 5,
        "spec_decode_num_draft_tokens": 20,
        "spec_decode_num_accepted_tokens": 12,
        "spec_decode_num_accepted_tokens_per_pos_0": 5,
        "spec_decode_num_accepted_tokens_per_pos_1": 4,
    }
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'paged:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'paged:spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'paged:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0' in text
    assert (
        'paged:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 4.0'
        in text
    )


def test_stop_string_cuts_several_new_tokens(smollm):
    """The server's and LLM's output state: an engine output of several tokens (an accepted
    run) whose middle token completes a stop string keeps the tokens up to that one."""
    from paged.engine.messages import EngineOutput
    from paged.engine.outputs import OutputState

    tok = smollm.get_tokenizer()
    ids = tok.encode(" quick brown fox jumps over", add_special_tokens=False)
    upto = next(i for i in range(len(ids)) if "fox" in tok.decode(ids[: i + 1]))
    assert upto < len(ids) - 1
    st = OutputState(0, tok, tok.encode("The"), SamplingParams(stop=["fox"]))
    lps = [{t: -1.0} for t in ids]
    stopped = st.update(EngineOutput("r", ids, False, logprobs=lps, ranks=[1] * len(ids)))
    assert stopped and st.kept == upto + 1
    assert st.out.text == " quick brown " and st.out.token_ids == ids[: upto + 1]
    assert len(st.out.logprobs) == upto + 1 and st.out.finish_reason == "stop"
