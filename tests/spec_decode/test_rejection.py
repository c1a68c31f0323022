"""The verification samplers alone: greedy acceptance, and rejection sampling's output
distribution against the target's on a tiny vocabulary (many draws, fixed seeds)."""

from __future__ import annotations

import torch

from paged.sampling.rejection import greedy_verify, padded_rows, rejection_verify


def test_padded_rows():
    rows = padded_rows(torch.tensor([2, 0, 3]), 3)
    assert rows.tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]


def test_greedy_accepts_while_argmax_matches():
    # request 0: 3 proposals, argmax rows [5, 6, 9, 4] -> accepts 5, 6, then 9 replaces 7
    # request 1: 2 proposals, all match -> 1, 2 and the bonus 3
    # request 2: 1 proposal, first mismatches -> only the target's 8
    argmax = torch.tensor([5, 6, 9, 4, 1, 2, 3, 8, 0])
    draft = torch.tensor([[5, 6, 7], [1, 2, 0], [9, 0, 0]])
    tokens, count = greedy_verify(argmax, draft, torch.tensor([3, 2, 1]))
    out = [t[:c] for t, c in zip(tokens.tolist(), count.tolist())]
    assert out == [[5, 6, 9], [1, 2, 3], [8]]


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=p.numel()).double() / samples.numel()
    return 0.5 * (freq - p.double()).abs().sum().item()


def _chi2(samples: torch.Tensor, p: torch.Tensor) -> float:
    n = samples.numel()
    obs = torch.bincount(samples, minlength=p.numel()).double()
    exp = p.double() * n
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a token of probability 0 was drawn"
    return (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()


def _run(draft_probs_mode: str, n: int = 40000):
    """n requests with the same per-position target p_j (K = 3 proposals) and proposals drawn
    from q (or a fixed point mass); returns (tokens, count, p)."""
    torch.manual_seed(0)
    v, k = 6, 3
    p = torch.tensor(
        [
            [0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
            [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
            [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
            [0.10, 0.20, 0.30, 0.40, 0.00, 0.00],
        ]
    )
    q = torch.tensor(
        [
            [0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
            [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
            [0.05, 0.05, 0.10, 0.10, 0.30, 0.40],
        ]
    )
    gen = torch.Generator().manual_seed(1)
    if draft_probs_mode == "point":
        draft = torch.tensor([[1, 2, 5]]).expand(n, k).contiguous()
        draft_probs = None
    else:
        draft = torch.stack([torch.multinomial(q[j], n, True, generator=gen) for j in range(k)], 1)
        draft_probs = q[None].expand(n, k, v).contiguous()
    probs = p[None].expand(n, k + 1, v).reshape(-1, v).contiguous()
    num = torch.full((n,), k, dtype=torch.int64)
    tokens, count = rejection_verify(probs, draft, num, draft_probs)
    return tokens, count, p


def _check_positions(tokens, count, p):
    for j in range(p.shape[0]):  # position j exists where the first j were accepted
        got = tokens[count > j, j]
        assert got.numel() > 400
        tv, chi2 = _tv(got, p[j]), _chi2(got, p[j])
        # 5 degrees of freedom at most: chi2 > 25 has probability < 2e-4 under the null
        assert tv < max(0.02, 1.5 / got.numel() ** 0.5) and chi2 < 25, (j, tv, chi2)


def test_rejection_sampling_preserves_target_distribution():
    tokens, count, p = _run("dist")
    _check_positions(tokens, count, p)
    assert count.min() >= 1 and count.max() == 4


def test_rejection_sampling_point_mass_proposals():
    tokens, count, p = _run("point")
    _check_positions(tokens, count, p)
    # proposal 1 at row 0 is accepted with probability p0(1) = 0.25
    assert abs((count > 1).double().mean().item() - 0.25) < 0.01


def test_proposals_sampled_from_a_wrong_distribution_are_corrected():
    """A sampler that just accepted proposals would give q; the check above must tell."""
    tokens, count, p = _run("dist")
    q0 = torch.tensor([0.10, 0.50, 0.10, 0.10, 0.10, 0.10])
    assert _tv(tokens[:, 0], q0) > 0.2
