"""Overflow in attention (issue 22 item 6): stabilized queries where exact, refusals elsewhere.

Before: with scale 1 and ‖q‖ = ‖k‖ ≈ 16, kernel_attention returned all-zero outputs for
positive and complex_exp and NaN for trig and the hybrids (fp32 and bf16), and fp16 inputs with
|x| ≈ 100 gave inf/NaN for the polynomial maps. Now every such call either gives the exact
normalized result (compared with an fp64 reference on the same features / kernel) or raises a
ValueError naming the cause and the fix.
"""

import copy

import pytest
import torch

from numerics import (
    assert_as_accurate,
    linear_attention_error_bound,
    matmul_error_bound,
    per_token_in_other_shapes,
    rounding_sigma,
    unit_roundoff,
)
from polysketch import features, kernel_attention
from polysketch.features.stability import attention_features, refuse_unless
from polysketch.nn import MultiHeadFeatureMap
from polysketch.ops import naive_linear_attention

D, T, E = 16, 24, 5
SOFTMAX = ["positive", "complex_exp", "trig", "hybrid_angular", "hybrid_gaussian"]
STABLE = [n for n in features.available() if features.get_class(n).stable_query]
F64 = torch.float64


def on_sphere(radius, *shape, seed=0, dtype=torch.float32):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return (x / x.norm(dim=-1, keepdim=True) * radius).to(dtype)


def qkv(rq, rk, dtype=torch.float32, seed=0):
    q = on_sphere(rq, 2, T, D, seed=seed, dtype=dtype)
    k = on_sphere(rk, 2, T, D, seed=seed + 1, dtype=dtype)
    v = torch.randn(2, T, E, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    return q, k, v


def build(name, **kw):
    if features.get_class(name).takes("num_features"):
        kw = {"num_features": 8} | kw
    fm = features.create(name, D, seed=3, **kw)
    if name == "hybrid_clustered":
        g = torch.Generator().manual_seed(0)
        fm.fit(torch.randn(64, D, generator=g), torch.randn(64, D, generator=g))
    return fm


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def exact_reference(fm, q, k, v, causal=True):
    """The normalized attention of the map's scores in fp64 (no guard): Σ s v / Σ s."""
    f = build(fm.name)  # same seed, same draw
    f.load_state_dict(fm.state_dict())
    f = f.double()
    return naive_linear_attention(
        f.query(q.double()), f.key(k.double()), v.double(), causal=causal, eps=0.0
    )


# ----- the issue's reproductions ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", SOFTMAX)
def test_issue_reproduction_norm_16_scale_1_is_refused_with_the_cause(name, dtype):
    q, k, v = qkv(16, 16, dtype)
    fm = features.create(name, D, seed=0)  # defaults: scale 1.0
    with pytest.raises(ValueError, match=r"(overflow|underflows).*lower scale.*normalize q and k"):
        kernel_attention(q, k, v, fm, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rk", [2.0, 4.0])
@pytest.mark.parametrize("name", SOFTMAX)
def test_large_queries_are_stabilized_exactly(name, rk, dtype):
    # ‖q‖ = 16: trig's query factor exp(128) overflows fp32, positive's rows sink to e^-80
    # (below eps), so the old path gave NaN or ~0. The query rows are rescaled instead.
    q, k, v = qkv(16, rk, dtype)
    fm = build(name)
    out = kernel_attention(q, k, v, fm, causal=True, chunk_size=8)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # 1. exact given the features it used: fp64 attention of the same (rounded) features, to
    # the rounding of an fp32 attention (bf16: its operands round to 8 bits)
    phi_q, phi_k = fm.query_stabilized(q), fm.key(k)
    same = naive_linear_attention(phi_q.double(), phi_k.double(), v.double(), causal=True, eps=0)
    if dtype == torch.bfloat16:
        assert rel(out, same) <= 2e-2
    else:
        bound = linear_attention_error_bound(phi_q, phi_k, v, dtype=dtype)
        assert ((out.double() - same).abs() <= bound).all()
    # 2. and it is the map's normalized attention (fp64 features, no stabilization)
    if dtype == torch.float32:
        signed = not fm.nonnegative  # denominators near zero amplify fp32 rounding
        assert rel(out, exact_reference(fm, q, k, v)) <= (1e-3 if signed else 1e-5)


@pytest.mark.parametrize(
    "name", ["polysketch", "tensor_power", "tensorsketch", "fpa", "llops", "taylor"]
)
def test_fp16_large_inputs_are_exact_or_refused_naming_bfloat16(name):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, T, D, generator=g) * 100 for _ in range(2))
    v = torch.randn(2, T, E, generator=g)
    fm = features.create(name, D, seed=0)
    for offset in (0.0, 1.0):
        try:
            out = kernel_attention(q.half(), k.half(), v.half(), fm, causal=True,
                                   denominator_offset=offset)  # fmt: skip
        except ValueError as err:
            assert "float16" in str(err) and "bfloat16" in str(err)
            continue
        assert torch.isfinite(out).all()
        f = fm.double()
        ref = naive_linear_attention(
            f.query(q.half().double()), f.key(k.half().double()), v.half().double(),
            causal=True, denominator_offset=offset,
        )  # fmt: skip
        assert rel(out, ref) <= 1e-2
    with pytest.raises(ValueError, match="float16"):
        kernel_attention((q * 10).half(), (k * 10).half(), v.half(), fm, causal=True)
    # only the queries overflow, offset 0: these maps have no stabilized form, so refuse
    # (before this check the query side went unchecked on the offset-0 path)
    small = k.half() / 100
    with pytest.raises(ValueError, match="query features.*float16"):
        kernel_attention((q * 10).half(), small, v.half(), fm, causal=True)


# ----- the rules --------------------------------------------------------------------------------
def test_offset_or_no_normalization_forbids_stabilization_and_refuses_overflow():
    q, k, v = qkv(16, 2)
    fm = build("trig")
    kernel_attention(q, k, v, fm, causal=True)  # offset 0: stabilized, fine
    with pytest.raises(ValueError, match=r"query features of feature map 'trig' overflow.*offset"):
        kernel_attention(q, k, v, fm, causal=True, denominator_offset=1.0)
    with pytest.raises(ValueError, match="query features of feature map 'trig' overflow"):
        kernel_attention(q, k, v, fm, causal=True, normalize=False)


def test_key_overflow_is_refused_never_shifted():
    q, k, v = qkv(2, 16)
    with pytest.raises(ValueError, match=r"key features of feature map 'trig' overflow.*per-key"):
        kernel_attention(q, k, v, build("trig"), causal=False)


def test_tiny_normalizer_of_a_nonnegative_map_is_refused():
    # ‖q‖ = ‖k‖ = 8: every feature is representable, but the keys' exp(−‖k‖²/2) makes
    # Σ_j φq·φk < eps even after the queries are stabilized; the guard would shrink outputs.
    q, k, v = qkv(8, 8)
    for name in ("positive", "complex_exp"):
        with pytest.raises(ValueError, match="normalizer of feature map .* underflows"):
            kernel_attention(q, k, v, build(name), causal=True)
    # with an offset the guard never fires (offset + Σ ≥ offset): the formula's result stands
    out = kernel_attention(q, k, v, build("positive"), causal=True, denominator_offset=1.0)
    assert torch.isfinite(out).all()


def test_masked_keys_and_fully_masked_rows_are_exempt():
    q, k, v = qkv(1, 1)
    k = k.clone()
    k[:, :3] *= 100.0  # overflowing trig keys, but masked
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[:, :3] = False
    out = kernel_attention(q, k, v, build("trig"), causal=True, key_padding_mask=mask)
    assert torch.isfinite(out[:, 3:]).all()
    with pytest.raises(ValueError, match="key features"):
        kernel_attention(q, k, v, build("trig"), causal=True)
    # left padding: the first queries see no key at all; no normalizer check for them
    out = kernel_attention(q, q, v, build("positive"), causal=True, key_padding_mask=mask)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", STABLE)
def test_query_stabilized_is_a_positive_row_factor(name):
    fm = build(name).double()
    x = on_sphere(3.0, 7, D, seed=5, dtype=F64)
    plain, stab = fm.query(x), fm.query_stabilized(x)
    big = plain.abs() > 1e-200
    ratio = torch.where(big, stab / plain, torch.nan)
    c = torch.nanmean(ratio, dim=-1, keepdim=True)
    assert (c > 0).all()
    assert torch.allclose(stab, plain * c, rtol=1e-12, atol=0)
    # far outside the representable range the stabilized row stays finite, max |φ| in [1/2, 1]
    for radius in (20.0, 40.0):
        y = on_sphere(radius, 7, D, seed=6)
        row_max = fm.float().query_stabilized(y).abs().amax(-1)
        assert torch.isfinite(row_max).all() and (row_max <= 1).all() and (row_max >= 0.5).all()
        fm = fm.double()


@pytest.mark.parametrize("name", [n for n in features.available() if n not in STABLE])
def test_other_maps_query_stabilized_is_query(name):
    fm = build(name)
    x = torch.randn(3, D)
    assert torch.equal(fm.query_stabilized(x), fm.query(x))


@pytest.mark.parametrize("name", STABLE)
def test_stabilized_path_same_outputs_and_gradients_fp64(name):
    # moderate norms, where both paths are representable: identical results and gradients
    fm = build(name).double()
    q, k, v = (x.double().requires_grad_(True) for x in qkv(3.0, 2.0))

    def run(stabilize):
        phi_q = fm.query_stabilized(q) if stabilize else fm.query(q)
        return naive_linear_attention(phi_q, fm.key(k), v, causal=True, eps=0.0)

    outs, grads = [], []
    for stabilize in (False, True):
        out = run(stabilize)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out.pow(2).sum(), (q, k, v)))
    assert rel(outs[1], outs[0]) <= 1e-10
    for a, b in zip(grads[1], grads[0], strict=True):
        assert rel(a, b) <= 1e-10
    # and kernel_attention takes that path (offset 0) with the same gradients
    out = kernel_attention(q, k, v, fm, causal=True, chunk_size=8, eps=0.0)
    g = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    assert rel(out.detach(), outs[0]) <= 1e-10
    for a, b in zip(g, grads[0], strict=True):
        assert rel(a, b) <= 1e-10


@pytest.mark.parametrize("name", ["positive", "trig", "hybrid_gaussian"])
def test_stabilized_path_is_causal(name):
    fm = build(name)
    q, k, v = qkv(10.0, 2.0)
    base = kernel_attention(q, k, v, fm, causal=True, chunk_size=8)
    for t in (0, 7, 8, 15):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, t + 1 :] *= 1.5  # larger future queries: stabilized, so still in range
        k2[:, t + 1 :] = on_sphere(2.0, 2, T - t - 1, D, seed=t)
        v2[:, t + 1 :] *= 3
        out = kernel_attention(q2, k2, v2, fm, causal=True, chunk_size=8)
        assert torch.equal(out[:, : t + 1], base[:, : t + 1])


def test_initial_state_is_checked_and_exact():
    fm = build("positive")
    q, k, v = qkv(12.0, 2.0)
    full = kernel_attention(q, k, v, fm, causal=True, chunk_size=8)
    _, state = kernel_attention(q[:, :10], k[:, :10], v[:, :10], fm, causal=True,
                                return_state=True)  # fmt: skip
    rest = kernel_attention(q[:, 10:], k[:, 10:], v[:, 10:], fm, causal=True,
                            initial_state=state, chunk_size=8)  # fmt: skip
    assert rel(rest, full[:, 10:]) <= 1e-5


def test_multi_head_map_is_stabilized_per_head():
    mh = MultiHeadFeatureMap("trig", D, 3, seed=0, num_features=8)
    assert mh.stable_query and mh.family == "softmax"
    x = on_sphere(16.0, 2, 3, 5, D)
    got = mh.query_stabilized(x)
    for h in range(3):
        fm = mh.head_map(h)
        ref = fm.query_stabilized(x[:, h])
        # the batched call rounds the projections θ = ω·u (|θ| ~ 60) in another order than the
        # per-head call: |Δθ| <= γ_D |u|·|ω|; a stabilized feature c·cos θ (c ~ 1, from the same
        # θ) moves by at most 2 max|Δθ|, plus its own rounding
        dtheta = matmul_error_bound(fm._scaled(x[:, h]), fm.omega.T, torch.float32)
        tol = 2 * float(dtheta.max()) + 2 * unit_roundoff(torch.float32)
        assert (got[:, h] - ref).abs().max() <= tol
    assert torch.isfinite(got).all() and not torch.isfinite(mh.query(x)).all()
    k = on_sphere(2.0, 2, 3, 5, D, seed=1)
    phi_q, phi_k = attention_features(mh, x, k, causal=True, eps=1e-6)
    assert torch.equal(phi_q, got)
    with pytest.raises(ValueError, match="key features of feature map 'trig' overflow"):
        attention_features(mh, k, x, causal=True, eps=1e-6)


def test_refuse_unless_cpu_raises_and_device_path_asserts():
    ok, bad = torch.tensor([True, True]), torch.tensor([True, False])
    refuse_unless(ok, "fine")
    refuse_unless(ok, "fine", asynchronous=True)
    with pytest.raises(ValueError, match="^broken$"):
        refuse_unless(bad, "broken")
    # the accelerator path (torch._assert_async, no host sync), forced on the CPU
    with pytest.raises(RuntimeError, match="broken"):
        refuse_unless(bad, "broken", asynchronous=True)
    q, k, _ = qkv(2, 16)
    with pytest.raises(RuntimeError, match="key features of feature map 'trig' overflow"):
        attention_features(build("trig"), q, k, causal=True, eps=1e-6, asynchronous=True)


def test_device_assertions_carry_messages_a_device_accepts():
    """CUDA's torch._assert_async refuses a message of 255 bytes or more (MPS: 250) before it
    checks anything; the device path clips to 249 bytes of UTF-8 at a character boundary."""
    from polysketch._checks import DEVICE_ASSERT_MESSAGE_BYTES, device_assert_message

    assert device_assert_message("fine") == "fine"
    long = "the normalizer Σ_j φq(q_i)·φk(k_j) is 0 " + "φ" * 300  # 2-byte characters
    for message in (long, "x" * 249, "x" * 250, "é" * 125, "é" * 126):
        clipped = device_assert_message(message)
        assert len(clipped.encode("utf-8")) <= DEVICE_ASSERT_MESSAGE_BYTES < 250
        assert clipped == message or (clipped.endswith("…") and message.startswith(clipped[:-1]))
    assert device_assert_message("x" * 249) == "x" * 249
    assert device_assert_message(long).startswith("the normalizer Σ_j φq(q_i)·φk(k_j) is 0 ")
    # the test suite runs torch._assert_async with the device's limit (tests/conftest.py) ...
    with pytest.raises(RuntimeError, match="Message length must be smaller than"):
        torch._assert_async(torch.tensor(True), long)
    # ... and refuse_unless's device path passes the clipped message, failing with its start
    refuse_unless(torch.tensor([True]), long, asynchronous=True)
    with pytest.raises(RuntimeError, match="^the normalizer Σ_j"):
        refuse_unless(torch.tensor([False]), long, asynchronous=True)


def test_compiled_attention_checks_without_graph_break():
    fm = build("positive")

    def fn(q, k, v):
        return kernel_attention(q, k, v, fm, causal=True, chunk_size=8, algorithm="chunked_scan")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    q, k, v = qkv(12.0, 2.0)
    f64 = copy.deepcopy(fm).double()
    exact = kernel_attention(q.double(), k.double(), v.double(), f64, causal=True, chunk_size=8,
                             algorithm="chunked_scan")  # fmt: skip
    assert_as_accurate(compiled(q, k, v), fn(q, k, v), exact)
    q, k, v = qkv(8.0, 8.0)
    with pytest.raises(RuntimeError, match="underflows"):
        compiled(q, k, v)


# ----- one decoding step of a symmetric map: query and key rows in one call ---------------------
@pytest.mark.parametrize("name", features.available())
def test_symmetric_maps_have_one_function_for_every_role(name):
    fm = build(name)
    x = on_sphere(1.5, 3, D, seed=5)
    if fm.symmetric:  # the claim decoding relies on: φq = φk = the stabilized φq
        torch.testing.assert_close(fm.key(x), fm.query(x), rtol=0, atol=0)
        torch.testing.assert_close(fm.query_stabilized(x), fm.query(x), rtol=0, atol=0)
    assert features.create("polysketch", D).symmetric
    assert not features.create("hedgehog", D).symmetric  # own query and key weights
    assert not features.create("positive", D).symmetric  # a stabilized query form


@pytest.mark.parametrize("normalize,offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_one_token_joint_features_equal_the_separate_calls(normalize, offset):
    mh = MultiHeadFeatureMap("polysketch", D, 3, seed=1, nonnegative=True)
    assert mh.symmetric
    q, k = on_sphere(2.0, 2, 3, 1, D, seed=7), on_sphere(2.0, 2, 3, 1, D, seed=8)
    sums = torch.rand(2, 3, mh.feature_dim)
    phi_q, phi_k = attention_features(mh, q, k, causal=True, eps=1e-6, normalize=normalize,
                                      denominator_offset=offset, initial_sums=sums)  # fmt: skip
    # the joint call rounds in another shape than the separate ones (a BLAS picks its kernel by
    # shape), so it is judged as flash-attention judges a kernel (``assert_as_accurate``),
    # against the separate calls in three shapes, each token in units of its rounding (issue 69)
    mh64 = copy.deepcopy(mh).double()
    for got, fn, fn64, x in ((phi_q, mh.query, mh64.query, q), (phi_k, mh.key, mh64.key, k)):
        sigma = lambda fn64=fn64, x=x: rounding_sigma(lambda: fn64(x.double()))  # noqa: E731
        assert_as_accurate(got, per_token_in_other_shapes(fn, x), fn64(x.double()),
                           sigma=sigma)  # fmt: skip
    # gradients through the joint call equal those of the separate calls (decoding with grad)
    q, k = (x.double().requires_grad_() for x in (q, k))
    mh = mh.double()
    g = torch.Generator().manual_seed(9)
    wq, wk = (torch.randn(2, 3, 1, mh.feature_dim, generator=g, dtype=torch.float64)
              for _ in range(2))  # fmt: skip
    a_q, a_k = attention_features(mh, q, k, causal=True, eps=1e-6, normalize=normalize,
                                  denominator_offset=offset)  # fmt: skip
    g_joint = torch.autograd.grad((a_q * wq).sum() + (a_k * wk).sum(), (q, k))
    g_apart = torch.autograd.grad((mh.query(q) * wq).sum() + (mh.key(k) * wk).sum(), (q, k))
    for a, b in zip(g_joint, g_apart, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_one_token_joint_check_still_names_the_overflowing_side():
    mh = MultiHeadFeatureMap("polysketch", D, 2, seed=1)
    big = torch.full((1, 2, 1, D), 1000.0).half()
    small = torch.full((1, 2, 1, D), 0.01).half()
    with pytest.raises(ValueError, match="query features.*float16"):
        attention_features(mh, big, small, causal=True, eps=1e-6)
    with pytest.raises(ValueError, match="key features.*float16"):
        attention_features(mh, small, big, causal=True, eps=1e-6)


def test_all_finite_tests_every_element_and_never_refuses_large_finite_values():
    from polysketch.features.stability import _all_finite

    huge = torch.full((2, 1000), torch.finfo(torch.float32).max)  # its fp32 sum overflows
    assert _all_finite(huge) and _all_finite(huge.half().clamp(-6e4, 6e4))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3, 2, 32)
        x[1, 0, 7] = bad
        assert not _all_finite(x) and not _all_finite(x.double())
    pair = torch.randn(4, 8)
    pair[0, 0], pair[0, 1] = float("inf"), -float("inf")  # inf − inf in the sum: still refused
    assert not _all_finite(pair)


# ----- every public entry point refuses what it cannot compute (issue 38 item 4) ----------------
@pytest.mark.parametrize("name", ["trig", "hybrid_angular", "hybrid_gaussian"])
def test_public_query_and_key_refuse_features_that_overflow(name):
    """Before: fm.query(x) of trig / hybrid_angular at ‖x‖ = 16 returned inf, NaN downstream."""
    fm = build(name)
    x = on_sphere(16.0, 2, 5, D)
    with pytest.raises(ValueError, match=rf"query features of feature map '{name}' overflow"):
        fm.query(x)
    with pytest.raises(ValueError, match=rf"key features of feature map '{name}' overflow"):
        fm.key(x)
    assert torch.isfinite(fm.query_stabilized(x)).all()  # the exact way around it
    assert not torch.isfinite(fm.unchecked("query", x)).all()  # what used to come back
    assert torch.isfinite(fm.query(on_sphere(2.0, 2, 5, D))).all()  # ordinary inputs pass


def _underflowing_features():
    """Positive random features at ‖q‖ = ‖k‖ = 16, scale 1: every score underflows to 0."""
    fm = features.create("positive", D, seed=0)
    q, k, v = qkv(16, 16)
    return fm.query(q), fm.key(k), v


def test_linear_attention_refuses_an_exactly_zero_normalizer():
    """Before: kernel_attention refused these features, but the same features passed to the
    public linear_attention returned all-zero outputs without a word."""
    from polysketch.ops import linear_attention, linear_attention_step

    phi_q, phi_k, v = _underflowing_features()
    assert (phi_q @ phi_k.transpose(-1, -2)).tril().sum(-1).eq(0).any()
    with pytest.raises(ValueError, match="normalizer .* is exactly 0"):
        linear_attention(phi_q, phi_k, v, causal=True)
    with pytest.raises(ValueError, match="normalizer .* is exactly 0"):
        linear_attention(phi_q, phi_k, v, causal=False)
    with pytest.raises(ValueError, match="normalizer .* is exactly 0"):
        linear_attention(phi_q, phi_k, v, causal=True, cu_seqlens=[0, 10, T])
    with pytest.raises(ValueError, match="normalizer .* is exactly 0"):  # one decoding step
        linear_attention_step(phi_q[..., :1, :], phi_k[..., :1, :], v[..., :1, :], None)
    # an offset, or no normalization, is well defined: no refusal
    assert torch.isfinite(
        linear_attention(phi_q, phi_k, v, causal=True, denominator_offset=1.0)
    ).all()
    assert linear_attention(phi_q, phi_k, v, causal=True, normalize=False).abs().max() == 0


def test_a_query_that_sees_no_key_keeps_its_zero_output():
    """A zero normalizer is refused only where the query sees a key: all-masked rows stay 0."""
    from polysketch.ops import linear_attention

    q, k, v = qkv(1, 1)
    fm = features.create("positive", D, seed=0)
    phi_q, phi_k = fm.query(q), fm.key(k)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, :5] = False  # row 0's first five queries see no key
    out = linear_attention(phi_q, phi_k, v, causal=True, key_padding_mask=mask)
    assert out[0, :5].abs().max() == 0 and out[0, 5:].abs().min() > 0
    packed = linear_attention(phi_q, phi_k, v, causal=True, key_padding_mask=mask,
                              cu_seqlens=[0, 3, T])  # fmt: skip
    assert packed[0, :3].abs().max() == 0 and packed[0, 3:5].abs().max() == 0
    assert packed[0, 5:].abs().min() > 0
