"""--speculative-config parsing and refusals; n-gram prompt lookup."""

from __future__ import annotations

import pytest

from paged.config import EngineConfig
from paged.spec_decode.config import SpeculativeConfig
from paged.spec_decode.ngram import ngram_propose


def test_parse_vllm_spellings():
    s = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 2}'
    )
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_max, s.prompt_lookup_min) == (
        "ngram",
        5,
        3,
        2,
    )
    d = SpeculativeConfig.parse({"model": "/x", "num_speculative_tokens": 2})
    assert d.method == "draft_model" and d.model == "/x"
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert EngineConfig(speculative_config=d).speculative_config is d


@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "model"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
        ({"method": "mtp", "num_speculative_tokens": 1}, "method"),
        ({"method": "medusa2", "num_speculative_tokens": 1}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),  # fmt: skip
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ('{"method": ', "JSON"),
    ],
)
def test_refusals_name_the_key(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=value)


def test_a_draft_leaves_the_targets_lora_flags_behind():
    from paged.spec_decode.draft import proposer_config

    target = EngineConfig(
        enable_lora=True, lora_modules=[{"name": "a", "path": "/a"}], max_loras=2,
        max_lora_rank=32, max_cpu_loras=4,
        speculative_config={"model": "/draft", "num_speculative_tokens": 2},
    )  # fmt: skip
    draft = proposer_config(target)  # its config was refused: "lora_modules: ... --enable-lora"
    assert draft.model == "/draft" and not draft.enable_lora and not draft.lora_modules
    assert (draft.max_loras, draft.max_lora_rank, draft.max_cpu_loras) == (1, 16, None)


def test_refused_combinations():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(
            speculative_config={"model": "x", "num_speculative_tokens": 2},
            tensor_parallel_size=2,
        )


def test_ngram_lookup():
    # the last 2 tokens (3, 4) occurred at 2..3, followed by 5, 6, 7
    assert ngram_propose([1, 2, 3, 4, 5, 6, 7, 9, 3, 4], 3, 1, 2) == [5, 6, 7]
    # the longest suffix wins over a more recent shorter match
    toks = [8, 3, 4, 1, 1, 7, 4, 2, 8, 3, 4]
    assert ngram_propose(toks, 2, 1, 3) == [1, 1]
    # the most recent occurrence among equal lengths
    assert ngram_propose([5, 1, 5, 2, 5], 1, 1, 1) == [2]
    # proposals stop at the end of the sequence
    assert ngram_propose([4, 4, 4], 5, 1, 2) == [4]
    assert ngram_propose([1, 2, 3], 3, 1, 3) == []
    assert ngram_propose([1, 2, 3, 1], 3, 2, 3) == []  # only 1-grams match: below the minimum


def _reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition, by brute force: longest suffix n-gram, most recent earlier match."""
    t = len(tokens)
    for n in range(min(hi, t - 1), lo - 1, -1):
        for s in range(t - n - 1, -1, -1):
            if tokens[s : s + n] == tokens[t - n :]:
                return tokens[s + n : s + n + k] if k > 0 else []
    return []


def test_ngram_lookup_against_brute_force():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        toks = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(1, 30))]
        k, lo = rng.randint(0, 4), rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        assert ngram_propose(toks, k, lo, hi) == _reference(toks, k, lo, hi), (toks, k, lo, hi)
