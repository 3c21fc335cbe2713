"""Warmup + cosine learning-rate schedule (polysketch.train.schedule)."""

import math

import pytest
import torch

from polysketch.train.schedule import WarmupCosine, learning_rate, warmup_cosine

KW = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 1 / 11),  # linear warmup (s + 1) / (W + 1)
        (9, 10 / 11),
        (10, 1.0),  # peak at the end of warmup
        (60, 0.1 + 0.5 * 0.9),  # half-way through the cosine: cos(π/2) = 0
        (35, 0.1 + 0.5 * (1 + math.cos(math.pi / 4)) * 0.9),
        (110, 0.1),  # floor at the last step
        (500, 0.1),  # and after it
    ],
)
def test_learning_rate_values(step, expected):
    assert learning_rate(step, **KW) == pytest.approx(expected, rel=1e-14)


def test_schedule_is_monotone_after_warmup():
    lrs = [learning_rate(s, **KW) for s in range(200)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11], strict=True))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))


def _optimizer():
    p = torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([p], lr=0.5), p


def test_lambda_lr_follows_formula_and_resumes_from_state_dict():
    opt, p = _optimizer()
    sched = warmup_cosine(opt, warmup_steps=3, total_steps=12, min_lr=0.05)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [learning_rate(s, lr=0.5, min_lr=0.05, warmup_steps=3, total_steps=12) for s in range(6)]
    assert seen == pytest.approx(want, rel=1e-14)
    state = sched.state_dict()
    assert state["lr_lambdas"][0]["total_steps"] == 12  # the schedule itself is saved

    opt2, _ = _optimizer()
    sched2 = warmup_cosine(opt2, warmup_steps=0, total_steps=1, min_lr=0.0)  # overwritten
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(state)
    for _ in range(8):
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()


def test_bad_schedule_arguments_name_the_argument():
    with pytest.raises(ValueError, match="min_lr"):
        WarmupCosine(lr=1e-3, min_lr=1e-2, warmup_steps=0, total_steps=10)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(lr=1e-3, min_lr=0.0, warmup_steps=-1, total_steps=10)
    with pytest.raises(ValueError, match="lr"):
        WarmupCosine(lr=0.0, min_lr=0.0, warmup_steps=0, total_steps=10)
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 2.0}])
    with pytest.raises(ValueError, match="share one lr"):
        warmup_cosine(opt, warmup_steps=1, total_steps=5, min_lr=0.0)
