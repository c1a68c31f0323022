"""The start-up profiling forward (ModelRunner.profile_run, on platforms that size the KV cache
from the activation peak) stays within max_num_seqs requests whatever the budgets."""

import pytest

from paged import LLM, SamplingParams
from paged_cpu.platform import CpuPlatform


@pytest.mark.parametrize("max_model_len, max_num_seqs", [(32, 1), (40, 3)])
def test_profile_run_with_a_short_max_model_len(tiny_models, monkeypatch, max_model_len,
                                                max_num_seqs):  # fmt: skip
    # the token budget (2048) exceeds max_num_seqs x max_model_len: the profiling batch once
    # took one request more than max_num_seqs and overflowed the block-table buffer
    monkeypatch.setattr(CpuPlatform, "needs_profile_run", True)
    llm = LLM(tiny_models["llama"], dtype="float32", max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)  # fmt: skip
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0)
    )
    assert len(out[0].outputs[0].token_ids) == 4
