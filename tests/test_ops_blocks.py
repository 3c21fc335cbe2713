"""chunked_blocks / chunked_scan (training path) == naive: outputs, gradients, states, dispatch,
half-precision operands, saved-tensor memory, Tq = 0, torch.compile(fullgraph=True)."""

import pytest
import torch

from conftest import naive_lt_same_dtype, rel_err
from polysketch import features, kernel_attention
from polysketch.ops import linear_attention, naive_linear_attention
from polysketch.ops.blocks import blocks_lt_multiply, state_dim
from polysketch.ops.dispatch import resolve_algorithm
from test_ops_linear import make

F64 = torch.float64
LAYOUTS = ("chunked_blocks", "chunked_scan")


def grads_of(fn, *inputs):
    xs = [x.detach().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    return out.detach(), torch.autograd.grad((out * w).sum(), xs)


def assert_close(fn, ref, *inputs, tol=1e-10):
    out, grads = grads_of(fn, *inputs)
    rout, rgrads = grads_of(ref, *inputs)
    assert float((out - rout).norm()) <= tol * max(float(rout.norm()), 1.0)
    for g, rg in zip(grads, rgrads, strict=True):
        assert float((g - rg).norm()) <= tol * max(float(rg.norm()), 1.0)


CASES = [(1, 1), (2, 1), (15, 16), (16, 16), (17, 16), (97, 16), (255, 256), (257, 256)]


@pytest.mark.parametrize("algorithm", LAYOUTS)
@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("t,chunk", CASES)
def test_layouts_match_naive_outputs_and_gradients(t, chunk, square, algorithm):
    q, k, v = make((2, 3), t, t, 5, 3, positive=not square)
    offset = 1.0 if square else 0.0

    def fn(q, k, v):
        return linear_attention(
            q, k, v, causal=True, square=square, chunk_size=chunk, algorithm=algorithm,
            denominator_offset=offset,
        )  # fmt: skip

    def ref(q, k, v):
        return naive_linear_attention(q, k, v, causal=True, square=square,
                                      denominator_offset=offset)  # fmt: skip

    assert_close(fn, ref, q, k, v)


@pytest.mark.parametrize("algorithm", LAYOUTS)
@pytest.mark.parametrize("square", [False, True])
def test_layouts_with_states_padding_and_prefix_keys(square, algorithm):
    """initial_state in, state out, key padding and Tq < Tk, against the scan without grad."""
    q, k, v = make((2,), 40, 53, 4, 3, positive=True)
    q0, k0, v0 = make((2,), 11, 11, 4, 3, positive=True, seed=1)
    keep = torch.rand(2, 53, generator=torch.Generator().manual_seed(2)) > 0.3
    _, s0 = linear_attention(q0, k0, v0, causal=True, square=square, return_state=True)
    kw = dict(causal=True, square=square, chunk_size=8, key_padding_mask=keep, return_state=True,
              initial_state=s0, denominator_offset=0.5)  # fmt: skip
    with torch.no_grad():
        ref, ref_state = linear_attention(q, k, v, algorithm="chunked_scan", **kw)
    qg = q.clone().requires_grad_(True)
    out, state = linear_attention(qg, k, v, algorithm=algorithm, **kw)
    assert rel_err(out, ref) < 1e-12
    assert rel_err(state.numerator, ref_state.numerator) < 1e-12
    assert rel_err(state.denominator, ref_state.denominator) < 1e-12
    assert state.length == ref_state.length == 11 + 53
    # the gradient w.r.t. an initial state equals the one through the (autograd) cumsum path
    num0 = s0.numerator.clone().requires_grad_(True)
    init = type(s0)(num0, s0.denominator, s0.length)
    kw["initial_state"] = init
    (linear_attention(q, k, v, algorithm=algorithm, **kw)[0] ** 2).sum().backward()
    num1 = s0.numerator.clone().requires_grad_(True)
    kw["initial_state"] = type(s0)(num1, s0.denominator, s0.length)
    (linear_attention(q, k, v, algorithm="cumsum", **kw)[0] ** 2).sum().backward()
    assert rel_err(num0.grad, num1.grad) < 1e-10


def test_gradient_of_returned_state_flows_back():
    """A loss on the returned state differentiates through the recomputing backward too."""
    q, k, v = make((2,), 37, 37, 4, 3, positive=True)
    for square in (False, True):

        def fn(k, v, algorithm, square=square):
            _, s = linear_attention(q, k, v, causal=True, square=square, chunk_size=8,
                                    return_state=True, algorithm=algorithm)  # fmt: skip
            return s.numerator.sum() + 3 * s.denominator.sum()

        kb, vb = (x.clone().requires_grad_(True) for x in (k, v))
        kc, vc = (x.clone().requires_grad_(True) for x in (k, v))
        fn(kb, vb, "chunked_blocks").backward()
        fn(kc, vc, "cumsum").backward()
        assert rel_err(kb.grad, kc.grad) < 1e-12 and rel_err(vb.grad, vc.grad) < 1e-12


def test_gradcheck_blocks():
    q, k, v = make((1,), 9, 9, 3, 2, positive=True)
    for square in (False, True):

        def fn(q, k, v, square=square):
            return linear_attention(q, k, v, causal=True, square=square, chunk_size=4,
                                    algorithm="chunked_blocks")  # fmt: skip

        assert torch.autograd.gradcheck(fn, [x.requires_grad_(True) for x in (q, k, v)])


def test_dispatch_by_device_and_forced_names():
    q, k, v = make((1,), 8, 8, 4, 3, positive=True, dtype=torch.float32)
    assert resolve_algorithm("chunked", q, k, v, square=True, with_state=False) == "chunked_scan"
    meta = [x.to("meta") for x in (q, k, v)]
    assert resolve_algorithm("chunked", *meta, square=True, with_state=False) == "chunked_blocks"
    for name in ("chunked_scan", "chunked_blocks", "cumsum"):
        assert resolve_algorithm(name, q, k, v, square=True, with_state=True) == name
    with pytest.raises(ValueError, match="algorithm"):
        resolve_algorithm("blocks", q, k, v, square=True, with_state=False)


def naive_same_dtype(q, k, v, *, square):
    """Causal normalized linear attention computed entirely in the inputs' (half) dtype."""
    num, row_sums = naive_lt_same_dtype(q, k, v, square=square)
    return num / (row_sums.unsqueeze(-1) + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("square", [False, True])
def test_half_operands_within_twice_the_same_dtype_naive_error(dtype, square):
    """The accelerator precision policy (half GEMM operands, fp32 scores/states/sums), run on
    CPU: error vs fp64 ≤ 2x that of the naive reference computed in the same half dtype
    (flash-attention's rule), for outputs and for gradients."""
    g = torch.Generator().manual_seed(0)
    t, f, e = 300, 8, 16
    q, k = (0.6 * torch.randn(2, t, f, generator=g) for _ in range(2))
    if not square:
        q, k = q.exp(), k.exp()
    v = torch.randn(2, t, e, generator=g)

    def ours(q, k, v):
        c = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)
        out, _ = blocks_lt_multiply(q, k, c, square=square, chunk_size=64)
        return out[..., :e] / (out[..., e:] + 1)

    truth, truth_grads = grads_of(lambda *x: naive_same_dtype(*x, square=square),
                                  *(x.double() for x in (q, k, v)))  # fmt: skip
    half = [x.to(dtype) for x in (q, k, v)]
    out, out_grads = grads_of(ours, *half)
    naive, naive_grads = grads_of(lambda *x: naive_same_dtype(*x, square=square), *half)
    assert out.dtype == torch.float32  # outputs accumulate in fp32
    assert rel_err(out.double(), truth) <= 2 * rel_err(naive.double(), truth)
    for mine, theirs, exact in zip(out_grads, naive_grads, truth_grads, strict=True):
        assert mine.dtype == dtype
        assert rel_err(mine.double(), exact) <= 2 * rel_err(theirs.double(), exact)


def _layer_normed_features(t, h=2, d=64, seed=0):
    """psf_random's features of LayerNorm'd q, k (|q|² = D = 64) and values, as a model feeds
    them: degree-2 sketch, r = 32, squared: scores (φq·φk)² ≈ (q·k)⁴ up to ~10⁶."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.layer_norm(torch.randn(1, h, t, d, generator=g), (d,))
            for _ in range(2))  # fmt: skip
    v = torch.randn(1, h, t, d, generator=g)
    fm = features.create("polysketch", d, degree=2, num_features=32, nonnegative=True, seed=0)
    return fm.query(q), fm.key(k), v


def test_fp16_operands_multiply_in_fp32_without_overflow():
    """fp16 operands, as the accelerator policy passes them: the degree-4 scores (~10⁶), the
    row sums (~10⁹) and the block sums of pair features exceed fp16's 65504, so the block
    function multiplies fp16 operands in fp32 (``blocks.gemm_dtype``). Its error against fp64
    on the same fp16 inputs is then fp32 rounding only: each of num and den is a sum of at most
    b + F' + n terms (relative error ≤ (b + F' + n)·u32, u32 = 2⁻²⁴, doubled by the ratio and
    by the feature products), gradients likewise before their final fp16 rounding (≤ u16 =
    2⁻¹¹ relative, the dtype autograd requires)."""
    t, chunk = 512, 128
    phi_q, phi_k, v = _layer_normed_features(t)
    a, b, c = (x.to(torch.float16) for x in (phi_q, phi_k, v))
    assert float((a.float() @ b.float().mT).square().max()) > 65504  # the range is exceeded
    e = c.shape[-1]

    def ours(a, b, c):
        c1 = torch.cat([c, c.new_ones(c.shape[:-1] + (1,))], dim=-1)
        out, _ = blocks_lt_multiply(a, b, c1, square=True, chunk_size=chunk)
        return out[..., :e] / (out[..., e:] + 1)

    out, grads = grads_of(ours, a, b, c)
    truth, truth_grads = grads_of(lambda *x: naive_same_dtype(*x, square=True),
                                  *(x.double() for x in (a, b, c)))  # fmt: skip
    u32, u16 = 2.0**-24, 2.0**-11
    bound = 4 * (chunk + state_dim(32, True) + t // chunk) * u32
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    assert rel_err(out.double(), truth) <= bound
    for mine, exact in zip(grads, truth_grads, strict=True):
        assert mine.dtype == torch.float16 and bool(torch.isfinite(mine).all())
        assert rel_err(mine.double(), exact) <= u16 + bound


def test_backward_stores_inputs_and_block_states_only():
    """Activation memory: inputs + per-block prefix states, nothing of size T·b or T·F'."""
    t, f, e, chunk = 1024, 16, 8, 64
    q, k, v = make((2,), t, t, f, e, positive=False, dtype=torch.float32)
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    xs = [x.requires_grad_(True) for x in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        linear_attention(*xs, causal=True, square=True, chunk_size=chunk,
                         algorithm="chunked_blocks", normalize=False)  # fmt: skip
    n_blocks = t // chunk
    inputs = sum(x.numel() * 4 for x in xs)
    states = 2 * n_blocks * state_dim(f, True) * (e + 1) * 4
    assert sum(saved) <= 2 * inputs + states  # (a copy of v with its ones column allowed)
    assert sum(saved) < t * state_dim(f, True) * 2 * 4  # far below one T×F' feature tensor


@pytest.mark.parametrize("algorithm", ["chunked", "chunked_blocks", "cumsum"])
def test_empty_query_gives_empty_output(algorithm):
    fm = features.create("polysketch", 8, degree=2, num_features=4, nonnegative=True, seed=0)
    q = torch.randn(2, 3, 0, 8)
    out = kernel_attention(q, q, torch.randn(2, 3, 0, 5), fm, causal=True, algorithm=algorithm)
    assert out.shape == (2, 3, 0, 5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, q, torch.randn(2, 3, 0, 5))
    assert sdpa.shape == out.shape
    k, v = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 5)
    out, state = linear_attention(q[..., :4], k.exp(), v, causal=True, return_state=True,
                                  algorithm=algorithm)  # fmt: skip
    _, ref = linear_attention(k.exp(), k.exp(), v, causal=True, return_state=True)
    assert out.shape == (2, 3, 0, 5) and state.length == 6
    assert torch.allclose(state.numerator, ref.numerator, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["chunked_blocks", "chunked_scan"])
def test_compiles_without_graph_breaks(algorithm):
    fm = features.create("polysketch", 16, degree=2, num_features=8, nonnegative=True, seed=0)

    def fn(q, k, v):
        return kernel_attention(q, k, v, fm, causal=True, chunk_size=32, algorithm=algorithm,
                                denominator_offset=1.0)  # fmt: skip

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = compiled(*xs)
    out.pow(2).sum().backward()
    ref_out, ref_grads = grads_of(fn, q, k, v)
    _, got = grads_of(compiled, q, k, v)
    assert torch.allclose(out.detach(), fn(q, k, v), atol=1e-5)
    for a, b in zip(got, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("group_bytes", [1, 30000, 60000])  # groups of 1; 3 or 1; 7 or 3
@pytest.mark.parametrize("in_block", [True, False])
def test_groups_of_one_or_a_few_blocks_match_all_blocks_at_once(group_bytes, local, square,
                                                                 in_block):  # fmt: skip
    """The recomputing function over groups of 1 block (the budget of wide maps on CPU) or a
    few, remainder included, against all 10 blocks in one group: outputs, the final state and
    the gradients of every input (the initial state and the local score inputs included)."""
    g = torch.Generator().manual_seed(3)
    t, f, x, d = 70, 4, 6, 3
    a, b = (torch.rand(2, t, f, generator=g, dtype=F64) for _ in range(2))
    c = torch.randn(2, t, x, generator=g, dtype=F64)
    p0 = torch.randn(2, state_dim(f, square), x, generator=g, dtype=F64)
    lq, lk = (torch.randn(2, t, d, generator=g, dtype=F64) for _ in range(2))
    inputs = (a, b, c, p0, lq, lk) if local else (a, b, c, p0)

    def run(budget, *xs):
        kw = dict(local_q=xs[4], local_k=xs[5], local_power=2) if local else {}
        out, state = blocks_lt_multiply(*xs[:3], square=square, chunk_size=7, initial=xs[3],
                                        group_bytes=budget, in_block=in_block, **kw)  # fmt: skip
        w = torch.linspace(-1, 1, state.numel(), dtype=F64).reshape(state.shape)
        return torch.cat([out.flatten(), (state * w).flatten()])

    assert_close(lambda *xs: run(group_bytes, *xs), lambda *xs: run(None, *xs), *inputs,
                 tol=1e-12)  # fmt: skip


@pytest.mark.parametrize("square", [False, True])
def test_without_in_block_scores_rows_read_the_earlier_blocks_only(square):
    """in_block=False: row i of block n is Ψq(a_i) (P_0 + Σ_{m<n} Ψ(B_m)ᵀ C_m), against the
    function with in-block scores minus those scores (values and gradients)."""
    g = torch.Generator().manual_seed(4)
    t, f, x = 30, 3, 4
    a, b = (torch.rand(2, t, f, generator=g, dtype=F64) for _ in range(2))
    c = torch.randn(2, t, x, generator=g, dtype=F64)

    def far(a, b, c):
        return blocks_lt_multiply(a, b, c, square=square, chunk_size=8, in_block=False)[0]

    def reference(a, b, c):
        s = a @ b.transpose(-1, -2)
        s = s * s if square else s
        blk = torch.arange(t) // 8
        earlier = blk[None, :] < blk[:, None]
        return torch.where(earlier, s, 0.0) @ c

    assert_close(far, reference, a, b, c, tol=1e-12)
