"""Incremental detokenization and stop strings, outside the engine core."""

from __future__ import annotations

from functools import partial


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (from `prefix` to the end) and emits what it adds beyond the
    window's already-emitted part, so multi-token characters and leading-space rules come
    out right; an incomplete UTF-8 sequence waits for its next token.
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", 1) is False:
            # A fast tokenizer that cleans up no spaces decodes as its Rust backend does; calling
            # that skips transformers' per-call conversions (two thirds of each decode's time).
            # Fast tokenizers never put spaces around special tokens.
            self.decode = partial(backend.decode, skip_special_tokens=skip_special_tokens)
        else:  # slow tokenizers honour spaces_between_special_tokens
            spaces = spaces_between_special_tokens
            self.decode = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                                  spaces_between_special_tokens=spaces)  # fmt: skip
        self.ids = list(prompt_ids[-6:])  # context for spacing of the first output token
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix_text = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(prefix_text) :]
        return ""


class StopChecker:
    """Finds stop strings in the growing text; holds back text that may start one."""

    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        self.stop = stop
        self.include = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def check(self, text: str, new_len: int) -> tuple[str, str | None]:
        """(text cut at the first stop string, the stop string) or (text, None)."""
        if not self.stop:
            return text, None
        start = max(0, len(text) - new_len - self.hold)
        best = None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return text, None
        i, s = best
        return text[: i + len(s) if self.include else i], s
