"""The one backend contract (ops.dispatch): every backend of the table, called through
``lt_multiply(a, b, c, *, square, chunk_size, initial, return_state, group_bytes) -> (num, den,
state)``, against an explicit fp64 reference: outputs, normalizer, state (pair layout) and
gradients, plain and square, with and without an initial and a returned state, awkward T;
then through ``linear_attention`` with key padding and states; the dispatcher's routing."""

import pytest
import torch

from conftest import rel_err
from polysketch.ops import dispatch, linear_attention, naive_linear_attention
from polysketch.ops.dispatch import BACKENDS, NONCAUSAL, group_bytes, plan
from polysketch.ops.pairs import compress, expand
from polysketch.ops.state import LinearAttentionState

F64 = torch.float64
TRITON = dispatch.triton_backend() is not None  # the interpreter on CPU (tests/conftest.py)


def reference(a, b, c, *, square, initial, causal=True):
    """num = lt(s) C + Φ(A)·N_0, den = lt(s) 1 + Φ(A)·Z_0 and the state N_0 + Σ Φ(B)⊗C,
    Z_0 + Σ Φ(B), with DENSE square states (einsums over F×F; ``pairs`` only converts the
    layout), so the reference shares no code with the backends' pair features."""
    s = a @ b.transpose(-1, -2)
    if square:
        s = s * s
    if causal:
        s = torch.tril(s, diagonal=s.shape[-1] - s.shape[-2])
    num, den = s @ c, s.sum(-1)
    f = a.shape[-1]
    if square:
        dn = torch.einsum("...tf,...tg,...te->...fge", b, b, c)
        dz = torch.einsum("...tf,...tg->...fg", b, b)
        n, z = compress(dn), compress(dz, values=False)
    else:
        n, z = b.transpose(-1, -2) @ c, b.sum(-2)
    if initial is not None:
        n0, z0 = initial
        if square:
            num = num + torch.einsum("...tf,...tg,...fge->...te", a, a, expand(n0, f))
            den = den + torch.einsum("...tf,...tg,...fg->...t", a, a, expand(z0, f, values=False))
        else:
            num, den = num + a @ n0, den + (a * z0.unsqueeze(-2)).sum(-1)
        n, z = n + n0, z + z0
    return num, den, (n, z)


def _inputs(lead, t, f, e, *, square, dtype=F64, seed=0, with_state=False):
    g = torch.Generator().manual_seed(seed)
    a, b = (0.5 * torch.randn(*lead, t, f, generator=g, dtype=F64) for _ in range(2))
    c = torch.randn(*lead, t, e, generator=g, dtype=F64)
    if not square:
        a, b = a.exp(), b.exp()
    fs = f * (f // 2 + 1) if square else f
    init = None
    if with_state:  # the state of earlier (random) keys, as a backend would have left it
        kp = 0.5 * torch.randn(*lead, 6, f, generator=g, dtype=F64)
        kp = kp if square else kp.exp()
        _, _, init = reference(kp, kp, torch.randn(*lead, 6, e, generator=g, dtype=F64),
                               square=square, initial=None)  # fmt: skip
        assert init[0].shape == (*lead, fs, e)
    return tuple(x.to(dtype) for x in (a, b, c)), init


def _value_and_grads(fn, tensors):
    leaves = [x.detach().clone().requires_grad_(True) for x in tensors]
    parts = [p for p in _flat(fn(*leaves)) if p is not None]
    loss = sum((p * torch.linspace(-1, 2, p.numel(), dtype=p.dtype).reshape(p.shape)).sum()
               for p in parts)  # fmt: skip
    return [p.detach() for p in parts], torch.autograd.grad(loss, leaves, allow_unused=True)


def _flat(result):
    num, den, state = result
    return [num, den, *(state if state is not None else ())]


CPU_BACKENDS = ["chunked_scan", "chunked_blocks", "cumsum"]
CASES = [(1, 1), (2, 1), (97, 1), (1, 16), (2, 16), (15, 16), (16, 16), (17, 16), (97, 16)]


@pytest.mark.parametrize("state", ["none", "in", "out", "in_out"])
@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("t,chunk", CASES)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_contract_matches_reference(name, t, chunk, square, state):
    backend = BACKENDS[name]
    assert backend.state  # these take and return states
    (a, b, c), init = _inputs((2,), t, 3, 5, square=square, seed=t + chunk,
                              with_state=state in ("in", "in_out"))  # fmt: skip
    ret = state in ("out", "in_out")
    tensors = [a, b, c, *(init or ())]

    def fast(a, b, c, *init):
        return backend.run(a, b, c, square=square, chunk_size=chunk, initial=init or None,
                           return_state=ret, group_bytes=group_bytes(name))  # fmt: skip

    def ref(a, b, c, *init):
        num, den, st = reference(a, b, c, square=square, initial=init or None)
        return num, den, st if ret else None

    got, got_grads = _value_and_grads(fast, tensors)
    want, want_grads = _value_and_grads(ref, tensors)
    assert len(got) == len(want) == (4 if ret else 2)
    assert got[0].shape == (2, t, 5) and got[1].shape == (2, t)
    for x, y in zip(got, want, strict=True):
        assert float((x - y).norm()) <= 1e-10 * max(float(y.norm()), 1.0)
    for x, y in zip(got_grads, want_grads, strict=True):
        assert float((x - y).norm()) <= 1e-10 * max(float(y.norm()), 1.0)


@pytest.mark.parametrize("group_bytes_", [1, 8000, 60000])
@pytest.mark.parametrize("square,f", [(False, 3), (True, 3), (True, 7)])
def test_scan_groups_through_the_contract(square, f, group_bytes_):
    # 10 blocks of 7 rows in groups of 1, a few, or all; F = 7 > E = 5 included
    (a, b, c), init = _inputs((2,), 70, f, 5, square=square, seed=f, with_state=True)
    num, den, st = BACKENDS["chunked_scan"].run(a, b, c, square=square, chunk_size=7,
                                                initial=init, return_state=True,
                                                group_bytes=group_bytes_)  # fmt: skip
    want = reference(a, b, c, square=square, initial=init)
    for x, y in zip((num, den, *st), (*want[:2], *want[2]), strict=True):
        assert rel_err(x, y) <= 1e-12


@pytest.mark.skipif(not TRITON, reason="the Triton kernels cannot run here")
@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("t", [1, 2, 15, 17, 97])
def test_triton_backend_contract_matches_reference(t, square):
    backend = BACKENDS["triton"]
    assert not backend.state and backend.half_operands  # no state: the dispatcher routes around
    (a, b, c), _ = _inputs((2,), t, 16, 32, square=square, dtype=torch.float32, seed=t)
    if square:
        a, b = a * 0.5, b * 0.5

    def fast(a, b, c):
        return backend.run(a, b, c, square=square, chunk_size=16, initial=None,
                           return_state=False, group_bytes=group_bytes("triton"))  # fmt: skip

    got, got_grads = _value_and_grads(fast, [a, b, c])
    want, want_grads = _value_and_grads(
        lambda a, b, c: (*reference(a, b, c, square=square, initial=None)[:2], None),
        [x.double() for x in (a, b, c)],
    )
    assert got[0].dtype == torch.float32 and len(got) == 2
    for x, y in zip([*got, *got_grads], [*want, *want_grads], strict=True):
        assert rel_err(x.double(), y) <= 1e-4
    with pytest.raises(ValueError, match="no initial state"):
        backend.run(a, b, c, square=square, chunk_size=16, initial=None, return_state=True,
                    group_bytes=None)  # fmt: skip


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("tq,tk", [(0, 4), (1, 9), (7, 3), (13, 13)])
def test_noncausal_backend_contract(tq, tk, square):
    g = torch.Generator().manual_seed(tq + tk)
    a = torch.randn(2, tq, 4, generator=g, dtype=F64)
    (_, b, c), init = _inputs((2,), tk, 4, 3, square=square, with_state=True)
    num, den, st = NONCAUSAL.run(a, b, c, square=square, chunk_size=1, initial=init,
                                 return_state=True, group_bytes=None)  # fmt: skip
    want = reference(a, b, c, square=square, initial=init, causal=False)
    assert num.shape == (2, tq, 3) and den.shape == (2, tq)
    for x, y in zip((num, den, *st), (*want[:2], *want[2]), strict=True):
        assert float((x - y).norm()) <= 1e-12 * max(float(y.norm()), 1.0)


ALL = CPU_BACKENDS + (["triton"] if TRITON else [])


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("name", ALL)
def test_every_backend_through_linear_attention_with_padding_and_states(name, square):
    """Key padding, an initial state, a returned state and Tq < Tk (keys before the first
    query fold into the initial state through the non-causal backend), against the naive
    reference on the whole sequence; Triton (no state) with padding only."""
    f, e = (16, 32) if name == "triton" else (3, 5)
    dtype = torch.float32 if name == "triton" else F64
    tol = 1e-4 if name == "triton" else 1e-10
    g = torch.Generator().manual_seed(3)
    q, k = (0.5 * torch.randn(2, 40, f, generator=g, dtype=F64) for _ in range(2))
    if not square:
        q, k = q.exp(), k.exp()
    v = torch.randn(2, 40, e, generator=g, dtype=F64)
    keep = torch.rand(2, 40, generator=g) > 0.3
    keep[:, 0] = True
    q, k, v = (x.to(dtype) for x in (q, k, v))
    kw = dict(causal=True, square=square, chunk_size=16, denominator_offset=0.5, algorithm=name)
    ref = naive_linear_attention(q.double(), k.double(), v.double(), causal=True, square=square,
                                 denominator_offset=0.5, key_padding_mask=keep)  # fmt: skip
    out = linear_attention(q, k, v, key_padding_mask=keep, **kw)
    assert rel_err(out.double(), ref) <= tol
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = linear_attention(*leaves, key_padding_mask=keep, **kw)
    grads = torch.autograd.grad(out.double().sin().sum(), leaves)
    ref_leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref = naive_linear_attention(*ref_leaves, causal=True, square=square, denominator_offset=0.5,
                                 key_padding_mask=keep)  # fmt: skip
    ref_grads = torch.autograd.grad(ref.sin().sum(), ref_leaves)
    for x, y in zip(grads, ref_grads, strict=True):
        assert rel_err(x.double(), y) <= tol
    if name == "triton":
        return
    # 12 keys as a state, then 28 keys of which the last 20 have queries
    _, s0 = linear_attention(q[..., :12, :], k[..., :12, :], v[..., :12, :], return_state=True,
                             key_padding_mask=keep[:, :12], **kw)  # fmt: skip
    out, s1 = linear_attention(q[..., 20:, :], k[..., 12:, :], v[..., 12:, :], initial_state=s0,
                               return_state=True, key_padding_mask=keep[:, 12:], **kw)  # fmt: skip
    assert rel_err(out, ref.detach()[..., 20:, :]) <= 1e-10 and s1.length == 40
    _, whole = linear_attention(q, k, v, key_padding_mask=keep, return_state=True, **kw)
    assert rel_err(s1.numerator, whole.numerator) <= 1e-12
    assert rel_err(s1.denominator, whole.denominator) <= 1e-12


def test_the_table_declares_and_the_dispatcher_routes():
    assert set(BACKENDS) == {"chunked_scan", "chunked_blocks", "cumsum", "triton"}
    q, k, v = (torch.rand(1, 8, 4) for _ in range(3))
    # the scan has no backward of its own: gradients run the blocks function, same budget
    p = plan("chunked", q, k, v, square=True, with_state=False, needs_grad=True)
    assert p.name == "chunked_scan" and p.backend is BACKENDS["chunked_blocks"]
    assert p.group_bytes == dispatch.CPU_GROUP_BYTES and p.operand_dtype == torch.float32
    p = plan("chunked", q, k, v, square=True, with_state=False, needs_grad=False)
    assert p.backend is BACKENDS["chunked_scan"]
    p = plan("chunked_blocks", q, k, v, square=True, with_state=True, needs_grad=False)
    assert p.group_bytes == dispatch.ACCELERATOR_GROUP_BYTES
    assert plan(None, q, k, v, square=True, with_state=True, needs_grad=True).backend is NONCAUSAL
    # one budget each, in one place
    assert dispatch.group_bytes_for("cpu") == dispatch.CPU_GROUP_BYTES
    assert dispatch.group_bytes_for("meta") == dispatch.ACCELERATOR_GROUP_BYTES
    assert dispatch.operand_dtype(torch.bfloat16, "cpu") == torch.float32
    assert dispatch.operand_dtype(torch.bfloat16, "meta") == torch.bfloat16
    with pytest.raises(ValueError, match='algorithm="triton"'):
        plan("triton", q, k, v, square=True, with_state=True, needs_grad=False)


def test_triton_mode_switch(monkeypatch):
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", [])
    monkeypatch.delenv("POLYSKETCH_TRITON", raising=False)
    assert dispatch.triton_mode() == "auto" and dispatch.triton_enabled()  # the default
    for value, mode in (("0", "off"), ("1", "on"), (" Auto ", "auto"), ("", "auto")):
        monkeypatch.setattr(dispatch, "_TRITON_SWITCH", [])
        monkeypatch.setenv("POLYSKETCH_TRITON", value)
        assert dispatch.triton_mode() == mode
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", [])
    monkeypatch.setenv("POLYSKETCH_TRITON", "maybe")
    with pytest.raises(ValueError, match="POLYSKETCH_TRITON"):
        dispatch.triton_mode()
    dispatch.enable_triton(False)
    assert dispatch.triton_mode() == "off" and not dispatch.triton_enabled()
    dispatch.enable_triton()
    assert dispatch.triton_mode() == "on"
    dispatch.enable_triton(None)
    assert dispatch.triton_mode() == "auto"
    with pytest.raises(TypeError, match="enabled"):
        dispatch.enable_triton("yes")
    # switched on, "chunked" still never picks Triton off CUDA
    dispatch.enable_triton()
    q = torch.rand(1, 8, 16, dtype=torch.bfloat16)
    v = torch.rand(1, 8, 32, dtype=torch.bfloat16)
    assert dispatch.resolve_algorithm("chunked", q, q, v, square=True, with_state=False) == (
        "chunked_scan"
    )
    meta = [x.to("meta") for x in (q, q, v)]
    assert dispatch.resolve_algorithm("chunked", *meta, square=True, with_state=False) == (
        "chunked_blocks"
    )


def test_state_of_an_empty_prefix_and_refused_dense_states():
    q, k, v = (torch.rand(2, 5, 3, dtype=F64) for _ in range(3))
    _, st = linear_attention(q[..., :0, :], k[..., :0, :], v[..., :0, :], causal=True,
                             square=True, return_state=True)  # fmt: skip
    assert st.numerator.shape == (2, 6, 3) and not st.numerator.any() and st.length == 0
    zeros = torch.zeros(2, 3, 3, 3, dtype=F64)
    dense = LinearAttentionState(zeros, zeros[..., 0])  # the F x F layout of earlier releases
    with pytest.raises(ValueError, match="dense_to_pair_state"):
        linear_attention(q, k, v, causal=True, square=True, initial_state=dense)
