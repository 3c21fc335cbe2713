"""soft_hash's training-only bucket balance (``bucket_balance`` = β, features/soft_hash.py Eqs.
7–8): L_bal = β(log F − I(token; bucket)) or, with ``bucket_balance_form="usage"``,
β(log F − H(ū)) per sequence, back-propagated beside the features by
``polysketch._auxiliary.add_auxiliary_loss`` without changing them; with
``bucket_balance_temperature=False`` its gradient does not reach the map's τ, with
``bucket_balance_inputs=False`` not the inputs."""

import math

import pytest
import torch

from polysketch import _auxiliary
from polysketch._auxiliary import add_auxiliary_gradient, add_auxiliary_loss, auxiliary_loss_scale
from polysketch.features import soft_hash
from polysketch.features.soft_hash import (
    SoftHashFeatureMap,
    information_deficit,
    usage_deficit,
    usage_direction_surrogate,
    usage_surrogate,
)
from polysketch.nn import TransformerConfig, TransformerLM, heads_batched
from polysketch.nn.core import AttentionCore
from polysketch.nn.heads import MultiHeadFeatureMap
from polysketch.ops import kernel_attention

D = 8


def _deficit_by_definition(logits: torch.Tensor, factors: int, usage_only=False) -> torch.Tensor:
    """log F − [H(ū) − mean_t H(p_t)] (``usage_only``: log F − H(ū)) in fp64 by brute force:
    p_t the Kronecker product of the factors' softmaxes, entropies summed term by term.
    logits (T, m·B) -> scalar."""
    parts = logits.double().unflatten(-1, (factors, -1)).softmax(-1)  # (T, m, B)
    rows = []
    for t in range(parts.shape[0]):
        p = parts[t, 0]
        for i in range(1, factors):
            p = torch.kron(p, parts[t, i])
        rows.append(p)
    p = torch.stack(rows)  # (T, F)
    h_tokens = -(p * p.log()).sum(-1).mean()
    u = p.mean(0)
    h_usage = -(u * u.log()).sum()
    return math.log(p.shape[-1]) - (h_usage - (0.0 if usage_only else h_tokens))


@pytest.mark.parametrize("usage_only", [False, True])
@pytest.mark.parametrize("factors,buckets", [(1, 6), (2, 3)])
def test_the_deficit_is_log_f_minus_the_mutual_information_or_the_usage_entropy(
    factors, buckets, usage_only
):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, factors * buckets, generator=g, dtype=torch.float64) * 2
    got = (usage_deficit if usage_only else information_deficit)(logits, factors)
    assert got.shape == (3,)
    for b in range(3):
        want = _deficit_by_definition(logits[b], factors, usage_only)
        torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-6)  # fp32 inside


@pytest.mark.parametrize("held", [False, True])
def test_the_surrogate_has_the_usage_deficits_gradient_in_the_logits_and_none_in_a_held_scale(
    held,
):
    """usage_surrogate(softmax(z), z) against usage_deficit(z) in fp64, z = s·u: equal
    gradients in u (sharp rows: τ-like scales up to 5); with the
    scale held, s's gradient is 0, as usage_deficit(sg(s)·u)'s."""
    g = torch.Generator().manual_seed(1)
    u = (torch.randn(3, 2, 11, 7, generator=g, dtype=torch.float64) * 3).requires_grad_()
    s = torch.tensor([1.7, 0.6], dtype=torch.float64, requires_grad=True)  # per head (..., H)
    z = s[:, None, None] * u
    got = usage_surrogate(z.softmax(-1), z, s if held else None)
    assert got.shape == (3, 2) and got.dtype == torch.float64
    weights = torch.randn(3, 2, generator=g, dtype=torch.float64)  # any per-sequence weights
    got_u, got_s = torch.autograd.grad((got * weights).sum(), [u, s])
    z_ref = (s.detach() if held else s)[:, None, None] * u
    want = (usage_deficit(z_ref, 1).double() * weights).sum()
    (want_u,) = torch.autograd.grad(want, [u], retain_graph=True)
    torch.testing.assert_close(got_u, want_u, rtol=1e-5, atol=1e-8)  # the deficit runs in fp32
    if held:
        torch.testing.assert_close(got_s, torch.zeros_like(s), rtol=0, atol=1e-13)
    else:
        (want_s,) = torch.autograd.grad(want, [s])
        assert want_s.abs().min() > 1e-3
        torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("held", [False, True])
def test_the_direction_surrogate_has_the_usage_deficits_gradient_in_w_and_none_in_x(held):
    """usage_direction_surrogate(softmax(z), x, W, s) against Eq. 8's deficit by definition in
    fp64, z = s·x W with x detached, per head W_h and s_h: equal gradients in W and (unless
    held) s; none in x nor, held, in s."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 2, 11, 5, generator=g, dtype=torch.float64) * 2).requires_grad_()
    w = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)  # (H, D, F)
    s = torch.tensor([1.3, 0.4], dtype=torch.float64, requires_grad=True)  # per head
    scale = s.detach() if held else s
    z = scale[:, None, None] * (x @ w)
    got = usage_direction_surrogate(z.softmax(-1), x, w, scale)
    assert got.shape == (3, 2) and got.dtype == torch.float64
    weights = torch.randn(3, 2, generator=g, dtype=torch.float64)  # any per-sequence weights
    got_w, got_s, got_x = torch.autograd.grad((got * weights).sum(), [w, s, x], allow_unused=True)
    assert got_x is None  # the inputs are held out
    z_ref = scale[:, None, None] * (x.detach() @ w)
    want = sum(weights[b, h] * _deficit_by_definition(z_ref[b, h], 1, usage_only=True)
               for b in range(3) for h in range(2))  # fmt: skip
    want_w, want_s = torch.autograd.grad(want, [w, s], allow_unused=True)
    assert want_w.abs().max() > 1e-3
    torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-12)  # fp64 both
    if held:
        assert got_s is None and want_s is None
    else:
        assert want_s.abs().min() > 1e-3
        torch.testing.assert_close(got_s, want_s, rtol=1e-10, atol=1e-12)


def test_the_deficit_is_zero_for_sure_and_even_buckets_and_log_f_for_collapse_or_uniform():
    f = 8
    sure_even = torch.eye(f) * 200.0  # token t sure of bucket t, each bucket once
    one_bucket = sure_even[[3] * f]  # every token sure of the same bucket
    uniform = torch.zeros(f, f)
    assert information_deficit(sure_even, 1).item() == pytest.approx(0.0, abs=1e-5)
    assert information_deficit(one_bucket, 1).item() == pytest.approx(math.log(f), abs=1e-5)
    assert information_deficit(uniform, 1).item() == pytest.approx(math.log(f), abs=1e-5)
    # the usage alone: even use is met by sure tokens and by uniform ones alike
    assert usage_deficit(sure_even, 1).item() == pytest.approx(0.0, abs=1e-5)
    assert usage_deficit(uniform, 1).item() == pytest.approx(0.0, abs=1e-5)
    assert usage_deficit(one_bucket, 1).item() == pytest.approx(math.log(f), abs=1e-5)


def test_a_negative_weight_an_unknown_form_and_a_non_bool_flag_are_refused_by_name():
    with pytest.raises(ValueError, match="bucket_balance"):
        SoftHashFeatureMap(D, num_features=6, bucket_balance=-0.1)
    with pytest.raises(ValueError, match="bucket_balance_form"):
        SoftHashFeatureMap(D, num_features=6, bucket_balance=0.1, bucket_balance_form="even")
    with pytest.raises(TypeError, match="bucket_balance_temperature"):
        SoftHashFeatureMap(D, num_features=6, bucket_balance=0.1, bucket_balance_temperature=0)
    with pytest.raises(TypeError, match="bucket_balance_inputs"):
        SoftHashFeatureMap(D, num_features=6, bucket_balance=0.1, bucket_balance_inputs="no")


def _pair(beta, **kw):
    """The same map with and without the balance (same draw), fp64, τ learned."""
    return (SoftHashFeatureMap(D, num_features=6, bucket_balance=beta, seed=3, **kw).double(),
            SoftHashFeatureMap(D, num_features=6, seed=3, **kw).double())  # fmt: skip


@pytest.mark.parametrize("form,through_tau,through_x", [
    ("information", True, True), ("information", False, True), ("usage", False, True),
    ("usage", True, True), ("usage", False, False), ("usage", True, False),
    ("information", True, False)])  # fmt: skip
@pytest.mark.parametrize("kw", [{}, {"factors": 2, "num_features": 9}, {"linear_weight": 0.1},
                                {"unit_directions": True}])  # fmt: skip
def test_values_unchanged_and_gradients_are_those_of_the_loss_plus_beta_deficits(
    kw, form, through_tau, through_x
):
    """∂/∂(θ, x) of ⟨φq, R⟩ + ⟨φk, S⟩ with β equals ∂/∂(θ, x) of the same plus β(mean
    deficit of the query logits + that of the key logits) computed explicitly on the map
    without β (with τ, or x, detached in those logits when the balance is not to reach it: τ's,
    or x's, gradient is then the plain map's)."""
    beta = 0.37
    balance = {"bucket_balance_form": form, "bucket_balance_temperature": through_tau,
               "bucket_balance_inputs": through_x}  # fmt: skip
    kw = {"num_features": 6, **kw}
    with_b = SoftHashFeatureMap(D, bucket_balance=beta, seed=3, **balance, **kw).double()
    plain = SoftHashFeatureMap(D, seed=3, **kw).double()
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 9, D, generator=g, dtype=torch.float64) * 2).requires_grad_()
    y = (torch.randn(2, 9, D, generator=g, dtype=torch.float64) * 2).requires_grad_()
    r = torch.randn(2, 9, with_b.feature_dim, generator=g, dtype=torch.float64)
    s = torch.randn(2, 9, with_b.feature_dim, generator=g, dtype=torch.float64)

    fq, fk = with_b.query(x), with_b.key(y)
    torch.testing.assert_close(fq, plain.query(x), rtol=0, atol=0)
    torch.testing.assert_close(fk, plain.key(y), rtol=0, atol=0)
    got = torch.autograd.grad((fq * r).sum() + (fk * s).sum(), [*with_b.parameters(), x, y])

    m, deficit = plain.factors, usage_deficit if form == "usage" else information_deficit
    task = (plain.query(x) * r).sum() + (plain.key(y) * s).sum()
    xb, yb = (x, y) if through_x else (x.detach(), y.detach())
    balance_loss = beta * (
        deficit(plain._logits(xb, False, learn_tau=through_tau), m).mean()
        + deficit(plain._logits(yb, True, learn_tau=through_tau), m).mean()
    )
    want = torch.autograd.grad(task + balance_loss, [*plain.parameters(), x, y], retain_graph=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # the deficit runs in fp32
    assert got[0].abs().max() > 0
    task_x = torch.autograd.grad(task, [x, y], retain_graph=True)
    if through_x:  # the balance moves the inputs (and so the layers below)
        assert (got[-2] - task_x[0]).abs().max() > 1e-6
    else:  # the inputs learn from the task alone; the directions still from the balance
        torch.testing.assert_close(got[-2], task_x[0], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(got[-1], task_x[1], rtol=1e-12, atol=1e-15)
        task_w = torch.autograd.grad(task, plain.weight_q, retain_graph=True)[0]
        assert (got[0] - task_w).abs().max() > 1e-6
    names = [n for n, _ in with_b.named_parameters()]
    tau = names.index("log_temperature")
    task_only = torch.autograd.grad(task, plain.log_temperature)[0]
    balance_tau = torch.autograd.grad(balance_loss, plain.log_temperature, allow_unused=True)[0]
    if through_tau:  # the balance moves τ (Eq. 7 sharpens, Eq. 8 softens)
        assert balance_tau.abs() > 1e-6
        assert (got[tau] - task_only).abs() > 1e-6
    else:  # τ learns from the task alone
        assert balance_tau is None
        torch.testing.assert_close(got[tau], task_only, rtol=1e-12, atol=1e-15)


def test_nothing_is_computed_without_autograd_nor_added_for_a_single_token(monkeypatch):
    with_b, plain = _pair(0.5)
    x = torch.randn(1, 5, D, dtype=torch.float64)
    usage = {"bucket_balance_form": "usage", "bucket_balance_temperature": False}
    held_x = {**usage, "bucket_balance_inputs": False}
    all_heads = [MultiHeadFeatureMap("soft_hash", D, 2, seed=1, num_features=6,
                                     bucket_balance=0.5, **kw)
                 for kw in ({}, usage, held_x)]  # fmt: skip

    def refuse(*args, **kwargs):
        raise AssertionError("the deficit was computed under no_grad")

    for form in soft_hash.BALANCE_FORMS:
        monkeypatch.setitem(soft_hash.BALANCE_FORMS, form, refuse)
    for module in (soft_hash, heads_batched):
        monkeypatch.setattr(module, "attach_usage_balance", refuse)
    with torch.no_grad():  # evaluation and decoding pay nothing
        torch.testing.assert_close(with_b.query(x), plain.query(x), rtol=0, atol=0)
        for heads in all_heads:
            heads.query(torch.randn(1, 2, 5, D))
    for heads in all_heads:  # ... and with autograd it is called
        with pytest.raises(AssertionError, match="no_grad"):
            heads.query(torch.randn(1, 2, 5, D))
    monkeypatch.undo()
    one = torch.randn(1, 1, D, dtype=torch.float64)  # decoding: I = 0 for one token, no loss
    a = torch.autograd.grad(with_b.query(one).sum(), with_b.weight_q)[0]
    b = torch.autograd.grad(plain.query(one).sum(), plain.weight_q)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_scale_in_force_at_the_forward_weighs_the_auxiliary_gradient():
    w = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)

    def grad_w(scale):
        with auxiliary_loss_scale(scale):
            out = add_auxiliary_loss(x * 1.0, w**2)  # ∂(w²)/∂w = 4
        return torch.autograd.grad(out.sum(), w)[0].item()

    assert grad_w(1.0) == 4.0 and grad_w(0.25) == 1.0
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="scale"):
            with auxiliary_loss_scale(bad):
                pass
    with pytest.raises(ValueError, match="scalar"):
        add_auxiliary_loss(x, torch.ones(2))


@pytest.mark.parametrize("form,through_tau,through_x", [
    ("information", True, True), ("usage", False, True), ("usage", False, False),
    ("usage", True, False)])  # fmt: skip
@pytest.mark.parametrize("factors", [1, 2])
def test_every_multi_head_path_gives_each_head_its_own_loss(factors, form, through_tau, through_x):
    """Batched heads and vmap: the same features and gradients, equal to those of the sum over
    heads of each head's explicit loss (as H separate maps would give)."""
    f = 9 if factors == 2 else 6
    kw = dict(num_features=f, factors=factors, bucket_balance=0.4, bucket_balance_form=form,
              bucket_balance_temperature=through_tau, bucket_balance_inputs=through_x)  # fmt: skip
    x = torch.randn(2, 3, 7, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x.requires_grad_()
    results = []
    for batched in (True, False):
        heads = MultiHeadFeatureMap("soft_hash", D, 3, seed=1, **kw).double()
        heads.use_batched = batched
        phi = torch.cat([heads.query(x), heads.key(x.flip(-2))], dim=-1)
        names = [n for n, _ in heads.named_parameters()] + ["x"]
        grads = torch.autograd.grad((phi * phi.detach().flip(-1)).sum(), [*heads.parameters(), x])
        results.append((phi, dict(zip(names, grads, strict=True))))
    (p0, g0), *rest = results
    for p, gr in rest:
        torch.testing.assert_close(p, p0, rtol=1e-12, atol=1e-14)
        for a, b in zip(sorted(g0.items()), sorted(gr.items()), strict=True):
            torch.testing.assert_close(a[1].reshape(-1), b[1].reshape(-1), rtol=1e-9, atol=1e-12)
    plain = MultiHeadFeatureMap("soft_hash", D, 3, seed=1, num_features=f, factors=factors)
    plain = plain.double()
    q = torch.cat([plain.query(x), plain.key(x.flip(-2))], dim=-1)
    explicit = (q * q.detach().flip(-1)).sum()
    params, _ = plain._stacked()  # (H, D, m·B) directions and (H,) log τ, differentiable
    log_t = params["map.log_temperature"]
    deficit = usage_deficit if form == "usage" else information_deficit
    if not through_tau:
        log_t = log_t.detach()
    xb = x if through_x else x.detach()
    for which, xs in (("q", xb), ("k", xb.flip(-2))):
        weight = params[f"map.weight_{which}"]
        for h in range(3):  # each head's own loss on its own slice: τ_h x W_h / √D
            logits = xs[:, h] @ weight[h] * (log_t[h].exp() / math.sqrt(D))
            explicit = explicit + 0.4 * deficit(logits, factors).mean()
    names = [n for n, _ in plain.named_parameters()] + ["x"]
    want = torch.autograd.grad(explicit, [*plain.parameters(), x])
    want = dict(zip(names, want, strict=True))
    for name, g in g0.items():
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-7)


def test_a_model_with_the_balance_trains_the_same_outputs_and_recomputes_exactly():
    """In a TransformerLM: the balance changes no logits; the recomputed backward equals the
    stored one (the scale is kept from the forward); the gradient differs from β = 0's."""
    base = dict(attention="soft_hash_far_local_tied", vocab_size=32, block_size=64, n_layer=2,
                n_head=2, n_embd=32, chunk_size=8)  # fmt: skip
    idx = torch.randint(0, 32, (2, 41), generator=torch.Generator().manual_seed(1))
    runs = {}
    for beta, recompute in ((0.0, True), (0.2, True), (0.2, False)):
        cfg = TransformerConfig(**base, map_kwargs={"num_features": 24, "bucket_balance": beta})
        torch.manual_seed(0)
        model = TransformerLM(cfg).double()
        for core in model.modules():
            if isinstance(core, AttentionCore):
                core.checkpoint = recompute
        logits, loss = model(idx, idx)
        runs[beta, recompute] = (logits, torch.autograd.grad(loss, list(model.parameters())))
    (l0, g0), (l1, g1), (l2, g2) = runs[0.0, True], runs[0.2, True], runs[0.2, False]
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    torch.testing.assert_close(l2, l0, rtol=0, atol=0)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(g1, g0, strict=True))


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_the_training_loop_weighs_the_auxiliary_loss_as_each_micro_batch_loss(
    tmp_path, monkeypatch, grad_accum
):
    """``train`` back-propagates loss / n for each of n micro-batches, and runs each forward
    under ``auxiliary_loss_scale(1 / n)``, so the bucket balance is averaged as the loss is
    (without the scale it would weigh n×)."""
    from polysketch.data.corpus import load_corpus
    from polysketch.nn import heads_batched
    from polysketch.train import TrainConfig, train

    seen = []  # the gradient each auxiliary loss is back-propagated with: its scale

    def recording(x, loss):
        loss.register_hook(lambda g: seen.append(float(g)))
        return add_auxiliary_loss(x, loss)

    monkeypatch.setattr(heads_batched, "add_auxiliary_loss", recording)
    monkeypatch.setattr(soft_hash, "add_auxiliary_loss", recording)
    text = tmp_path / "tiny.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    model = TransformerConfig(attention="soft_hash_far_local_tied", vocab_size=256,
                              block_size=16, n_layer=1, n_head=2, n_embd=16, chunk_size=8,
                              map_kwargs={"num_features": 8, "bucket_balance": 0.5})  # fmt: skip
    cfg = TrainConfig(steps=1, batch_size=4, grad_accum=grad_accum, warmup_steps=0,
                      eval_interval=1, eval_batches=1, log_interval=1)  # fmt: skip
    train(model, cfg, load_corpus(text), progress=False)
    # queries and keys of each micro-batch's far branch, once each (the backward recomputes the
    # forward outside the scale's block: the scale is the one kept from the first forward)
    assert seen == [1 / grad_accum] * (2 * grad_accum)


def test_a_compiled_model_with_the_balance_has_eager_gradients_at_each_scale():
    """torch.compile(fullgraph=True) traces the balance (the scale is a global float, not a
    ContextVar it cannot trace): a compiled model's gradients equal eager ones at the scale in
    force, not at the one it was first compiled with."""
    torch._dynamo.reset()
    maps = {"num_features": 8, "bucket_balance": 0.5, "bucket_balance_form": "usage",
            "bucket_balance_temperature": False}  # fmt: skip
    cfg = TransformerConfig(n_layer=1, n_head=2, n_embd=32, attention="soft_hash",
                            chunk_size=16, map_kwargs=maps)  # fmt: skip
    model = TransformerLM(cfg).double()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    seen = []
    for scale in (1.0, 0.25):
        with auxiliary_loss_scale(scale):
            got = torch.autograd.grad(compiled(idx, idx)[1], params, allow_unused=True)
            want = torch.autograd.grad(model(idx, idx)[1], params, allow_unused=True)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        seen.append(want)
    moved = [(a - b).abs().max() for a, b in zip(*seen, strict=True) if a is not None]
    assert max(moved) > 1e-6  # the scale weighs the balance's gradient


def _balance_step(path: str, recompute: bool, maps: dict, calls: list | None = None) -> dict:
    """Gradients of one fp64 step with the balance: a model of two far heads (the batched heads)
    or ``kernel_attention`` with one map (the map's own path), recomputed or not; ``calls``
    emptied once the model is built (its heads' construction probes the map)."""
    if path == "model":
        cfg = TransformerConfig(attention="soft_hash_far_local_balanced", vocab_size=32,
                                block_size=40, n_layer=2, n_head=2, n_embd=16, chunk_size=8,
                                map_kwargs=maps, recompute=recompute)  # fmt: skip
        model = TransformerLM(cfg).double().train()
        idx = torch.randint(0, 32, (2, 41), generator=torch.Generator().manual_seed(0))
        if calls is not None:
            calls.clear()
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        return {n: p.grad for n, p in model.named_parameters()}
    fm = SoftHashFeatureMap(D, seed=3, **maps).double()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 24, D, generator=gen, dtype=torch.float64).requires_grad_()
               for _ in range(3))  # fmt: skip
    out = kernel_attention(q, k, v, fm, causal=True, chunk_size=8, checkpoint=recompute)
    (out * out.detach().flip(-1)).sum().backward()
    return {**{n: p.grad for n, p in fm.named_parameters()}, "q": q.grad, "k": k.grad}


@pytest.mark.parametrize("inputs,through_tau", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("path", ["model", "map"])
def test_a_recomputed_layer_attaches_the_balance_once_with_the_same_gradients(
    monkeypatch, path, inputs, through_tau
):
    """Under recomputation (the cores' ``recompute=True``, ``kernel_attention(checkpoint=
    True)``: torch.utils.checkpoint) the balance is computed in the first forward only (its
    gradients ride on one autograd node, not on saved tensors; the rerun skips it:
    ``_auxiliary.replaying``): as many calls a step as without recomputation, and the same
    gradients in fp64."""
    real = soft_hash.attach_usage_balance
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for module in (soft_hash, heads_batched):  # the map's own path and the batched heads'
        monkeypatch.setattr(module, "attach_usage_balance", counted)
    maps = dict(num_features=12, bucket_balance=0.3, bucket_balance_form="usage",
                bucket_balance_inputs=inputs, bucket_balance_temperature=through_tau)  # fmt: skip
    grads, counts = {}, {}
    for recompute in (True, False):
        calls.clear()
        grads[recompute] = _balance_step(path, recompute, maps, calls)
        counts[recompute] = len(calls)
    assert counts[True] == counts[False] == (4 if path == "model" else 2)  # q, k (per layer)
    for name, g in grads[False].items():  # fp64, the same sums in another order at most
        torch.testing.assert_close(grads[True][name], g, rtol=1e-12, atol=1e-14, msg=name)
    without = _balance_step(path, False, {**maps, "bucket_balance": 0.0})
    assert any((g - without[n]).abs().max() > 1e-6 for n, g in grads[True].items())


@pytest.mark.parametrize("direct", [True, False])
def test_known_gradients_ride_on_the_backward_as_their_surrogate_loss_would(monkeypatch, direct):
    """``add_auxiliary_gradient(y, own, ((w, g_w),))`` gives the gradients of
    s·(⟨y, sg(own)⟩ + ⟨w, sg(g_w)⟩), s the scale at the forward, once per backward: as node
    attributes (eager) or through that loss (``torch.compile`` / ``torch.func``)."""
    monkeypatch.setattr(_auxiliary, "_direct", lambda: direct)
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
            for shape in ((3, 4), (4, 5)))  # fmt: skip
    own, g_w, r = (torch.randn(*shape, generator=gen, dtype=torch.float64)
                   for shape in ((1, 5), (4, 5), (3, 5)))  # fmt: skip
    with auxiliary_loss_scale(0.5):
        y = add_auxiliary_gradient(x @ w, own, ((w, g_w),))
    got = torch.autograd.grad((y * r).sum(), [x, w])
    y = x @ w
    want = torch.autograd.grad((y * r).sum() + 0.5 * ((y * own).sum() + (w * g_w).sum()), [x, w])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="does not broadcast"):
        add_auxiliary_gradient(x @ w, torch.ones(2, 5))
    with pytest.raises(ValueError, match="gradient of shape"):
        add_auxiliary_gradient(x @ w, None, ((w, torch.ones(5, 4)),))
    with torch.no_grad():
        assert add_auxiliary_gradient(x @ w, own) is not None
