"""Training on a dp × cp mesh (``polysketch.train.mesh``; gloo, forked ranks that call
``train`` as torchrun's processes would): context parallelism, dp × cp, and FSDP2 give the
single-process losses to rounding for 20 steps; checkpoints are gathered, resume exactly
within a layout and to rounding across layouts; generation after CP training equals the
loaded checkpoint's on one process."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from numerics import assert_as_accurate
from polysketch.data.corpus import load_corpus
from polysketch.nn import TransformerConfig
from polysketch.train import TrainConfig, load_checkpoint, load_model, train
from polysketch.train.batches import pack_rows
from test_distributed_harness import run_ranks

TEXT = "".join(
    f"{i}: all the world's a stage, and all the men and women merely players\n" for i in range(80)
)
# fp32 losses of two layouts differ by rounding that AdamW amplifies over 20 steps where
# gradients are near zero, by an amount that depends on the CPU's BLAS path (relative 5e-6 on
# one machine, 4e-4 on another under MKL_CBWR=COMPATIBLE): no fixed tolerance is portable. The
# fp32 runs are judged by flash-attention's rule instead (``_close``): the layout's losses are
# as close to the fp64 one-process run as the fp32 one-process run is (numerics.py); the fp64
# tests below check that the algorithm itself is exact (1e-10).


def _model_config(**kw) -> TransformerConfig:
    base = dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32, chunk_size=16,
                attention="psf_random", seed=1)  # fmt: skip
    return TransformerConfig(**{**base, **kw})


def _train_config(**kw) -> TrainConfig:
    base = dict(steps=20, batch_size=4, lr=3e-3, warmup_steps=2, eval_interval=10,
                eval_batches=2, log_interval=5, device="cpu")  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _corpus(tmp):
    """The corpus file, written by whichever rank comes first: to a file of its own, then
    renamed, so another rank never reads it half written (it did: "0 tokens")."""
    path = os.path.join(tmp, "corpus.txt")
    if not os.path.exists(path):
        part = f"{path}.{os.getpid()}.tmp"
        with open(part, "w") as fh:
            fh.write(TEXT)
        os.replace(part, path)
    return load_corpus(path)


def _summary(history) -> dict:
    rows = {k: [r["loss"] for r in history[k]] for k in ("train", "val")}
    return {"loss": torch.tensor(rows["train"], dtype=torch.float64),
            "val": torch.tensor(rows["val"], dtype=torch.float64)}  # fmt: skip


def _rank_train(rank, world, tmp, model_kw, train_kw, resume=False, stop_after=None) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    history = train(_model_config(**model_kw), _train_config(**train_kw), _corpus(tmp),
                    progress=False, resume=resume, stop_after=stop_after)  # fmt: skip
    return _summary(history)


def _single(tmp, model_kw=None, train_kw=None, **kw) -> dict:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        assert key not in os.environ
    history = train(_model_config(**(model_kw or {})), _train_config(**(train_kw or {})),
                    _corpus(tmp), progress=False, **kw)  # fmt: skip
    return _summary(history)


def _single_fp64(tmp, model_kw=None, train_kw=None, **kw) -> dict:
    """``_single`` with float64 as the default dtype (the model and its training in fp64)."""
    torch.set_default_dtype(torch.float64)
    try:
        return _single(tmp, model_kw, train_kw, **kw)
    finally:
        torch.set_default_dtype(torch.float32)


def _singles(tmp, model_kw=None, train_kw=None, **kw) -> list[dict]:
    """The one-process fp32 run in three shapes: its batch of 4 in 1, 2 and 4 micro-batches
    (``grad_accum``; the same steps in exact arithmetic, summed in other shapes)."""
    train_kw = dict(train_kw or {})
    return [_single(tmp, model_kw, {**train_kw, "grad_accum": g}, **kw) for g in (1, 2, 4)]


def _close(got: dict, wants: list[dict], exact: dict, *, trained: bool = True) -> None:
    """``got`` (fp32 losses of a layout) as accurate as ``wants`` (fp32, one process, in three
    shapes: ``_singles``) against ``exact`` (fp64, one process): training and validation
    losses together, relative Frobenius error, at most twice the largest of the one-process
    runs' (plus one fp32 unit roundoff). The layout sums in other shapes than one process, so
    both errors are draws of AdamW-amplified rounding: the yardstick is the largest of three
    draws, not one (issue 69)."""

    def vec(x):
        return torch.cat([x["loss"], x["val"]])

    assert_as_accurate(vec(got).float(), [vec(w).float() for w in wants], vec(exact), norm="fro")
    if trained:
        assert all(w["loss"][-1] < w["loss"][0] - 0.5 for w in wants)


def test_cp2_training_equals_one_process(tmp_path):
    want, exact = _singles(str(tmp_path)), _single_fp64(str(tmp_path))
    results = run_ranks(2, _rank_train, str(tmp_path), {}, {"cp": 2})
    for r in results:  # every rank reports the global loss
        _close(r, want, exact)


@pytest.mark.parametrize(
    "world, model_kw, train_kw",
    [
        (4, {}, {"cp": 2}),  # dp 2 x cp 2
        (2, {}, {"fsdp": True}),  # FSDP2, dp 2
        (4, {}, {"cp": 2, "fsdp": True}),  # FSDP2 over dp 2 x cp 2
        (2, {"attention": "psf_mixed", "short_conv": 3}, {"cp": 2, "grad_accum": 2}),
    ],
)
def test_mesh_training_equals_one_process(tmp_path, world, model_kw, train_kw):
    single_kw = {k: v for k, v in train_kw.items() if k not in ("cp", "fsdp")}
    want = _singles(str(tmp_path), model_kw, single_kw)
    exact = _single_fp64(str(tmp_path), model_kw, single_kw)
    for r in run_ranks(world, _rank_train, str(tmp_path), model_kw, train_kw, timeout=600):
        _close(r, want, exact)


def test_bf16_autocast_on_cp2_trains_like_one_process(tmp_path):
    """--amp bf16 under cp 2 (psf_mixed: halos and states of bf16 operands, fp32 states):
    within bf16's rounding of the one-process bf16 run (eps 7.8e-3; measured 5.4e-4)."""
    kw = {"attention": "psf_mixed"}
    want = _single(str(tmp_path), kw, {"amp": "bf16"})
    for r in run_ranks(2, _rank_train, str(tmp_path), kw, {"amp": "bf16", "cp": 2}):
        torch.testing.assert_close(r["loss"], want["loss"], rtol=1e-2, atol=0)
    assert want["loss"][-1] < want["loss"][0] - 0.5


def _rank_train_fp64(rank, world, tmp, model_kw, train_kw) -> dict:
    torch.set_default_dtype(torch.float64)  # a forked rank: its own default
    return _rank_train(rank, world, tmp, model_kw, train_kw)


@pytest.mark.parametrize(
    "world, model_kw, train_kw",
    [(2, {"short_conv": 3}, {"cp": 2}), (4, {}, {"cp": 2, "fsdp": True}),
     (4, {"attention": "psf_mixed"}, {"cp": 4, "grad_accum": 2})],
)  # fmt: skip
def test_fp64_mesh_training_equals_one_process_to_1e10(tmp_path, world, model_kw, train_kw):
    """In fp64 the 20 losses agree to 1e-10 (measured <= 2e-13): the fp32 differences of
    the tests above are rounding, amplified by AdamW where gradients are near zero."""
    single_kw = {k: v for k, v in train_kw.items() if k not in ("cp", "fsdp")}
    torch.set_default_dtype(torch.float64)
    try:
        want = _single(str(tmp_path), model_kw, single_kw)
    finally:
        torch.set_default_dtype(torch.float32)
    assert want["loss"].dtype == torch.float64
    for r in run_ranks(world, _rank_train_fp64, str(tmp_path), model_kw, train_kw):
        for key in ("loss", "val"):
            torch.testing.assert_close(r[key], want[key], rtol=1e-10, atol=0)


@pytest.mark.parametrize("world, layout", [(2, {"cp": 2}), (2, {"fsdp": True})])
def test_resume_is_exact_within_a_layout_and_to_rounding_across(tmp_path, world, layout):
    tmp = str(tmp_path)
    straight = run_ranks(world, _rank_train, tmp, {}, {**layout, "out_dir": f"{tmp}/a"})[0]
    run_ranks(world, _rank_train, tmp, {}, {**layout, "out_dir": f"{tmp}/b"}, False, 10)
    state = load_checkpoint(f"{tmp}/b/ckpt.pt", restore_rng=False)
    assert state["step"] == 10
    reference, exact = _singles(tmp), _single_fp64(tmp)  # one process, 20 steps
    model = state["model"]
    assert set(model) >= {"wte.weight", "lm_head.weight"} and all(
        type(v) is torch.Tensor for v in model.values()
    )  # gathered full tensors in the one-process format, read with weights_only=True
    os.makedirs(f"{tmp}/c")
    shutil.copy(f"{tmp}/b/ckpt.pt", f"{tmp}/c/ckpt.pt")
    resumed = run_ranks(world, _rank_train, tmp, {}, {**layout, "out_dir": f"{tmp}/b"}, True)[0]
    assert torch.equal(resumed["loss"], straight["loss"])  # bit for bit within the layout
    assert torch.equal(resumed["val"], straight["val"])
    # the same checkpoint continued on ONE process: equal to rounding
    one = _single(tmp, train_kw={"out_dir": f"{tmp}/c"}, resume=True)
    _close(one, reference, exact)


def _rank_generate(rank, world, tmp) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    history = train(_model_config(), _train_config(cp=2, out_dir=f"{tmp}/g"), _corpus(tmp),
                    progress=False)  # fmt: skip
    prompt = torch.tensor([list(b"all the ")])
    return {"tokens": history["model"].generate(prompt, 24, temperature=0.0)}


def test_generation_after_cp_training_equals_the_loaded_checkpoint(tmp_path):
    tmp = str(tmp_path)
    trained = run_ranks(2, _rank_generate, tmp)
    assert torch.equal(trained[0]["tokens"], trained[1]["tokens"])  # replicated parameters
    model, _ = load_model(f"{tmp}/g/ckpt.pt", device="cpu")
    prompt = torch.tensor([list(b"all the ")])
    loaded = model.generate(prompt, 24, temperature=0.0)
    assert torch.equal(loaded, trained[0]["tokens"])
    single = train(_model_config(), _train_config(), _corpus(tmp), progress=False)["model"]
    assert torch.equal(single.generate(prompt, 24, temperature=0.0), loaded)


def _mqar():
    from polysketch.data.mqar import MQARConfig
    from polysketch.train import MQARData

    return MQARData.make(MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4),
                         num_train=64, num_val=6)  # fmt: skip


def _rank_train_mqar(rank, world, train_kw) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cfg = _train_config(steps=6, eval_interval=3, **train_kw)
    return _summary(train(_model_config(vocab_size=64), cfg, _mqar(), progress=False))


def test_mqar_fsdp_with_accumulation_and_an_empty_validation_share():
    """MQAR (labels on the recall positions only) under FSDP2: dp 2 with grad_accum 2 (one
    reduce-scatter per step), and dp 4, whose last validation batch (6 examples in batches of
    4: 2 rows) leaves two replicas without rows: they run a fully ignored row so that every
    rank joins FSDP2's collectives. Losses and validation losses as on one process."""
    cfg = _train_config(steps=6, eval_interval=3, grad_accum=2)
    want = [_summary(train(_model_config(vocab_size=64),
                           _train_config(steps=6, eval_interval=3, grad_accum=g), _mqar(),
                           progress=False)) for g in (1, 2, 4)]  # fmt: skip
    torch.set_default_dtype(torch.float64)
    try:
        exact = _summary(train(_model_config(vocab_size=64), cfg, _mqar(), progress=False))
    finally:
        torch.set_default_dtype(torch.float32)
    for world, kw in ((2, {"fsdp": True, "grad_accum": 2}), (4, {"fsdp": True})):
        for r in run_ranks(world, _rank_train_mqar, kw):
            _close(r, want, exact, trained=False)


def test_pack_rows_starts_documents_at_rows_and_after_separators():
    x = torch.tensor([[1, 10, 10, 2, 3, 10], [10, 10, 4, 10, 10, 5]])
    px, py, cu = pack_rows(x, x + 1, [10, 10])
    assert px.shape == py.shape == (1, 12) and torch.equal(px[0], x.flatten())
    assert cu == [0, 3, 6, 8, 11, 12]  # rows at 0 and 6; after each "\n\n" inside a row


def test_packed_training_cp2_equals_one_process(tmp_path):
    """--pack: the same packed run on one process and on cp 2 (documents cross the shards)."""
    conv = {"short_conv": 3}  # the short convolution resets at document starts too
    want = _singles(str(tmp_path), conv, {"pack": True})
    exact = _single_fp64(str(tmp_path), conv, {"pack": True})
    plain = _single(str(tmp_path), conv)
    assert not torch.equal(want[0]["loss"], plain["loss"])  # packing changed what is computed
    for r in run_ranks(2, _rank_train, str(tmp_path), conv, {"pack": True, "cp": 2}):
        _close(r, want, exact)


def test_mesh_refusals():
    with pytest.raises(ValueError, match="cp=2 must divide the number of processes"):
        train(_model_config(), _train_config(cp=2), _corpus_text(), progress=False)
    with pytest.raises(ValueError, match="attention='softmax'.*supported"):
        train(_model_config(attention="softmax"), _train_config(cp=2), _corpus_text())
    with pytest.raises(ValueError, match="compile is not supported with fsdp"):
        _train_config(fsdp=True, compile="eager").validate()
    with pytest.raises(ValueError, match="warm_start_steps"):
        _train_config(cp=2, warm_start_steps=3).validate()
    with pytest.raises(ValueError, match="packing needs a text corpus"):
        train(_model_config(vocab_size=64), _train_config(pack=True), _mqar(), progress=False)
    with pytest.raises(ValueError, match="mixed attention with packed sequences"):
        train(_model_config(attention="psf_mixed"), _train_config(pack=True), _corpus_text())


def _corpus_text():
    from polysketch.data.corpus import Corpus

    tokens = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    return Corpus(train=tokens[:4000], val=tokens[4000:], vocab_size=256, source="test")
