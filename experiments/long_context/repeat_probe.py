"""The repeat (copy) probe: does a model predict a passage better when it occurred before?

On validation windows of ``polysketch.data.repeat`` (a passage P at a, again at a + d), with
per-token cross-entropy ℓ_i (nats per byte; byte-level tokens):

    first  = mean ℓ over first-occurrence targets,   second = mean ℓ over recurrence targets,
    drop   = first − second                           (what reading d tokens back buys).

Two controls make the drop mean "uses far context":

* counterfactual: the same windows with each first occurrence replaced by other text; the
  recurrence is then new text, so its drop (``cf_drop``) must vanish;
* ablation (attentions with a separate global part, ``polysketch.nn.ablate_global``: mixed
  attention's far blocks, or the global branch beside a ``local_window``): the recurrence's
  loss with that part switched off; for d ≥ the block size (or window) the copy can only
  come through it, so ``ablated_drop`` must fall to about ``cf_drop``.

``token_losses`` evaluates in batches without gradients; ``split_losses`` averages over the
masks; ``probe_model`` returns every number of a table row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polysketch.data.repeat import RepeatSet
from polysketch.nn.ablate import ablate_global, global_parts

__all__ = ["token_losses", "split_losses", "probe_model", "PROBE_COLUMNS"]

PROBE_COLUMNS = (
    "first", "second", "drop", "cf_first", "cf_second", "cf_drop", "ablated_second",
    "ablated_drop",
)  # fmt: skip


@torch.no_grad()
def token_losses(model, inputs: torch.Tensor, targets: torch.Tensor, *, batch: int = 4):
    """ℓ_i = −log p(targets_i | inputs_≤i) for every window and position: (N, T) -> (N, T)."""
    if inputs.shape != targets.shape or inputs.dim() != 2:
        raise ValueError(
            f"inputs and targets must both be (N, T), got {tuple(inputs.shape)} and "
            f"{tuple(targets.shape)}"
        )
    was_training = model.training
    model.eval()
    try:
        out = []
        for i in range(0, inputs.shape[0], batch):
            logits, _ = model(inputs[i : i + batch])
            ce = F.cross_entropy(
                logits.float().flatten(0, 1), targets[i : i + batch].flatten(), reduction="none"
            )
            out.append(ce.view(logits.shape[0], -1))
        return torch.cat(out)
    finally:
        model.train(was_training)


def split_losses(losses: torch.Tensor, first_mask: torch.Tensor, second_mask: torch.Tensor):
    """(first, second, drop): mean of ``losses`` (N, T) over the (T,) masks, and their gap."""
    if first_mask.shape != losses.shape[-1:] or second_mask.shape != losses.shape[-1:]:
        raise ValueError(f"masks must have shape ({losses.shape[-1]},)")
    if not bool(first_mask.any()) or not bool(second_mask.any()):
        raise ValueError("masks must each select at least one position")
    first = float(losses[:, first_mask].mean())
    second = float(losses[:, second_mask].mean())
    return first, second, first - second


def probe_model(model, factual: RepeatSet, counterfactual: RepeatSet, *, batch: int = 4):
    """Every probe number for ``model`` (module docstring); ablation columns are '' for an
    attention without a global part."""
    if not torch.equal(factual.second_mask, counterfactual.second_mask):
        raise ValueError("factual and counterfactual windows must share their layout")
    row = {}
    lf = token_losses(model, factual.inputs, factual.targets, batch=batch)
    row["first"], row["second"], row["drop"] = split_losses(
        lf, factual.first_mask, factual.second_mask
    )
    lc = token_losses(model, counterfactual.inputs, counterfactual.targets, batch=batch)
    row["cf_first"], row["cf_second"], row["cf_drop"] = split_losses(
        lc, counterfactual.first_mask, counterfactual.second_mask
    )
    row["ablated_second"] = row["ablated_drop"] = ""
    if global_parts(model):
        with ablate_global(model):
            la = token_losses(model, factual.inputs, factual.targets, batch=batch)
        _, row["ablated_second"], row["ablated_drop"] = split_losses(
            la, factual.first_mask, factual.second_mask
        )
    return row
