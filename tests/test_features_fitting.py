"""The shared fitting machinery (features/fitting.py) and the one Eckart–Young optimum."""

import warnings

import pytest
import torch

from polysketch.eval import fidelity
from polysketch.features import create, fitting, optimal_rank
from polysketch.features.llops import fit_kernel, optimal_error, relative_loss


def _data(seed=0, n=64, d=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


class _Scalar(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("after", [3.0, float("nan")])
def test_keep_start_if_worse_restores_on_rise_or_nan(after):
    m = _Scalar()
    losses = iter([1.0, after])

    def train():
        with torch.no_grad():
            m.w.mul_(10)
        return "history"

    with pytest.warns(UserWarning, match=r"demo fit: loss rose from 1 to .*restored"):
        out = fitting.keep_start_if_worse(m, lambda: next(losses), train, label="demo fit")
    assert out == "history"
    assert torch.equal(m.w, torch.tensor([1.0, 2.0]))


def test_keep_start_if_worse_keeps_improvement_and_is_silent_without_label():
    m = _Scalar()
    losses = iter([1.0, 0.5])

    def train():
        with torch.no_grad():
            m.w.add_(1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fitting.keep_start_if_worse(m, lambda: next(losses), train)
    assert torch.equal(m.w, torch.tensor([2.0, 3.0]))
    losses = iter([1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no label: restore silently
        fitting.keep_start_if_worse(m, lambda: next(losses), train)
    assert torch.equal(m.w, torch.tensor([2.0, 3.0]))


def test_llops_fit_that_diverges_to_nan_keeps_its_start():
    # Before: LLoPS compared `after > before`, which is False for NaN, and kept NaN factors.
    q, k = _data()
    fm = create("llops", 4, degree=2, num_features=8, seed=0)
    start = fm.theta_q.detach().clone()
    history = fm.fit(q, k, steps=5, lr=1e30, init="current")
    assert any(h != h for h in history)  # the steps did diverge
    assert torch.equal(fm.theta_q, start)
    assert fm._fit_loss(q, k, None) == pytest.approx(history[0])


def test_one_fit_loop_and_loss_for_every_learnable_map():
    # llops and learned_polysketch train through fitting.fit_kernel; the loss they keep the
    # better parameters by is fitting.kernel_loss (the same Eq. 6 ratio the steps minimise).
    q, k = _data(1)
    assert fit_kernel is fitting.fit_kernel and relative_loss is fitting.relative_loss
    fm = create("learned_polysketch", 4, num_features=4, expansion=2, levels=1, seed=0)
    with torch.no_grad():
        direct = float(relative_loss(fm.approx_kernel(q, k), fm.target_kernel(q, k)))
    assert fitting.kernel_loss(fm, q, k, None) == pytest.approx(direct, rel=1e-6)
    history = fitting.fit_kernel(fm, q, k, steps=3, lr=1e-3, seed=0, progress=False)
    assert len(history) == 3 and history[0] == pytest.approx(direct, rel=1e-5)


def test_flat_finite_and_rows():
    with pytest.raises(ValueError, match="q must hold at least one vector"):
        fitting.flat_finite(torch.zeros(0, 3), "q")
    with pytest.raises(ValueError, match="k contains NaN"):
        fitting.flat_finite(torch.tensor([[float("nan"), 0.0]]), "k")
    x = torch.arange(10.0).reshape(10, 1)
    assert fitting.strided_rows(x, 4).flatten().tolist() == [0.0, 3.0, 6.0, 9.0]
    a, b = fitting.random_rows(x, x, 1, torch.Generator().manual_seed(0), size=3)
    assert a.shape == b.shape == (3, 1)


def test_optimal_error_is_the_optimal_rank_bound_squared():
    # One implementation of Eckart–Young: llops.optimal_error is optimal_rank's relative
    # error squared (Eq. 6 units), on the flattened samples.
    q, k = _data(2, n=30, d=3)
    q, k = q.double(), k.double()
    for degree, f in ((1, 2), (2, 4), (3, 5)):
        opt = optimal_rank.optimal_rank_error(q, k, degree, f)
        assert optimal_error(q, k, degree=degree, num_features=f) == pytest.approx(
            opt.relative**2, rel=1e-12
        )
    batched = optimal_error(q.reshape(2, 15, 3), k.reshape(3, 10, 3), degree=2, num_features=4)
    assert batched == pytest.approx(optimal_rank.optimal_rank_error(q, k, 2, 4).relative ** 2)


def test_eval_reexports_the_features_implementation():
    assert fidelity.optimal_rank_error is optimal_rank.optimal_rank_error
