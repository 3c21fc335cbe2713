"""``long_context.py mqar-diagnose``: what trained models' far branches see on MQAR.

Reads checkpoints that ``long_context.py mqar --save-models DIR`` wrote (``DIR/<run>/ckpt.pt``;
loading runs no code from them: ``polysketch.train.load_model``) and diagnoses each on the
validation sequences of the MQAR setting it was trained on (``--setting``, ``--seed``; drawn
as its run's validation set, and that set itself when ``--examples`` is the setting's
``num_val``), per layer with a soft-hash far branch
(``mqar_diagnostics.diagnose_mqar``: the weight on the answer's source, whether it scores
highest among the context's values, the cosines behind it, τ and the bucket entropies). Writes
``mqar_diagnose.csv`` and ``mqar_diagnose.md``; a model without a soft-hash far branch gets no
row and is named in the markdown.
"""

from __future__ import annotations

import time
from pathlib import Path

from polysketch._files import write_csv
from polysketch.eval import mqar_sweep as ms
from polysketch.train import load_model

from .cli import add_common, guarded, header, out_dir
from .mqar_cli import _settings
from .mqar_diagnostics import MQAR_DIAG_COLUMNS, diagnose_mqar
from .report import markdown_table

__all__ = ["register"]

COLUMNS = ("run", *MQAR_DIAG_COLUMNS)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "mqar-diagnose", help="what saved MQAR models' soft-hash far branches see, per layer"
    )
    add_common(p, "mqar_diagnose")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT",
                   help="ckpt.pt files written by `mqar --save-models` (each row names its "
                   "folder and the one above it)")  # fmt: skip
    p.add_argument("--setting", default="curriculum256",
                   choices=("long", "long512", "long_curriculum", "curriculum256"),
                   help="the MQAR setting the models were trained on")  # fmt: skip
    p.add_argument("--examples", type=int, default=32,
                   help="validation sequences diagnosed (default 32)")  # fmt: skip
    p.add_argument("--per-head", action="store_true",
                   help="a row per layer and head (default: the mean over its heads)")  # fmt: skip
    for key in ("seq_len", "num_kv_pairs", "min_distance", "steps", "batch_size", "num_train"):
        p.set_defaults(**{key: None})
    p.set_defaults(attentions=None, run=lambda args, argv: guarded(_run, args, argv))


def _run(args, argv) -> int:
    if args.examples < 1:
        raise ValueError(f"--examples must be >= 1, got {args.examples}")
    start = time.perf_counter()
    settings, _ = _settings(args)
    data = ms.make_data({**settings, "num_val": args.examples}, seed=args.seed)
    inputs, targets = data.val_inputs, data.val_targets
    rows, skipped = [], []
    for path in args.checkpoints:
        path = Path(path)
        model, _ = load_model(path, device="cpu")
        if model.config.vocab_size < data.vocab_size:
            raise ValueError(f"{path}: its model does not fit the --setting's sequences")
        if model.config.block_size != inputs.shape[1]:  # trained on another setting's length
            raise ValueError(f"{path}: its model was trained on T = {model.config.block_size} "
                             f"sequences, --setting {args.setting}'s have T = {inputs.shape[1]}; "
                             "pass the --setting it was trained in")  # fmt: skip
        name = f"{path.parent.parent.name}/{path.parent.name}"  # DIR/<attention>_lr<lr>
        found = diagnose_mqar(
            model, inputs, targets, settings["num_kv_pairs"], per_head=args.per_head
        )
        if not found:
            skipped.append(name)
        rows += [{"run": name, **row} for row in found]
    out = out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "mqar_diagnose.csv", columns=COLUMNS)
    table = markdown_table(
        COLUMNS,
        [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS]
         for r in rows],
    )  # fmt: skip
    extra = [f"Setting {args.setting}, seed {args.seed}: its first {args.examples} validation "
             "sequences. Columns: `experiments/long_context/mqar_diagnostics.py`."]  # fmt: skip
    if skipped:
        extra.append("No soft-hash far branch (no rows): " + ", ".join(skipped) + ".")
    md = header("Long-range MQAR: what the far branch sees", argv,
                cpu_s=time.perf_counter() - start, resumable=False, extra=extra)  # fmt: skip
    (out / "mqar_diagnose.md").write_text(md + "\n" + table + "\n")
    print(table)
    return 0
