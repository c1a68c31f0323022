"""The whole schema corpus on the default model (real JSON), offline. A soak run: marked slow
(`make test-slow`, CI)."""

from __future__ import annotations

import json

import pytest
from structured_helpers import SCHEMAS, GrammarOracle, format_checked

from paged import LLM
from paged.sampling.params import SamplingParams, StructuredOutputsParams


@pytest.mark.slow
def test_corpus_on_the_default_model(default_model_path):
    llm = LLM(default_model_path, dtype="float32", max_model_len=1024, kv_cache_memory="256MiB")
    convs = [
        [{"role": "user", "content": f"Reply with JSON only: {c['prompt']}."}] for c in SCHEMAS
    ]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=c["schema"]),
        )
        for c in SCHEMAS
    ]
    outs = llm.chat(convs, params, use_tqdm=False)
    oracle = GrammarOracle(llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids[0])
    complete = 0
    for c, o in zip(SCHEMAS, outs):
        out = o.outputs[0]
        if out.finish_reason == "stop":
            format_checked(c["schema"], json.loads(out.text))
            complete += 1
        else:  # a string without a length bound (e.g. an email) may run to max_tokens
            compiled = oracle.compiler.compile_json_schema(json.dumps(c["schema"]))
            ok, done = oracle.accepts(compiled, out.token_ids)
            assert out.finish_reason == "length" and ok and not done, c["name"]
    assert complete >= len(SCHEMAS) - 2
    assert len(llm.engine.structured) == 0
    llm.engine.kv.check_invariants()
