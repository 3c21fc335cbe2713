"""Training: the loop (AdamW, warmup + cosine, accumulation, bf16, DDP), checkpoints, resume.

- ``TrainConfig``, ``train(model_config, train_config, data, resume=..., progress=...)``;
  ``check_launch`` (the launch's layout, before any work); ``WarmupWarning`` (a warmup as
  long as the run) and ``TrainingOutOfMemoryError`` (what ``train`` raises out of memory).
- ``MQARData``: an MQAR train/validation set for ``train``; a ``polysketch.data.Corpus`` is
  the other accepted data.
- ``warmup_cosine``: the LambdaLR schedule; ``learning_rate``: its formula.
- ``save_checkpoint`` / ``load_checkpoint``: atomic, checksummed checkpoints with RNG states,
  loaded without running code (``CheckpointError`` names a refused or damaged file);
  ``load_model``: the ``TransformerLM`` a ``polysketch train`` checkpoint holds;
  ``saved_config``: a stored config with the defaults of fields added since it was saved;
  ``stored_model_config``: the model config a checkpoint stores (a preset's training-only λ
  written out), for comparing a run with a checkpoint.
"""

from .batches import CorpusBatches, MQARBatches, MQARData
from .checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model,
    rng_state,
    save_checkpoint,
    saved_config,
    set_rng_state,
    stored_model_config,
    stored_spec,
)
from .config import TrainConfig
from .distributed import DistContext, rank_slice
from .loop import (
    CHECKPOINT_NAME,
    TrainingOutOfMemoryError,
    WarmupWarning,
    check_launch,
    param_groups,
    train,
)
from .schedule import WarmupCosine, default_warmup, learning_rate, warmup_cosine

__all__ = [
    "TrainConfig",
    "train",
    "check_launch",
    "WarmupWarning",
    "TrainingOutOfMemoryError",
    "MQARData",
    "CorpusBatches",
    "MQARBatches",
    "param_groups",
    "CHECKPOINT_NAME",
    "warmup_cosine",
    "WarmupCosine",
    "learning_rate",
    "default_warmup",
    "DistContext",
    "rank_slice",
    "save_checkpoint",
    "CheckpointError",
    "load_checkpoint",
    "load_model",
    "rng_state",
    "set_rng_state",
    "saved_config",
    "stored_model_config",
    "stored_spec",
]
