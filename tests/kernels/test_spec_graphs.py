"""Speculative decoding's verification graphs end to end on CPU: the engine on the Triton
backend (interpreted) with a graph runner whose "graphs" rerun the captured forward on replay,
reading the static input buffers as a real graph does. n-gram speculation replays the padded
verification graphs (each request 1 + k rows) and its greedy output equals plain decoding's,
with prompts of several chunks, repeats that the n-grams find, and no blocks leaked."""

from __future__ import annotations

import pytest
import torch
from test_graph_runner import FakeGraph, FakeGraphRunner
from test_long_prompt import TritonOnCpu

from paged import LLM, SamplingParams


class Recorded(torch.nn.Module):
    """The model; a forward run while a graph records is rerun, in place, on its replay."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def layers(self):
        return self.inner.layers

    def forward(self, input_ids, positions, meta):
        out = self.inner(input_ids, positions, meta)
        graph = FakeGraph.recording
        if graph is not None:
            graph.ops.append(lambda: out.copy_(self.inner(input_ids, positions, meta)))
        return out


class ReplayRunner(FakeGraphRunner):
    """test_graph_runner's fake graph API around the real model."""

    graph_name = "replay"
    eager_fallback = False
    made: list[ReplayRunner] = []

    def __init__(self, model, *args, **kwargs) -> None:
        super().__init__(Recorded(model), *args, **kwargs)
        ReplayRunner.made.append(self)

    def _graph_body(self, input_ids, positions, meta, with_tail):
        """Capture's two warm-up bodies before each graph (on a device they compile kernels
        outside the capture) are left out: a fake graph compiles nothing, and each
        interpreted forward costs seconds. The recorded body runs as before."""
        if FakeGraph.recording is None:  # only capture() calls this: a warm-up
            return None, None
        return super()._graph_body(input_ids, positions, meta, with_tail)


class TritonGraphsOnCpu(TritonOnCpu):
    name = "triton-graphs-on-cpu"

    def step_runner(self):
        return ReplayRunner


@pytest.mark.slow  # 20-40 s of interpreted graphs on two cores: with the long checks
def test_verification_graphs_equal_plain_decoding(tiny_models, engines_on, interpreter_only):
    engines_on(TritonGraphsOnCpu())
    g = torch.Generator().manual_seed(3)
    base = torch.randint(2, 320, (6,), generator=g).tolist()
    prompts = [base * 4, torch.randint(2, 320, (40,), generator=g).tolist(), base[:4] * 3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=64,
              max_num_seqs=4, enforce_eager=False)  # fmt: skip
    path = tiny_models["llama"]
    plain = LLM(path, **{**kw, "enforce_eager": True})  # the reference: no graphs to capture
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    ReplayRunner.made.clear()
    spec = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 3}, **kw)  # fmt: skip
    runner = ReplayRunner.made[-1]
    assert runner.spec_q == 4 and runner.spec_sizes == [1, 2, 4]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    replays = sum(graph.replays for graph, _, _ in runner.spec_graphs.values())
    stats = spec.engine.metrics()
    assert replays > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    spec.engine.kv.check_invariants()
    assert spec.engine.kv.num_free_blocks == spec.engine.num_blocks
