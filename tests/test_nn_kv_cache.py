"""``nn.cache.KVCache``: keys and values appended in place into buffers that double (amortized
O(1) rows a token), against the ``torch.cat`` reference it replaced: the same keys, values and
masks after every append, the caller's tensors never written, autograd through ``cat``."""

import torch

from conftest import seeded
from polysketch.nn.cache import KVCache


def _kv(g, n, b=2, h=3, d=4, e=5, dtype=torch.float64):
    return (torch.randn(b, h, n, d, generator=g, dtype=dtype),
            torch.randn(b, h, n, e, generator=g, dtype=dtype))  # fmt: skip


def test_appends_equal_the_cat_reference_across_growths():
    g = seeded(0)
    cache, ref_k, ref_v, ref_keep = KVCache(), None, None, None
    prompt_k, prompt_v = _kv(g, 40)
    kept = (prompt_k.clone(), prompt_v.clone())
    returned = []
    for i, n in enumerate([40, 1, 1, 30, 1, 100, 7, 1, 200, 1]):  # crosses 104 and 237
        k, v = (prompt_k, prompt_v) if i == 0 else _kv(g, n)
        keep = None if i % 3 else torch.rand(2, n, generator=g) > 0.3
        got_k, got_v, got_keep = cache.append(k, v, keep)
        ref_k = k if ref_k is None else torch.cat([ref_k, k], dim=-2)
        ref_v = v if ref_v is None else torch.cat([ref_v, v], dim=-2)
        ref_keep = _keep_ref(ref_keep, keep, ref_k.shape[-2] - n, k)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        assert (got_keep is None) == (ref_keep is None)
        assert got_keep is None or torch.equal(got_keep, ref_keep)
        assert cache.length == ref_k.shape[-2]
        assert cache.num_floats() == ref_k.numel() + ref_v.numel()
        returned.append((got_k.clone(), got_k))
    assert cache._k.shape[-2] >= cache.length and cache._owned
    # earlier results are views that later appends never change; the caller's tensors neither
    assert all(torch.equal(copy, view) for copy, view in returned)
    assert torch.equal(prompt_k, kept[0]) and torch.equal(prompt_v, kept[1])


def _keep_ref(old, keep, length, k):
    if keep is None and old is None:
        return None
    if old is None and length:
        old = torch.ones(k.shape[0], length, dtype=torch.bool)
    new = keep if keep is not None else torch.ones(k.shape[0], k.shape[-2], dtype=torch.bool)
    return new if old is None else torch.cat([old, new], dim=-1)


def test_select_rows_then_append():
    g = seeded(1)
    cache = KVCache()
    k0, v0 = _kv(g, 10)
    cache.append(k0, v0, None)
    index = torch.tensor([1, 1, 0])
    cache.select_rows(index)
    k1, v1 = _kv(g, 1, b=3)
    got_k, got_v, _ = cache.append(k1, v1, None)
    assert torch.equal(got_k, torch.cat([k0[index], k1], dim=-2))
    assert torch.equal(got_v, torch.cat([v0[index], v1], dim=-2))


def test_under_autograd_it_appends_by_cat_and_gradients_flow():
    g = seeded(2)
    k0, v0 = (x.requires_grad_() for x in _kv(g, 6))
    k1, v1 = (x.requires_grad_() for x in _kv(g, 2))
    cache = KVCache()
    cache.append(k0, v0, None)
    got_k, got_v, _ = cache.append(k1, v1, None)
    (got_k.sum() + 2 * got_v.sum()).backward()
    for x, scale in ((k0, 1), (k1, 1), (v0, 2), (v1, 2)):
        assert torch.equal(x.grad, torch.full_like(x, scale))
    # without grad, the same appends write in place and give the same values
    with torch.no_grad():
        plain = KVCache()
        plain.append(k0, v0, None)
        assert torch.equal(plain.append(k1, v1, None)[0], got_k)


def test_another_dtype_appends_by_cat_as_before():
    g = seeded(3)
    cache = KVCache()
    cache.append(*_kv(g, 4, dtype=torch.float32), None)
    k, v = _kv(g, 1, dtype=torch.float64)
    got_k, _, _ = cache.append(k, v, None)
    assert got_k.dtype == torch.float64 and got_k.shape[-2] == 5  # torch.cat's promotion


def test_a_token_costs_amortized_constant_rows():
    """1,000 one-token appends after a 10-token prompt reallocate the buffers O(log t) times
    (capacity grows by a quarter, at least 64 rows), where a cat per token copies every row
    each time; the room never exceeds a quarter of the rows plus 64."""
    g = seeded(4)
    cache = KVCache()
    cache.append(*_kv(g, 10, b=1, h=1), None)
    pointers = {cache._k.data_ptr()}
    with torch.no_grad():
        for _ in range(1000):
            cache.append(*_kv(g, 1, b=1, h=1), None)
            pointers.add(cache._k.data_ptr())
            assert cache._k.shape[-2] <= cache.length + max(cache.length // 4, 64)
    assert cache.length == 1010 and len(pointers) <= 12  # 74, 138, 202, 266, 332, ..., 1262


def test_a_prompt_cached_under_inference_mode_decodes_outside_it():
    """Buffers made under torch.inference_mode cannot be written outside it: they are copied
    (a cat per token never wrote in place, so this worked before and must still)."""
    g = seeded(5)
    cache = KVCache()
    k0, v0 = _kv(g, 5)
    with torch.inference_mode():
        cache.append(k0, v0, None)
    k1, v1 = _kv(g, 1)
    with torch.no_grad():
        got_k, got_v, _ = cache.append(k1, v1, None)
    assert torch.equal(got_k, torch.cat([k0, k1], dim=-2))
    assert torch.equal(got_v, torch.cat([v0, v1], dim=-2))
    with torch.no_grad():  # and the copy is a buffer this cache writes from then on
        got_k, _, _ = cache.append(k1, v1, None)
    assert got_k.shape[-2] == 7 and not got_k.is_inference()
