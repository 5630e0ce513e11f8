"""ext #5008: the variable-token padding primitive of the THD dispatcher.

Tokens of a rank are padded to a static count; padded rows are never routed (idx -1, weight 0, valid False),
so they reach no expert and contribute nothing; too small a static count is refused.
"""
import pytest
import torch

from dsv4.model.ep_dispatch import pad_routed_tokens


def test_pad_routed_tokens():
    x = torch.randn(5, 3)
    w = torch.rand(5, 2)
    idx = torch.randint(0, 8, (5, 2))
    xp, wp, ip, valid = pad_routed_tokens(x, w, idx, 8)
    assert xp.shape == (8, 3) and wp.shape == (8, 2) and ip.shape == (8, 2)
    assert torch.equal(xp[:5], x) and torch.equal(wp[:5], w) and torch.equal(ip[:5], idx)
    assert valid.tolist() == [True] * 5 + [False] * 3
    assert (ip[5:] == -1).all() and (wp[5:] == 0).all() and (xp[5:] == 0).all()
    # padded rows are not routed: the expert load counts only real tokens
    load = torch.bincount(ip[ip >= 0], minlength=8)
    assert int(load.sum()) == 10 and torch.equal(load, torch.bincount(idx.reshape(-1), minlength=8))


def test_static_count_too_small():
    with pytest.raises(ValueError, match="static_tokens"):
        pad_routed_tokens(torch.randn(5, 3), torch.rand(5, 2), torch.zeros(5, 2, dtype=torch.long), 4)
