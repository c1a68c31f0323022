"""KV-cache groups on the Triton backend (interpreted): Gemma 2's sliding and global layers
each read their group's block tables from one shared cache tensor per place; the windowed
group's released positions hold the null block (NaN here: the kernels never load it) while
chunked prefill, a prefix hit and decodes run; greedy tokens equal HF's."""

from __future__ import annotations

import pytest
import torch


def attention_on_triton():
    """The cpu platform with the Triton attention backend and kernels, Gemma's elementwise ops
    left in torch: these tests are about the groups' tables; interpreted, the Gemma kernels
    would double their time (they have their own tests: test_gemma_fused.py)."""
    from test_long_prompt import TritonOnCpu

    class AttentionOnTriton(TritonOnCpu):
        def ops(self):
            return {k: v for k, v in super().ops().items()
                    if not k.startswith(("gemma_", "gelu_"))}  # fmt: skip

    return AttentionOnTriton


@pytest.mark.slow  # 17 s: interpreted Triton through the engine, with the long checks
def test_groups_on_triton(tmp_path, engines_on, interpreter_only):
    from test_hf_parity import hf_greedy
    from test_kv_groups import PROMPTS, build
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams

    platform = attention_on_triton()
    path = build("gemma2", str(tmp_path / "gemma2"))  # window 10: two groups of two layers
    engines_on(platform())
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=64,
              max_model_len=128)  # fmt: skip
    try:
        kv = llm.engine.kv
        assert llm.engine.runner.backend.name == "triton" and kv.windows == [None, 10]
        for cache in llm.engine.runner.kv_caches:  # [2, blocks, ...]: a read of it shows
            cache[:, kv.null_block] = float("nan")
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        got = []
        for prompts in (PROMPTS[:1], PROMPTS[1:]):  # the second shares the first's prefix
            outs = llm.generate(prompts, params, use_tqdm=False)
            got += [o.outputs[0].token_ids for o in outs]
        assert kv.num_window_released > 0 and kv.hits > 0
        kv.check_invariants([])
        assert kv.num_free_blocks == kv.num_usable_blocks
    finally:
        llm.engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got == [hf_greedy(hf, p, 6) for p in PROMPTS]


class ReplayGraph:
    """A "graph" that replays its captured forward eagerly, on the same static buffers and
    the metadata planned at capture (as a real graph's kernels read them)."""

    def __init__(self) -> None:
        self.run = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        (out, tail), again = self.run
        new_out, new_tail = again()
        out.copy_(new_out)
        for old, new in zip(tail or (), new_tail or ()):
            if old is not None:
                old.copy_(new)


@pytest.mark.slow  # 17 s: interpreted Triton through the engine, with the long checks
def test_group_tables_through_graph_replay(tmp_path, engines_on, interpreter_only):
    """Decode, prompt-chunk and speculative verification steps (ngram proposals) replay
    captured "graphs": each group's block tables and slots reach its static buffers (padded
    rows write nowhere); greedy tokens equal HF's. (The null block is not poisoned here: a
    verification graph's padding rows reach past the table, whose padding is block 0, with
    zero weight.)"""
    import contextlib

    from test_hf_parity import hf_greedy
    from test_kv_groups import PROMPTS, build
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams
    from paged.worker.graph_runner import GraphStepRunner

    class ReplayRunner(GraphStepRunner):
        recording: ReplayGraph | None = None

        def new_graph(self) -> ReplayGraph:
            return ReplayGraph()

        @contextlib.contextmanager
        def graph_capture(self, graph: ReplayGraph, pool):
            self.recording = graph
            try:
                yield
            finally:
                self.recording = None

        def _graph_body(self, *args):
            """The captured call, replayed as it was made. Capture's two warm-up bodies (on a
            device they compile kernels outside the capture) are left out: this graph
            compiles nothing, and each interpreted forward costs seconds."""
            graph = self.recording
            if graph is None:  # only capture() calls this: a warm-up
                return None, None
            body = super()._graph_body
            outs = body(*args)
            graph.run = (outs, lambda: body(*args))
            return outs

    class GraphsOnCpu(attention_on_triton()):
        def step_runner(self):
            return ReplayRunner

    path = build("gemma2", str(tmp_path / "gemma2"))
    engines_on(GraphsOnCpu())
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=64,
              max_model_len=128, max_num_seqs=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    try:
        runner = llm.engine.runner.step_runner
        assert runner.num_kv_groups == 2 and len(runner.group_tables) == 2
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert runner.prefill_sizes == [16]  # prompt chunks: their own graph
        for graphs in (runner.graphs, runner.spec_graphs, runner.prefill_graphs):
            assert sum(g.replays for g, _, _ in graphs.values()) > 0
        kv = llm.engine.kv
        assert kv.num_window_released > 0
        kv.check_invariants([])
    finally:
        llm.engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got == [hf_greedy(hf, p, 6) for p in PROMPTS]
