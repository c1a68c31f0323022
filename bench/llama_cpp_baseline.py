"""llama.cpp on the same GGUF, through llama-cpp-python's C API (bench/install_llama_cpp.sh builds
it from source): greedy, every sequence generates exactly `max_tokens` tokens, `batch`
sequences decoded together, a KV stream per sequence (llama.cpp's own `batched` example: one
llama_decode per step over every sequence's next token), prefill included in the time.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np


def llama_cpp_throughput(
    path: str, prompts: list[list[int]], max_tokens: int, batch: int, warm_up: bool = True
) -> float | None:
    """Output tokens/s over `prompts`, `batch` at a time; None when llama-cpp-python is missing."""
    try:
        import llama_cpp as L
    except ImportError:
        return None
    L.llama_log_set(_quiet(L), None)
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    longest = max(map(len, prompts)) + max_tokens
    cparams = L.llama_context_default_params()
    cparams.n_ctx = batch * longest
    cparams.n_batch = cparams.n_ubatch = min(512, cparams.n_ctx)
    cparams.n_seq_max = batch
    cparams.kv_unified = False  # a KV stream per sequence: attention reads only its own cells
    cparams.n_threads = cparams.n_threads_batch = os.cpu_count() or 1
    ctx = L.llama_init_from_model(model, cparams)
    lb = L.llama_batch_init(cparams.n_batch, 0, batch)
    try:
        run = _Runner(L, ctx, lb, cparams.n_batch, n_vocab)
        if warm_up:
            run.generate(prompts[:batch], 4)
        t = time.perf_counter()
        for i in range(0, len(prompts), batch):
            run.generate(prompts[i : i + batch], max_tokens)
        return len(prompts) * max_tokens / (time.perf_counter() - t)
    finally:
        L.llama_batch_free(lb)
        L.llama_free(ctx)
        L.llama_model_free(model)


_CALLBACK = None


def _quiet(L):
    """A log callback that drops llama.cpp's messages (kept referenced: C holds the pointer)."""
    global _CALLBACK
    if _CALLBACK is None:
        _CALLBACK = L.llama_log_callback(lambda level, text, data: None)
    return _CALLBACK


class _Runner:
    def __init__(self, L, ctx, lb, n_batch: int, n_vocab: int) -> None:
        self.L, self.ctx, self.lb, self.n_batch, self.n_vocab = L, ctx, lb, n_batch, n_vocab

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuations of `prompts` (one sequence id each), `max_tokens` tokens each."""
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        out: list[list[int]] = [[] for _ in prompts]
        # Prefill: every prompt's tokens, n_batch at a time; each prompt's last token's logits.
        entries = [(s, pos, tok, pos == len(p) - 1) for s, p in enumerate(prompts)
                   for pos, tok in enumerate(p)]  # fmt: skip
        for i in range(0, len(entries), self.n_batch):
            self._decode(entries[i : i + self.n_batch], out)
        for _ in range(max_tokens - 1):  # decode: every sequence's last token, one step
            step = [(s, len(p) + len(out[s]) - 1, out[s][-1], True) for s, p in enumerate(prompts)]
            for i in range(0, len(step), self.n_batch):
                self._decode(step[i : i + self.n_batch], out)
        return out

    def _decode(self, entries: list[tuple[int, int, int, bool]], out: list[list[int]]) -> None:
        lb = self.lb
        for i, (seq, pos, tok, want) in enumerate(entries):
            lb.token[i], lb.pos[i], lb.n_seq_id[i] = tok, pos, 1
            lb.seq_id[i][0] = seq
            lb.logits[i] = want
        lb.n_tokens = len(entries)
        if self.L.llama_decode(self.ctx, lb) != 0:
            raise RuntimeError("llama_decode failed")
        for i, (seq, _, _, want) in enumerate(entries):
            if want:
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                logits = np.ctypeslib.as_array(
                    ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)
                )
                out[seq].append(int(logits.argmax()))
