"""Graph capture, device-neutral: decode graphs are captured at start-up for a set of batch
sizes and replayed with the batch padded up to the nearest captured size. Every step after a
capture that fails runs eagerly (unless the platform asks for the error instead).

Steps with prompt chunks (`prefill_graphs`, where the backend's varlen plan is fixed by static
shapes) get graphs of their own, one per token count up to `max_prefill_capture_tokens`, for
up to `max_prefill_capture_reqs` requests: the step's tokens fill the first rows (the rest
are padding rows: no KV slot, outputs dropped), its requests the first entries of a static
query_start_loc (the rest empty sequences). Their eager forward is host-bound (hundreds of
launches against a few milliseconds of device work); a replay is one launch. Larger steps,
whose device time hides their launches, run eagerly.

With speculative decoding, a second set of graphs runs the verification steps: every request
padded to Q = 1 + num_speculative_tokens query rows (a plain decode, a verification of fewer
proposals, or a short prompt chunk alike), its padding rows after its real ones writing no KV
and its sequence length grown by the padding, so that its context (length - Q) is unchanged
and causality keeps the padding keys from its real rows. Only backends whose varlen plan is
fixed by static shapes (`graph_safe_varlen`) get these graphs.

A platform subclasses `GraphStepRunner` and supplies the device's graph API through four
small methods (`new_graph`, `graph_capture`, `graph_pool`, and `graphs_available` where
the API may be missing); synchronization goes through `Platform.synchronize`.

Decode graphs up to `max_tail_capture_size` also run the step's tail when the model runner
sets `tail` (the LM head and the greedy argmax: `decode_logits` replays them), so a small
batch's step is one graph from input ids to greedy tokens. Larger batches leave the head out:
their launches cost little beside the step, and the static logits would hold memory. Where
the model runner also sets `sampler`, each of those sizes gets two small graphs more that
draw from the tail's logits (`decode_sample`: requests that sample with temperature, top-k /
top-p and min-p alone; one graph with the top-k/top-p sort, one without), so a sampled step
too needs no eager kernel between its input ids and its tokens. Their random numbers come
from the device's default generator, which the graph API advances at every replay.

A model with several KV-cache groups (model/kv_groups.py) gets static block tables and slot
mappings per group (`group_tables`, `group_slots`; the first group's are `tables`, `slots`).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from tqdm import tqdm

from paged.model.attention import AttentionMetadata, plan_groups
from paged.worker.step_runner import StepRunner, Tail

log = logging.getLogger("paged")


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, then every 16 up to min(max_num_seqs, limit)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    return sorted(set(sizes + [top]))


def prefill_capture_sizes(max_tokens: int, limit: int = 2048) -> list[int]:
    """Token counts of steps with prompt chunks to capture: 16, 32, every 64 up to 512, every
    128 up to 1024, every 256 above, up to min(max_tokens, limit). Above 512 the steps fall
    within a GEMM tile or two of a captured count."""
    top = min(max_tokens, limit)
    sizes = [16, 32, *range(64, 513, 64), *range(640, 1025, 128), *range(1280, top + 1, 256)]
    return sorted({s for s in sizes if s <= top} | {top})


class GraphStepRunner(StepRunner):
    graph_name: ClassVar[str] = "device"  # in the progress bar and log lines ("CUDA", "HIP")
    max_capture_size: ClassVar[int] = 512  # the largest decode batch captured
    # After a capture that raises RuntimeError: log a warning and run every step eagerly
    # (True), or let the error propagate (False).
    eager_fallback: ClassVar[bool] = True

    max_spec_capture_size: ClassVar[int] = 128  # the largest verification batch captured
    max_tail_capture_size: ClassVar[int] = 32  # the largest decode graph that runs `tail` too
    # Steps with prompt chunks: the most tokens and requests a captured one holds.
    max_prefill_capture_tokens: ClassVar[int] = 2048
    max_prefill_capture_reqs: ClassVar[int] = 64

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, tuple[Any, torch.Tensor, AttentionMetadata]] = {}
        self.sizes: list[int] = []
        self.tails: dict[int, Tail] = {}  # decode size -> the tail's outputs in its graph
        # (decode size, sort) -> (graph, its token ids): `sampler` over that size's tail
        self.sample_graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor]] = {}
        self.spec_graphs: dict[int, tuple[Any, torch.Tensor, AttentionMetadata]] = {}
        self.spec_sizes: list[int] = []
        self.spec_q = self.spec_width()
        self.prefill_graphs: dict[int, tuple[Any, torch.Tensor, AttentionMetadata]] = {}
        self.prefill_sizes: list[int] = []
        self.prefill_reqs = 0  # requests in each prefill graph (its static batch)

    # The device's graph API: overridden per platform.

    def graphs_available(self) -> bool:
        """False where this torch build has no graph API: the runner stays eager."""
        return True

    def new_graph(self) -> Any:
        """A fresh graph object with a `replay()` method (CUDA: a new `CUDAGraph`)."""
        raise NotImplementedError

    def graph_capture(self, graph: Any, pool: Any) -> AbstractContextManager:
        """The context manager that records into `graph`, allocating from `pool`."""
        raise NotImplementedError

    def graph_pool(self) -> Any:
        """A memory-pool handle shared by all captured graphs (None: the API's default)."""
        return None

    def synchronize(self) -> None:
        self.platform.synchronize()

    # Capture and replay.

    def spec_width(self) -> int:
        """Query rows per request in a verification graph (1 + proposals); 0: no such graphs
        (no speculative decoding, LoRA's per-token slots, or a backend whose varlen plan
        reads the host)."""
        spec = getattr(self.config, "speculative_config", None)
        if spec is None or getattr(self.config, "enable_lora", False):
            return 0
        if not getattr(self.backend, "graph_safe_varlen", False):
            return 0
        return 1 + spec.num_speculative_tokens

    def prefill_plan(self, top: int) -> tuple[list[int], int]:
        """(token counts, requests) of the graphs for steps with prompt chunks, ([], 0) where
        there are none: off, LoRA (its token slots are planned per step), pipeline stages
        (their forward does not come here), or a backend whose varlen plan reads the host."""
        cfg = self.config
        if (
            not cfg.prefill_graphs
            or getattr(cfg, "enable_lora", False)
            or getattr(cfg, "pipeline_parallel_size", 1) > 1
            or not getattr(self.backend, "graph_safe_varlen", False)
        ):
            return [], 0
        sizes = prefill_capture_sizes(cfg.max_num_batched_tokens, self.max_prefill_capture_tokens)
        return sizes, min(top, self.max_prefill_capture_reqs)

    def allocate_static_inputs(self, top: int, top_tokens: int | None = None) -> None:
        """Input buffers the graphs read, sized for the largest captured batch (`top`
        requests, `top_tokens` query rows: `top` unless verification graphs need more)."""
        cfg, dev = self.config, self.platform.device
        max_blocks = -(-cfg.max_model_len // cfg.block_size)
        rows = max(top, top_tokens or 0)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=dev)
        more = range(self.num_kv_groups - 1)  # KV-cache groups after the first
        self.group_slots = [self.slots, *(torch.full_like(self.slots, -1) for _ in more)]
        self.group_tables = [self.tables, *(torch.zeros_like(self.tables) for _ in more)]
        self.qsl = torch.arange(top + 1, dtype=torch.int32, device=dev)
        if self.spec_q:  # verification graphs: Q rows per request
            q = self.spec_q
            self.spec_qsl = torch.arange(0, top * q + 1, q, dtype=torch.int32, device=dev)
        if self.prefill_reqs:  # prefill graphs: written at each replay
            self.prefill_qsl = torch.zeros(self.prefill_reqs + 1, dtype=torch.int32, device=dev)

    def graph_meta(self, n: int) -> AttentionMetadata:
        """The planned metadata of a captured decode batch of `n`: views of the static
        buffers, lengths bounded by max_model_len, a plan fixed from static shapes only."""
        meta = AttentionMetadata(
            num_reqs=n,
            num_decodes=n,
            num_tokens=n,
            query_start_loc=self.qsl[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.tables[:n],
            slot_mapping=self.slots[:n],
            max_query_len=1,
            max_seq_len=self.config.max_model_len,
        )
        plan_for_graph = getattr(self.backend, "plan_for_graph", None)
        return plan_groups(self.backend, self._group_views(meta, n, n), plan_for_graph)

    def spec_graph_meta(self, n: int) -> AttentionMetadata:
        """The metadata of a captured verification batch of `n` requests x Q rows."""
        q = self.spec_q
        meta = AttentionMetadata(
            num_reqs=n,
            num_decodes=0,
            num_tokens=n * q,
            query_start_loc=self.spec_qsl[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.tables[:n],
            slot_mapping=self.slots[: n * q],
            max_query_len=q,
            max_seq_len=self.config.max_model_len,
        )
        return plan_groups(self.backend, self._group_views(meta, n, n * q))

    def prefill_graph_meta(self, t: int) -> AttentionMetadata:
        """The metadata of a captured step of `t` token rows and `prefill_reqs` requests:
        views of the static buffers; max_query_len t picks the varlen tiles."""
        r = self.prefill_reqs
        meta = AttentionMetadata(
            num_reqs=r,
            num_decodes=0,
            num_tokens=t,
            query_start_loc=self.prefill_qsl,
            seq_lens=self.seq_lens[:r],
            block_tables=self.tables[:r],
            slot_mapping=self.slots[:t],
            max_query_len=t,
            max_seq_len=self.config.max_model_len,
        )
        return plan_groups(self.backend, self._group_views(meta, r, t))

    def _group_views(self, meta: AttentionMetadata, n: int, rows: int) -> AttentionMetadata:
        """`meta` with a view of every other KV-cache group's static table and slots."""
        meta.group_views = [
            dataclasses.replace(
                meta, block_tables=table[:n], slot_mapping=slots[:rows], group_views=[]
            )
            for table, slots in zip(self.group_tables[1:], self.group_slots[1:])
        ]
        return meta

    def _copy_groups(self, meta: AttentionMetadata, rows: torch.Tensor | None = None) -> None:
        """Each KV-cache group's block tables and slot mapping into its static buffers (the
        slots at `rows`, or the first ones)."""
        n, width = meta.num_reqs, meta.block_tables.shape[1]
        views = [meta, *meta.group_views]
        for view, table, slots in zip(views, self.group_tables, self.group_slots):
            table[:n, :width].copy_(view.block_tables, non_blocking=True)
            if rows is None:
                slots[: view.slot_mapping.shape[0]].copy_(view.slot_mapping, non_blocking=True)
            else:
                slots.index_copy_(0, rows, view.slot_mapping)

    def _graph_body(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        with_tail: bool,
    ) -> tuple[torch.Tensor, Tail | None]:
        """What a graph records: the forward, then the tail where asked."""
        out = self.model(input_ids, positions, meta)
        return out, (self.tail(out) if with_tail else None)

    def _sampler_body(self, n: int, sort: bool) -> torch.Tensor:
        """What a sampler graph records: the draw over decode size n's tail."""
        logits, greedy = self.tails[n]
        return self.sampler(logits, greedy, self.sample_params[:, :n], sort)

    def capture(self) -> None:
        if self.config.enforce_eager or not self.graphs_available():
            return
        sizes = capture_sizes(self.config.max_num_seqs, self.max_capture_size)
        q = self.spec_q
        spec_sizes = []
        if q:  # verification graphs (speculative decoding)
            spec_sizes = capture_sizes(self.config.max_num_seqs, self.max_spec_capture_size)
        prefill_sizes, self.prefill_reqs = self.prefill_plan(sizes[-1])
        rows = max(max(spec_sizes, default=0) * q, max(prefill_sizes, default=0))
        self.allocate_static_inputs(sizes[-1], rows)
        ensure_workspace = getattr(self.backend, "ensure_workspace", None)
        if ensure_workspace is not None:  # the backend's workspace for the largest batch
            ensure_workspace(sizes[-1])
        t0 = time.perf_counter()
        # The largest first (prefill steps hold the most activations): the pool is reused.
        todo = (
            [("prefill", t) for t in reversed(prefill_sizes)]
            + [("decode", n) for n in reversed(sizes)]
            + [("verify", n) for n in reversed(spec_sizes)]
        )
        kept = {"prefill": self.prefill_graphs, "decode": self.graphs, "verify": self.spec_graphs}
        try:
            pool = self.graph_pool()
            desc = f"Capturing {self.graph_name} graphs"
            for kind, n in tqdm(todo, desc=desc, leave=False):
                if kind == "prefill":
                    meta, t = self.prefill_graph_meta(n), n
                elif kind == "decode":
                    meta, t = self.graph_meta(n), n
                else:
                    meta, t = self.spec_graph_meta(n), n * q
                tail = kind == "decode" and self.tail is not None
                tail = tail and n <= self.max_tail_capture_size
                args = (self.input_ids[:t], self.positions[:t], meta, tail)
                with torch.inference_mode():
                    for _ in range(2):  # warm-up: kernels compile outside the capture
                        self._graph_body(*args)
                    self.synchronize()
                    graph = self.new_graph()
                    with self.graph_capture(graph, pool):
                        out, tail_out = self._graph_body(*args)
                kept[kind][n] = (graph, out, meta)
                if tail_out is not None:
                    self.tails[n] = tail_out
        except RuntimeError as e:  # a driver or op that cannot be captured
            if not self.eager_fallback:
                raise
            log.warning("%s graph capture failed, running eagerly: %s", self.graph_name, e)
            for graphs in kept.values():
                graphs.clear()
            self.tails.clear()
            return
        try:
            self._capture_samplers(pool)
        except RuntimeError as e:  # the decode graphs stay; the draw runs eagerly
            if not self.eager_fallback:
                raise
            log.warning("%s sampler graph capture failed, sampling eagerly: %s",
                        self.graph_name, e)  # fmt: skip
            self.sample_graphs.clear()
        self.synchronize()
        self.sizes, self.spec_sizes, self.prefill_sizes = sizes, spec_sizes, prefill_sizes
        spec = f", verification batch 1..{spec_sizes[-1]} x {q} rows" if spec_sizes else ""
        if prefill_sizes:
            spec += (f", steps with prompt chunks up to {prefill_sizes[-1]} tokens and "
                     f"{self.prefill_reqs} requests")  # fmt: skip
        if self.tails:
            spec += f", LM head and greedy tokens inside up to batch {max(self.tails)}"
        if self.sample_graphs:
            spec += " (sampled tokens in graphs of their own)"
        log.info(
            "captured %d %s graphs (decode batch 1..%d%s) in %.1f s",
            len(self.graphs) + len(self.spec_graphs) + len(self.prefill_graphs),
            self.graph_name,
            sizes[-1],
            spec,
            time.perf_counter() - t0,
        )

    def _capture_samplers(self, pool: Any) -> None:
        """Two sampler graphs (with and without the sort) per decode size whose graph runs
        the tail; every row's parameters in `sample_params` [4, max size]."""
        if self.sampler is None or not self.tails or self.tails[min(self.tails)][0] is None:
            return
        self.sample_params = torch.zeros(4, max(self.tails), dtype=torch.float32,
                                         device=self.platform.device)  # fmt: skip
        self.sample_params[1:3] = 1.0  # (top_k 1, top_p 1: a greedy row's values suffice)
        with torch.inference_mode():
            for n in sorted(self.tails):
                for sort in (False, True):
                    for _ in range(2):  # warm-up, outside the capture
                        self._sampler_body(n, sort)
                    self.synchronize()
                    graph = self.new_graph()
                    with self.graph_capture(graph, pool):
                        ids = self._sampler_body(n, sort)
                    self.sample_graphs[(n, sort)] = (graph, ids)

    @torch.inference_mode()
    def decode_sample(self, n: int, params: list[tuple], sort: bool) -> torch.Tensor | None:
        """Token ids of the decode step of n requests whose tail decode_logits just ran, drawn
        in its sampler graph from each row's (temperature, top_k, top_p, min_p); None
        where there is no such graph."""
        if not self.sample_graphs or n > max(self.tails):
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        graph, ids = self.sample_graphs[(size, sort)]
        host = torch.tensor(params, dtype=torch.float32).T.contiguous()  # [4, n]
        if self.platform.pin_memory:  # queued behind the forward, not waiting for it
            host = host.pin_memory()
        self.sample_params[:, :n].copy_(host, non_blocking=True)
        if size > n:  # padding rows: greedy
            self.sample_params[0, n:size].zero_()
        graph.replay()
        return ids[:n]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = meta.num_reqs
        if meta.num_decodes != n and self._fits_spec_graph(meta):
            return self._spec_forward(input_ids, positions, meta)
        if meta.num_decodes != n and self._fits_prefill_graph(meta, input_ids.shape[0]):
            return self._prefill_forward(input_ids, positions, meta)
        if not self.graphs or meta.num_decodes != n or n > self.sizes[-1]:
            return super().forward(input_ids, positions, meta)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        return self._replay(size, input_ids, positions, meta)[:n]

    @torch.inference_mode()
    def decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> Tail | None:
        """The tail's (logits, greedy ids) of a decode step, from a graph that ran it (None:
        no such graph for this step; call forward)."""
        n = meta.num_reqs
        if not self.tails or meta.num_decodes != n or n > max(self.tails):
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self._replay(size, input_ids, positions, meta)
        logits, ids = self.tails[size]
        return (None if logits is None else logits[:n]), (None if ids is None else ids[:n])

    def _replay(
        self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the decode graph of `size` on this step's inputs; its whole static output."""
        n = meta.num_reqs
        graph, out, _ = self.graphs[size]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self._copy_groups(meta)
        if size > n:  # padding rows attend to nothing and write nowhere
            for slots in self.group_slots:
                slots[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(0)
        graph.replay()
        return out

    def _fits_prefill_graph(self, meta: AttentionMetadata, tokens: int) -> bool:
        return bool(
            self.prefill_graphs
            and meta.num_reqs <= self.prefill_reqs
            and tokens <= self.prefill_sizes[-1]
        )

    def _prefill_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the prefill graph of the nearest token count: the step's tokens in its
        first rows, its requests in the first entries of query_start_loc, the rest empty."""
        n, t = meta.num_reqs, input_ids.shape[0]
        size = self.prefill_sizes[bisect.bisect_left(self.prefill_sizes, t)]
        graph, out, _ = self.prefill_graphs[size]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.prefill_qsl[: n + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.prefill_qsl[n + 1 :].fill_(t)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n : self.prefill_reqs].fill_(0)
        self._copy_groups(meta)
        for slots in self.group_slots:  # padding rows write nowhere
            slots[t:size].fill_(-1)
        graph.replay()
        return out[:t]

    def _fits_spec_graph(self, meta: AttentionMetadata) -> bool:
        """Whether a verification graph runs this step: each request's query rows fit in Q
        and its padded length stays within the block table."""
        return bool(
            self.spec_graphs
            and meta.num_reqs <= self.spec_sizes[-1]
            and meta.max_query_len <= self.spec_q
            and max(meta.seq_lens_cpu, default=0) + self.spec_q <= self.config.max_model_len
        )

    def _spec_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the verification graph: request i's rows at [i * Q, i * Q + len), padding
        rows after them (token 0, position 0, no KV slot), its length grown by the padding."""
        n, q = meta.num_reqs, self.spec_q
        size = self.spec_sizes[bisect.bisect_left(self.spec_sizes, n)]
        graph, out, _ = self.spec_graphs[size]
        lens = meta.query_lens_cpu
        rows = torch.tensor(
            [i * q + j for i, ln in enumerate(lens) for j in range(ln)], dtype=torch.long
        )
        padded = torch.tensor([s + q - ln for s, ln in zip(meta.seq_lens_cpu, lens)],
                              dtype=torch.int32)  # fmt: skip
        rows = rows.to(self.input_ids.device, non_blocking=True)
        t = size * q
        self.input_ids[:t].zero_()
        self.positions[:t].zero_()
        for slots in self.group_slots:
            slots[:t].fill_(-1)
        self.input_ids.index_copy_(0, rows, input_ids)
        self.positions.index_copy_(0, rows, positions)
        self.seq_lens[:n].copy_(padded, non_blocking=True)
        self._copy_groups(meta, rows)
        if size > n:  # padding requests attend to nothing
            self.seq_lens[n:size].fill_(0)
        graph.replay()
        return out.index_select(0, rows)
