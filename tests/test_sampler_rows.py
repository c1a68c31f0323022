"""The draw a sampler graph records (paged.sampling.sampler.sample_rows) against the eager
sampler: from the same random state, the same tokens for every mix of temperature, top-k,
top-p, min-p and greedy rows; and which requests it may take (plain_rows)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged import SamplingParams
from paged.sampling.sampler import build_sampling_batch, plain_rows, sample, sample_rows

VOCAB = 97

MIXES = {
    "temperature": [dict(temperature=0.7), dict(temperature=1.3)],
    "greedy and top-k": [dict(temperature=0.0), dict(temperature=0.9, top_k=5)],
    "top-p": [dict(temperature=1.0, top_p=0.8), dict(temperature=0.5)],
    "top-k and top-p": [dict(temperature=1.1, top_k=20, top_p=0.5), dict(temperature=0.8)],
    "min-p": [dict(temperature=1.0, min_p=0.2), dict(temperature=0.0)],
    "all": [dict(temperature=0.6, top_k=3, top_p=0.9, min_p=0.1), dict(temperature=0.0),
            dict(temperature=2.0)],  # fmt: skip
}


def views(kwargs: list[dict]) -> list[SimpleNamespace]:
    return [SimpleNamespace(params=SamplingParams(max_tokens=4, **kw), request_id=str(i),
                            num_prompt_tokens=0, num_output_tokens=0)
            for i, kw in enumerate(kwargs)]  # fmt: skip


@pytest.mark.parametrize("mix", MIXES)
def test_the_graph_draw_equals_the_eager_sampler(mix):
    reqs = views(MIXES[mix])
    rows = plain_rows(reqs, VOCAB)
    assert rows is not None
    sort = any(k < VOCAB or p < 1.0 for t, k, p, _ in rows if t > 0)
    params = torch.tensor(rows, dtype=torch.float32).T.contiguous()
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    for seed in range(20):
        torch.manual_seed(seed)
        sb = build_sampling_batch(reqs, logits.device, VOCAB, [5] * len(reqs))
        want = sample(logits.clone(), sb)
        torch.manual_seed(seed)
        got = sample_rows(logits.clone(), logits.argmax(-1), params, sort)
        assert got.tolist() == want.tolist()


def test_the_sorting_draw_without_filters_is_the_plain_one():
    rows = plain_rows(views([dict(temperature=0.8), dict(temperature=0.0)]), VOCAB)
    params = torch.tensor(rows, dtype=torch.float32).T.contiguous()
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    for seed in range(10):
        torch.manual_seed(seed)
        plain = sample_rows(logits, logits.argmax(-1), params, False)
        torch.manual_seed(seed)
        assert sample_rows(logits, logits.argmax(-1), params, True).tolist() == plain.tolist()


def test_top_p_of_one_keeps_every_token():
    """A row at top_p 1 beside one that truncates keeps its whole distribution, even where
    the cumulative sum rounds to 1 before the last token."""
    from paged.sampling.sampler import _top_k_top_p

    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 30.0  # the others' mass (96 e^-30) is below float32's rounding of 1
    kept = _top_k_top_p(logits, None, torch.tensor([1.0, 0.5])).isfinite()
    assert kept[0].all() and kept[1].sum() == 1


@pytest.mark.parametrize("kw", [dict(temperature=0.8, seed=3), dict(repetition_penalty=1.2),
                                dict(temperature=0.0, presence_penalty=0.5),
                                dict(temperature=0.7, logit_bias={3: 1.0}),
                                dict(temperature=0.7, min_tokens=2)])  # fmt: skip
def test_requests_with_more_than_the_plain_filters_are_not_plain(kw):
    assert plain_rows(views([dict(temperature=0.5), kw]), VOCAB) is None


def test_plain_rows_values():
    rows = plain_rows(views([dict(temperature=0.0, seed=4), dict(temperature=0.9, top_k=7,
                                                                top_p=0.8, min_p=0.1)]), VOCAB)
    assert rows == [(0.0, VOCAB, 1.0, 0.0), (0.9, 7, 0.8, 0.1)]  # a greedy row's seed: unused


def test_a_seeded_draw_depends_on_its_seed_and_position_only():
    """The same seeded row gives the same token whatever rows are beside it and whatever was
    drawn before; another position or seed draws other noise."""
    logits = torch.zeros(3, VOCAB)  # uniform: the token is the noise's argmin

    def draw(kwargs: list[dict], index: list[int]) -> list[int]:
        sb = build_sampling_batch(views(kwargs), logits.device, VOCAB, index)
        return sample(logits[: len(kwargs)].clone(), sb).tolist()

    seeded = dict(temperature=1.0, seed=7)
    alone = draw([seeded], [12])[0]
    torch.manual_seed(0)
    assert draw([dict(temperature=1.0), seeded, dict(temperature=0.5)], [3, 12, 40])[1] == alone
    assert draw([seeded], [12])[0] == alone  # after other draws
    others = {draw([seeded], [i])[0] for i in range(13, 33)} | {
        draw([dict(temperature=1.0, seed=s)], [12])[0] for s in range(8, 28)
    }
    assert len(others) > 10  # 40 draws over 97 tokens
