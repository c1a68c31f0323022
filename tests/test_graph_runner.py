"""The device-neutral graph runner (`paged.worker.graph_runner`) on CPU, with a fake graph API: a
"graph" records closures while captured and reruns them on replay, so replay reads the
static input buffers exactly as a real captured graph would."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from paged.model.attention import AttentionMetadata
from paged.worker.graph_runner import GraphStepRunner, capture_sizes, prefill_capture_sizes


class FakeGraph:
    recording: FakeGraph | None = None

    def __init__(self) -> None:
        self.ops: list = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for op in self.ops:
            op()


class FakeModel(torch.nn.Module):
    """Echoes what each row sees: [input id, position, seq len, slot, first block]."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, positions, meta):
        self.calls += 1

        def compute():  # each row with its request's length and first block
            req = torch.searchsorted(meta.query_start_loc[1:].long(),
                                     torch.arange(len(input_ids)), right=True)  # fmt: skip
            req = req.clamp(max=meta.num_reqs - 1)  # a graph's padding rows: past every request
            cols = [input_ids, positions, meta.seq_lens.long()[req], meta.slot_mapping]
            return torch.stack(cols + [meta.block_tables[req, 0].long()], -1)

        out = compute()
        graph = FakeGraph.recording
        if graph is not None:
            graph.ops.append(lambda: out.copy_(compute()))
        return out


class FakeBackend:
    def __init__(self, graph_plan: bool = True, graph_safe_varlen: bool = True) -> None:
        self.graph_safe_varlen = graph_safe_varlen
        self.workspace_for: list[int] = []
        self.plans: list[tuple[str, int]] = []
        if graph_plan:
            self.plan_for_graph = self._plan_for_graph

    def ensure_workspace(self, n: int) -> None:
        self.workspace_for.append(n)

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        self.plans.append(("eager", meta.num_reqs))
        meta.extra = "eager"
        return meta

    def _plan_for_graph(self, meta: AttentionMetadata) -> AttentionMetadata:
        self.plans.append(("graph", meta.num_reqs))
        meta.extra = "graph"
        return meta


class FakeGraphRunner(GraphStepRunner):
    graph_name = "Fake"
    fail_at: int | None = None  # capture size whose new_graph raises

    def new_graph(self) -> FakeGraph:
        if self.fail_at is not None and len(self.graphs) == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        return FakeGraph()

    @contextlib.contextmanager
    def graph_capture(self, graph: FakeGraph, pool):
        assert pool == "pool"
        FakeGraph.recording = graph
        try:
            yield
        finally:
            FakeGraph.recording = None

    def graph_pool(self):
        return "pool"

    def _graph_body(self, input_ids, positions, meta, with_tail):
        """The body, its tail recorded too (the model records its own forward)."""
        out, tail = super()._graph_body(input_ids, positions, meta, with_tail)
        if FakeGraph.recording is not None and tail is not None:

            def again() -> None:
                for old, new in zip(tail, self.tail(out)):
                    if old is not None:
                        old.copy_(new)

            FakeGraph.recording.ops.append(again)
        return out, tail

    def _sampler_body(self, n, sort):
        """The sampler graph's draw, recorded too (a replay draws again)."""
        ids = super()._sampler_body(n, sort)
        if FakeGraph.recording is not None:
            FakeGraph.recording.ops.append(lambda: ids.copy_(super(FakeGraphRunner, self)
                                                             ._sampler_body(n, sort)))  # fmt: skip
        return ids


def make_runner(cls=FakeGraphRunner, enforce_eager=False, graph_plan=True, max_num_seqs=6,
                spec_tokens=None, enable_lora=False, graph_safe_varlen=True,
                prefill_graphs=False, max_num_batched_tokens=40):  # fmt: skip
    spec = None if spec_tokens is None else SimpleNamespace(num_speculative_tokens=spec_tokens)
    config = SimpleNamespace(
        enforce_eager=enforce_eager, max_num_seqs=max_num_seqs, max_model_len=64, block_size=16,
        speculative_config=spec, enable_lora=enable_lora, prefill_graphs=prefill_graphs,
        max_num_batched_tokens=max_num_batched_tokens,
    )  # fmt: skip
    syncs: list[int] = []
    platform = SimpleNamespace(device=torch.device("cpu"), synchronize=lambda: syncs.append(1),
                               pin_memory=False)
    runner = cls(FakeModel(), config, platform, FakeBackend(graph_plan, graph_safe_varlen))
    return runner, syncs


def decode_meta(n: int, offset: int = 0, num_decodes: int | None = None) -> AttentionMetadata:
    r = torch.arange(n)
    return AttentionMetadata(
        num_reqs=n,
        num_decodes=n if num_decodes is None else num_decodes,
        num_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=(r + 11 + offset).int(),
        block_tables=(r + 3 + offset).int().unsqueeze(1),
        slot_mapping=r + 100 + offset,
        max_query_len=1,
        max_seq_len=64,
    )


def step(runner, n, offset=0, num_decodes=None):
    ids, pos = torch.arange(n) + 5 + offset, torch.arange(n) + 20 + offset
    return runner.forward(ids, pos, decode_meta(n, offset, num_decodes))


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1000)[-2:] == [496, 512]
    assert capture_sizes(1000, limit=256)[-1] == 256


def test_capture_then_padded_replay(caplog):
    runner, syncs = make_runner()
    with caplog.at_level(logging.INFO, logger="paged"):
        runner.capture()
    assert runner.sizes == [1, 2, 4, 6] and sorted(runner.graphs) == [1, 2, 4, 6]
    assert runner.backend.workspace_for == [6]
    assert runner.backend.plans == [("graph", n) for n in (6, 4, 2, 1)]  # largest first
    assert runner.model.calls == 4 * 3  # two warm-ups and the capture, per size
    assert len(syncs) == 4 + 1  # before each capture, and once at the end
    assert "captured 4 Fake graphs (decode batch 1..6)" in caplog.text
    assert runner.tables.shape == (6, 4) and runner.slots.tolist() == [-1] * 6

    out = step(runner, 4, offset=50)  # fills all four rows of the size-4 graph
    assert out[:, 3].tolist() == [150, 151, 152, 153]
    out = step(runner, 3)  # padded to 4: the fourth row must be neutralised
    graph, full, _ = runner.graphs[4]
    assert graph.replays == 2 and runner.model.calls == 12  # replayed, not run eagerly
    expected = [[5 + i, 20 + i, 11 + i, 100 + i, 3 + i] for i in range(3)]
    assert out.tolist() == expected
    assert runner.slots[3].item() == -1 and runner.seq_lens[3].item() == 0
    assert full[3, 2].item() == 0 and full[3, 3].item() == -1
    assert runner.backend.plans[4:] == []  # the captured plan is reused, no eager plan


def test_prefill_and_eager_only_steps():
    runner, _ = make_runner()
    runner.capture()
    calls = runner.model.calls
    out = step(runner, 3, num_decodes=2)  # a prefill chunk in the batch: eager
    assert runner.model.calls == calls + 1 and runner.backend.plans[-1] == ("eager", 3)
    assert out[:, 3].tolist() == [100, 101, 102]
    step(runner, 7)  # above the largest captured size: eager
    assert runner.model.calls == calls + 2
    assert all(g.replays == 0 for g, _, _ in runner.graphs.values())


def test_enforce_eager_captures_nothing():
    runner, syncs = make_runner(enforce_eager=True)
    runner.capture()
    assert runner.graphs == {} and runner.model.calls == 0 and not syncs
    assert step(runner, 2)[:, 0].tolist() == [5, 6]
    assert runner.backend.plans == [("eager", 2)]


def test_graph_api_missing_stays_eager():
    class NoGraphs(FakeGraphRunner):
        def graphs_available(self) -> bool:
            return False

    runner, _ = make_runner(NoGraphs)
    runner.capture()
    assert runner.graphs == {} and runner.model.calls == 0
    step(runner, 1)
    assert runner.backend.plans == [("eager", 1)]


def test_failed_capture_falls_back_to_eager(caplog):
    class FailsAtThird(FakeGraphRunner):
        fail_at = 2  # sizes 6 and 4 captured, then size 2 fails

    runner, _ = make_runner(FailsAtThird)
    with caplog.at_level(logging.WARNING, logger="paged"):
        runner.capture()
    assert runner.graphs == {} and runner.sizes == []
    assert "Fake graph capture failed, running eagerly" in caplog.text
    out = step(runner, 3)
    assert out[:, 3].tolist() == [100, 101, 102] and runner.backend.plans[-1] == ("eager", 3)


def echo_tail(out):
    """A tail over FakeModel's rows: "logits" (the input ids and positions, as floats) and
    their "argmax"."""
    logits = out[:, :2].float()
    return logits, logits.argmax(-1)


def test_tail_inside_small_graphs_only():
    class SmallTails(FakeGraphRunner):
        max_tail_capture_size = 2

    runner, _ = make_runner(SmallTails)
    runner.tail = echo_tail
    runner.capture()
    assert sorted(runner.tails) == [1, 2] and sorted(runner.graphs) == [1, 2, 4, 6]
    ids, pos = torch.tensor([7, 30]), torch.tensor([31, 2])
    logits, greedy = runner.decode_logits(ids, pos, decode_meta(2))
    assert logits.tolist() == [[7.0, 31.0], [30.0, 2.0]] and greedy.tolist() == [1, 0]
    assert runner.graphs[2][0].replays == 1
    logits, greedy = runner.decode_logits(ids[:1], pos[:1], decode_meta(1))  # its own graph
    assert logits.tolist() == [[7.0, 31.0]] and greedy.tolist() == [1]
    calls = runner.model.calls
    assert runner.decode_logits(ids[:1], pos[:1], decode_meta(1, num_decodes=0)) is None
    assert runner.decode_logits(torch.arange(3), torch.arange(3), decode_meta(3)) is None
    assert runner.model.calls == calls  # refused: nothing ran (the caller runs forward)
    assert step(runner, 2, offset=1)[:, 0].tolist() == [6, 7]  # forward still replays


def test_tails_dropped_with_failed_capture():
    class FailsAtLast(FakeGraphRunner):
        fail_at = 3  # sizes 6, 4, 2 captured (tails with them), then size 1 fails

    runner, _ = make_runner(FailsAtLast)
    runner.tail = echo_tail
    runner.capture()
    assert runner.graphs == {} and runner.tails == {}
    assert runner.decode_logits(torch.arange(2), torch.arange(2), decode_meta(2)) is None


def test_sampler_graphs_per_tail_size_and_a_failed_one_keeps_the_decode_graphs():
    class SmallTails(FakeGraphRunner):
        max_tail_capture_size = 2

    def draw(logits, greedy, params, sort):  # what each row's "temperature" and sort give
        return greedy + 2 * (params[0] > 0) + 10 * sort

    runner, _ = make_runner(SmallTails)
    runner.tail, runner.sampler = echo_tail, draw
    runner.capture()
    assert sorted(runner.sample_graphs) == [(1, False), (1, True), (2, False), (2, True)]
    ids, pos = torch.tensor([7, 30]), torch.tensor([31, 2])
    runner.decode_logits(ids[:1], pos[:1], decode_meta(1))
    assert runner.decode_sample(1, [(0.5, 4, 1.0, 0.0)], False).tolist() == [3]
    runner.decode_logits(ids, pos, decode_meta(2))
    assert runner.decode_sample(2, [(0.0, 4, 1.0, 0.0), (0.7, 4, 0.9, 0.0)], True).tolist() \
        == [11, 12]  # fmt: skip
    assert runner.sample_graphs[(2, True)][0].replays == 1
    assert runner.decode_sample(3, [(0.5, 4, 1.0, 0.0)] * 3, False) is None  # no tail graph

    def broken(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner, _ = make_runner(SmallTails)
    runner.tail, runner.sampler = echo_tail, broken
    runner.capture()
    assert sorted(runner.tails) == [1, 2] and runner.sample_graphs == {}
    assert runner.decode_sample(1, [(0.5, 4, 1.0, 0.0)], False) is None
    assert runner.decode_logits(ids, pos, decode_meta(2))[1].tolist() == [1, 0]


def test_eager_runner_has_no_tail():
    from paged.worker.step_runner import StepRunner

    runner, _ = make_runner(StepRunner)
    assert runner.decode_logits(torch.arange(2), torch.arange(2), decode_meta(2)) is None


def test_failed_capture_raises_without_fallback():
    class Strict(FakeGraphRunner):
        fail_at = 0
        eager_fallback = False

    runner, _ = make_runner(Strict)
    with pytest.raises(RuntimeError, match="capturing"):
        runner.capture()


def test_backend_without_graph_hooks():
    runner, _ = make_runner(graph_plan=False, max_num_seqs=2)
    runner.backend.ensure_workspace = None  # neither plan_for_graph nor ensure_workspace
    runner.capture()
    assert runner.backend.plans == [("eager", 2), ("eager", 1)]
    assert sorted(runner.graphs) == [1, 2]


def test_plugin_runners_configure_the_core_runner():
    cuda = pytest.importorskip("paged_cuda.graphs").CudaGraphStepRunner
    assert issubclass(cuda, GraphStepRunner) and cuda.graph_name == "CUDA"
    assert cuda.max_capture_size == 512 and not cuda.eager_fallback  # errors propagate
    rocm = pytest.importorskip("paged_rocm.graphs").HipGraphStepRunner
    assert rocm.graph_name == "HIP" and rocm.max_capture_size == 512 and rocm.eager_fallback
    xpu = pytest.importorskip("paged_xpu.graphs").XpuGraphStepRunner
    assert xpu.graph_name == "XPU" and xpu.max_capture_size == 256 and xpu.eager_fallback


def verify_step(runner, qlens, seq_lens):
    """A speculative step: request i has qlens[i] query rows (1: a plain decode)."""
    t = sum(qlens)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(qlens),
        num_decodes=sum(1 for q in qlens if q == 1) if max(qlens) == 1 else 0,
        num_tokens=t,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=(torch.arange(len(qlens)) + 3).int().unsqueeze(1),
        slot_mapping=torch.arange(t) + 100,
        max_query_len=max(qlens),
        max_seq_len=64,
        query_lens_cpu=list(qlens),
        seq_lens_cpu=list(seq_lens),
    )
    return runner.forward(torch.arange(t) + 5, torch.arange(t) + 20, meta)


def test_verification_steps_replay_padded_graphs():
    runner, _ = make_runner(spec_tokens=2)  # Q = 3 rows per request
    runner.capture()
    assert runner.spec_q == 3 and runner.spec_sizes == [1, 2, 4, 6]
    assert sorted(runner.spec_graphs) == [1, 2, 4, 6] and runner.input_ids.shape == (18,)
    calls = runner.model.calls
    out = verify_step(runner, [1, 3, 2], [11, 20, 30])  # padded to 4 requests x 3 rows
    graph = runner.spec_graphs[4][0]
    assert graph.replays == 1 and runner.model.calls == calls
    req = [0, 1, 1, 1, 2, 2]
    padded_len = [11 + 2, 20, 30 + 1]  # grown by each request's padding rows
    expected = [[5 + t, 20 + t, padded_len[r], 100 + t, 3 + r] for t, r in enumerate(req)]
    assert out.tolist() == expected
    assert runner.slots[:12].tolist() == [100, -1, -1, 101, 102, 103, 104, 105, -1] + [-1] * 3
    assert runner.seq_lens[3].item() == 0  # the padding request attends to nothing
    verify_step(runner, [1, 1], [11, 12])  # plain decodes: the decode graph
    assert runner.graphs[2][0].replays == 1 and graph.replays == 1
    verify_step(runner, [4, 1], [11, 12])  # a chunk longer than Q: eager
    verify_step(runner, [2, 1], [62, 12])  # padding would pass max_model_len: eager
    assert runner.model.calls == calls + 2 and graph.replays == 1


@pytest.mark.parametrize("why", ["lora", "backend", "no spec"])
def test_no_verification_graphs(why):
    kw = {"lora": {"enable_lora": True}, "backend": {"graph_safe_varlen": False}}.get(why, {})
    runner, _ = make_runner(spec_tokens=None if why == "no spec" else 2, **kw)
    runner.capture()
    assert runner.spec_q == 0 and runner.spec_graphs == {} and len(runner.graphs) == 4
    out = verify_step(runner, [1, 3], [11, 20])
    assert out[:, 2].tolist() == [11, 20, 20, 20]  # eager, unpadded


def test_prefill_capture_sizes():
    assert prefill_capture_sizes(40) == [16, 32, 40]
    assert prefill_capture_sizes(100) == [16, 32, 64, 100]
    sizes = prefill_capture_sizes(8192)
    assert sizes[:4] == [16, 32, 64, 128] and sizes[-4:] == [1280, 1536, 1792, 2048]
    assert len(sizes) == 18 and prefill_capture_sizes(8192, limit=512)[-1] == 512


def chunk_step(runner, qlens, seq_lens):
    """A step with prompt chunks: request i has qlens[i] rows (decodes first)."""
    return verify_step(runner, qlens, seq_lens)


def test_prefill_steps_replay_padded_graphs(caplog):
    runner, _ = make_runner(prefill_graphs=True)
    with caplog.at_level(logging.INFO, logger="paged"):
        runner.capture()
    assert runner.prefill_sizes == [16, 32, 40] and sorted(runner.prefill_graphs) == [16, 32, 40]
    assert runner.prefill_reqs == 6 and runner.input_ids.shape == (40,)
    assert runner.backend.plans[:3] == [("eager", 6)] * 3  # captured first, largest first
    assert "captured 7 Fake graphs" in caplog.text
    assert "prompt chunks up to 40 tokens and 6 requests" in caplog.text
    calls = runner.model.calls
    out = chunk_step(runner, [1, 1, 9], [11, 12, 30])  # two decodes and a chunk: 11 rows -> 16
    graph = runner.prefill_graphs[16][0]
    assert graph.replays == 1 and runner.model.calls == calls
    req = [0, 1] + [2] * 9
    expected = [[5 + t, 20 + t, [11, 12, 30][r], 100 + t, 3 + r] for t, r in enumerate(req)]
    assert out.tolist() == expected
    assert runner.prefill_qsl.tolist() == [0, 1, 2, 11, 11, 11, 11]  # the rest: empty
    assert runner.seq_lens[3:6].tolist() == [0, 0, 0]
    assert runner.slots[11:16].tolist() == [-1] * 5  # padding rows write nowhere
    chunk_step(runner, [16, 16], [16, 32])  # 32 rows: the graph of 32, exactly
    assert runner.prefill_graphs[32][0].replays == 1
    step(runner, 4)  # a pure decode step: its own graph
    assert runner.graphs[4][0].replays == 1
    chunk_step(runner, [20, 21], [20, 21])  # 41 rows: more than captured, eager
    assert runner.model.calls == calls + 1


def test_prefill_graphs_hold_few_requests():
    class FewRequests(FakeGraphRunner):
        max_prefill_capture_reqs = 2

    runner, _ = make_runner(FewRequests, prefill_graphs=True)
    runner.capture()
    assert runner.prefill_reqs == 2 and runner.prefill_qsl.shape == (3,)
    calls = runner.model.calls
    out = chunk_step(runner, [1, 1, 3], [11, 12, 13])  # three requests: eager
    assert runner.model.calls == calls + 1 and out[:, 2].tolist() == [11, 12, 13, 13, 13]
    chunk_step(runner, [1, 3], [11, 13])
    assert runner.model.calls == calls + 1 and runner.prefill_graphs[16][0].replays == 1


@pytest.mark.parametrize("why", ["off", "lora", "backend", "stages"])
def test_no_prefill_graphs(why):
    kw = {"lora": {"enable_lora": True}, "backend": {"graph_safe_varlen": False}}.get(why, {})
    runner, _ = make_runner(prefill_graphs=why != "off", **kw)
    runner.config.pipeline_parallel_size = 2 if why == "stages" else 1
    runner.capture()
    assert runner.prefill_graphs == {} and runner.prefill_reqs == 0 and len(runner.graphs) == 4
    calls = runner.model.calls
    chunk_step(runner, [1, 3], [11, 13])
    assert runner.model.calls == calls + 1
