"""EngineCore: the step loop. Owns the platform, model runner, KV pool and scheduler.

It sees token ids only: tokenization and detokenization happen outside it, so that a
server can run it in its own process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

from paged.config import EngineConfig
from paged.engine.kv_cache import KVCacheManager
from paged.engine.launch_clock import LaunchClock
from paged.engine.messages import REJECTED, EngineOutput  # EngineOutput re-exported
from paged.engine.pooling import prepare as prepare_pooling
from paged.engine.request import Request, sample_params, sequence_ids
from paged.engine.scheduler import Scheduler
from paged.engine.warmup import warm_up
from paged.executor import WorkerFailure, create_executor
from paged.kernels.compile_watch import CompileWatch, watch_compiles
from paged.lora.request import LoRARequest
from paged.model.pooling_config import resolve_pooler, resolve_runner
from paged.plugins import select_platform
from paged.sampling.params import SamplingParams
from paged.sampling.structured import MaskFill, StructuredOutputs
from paged.worker.worker import load_model_config, resolve_config

if TYPE_CHECKING:
    from paged.engine.faults import Faults
    from paged.scheduled import TokenBitmask

log = logging.getLogger("paged")
UNSATISFIABLE = (
    "structured_outputs: no token of the model's vocabulary can continue the output under this "
    "request's constraints (the structured output with min_tokens, allowed_token_ids and "
    "bad_words): it asks for text the tokenizer cannot produce"
)


def eos_ids(hf_config) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (eos,)


class EngineCore:
    def __init__(
        self, config: EngineConfig, faults: Faults | None = None, exit_on_failure: bool = False
    ) -> None:
        """`config` is not changed: the engine resolves it into its own (`self.config`).
        `faults`: test-only fault injection (paged.engine.faults); None in production.
        `exit_on_failure`: a worker's death ends this process (an engine-core process)."""
        t0 = time.perf_counter()
        if config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size: one engine is one replica; serve several with "
                "`paged serve --data-parallel-size N`"
            )
        self.platform = select_platform(config.platform)
        self.platform.configure(config.platform_options)
        self.hf_config, self.source = load_model_config(config)
        self.config = config = resolve_config(config, self.platform, self.hf_config)
        # --runner: a pooling model is built without its LM head (docs/models.md, Embeddings)
        weights = None if config.load_format == "dummy" else self.source  # dummy: drawn, head too
        runner = resolve_runner(config.runner, self.hf_config, weights)
        if runner == "pooling" and config.pipeline_parallel_size > 1:
            raise ValueError("runner pooling: not supported with pipeline_parallel_size > 1")
        self.config = config = dataclasses.replace(config, runner=runner)
        self.pooler = resolve_pooler(config.pooler_config, self.hf_config, self.source)
        self.max_model_len = config.max_model_len
        self.eos_token_ids = eos_ids(self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.executor = create_executor(config, exit_on_failure)
        self.runner = self.executor.runner  # the driver's (rank 0)
        self.num_blocks = self.executor.num_blocks
        if faults is not None:
            from paged.engine.faults import install

            install(self.runner, faults)
        # A block list per KV-cache group (the runner's); windowed groups release the blocks
        # out of their window (docs/architecture.md).
        self.kv = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            group_windows=self.runner.kv_groups.windows,
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.max_loras if config.enable_lora else 0,
        )
        self.requests: dict[str, Request] = {}
        self.spec = None  # speculative decoding (docs/speculative.md)
        if config.speculative_config is not None:
            from paged.spec_decode.decoder import SpecDecoder

            driver = getattr(self.executor, "driver", None)
            draft = getattr(driver, "draft", None)  # the driver's draft runner or EAGLE head
            self.spec = SpecDecoder(config.speculative_config, draft, self.runner)
            self.scheduler.lookahead = self.spec.lookahead
        # Masks (structured outputs, allowed ids, bad words): compiled off the step loop.
        self.structured = StructuredOutputs(
            self._load_tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            config.structured_outputs_backend,
        )
        self.structured.pin_memory = self.platform.pin_memory
        self._filler: ThreadPoolExecutor | None = None  # fills masks beside the resolve
        self.inflight = None  # (batch, handle, computed counts) of a launched step
        self.clock = LaunchClock()  # step times, for the serving loop's late launch
        self.reset_counters()
        self.compile_watch: CompileWatch | None = None
        warm = config.kernel_warmup
        if (self.platform.kernel_warmup if warm is None else warm) and runner == "generate":
            warm_up(self)  # kernels compile now, not in the first requests
            self.compile_watch = watch_compiles()  # and any it missed is logged
        log.info(
            "engine ready on %s (%s, %s) in %.1f s: %d KV blocks of %d tokens (%d tokens)",
            self.platform.name,
            config.dtype,
            self.runner.backend.name,
            time.perf_counter() - t0,
            self.num_blocks,
            config.block_size,
            self.num_blocks * config.block_size,
        )

    # ---- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.pooling is not None:  # an embedding request: may fill the context
            prompt_token_ids, params = self._pooling_request(prompt_token_ids, params)
        elif self.config.runner == "pooling":
            raise ValueError(
                "model: this model runs for pooling (--runner pooling, no LM head): it serves "
                "embeddings (/v1/embeddings, LLM.embed), not generation"
            )
        n = len(prompt_token_ids)
        if n >= self.max_model_len and params.pooling is None:
            raise ValueError(
                f"prompt: {n} tokens, but the model's context length is "
                f"{self.max_model_len} (the prompt must leave room for output)"
            )
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt: token id {bad} is out of vocabulary (vocabulary size {self.vocab_size})"
            )
        for t in params.stop_token_ids or []:
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"stop_token_ids: token id {t} is out of vocabulary "
                    f"(vocabulary size {self.vocab_size})"
                )
        for t in params.logit_bias or {}:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(
                    f"logit_bias: token id {t} is out of vocabulary "
                    f"(vocabulary size {self.vocab_size})"
                )
        for name in ("logprobs", "prompt_logprobs"):  # --max-logprobs
            k = getattr(params, name)
            if k is not None and k > self.config.max_logprobs:
                raise ValueError(f"{name}: {k} asked for, but this server returns at most "
                                 f"{self.config.max_logprobs} (--max-logprobs)")  # fmt: skip
        if lora_request is not None:  # read and checked against the model once per id
            if self.runner.lora is None:
                raise ValueError("lora_request: LoRA adapters need --enable-lora")
            self.runner.lora.check(lora_request)
        params = dataclasses.replace(params, eos_token_ids=self.eos_token_ids)  # ours, not theirs
        # n > 1 (or best_of): one sequence each, `sequence_ids`; the prompt is computed once.
        ids = sequence_ids(request_id, params.num_sequences)
        if any(i in self.requests for i in ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        seqs = [
            Request(i, prompt_token_ids, sample_params(params, k), lora_request=lora_request)
            for k, i in enumerate(ids)
        ]
        masked = StructuredOutputs.needs(params)
        if masked:  # scheduled once its mask is ready (step())
            self.structured.add(seqs)
        for req in seqs:
            self.requests[req.request_id] = req
        if not masked:
            self.scheduler.add(seqs[0], seqs[1:])
        self.stats["prompt_tokens"] += n

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded): its slot and host copy are freed. Requests already
        running with it finish with it (its slot is only reused once none is)."""
        if self.runner.lora is not None and not any(
            r.lora_int_id == lora_int_id for r in self.requests.values()
        ):
            self.runner.lora.forget(lora_int_id)

    def _pooling_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        if self.config.pipeline_parallel_size > 1:
            raise ValueError("input: embeddings are not supported with pipeline parallelism")
        return prepare_pooling(self.pooler, params, prompt_token_ids, self.max_model_len)

    def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.finish(req, reason)
                self.structured.free(rid)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self.inflight is not None
            or bool(self.structured.pending)
        )

    def _load_tokenizer(self):
        """The tokenizer, for the masks' vocabulary (loaded once, by the first request that
        needs it; the front end has its own)."""
        if self.source is None:
            return None
        from paged.model.loader import load_tokenizer

        return load_tokenizer(self.source, self.config.tokenizer)

    def _admit_masked(self) -> list[EngineOutput]:
        """Schedule the requests whose masks are now ready; reject those that failed. With
        nothing else to run, wait a little for one instead of spinning."""
        idle = not self.scheduler.has_unfinished() and self.inflight is None
        ready, failed = self.structured.ready(0.05 if idle else 0.0)
        for seqs in ready:
            self.scheduler.add(seqs[0], seqs[1:])
        outs = []
        for req, why in failed:  # "rejected": a client error, as a refusal in add_request
            self.requests.pop(req.request_id, None)
            self.scheduler.finish(req, "rejected")
            outs.append(self._output(req, [], error=why))
        return outs

    def metrics(self) -> dict[str, float]:
        """Gauges and counters for /metrics (counters are totals since start)."""
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": self.kv.usage,
            "prefix_cache_queries": self.kv.queries,
            "prefix_cache_hits": self.kv.hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.stats["prompt_tokens"],
            "prompt_tokens_computed": self.scheduler.num_prompt_computed,
            "generation_tokens": self.stats["generation_tokens"],
            "num_free_blocks": self.kv.num_free_blocks,
            "num_blocks": self.num_blocks,
            "kv_window_released_blocks": self.kv.num_window_released,
            "late_launches": self.clock.launches,
            "late_launches_missed": self.clock.missed,
            "kernel_compiles": self.compile_watch.compiled if self.compile_watch else 0,
            **(self.spec.metrics() if self.spec is not None else {}),
        }

    def reset_counters(self) -> None:
        """Every counter /metrics reports, as at start (also after the start-up warm-up)."""
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self.kv.reset_counters()
        self.scheduler.reset_counters()
        self.clock.reset_counters()
        if self.spec is not None:
            self.spec.reset_counters()

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule and launch one step; return the outputs of the steps that completed.

        With overlap (``runner.overlap``) the step launched here completes in the next call:
        the scheduler counts its tokens as pending placeholders, the next step reads them on
        the device, and the host work of both calls runs while the device computes."""
        outs: list[EngineOutput] = []
        if self.structured.pending:
            outs += self._admit_masked()
        prev = self.inflight
        if prev is not None and prev[1].pending is not None:  # its mask is being filled
            mask = prev[0].token_bitmask  # a DeferredMask: only those defer the sampling
            try:  # queue its sampling now, before this step's forward
                prev[1].finish()
            except Exception as e:
                self._fatal(e)
                outs += self._fail([r for r in prev[0].reqs if not r.finished], e)
                prev = self.inflight = None
            finally:
                mask.wait()  # never two fills at once, whatever failed
        if prev is not None and not self._can_overlap():
            outs += self._resolve(prev)
            prev = self.inflight = None
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if self.spec is not None:  # proposals for the decodes given lookahead slots
            self.spec.propose(batch)
        fill = None
        if self.structured.masks and prev is not None:  # filled beside prev's resolve
            fill = batch.token_bitmask = DeferredMask()
        elif self.structured.masks:  # filled by the driver while the forward runs
            batch.token_bitmask = partial(self.structured.bitmask, batch)
        launched = None
        if batch.reqs:
            try:
                handle = self.executor.launch(batch, prev[1] if prev else None)
                launched = (batch, handle, self.scheduler.launched(batch))
                now = time.perf_counter()
                self.clock.launched(batch, now - t0, now, behind=prev is not None)
            except Exception as e:  # fail this step's requests, keep the engine alive
                self._fatal(e)
                outs += self._fail(batch.reqs, e)
        if prev is not None:
            if fill is not None and launched is not None:  # its sampling is queued by the
                self._fill_beside(fill, batch, prev)  # next call, once this one returned
            outs += self._resolve(prev)
        self.inflight = launched if self.runner.overlap else None
        if launched is not None and not self.runner.overlap:
            outs += self._resolve(launched)
        return outs

    def launch_deadline(self) -> float | None:
        """With a step in flight under overlap and `late_launch`: when (time.perf_counter)
        the next step should be scheduled so that the device finds it queued when the one in
        flight ends (paged.engine.launch_clock); None: at once."""
        if self.inflight is None or not self.config.late_launch:
            return None
        return self.clock.deadline(time.perf_counter())

    def _fill_beside(self, mask: DeferredMask, batch, prev) -> None:
        """Start `batch`'s mask once its forward is queued: the matchers take the tokens of
        the step in flight (`prev`: the device samples them before `batch`'s forward, so the
        wait is short), then xgrammar fills the rows in a thread (C++, without the GIL) while
        this thread resolves `prev` (detokenizing, stop checks). Only the C++ call leaves this
        thread: Python work in both would queue for the GIL (up to its 5 ms switch interval
        each time). The runner leaves the step's sampling to `StepHandle.finish`, which the
        next call of `step()` runs first: the fill also hides behind the caller's handling of
        this call's outputs (detokenizing), and the sampling is still queued before the next
        forward (whose decodes read its tokens on the device)."""
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="paged-mask")
        try:
            handle = prev[1]
            try:
                sampled, _ = handle.result()
            except Exception:  # the step failed: _resolve(prev) reports it
                sampled = []
            self.structured.accept_early(handle.reqs, sampled)
            mask.start(self.structured.begin_fill(batch), self._filler)
        except Exception as e:  # reported through the step that uses the mask
            mask.start_failed(e)

    def _can_overlap(self) -> bool:
        """Penalties and bad words read the output tokens on the host: those steps wait for
        the last one. Grammars take the token in flight early (_fill_beside). So do steps where a
        request may speculate: its proposals follow its last token, on the host."""
        spec = self.spec
        return self.runner.overlap and not any(
            r.params.needs_penalties
            or StructuredOutputs.needs_sync(r.params)
            or (spec is not None and spec.lookahead(r))
            for r in self.scheduler.running
        )

    def _resolve(self, launched) -> list[EngineOutput]:
        batch, handle, computed = launched
        try:
            t0 = time.perf_counter()
            sampled, logprobs = handle.result()
            now = time.perf_counter()
            self.clock.ended(now - t0, now)
            embeddings = handle.embeddings()
            for rid, (first, entries, ranks) in handle.prompt_logprobs().items():
                if rid in self.requests:
                    self.requests[rid].add_prompt_logprobs(first, entries, ranks)
        except Exception as e:
            self._fatal(e)
            forked = [f for _, fs in batch.forks for f in fs]
            return self._fail([r for r in [*batch.reqs, *forked] if not r.finished], e)
        outs = []
        extra = getattr(handle, "extra", {})  # verifying requests: tokens after the first
        if self.spec is not None:
            self.spec.record(batch, {rid: len(e[0]) for rid, e in extra.items()})
        more = {rid: e[0] for rid, e in extra.items()}
        for req, toks in self.scheduler.resolve(batch, computed, handle.reqs, sampled, more):
            tok = toks[0]
            self.stats["generation_tokens"] += len(toks)
            error = None
            if not req.finished and self.structured.masks:
                state = self.structured.accept(req.request_id, tok)
                if state == "done":  # the grammar is complete
                    self.scheduler.finish(req, "stop")
                elif state == "refused":  # the mask left nothing: the client's constraints
                    self.scheduler.finish(req, REJECTED)  # can't be met (a 400, not a 500)
                    error = UNSATISFIABLE
            if req.finished:
                self.requests.pop(req.request_id, None)
                self.structured.free(req.request_id)
            out = self._output(req, toks, error=error)
            if req.request_id in logprobs:
                rest = extra.get(req.request_id, ([], [], []))
                out.logprobs = [logprobs[req.request_id], *rest[1][: len(toks) - 1]]
                out.ranks = [handle.ranks[req.request_id], *rest[2][: len(toks) - 1]]
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                out.prompt_logprobs, out.prompt_ranks = req.prompt_logprobs, req.prompt_ranks
                req.prompt_logprobs_sent = True
            outs.append(out)
        for rid, vec in embeddings.items():  # embedding requests whose prompt is done
            req = self.requests.pop(rid, None)
            if req is None or req.finished:  # aborted while the step ran
                continue
            self.scheduler.finish(req, "stop")
            out = self._output(req, [])
            out.embedding = vec
            outs.append(out)
        return outs

    def _fatal(self, e: Exception) -> None:
        """A step failed because a worker is gone: the replica cannot go on."""
        why = self.executor.wait_failure(2.0)
        if isinstance(e, WorkerFailure) or why is not None:
            raise WorkerFailure(why or str(e)) from e

    def shutdown(self) -> None:
        """Stop the workers (a no-op with one rank)."""
        if self._filler is not None:
            self._filler.shutdown(wait=False)
        if self.compile_watch is not None:
            self.compile_watch.stop()
            self.compile_watch = None
        self.executor.shutdown()

    def _fail(self, reqs: list[Request], e: Exception) -> list[EngineOutput]:
        log.exception("step failed", exc_info=e)
        outs = []
        reqs = [*reqs, *(f for r in reqs for f in r.followers)]  # sequences not forked yet
        for req in reqs:
            self.scheduler.finish(req, "error")
            self.requests.pop(req.request_id, None)
            self.structured.free(req.request_id)
            outs.append(self._output(req, [], error=f"{type(e).__name__}: {e}"))
        return outs

    def _output(self, req: Request, new: list[int], error: str | None = None) -> EngineOutput:
        return EngineOutput(
            req.request_id,
            new,
            req.finished,
            req.finish_reason,
            req.stop_reason,
            req.num_prompt_tokens,
            max(req.num_cached_tokens, 0),
            error,
        )


class DeferredMask:
    """A step's structured-outputs bitmask filled while the engine resolves the step before
    (`EngineCore._fill_beside`): the runner defers the step's sampling when handed one
    (`deferred`); calling it waits for xgrammar's rows and finishes the mask."""

    deferred = True

    def __init__(self) -> None:
        self.fill: MaskFill | None = None
        self.future: Future | None = None
        self.error: Exception | None = None

    def start(self, fill: MaskFill | None, pool: ThreadPoolExecutor) -> None:
        self.fill = fill
        if fill is not None:
            self.future = pool.submit(fill.grammar)

    def start_failed(self, error: Exception) -> None:
        self.error = error

    def __call__(self) -> TokenBitmask | None:
        if self.error is not None:
            raise self.error
        if self.future is not None:
            self.future.result()
        return self.fill.finish() if self.fill is not None else None

    def wait(self) -> None:
        """Wait for xgrammar's rows (never two fills at once), whatever failed."""
        if self.future is not None:
            try:
                self.future.result()
            except Exception:  # reported through the step that used it
                pass
