"""Structured outputs with xgrammar: grammars, per-request matchers and each step's token mask.

The engine core owns one StructuredOutputs. It compiles a request's grammar off the step
loop (a thread pool; xgrammar's GrammarCompiler caches compiled grammars by spec), keeps a
GrammarMatcher per constrained request, fills a packed token bitmask (bit set: allowed) for
the constrained rows of each step and advances the matcher with each resolved token. The
same bitmask also carries `allowed_token_ids` and `bad_words`, so the device applies one
mask per step. The tokenizer (for xgrammar's TokenizerInfo and for tokenizing bad words) is
loaded in the engine core once, lazily, by the first request that needs it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paged.sampling.params import SamplingParams, StructuredOutputsParams
from paged.sampling.schema_limits import malformed, unenforced

if TYPE_CHECKING:
    from paged.scheduled import TokenBitmask

log = logging.getLogger("paged")
BACKENDS = ("auto", "xgrammar", "llguidance")
COMPILE_CACHE_BYTES = 512 << 20  # compiled grammars kept for reuse
KEEP_COMPILED = 32  # the last grammars used: their requests skip the compile pool
JSON_OBJECT = '{"type": "object"}'  # json_object's schema: any object, never an array
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] [^\s:]+:\d+: ")  # "[16:36:30] /project/x.cc:94: "


def check_backend(name: str) -> str:
    """The backend `--structured-outputs-backend` names, resolved ('auto' is xgrammar)."""
    if name not in BACKENDS:
        raise ValueError(
            f"structured_outputs_backend: {name!r} is not one of {', '.join(BACKENDS)}"
        )
    if name == "llguidance":
        try:
            import llguidance  # noqa: F401
        except ImportError:
            raise ValueError(
                "structured_outputs_backend: llguidance is not installed "
                "(pip install llguidance), use xgrammar"
            ) from None
        raise ValueError(
            "structured_outputs_backend: llguidance is installed but paged drives xgrammar "
            "only; use xgrammar (or auto)"
        )
    return "xgrammar"


def _clean(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGR_PREFIX.sub("", msg)[:500]


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are valid
    xgrammar EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_spec(sp: StructuredOutputsParams, field: str) -> None:
    """Parse the spec without a tokenizer (cheap): ValueError '`field`: why' if invalid.
    `field` is how the client spelled it (e.g. response_format.json_schema.schema)."""
    kind = sp.kind
    if kind == "json_object":
        return
    text = choice_ebnf(sp.choice) if kind == "choice" else sp.spec
    if kind == "json" and (found := _malformed(text)) is not None:
        where, why = found
        raise ValueError(f"{field}: invalid JSON schema: at {where or 'the root'}: {why}")
    try:
        _parse(kind, text)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / InvalidJSONError
        what = {"json": "invalid JSON schema", "regex": "invalid regex",
                "grammar": "invalid EBNF grammar", "choice": "invalid choices"}[kind]  # fmt: skip
        raise ValueError(f"{field}: {what}: {_clean(e)}") from None
    if kind == "json" and (found := _unenforced(text)) is not None:
        where, what = found
        raise ValueError(f"{field}: at {where or 'the root'}: {what}: the structured-outputs "
                         "backend (xgrammar) cannot enforce it; remove it")  # fmt: skip


@functools.lru_cache(maxsize=512)
def _malformed(text: str) -> tuple[str, str] | None:
    """Where a JSON schema's shape is wrong (xgrammar skips what no `$ref` reaches)."""
    return malformed(json.loads(text))


@functools.lru_cache(maxsize=512)
def _unenforced(text: str) -> tuple[str, str] | None:
    """The first keyword of a (valid) JSON schema xgrammar would ignore: (where, what)."""
    return next(unenforced(json.loads(text)), None)


@functools.lru_cache(maxsize=512)
def _parse(kind: str, text: str) -> None:
    """Parse a spec's text (raises when invalid). Valid ones are remembered: a batch of
    requests with one schema parses it once (0.15 ms each for a modest schema)."""
    import xgrammar as xgr

    if kind == "json":
        xgr.Grammar.from_json_schema(text)
    elif kind == "regex":
        xgr.Grammar.from_regex(text)
    else:  # grammar, choice (as EBNF)
        xgr.Grammar.from_ebnf(text)


def bad_words_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word alone and after a space (a word starts
    the text or follows another), the spaced form kept when it is a different first token
    of the same length."""
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


def words_of(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack_allowed(ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """A bitmask row (uint32 words) with only `ids` allowed."""
    allowed = np.zeros(words_of(vocab_size) * 32, dtype=bool)
    allowed[np.fromiter(ids, dtype=np.int64)] = True
    return np.packbits(allowed, bitorder="little").view(np.uint32)


@dataclass
class RequestMask:
    """What masks one request's logits: a matcher, allowed ids, bad word sequences."""

    matcher: Any = None  # xgrammar.GrammarMatcher
    allowed: np.ndarray | None = None  # uint32 words
    bad_words: list[list[int]] = field(default_factory=list)
    # The grammar waits until the output ends with these ids (structured_outputs_after: a
    # reasoning parser's end marker); until then the matcher neither masks nor advances.
    after: list[int] | None = None
    tail: list[int] = field(default_factory=list)  # the last len(after) output ids
    # A reasoning budget: past `budget` output tokens, the ids of `end` are forced until the
    # output ends with them (then budget is None: the reasoning is over).
    budget: int | None = None
    end: list[int] = field(default_factory=list)
    count: int = 0  # output tokens so far
    end_tail: list[int] = field(default_factory=list)  # the last len(end) output ids

    def forced(self) -> int | None:
        """The id this step must sample (reasoning over budget), else None."""
        if self.budget is None or self.count < self.budget:
            return None
        t, e = self.end_tail, self.end
        k = next(j for j in range(min(len(t), len(e) - 1), -1, -1) if t[len(t) - j :] == e[:j])
        return e[k]  # the marker continues after its longest part the output ends with


@dataclass
class MaskFill:
    """One step's bitmask being filled: `grammar` (xgrammar's rows, in C++ threads that
    release the GIL) then `finish` (allowed ids, bad words, forced ids; Python)."""

    rows: dict[str, int]  # sequence id -> its row
    bm: torch.Tensor  # int32 [rows, words], on the host
    live: list[tuple[int, Any]]  # (row, matcher) of the grammars that mask this step
    special: list[tuple[int, Any, RequestMask]]  # rows with ids, bad words or a budget
    batcher: Any  # xgrammar.BatchGrammarMatcher

    def grammar(self) -> None:
        if self.live:
            rows, matchers = zip(*self.live)
            self.batcher.batch_fill_next_token_bitmask(list(matchers), self.bm, list(rows))

    def finish(self) -> TokenBitmask:
        words = self.bm.numpy().view(np.uint32)
        for k, req, m in self.special:
            if (t := m.forced()) is not None:  # over the reasoning budget: close it
                words[k] = 0
                words[k, t >> 5] = np.uint32(1 << (t & 31))
                continue
            if m.allowed is not None:
                words[k] &= m.allowed
            if m.bad_words:
                out = req.output_token_ids
                for seq in m.bad_words:
                    n = len(seq) - 1
                    if n <= len(out) and (n == 0 or out[-n:] == seq[:-1]):
                        t = seq[-1]
                        words[k, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        return self.rows, self.bm


class StructuredOutputs:
    """Engine-core side: compiles, holds matchers, fills each step's bitmask."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        backend: str = "auto",
        max_workers: int = 2,
    ) -> None:
        self.backend = check_backend(backend)
        self.vocab_size = vocab_size  # the logits' (the model's), may exceed the tokenizer's
        self.eos_token_ids = eos_token_ids
        self._load_tokenizer = load_tokenizer
        self._tok_lock = threading.Lock()
        self._tokenizer: Any = None
        self._compiler: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, once there are matchers
        self._compiled: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()  # recent ones
        self._compiled_lock = threading.Lock()
        self.pending: dict[str, tuple[list[Any], Future]] = {}  # first id -> (sequences, job)
        self.masks: dict[str, RequestMask] = {}  # sequence id -> its mask state
        self.pin_memory = False  # the engine sets it where the platform pins host buffers
        self._early: dict[str, str | None] = {}  # sequence id -> accept()'s answer, taken early
        self._buffers: list[torch.Tensor | None] = [None, None]  # the bitmask's host rows
        self._turn = 0

    @staticmethod
    def needs(params: SamplingParams) -> bool:
        return bool(
            params.structured_outputs is not None
            or params.allowed_token_ids
            or params.bad_words
            or params.thinking_token_budget is not None
        )

    @staticmethod
    def needs_sync(params: SamplingParams) -> bool:
        """The mask reads the output tokens on the host (bad words): the step waits for the
        last one (no overlap). A grammar does not: its matcher takes the token in flight
        early (`accept_early`), once the next forward is queued."""
        return bool(params.bad_words)

    # ---- requests ------------------------------------------------------------------
    def add(self, seqs: list[Any]) -> None:
        """Start preparing the mask of a request's sequences (same params but the seed); they
        may be scheduled once `ready()` returns them. ValueError (naming the field) for a spec
        that does not parse or an id out of vocabulary."""
        p = seqs[0].params
        if p.structured_outputs is not None:
            check_spec(p.structured_outputs, f"structured_outputs.{p.structured_outputs.kind}")
        if p.allowed_token_ids:
            bad = next((t for t in p.allowed_token_ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"allowed_token_ids: token id {bad} is out of vocabulary "
                    f"(vocabulary size {self.vocab_size})"
                )
        sp = p.structured_outputs
        if not p.bad_words and (sp is None or self._known(sp)):  # no compiling: ready now
            job: Future = Future()
            try:
                job.set_result(self._prepare(p))
            except Exception as e:
                job.set_exception(e)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._max_workers, thread_name_prefix="paged-grammar"
                )
            job = self._pool.submit(self._prepare, p)
        self.pending[seqs[0].request_id] = (seqs, job)

    def ready(self, timeout: float = 0.0) -> tuple[list[list[Any]], list[tuple[Any, str]]]:
        """(sequences of each request whose mask is ready, (sequence, error) of those that
        failed); finished (aborted) sequences are dropped. Waits up to `timeout` seconds for
        one job when none is done."""
        jobs = [f for _, f in self.pending.values()]
        if timeout and jobs and not any(f.done() for f in jobs):
            wait(jobs, timeout, FIRST_COMPLETED)
        done, failed = [], []
        for key, (seqs, fut) in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[key]
            seqs = [s for s in seqs if not s.finished]
            try:
                compiled, allowed, bad = fut.result()
            except Exception as e:
                log.warning("request %s: structured output setup failed: %s", key, e)
                why = str(e) if isinstance(e, ValueError) else _clean(e)
                failed += [(s, why) for s in seqs]
                continue
            for s in seqs:
                matcher = None
                if compiled is not None:
                    import xgrammar as xgr

                    matcher = xgr.GrammarMatcher(compiled)
                after = s.params.structured_outputs_after if matcher is not None else None
                m = RequestMask(matcher, allowed, bad, after or None)
                if s.params.thinking_token_budget is not None:
                    m.budget, m.end = s.params.thinking_token_budget, s.params.reasoning_end_ids
                self.masks[s.request_id] = m
            if seqs:
                done.append(seqs)
        return done, failed

    def free(self, request_id: str) -> None:
        """Forget a finished sequence's mask (a job still preparing drops finished ones)."""
        self.masks.pop(request_id, None)
        self._early.pop(request_id, None)

    def __len__(self) -> int:
        """Sequences with a mask, and requests whose mask is being prepared."""
        return len(self.masks) + len(self.pending)

    # ---- compiling (pool threads) --------------------------------------------------
    def _tok(self) -> Any:
        with self._tok_lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self._load_tokenizer()
                if tok is None:
                    raise ValueError(
                        "structured_outputs: this model has no tokenizer to build masks with"
                    )
                info = xgr.TokenizerInfo.from_huggingface(
                    tok,
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(self.eos_token_ids) or None,
                )
                # Compiled grammars are cached by spec, least recently used out past the limit.
                compiler = xgr.GrammarCompiler(info, cache_limit_bytes=COMPILE_CACHE_BYTES)
                self._tokenizer, self._compiler = tok, compiler
            return self._tokenizer

    def _prepare(self, p: SamplingParams) -> tuple[Any, np.ndarray | None, list[list[int]]]:
        """(compiled grammar or None, allowed-ids row or None, bad word token sequences)."""
        allowed = None
        if p.allowed_token_ids:
            allowed = pack_allowed(p.allowed_token_ids, self.vocab_size)
        if p.structured_outputs is None and not p.bad_words:
            return None, allowed, []
        tok = self._tok()
        bad = bad_words_ids(tok, p.bad_words) if p.bad_words else []
        sp, compiled = p.structured_outputs, None
        if sp is not None:
            try:
                compiled = self._compile(sp)
            except Exception as e:
                raise ValueError(f"structured_outputs.{sp.kind}: {_clean(e)}") from None
        return compiled, allowed, bad

    @staticmethod
    def _key(sp: StructuredOutputsParams) -> tuple[str, str, bool]:
        return sp.kind, sp.spec, sp.disable_any_whitespace

    def _known(self, sp: StructuredOutputsParams) -> bool:
        with self._compiled_lock:
            return self._key(sp) in self._compiled

    def _compile(self, sp: StructuredOutputsParams) -> Any:
        """The compiled grammar: from the last KEEP_COMPILED ones (a request whose grammar
        is among them is ready at once, `add`), else compiled by xgrammar (its own cache
        first)."""
        key = self._key(sp)
        with self._compiled_lock:
            if (compiled := self._compiled.get(key)) is not None:
                self._compiled.move_to_end(key)
                return compiled
        c = self._compiler
        kind = sp.kind
        if kind == "json":
            compiled = c.compile_json_schema(sp.spec, any_whitespace=not sp.disable_any_whitespace)
        elif kind == "json_object":  # an object, as OpenAI's JSON mode (and vLLM's xgrammar)
            compiled = c.compile_json_schema(
                JSON_OBJECT, any_whitespace=not sp.disable_any_whitespace
            )
        elif kind == "regex":
            compiled = c.compile_regex(sp.regex)
        elif kind == "choice":
            compiled = c.compile_grammar(choice_ebnf(sp.choice))
        else:
            compiled = c.compile_grammar(sp.grammar)
        with self._compiled_lock:
            self._compiled[key] = compiled
            while len(self._compiled) > KEEP_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    # ---- each step -----------------------------------------------------------------
    def bitmask(self, batch: Any) -> TokenBitmask | None:
        """The mask of `batch`'s masked requests that sample in this step (forked sequences
        included), or None. Called after scheduling, before the step's tokens are added."""
        fill = self.begin_fill(batch)
        if fill is None:
            return None
        fill.grammar()
        return fill.finish()

    def begin_fill(self, batch: Any) -> MaskFill | None:
        """`bitmask` in parts (None: no row): the rows no grammar fills are set here;
        `MaskFill.grammar` fills the others and may run in a thread while the engine resolves
        the step in flight; `MaskFill.finish` applies allowed ids, bad words, forced ids."""
        masks = self.masks
        sampling = [
            r
            for r, n in zip(batch.reqs, batch.num_new)
            if r.request_id in masks and r.num_computed_tokens + n >= r.num_tokens
        ]
        sampling += [s for _, seqs in getattr(batch, "forks", ()) for s in seqs
                     if s.request_id in masks]  # fmt: skip
        if not sampling:
            return None
        bm = self._buffer(len(sampling))
        live, idle, special = [], [], []
        for k, req in enumerate(sampling):
            m = masks[req.request_id]
            if m.matcher is not None and m.after is None and not m.matcher.is_terminated():
                live.append((k, m.matcher))
            else:
                idle.append(k)
            if m.budget is not None or m.allowed is not None or m.bad_words:
                special.append((k, req, m))
        if idle:  # every id allowed; xgrammar writes whole rows for the live ones
            bm.numpy()[idle] = -1  # (numpy: the buffer may be an inference-mode tensor)
        if live and self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher()
        rows = {r.request_id: k for k, r in enumerate(sampling)}
        return MaskFill(rows, bm, live, special, self._batch)

    def _buffer(self, k: int) -> torch.Tensor:
        """k rows of one of two host buffers used in turn (page-locked where the platform pins:
        the runner queues the copy to the device behind the forward). A buffer is written again
        two steps later, once the step between has its tokens: its copy, queued before its
        step's sampling, is done by then."""
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.shape[0] < k:
            rows = 1 << max(k - 1, 63).bit_length()  # room to grow: 64, 128, 256, ...
            shape = (rows, words_of(self.vocab_size))
            buf = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_memory)
            self._buffers[self._turn] = buf
        return buf[:k]

    def accept_early(self, reqs: list[Any], tokens: list[int]) -> None:
        """Advance the matchers by the tokens of the step in flight before the engine resolves
        it (overlapped steps: the next step's mask needs them while its forward runs); the
        engine's accept() for those tokens then returns the answer kept here."""
        for req, tok in zip(reqs, tokens):
            rid = req.request_id
            if not req.finished and rid in self.masks and rid not in self._early:
                self._early[rid] = self._advance(rid, tok)

    def accept(self, request_id: str, token: int) -> str | None:
        """Advance the request's matcher by a resolved token: "done" when the grammar has
        terminated (the request stops), "refused" when the token breaks it (only when the
        mask left nothing, e.g. against min_tokens), else None."""
        if request_id in self._early:
            return self._early.pop(request_id)
        return self._advance(request_id, token)

    def _advance(self, request_id: str, token: int) -> str | None:
        m = self.masks.get(request_id)
        if m is not None and m.budget is not None:
            m.count += 1
            m.end_tail = [*m.end_tail, token][-len(m.end) :]
            if m.end_tail == m.end:
                m.budget = None  # the reasoning has ended
        if m is None or m.matcher is None:
            return None
        if m.after is not None:  # not started: watch for the marker
            m.tail = [*m.tail, token][-len(m.after) :]
            if m.tail == m.after:
                m.after = None
            return None
        if m.matcher.is_terminated():
            return "done"
        if not m.matcher.accept_token(token):
            return "refused"
        return "done" if m.matcher.is_terminated() else None
