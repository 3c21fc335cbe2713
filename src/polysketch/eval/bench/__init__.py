"""Speed: causal attention and whole-model training steps against softmax attention.

* ``attention``: ``run_benchmark(BenchConfig)`` times causal kernelized attention (forward,
  forward + backward, decode steps) against ``scaled_dot_product_attention``;
* ``model``: ``run_model_benchmark(ModelBenchConfig)`` times ``TransformerLM`` training steps;
* ``decode``: ``run_decode_benchmark(DecodeBenchConfig)`` times whole-model greedy decoding,
  ms/token vs position (``polysketch bench --decode``);
* ``costs``: the analytic FLOP and memory model; ``timing``: ``time_call``
  (``torch.utils.benchmark.Timer``), peak memory, malloc's top pad;
* ``report``: the CSV, the plot and the text report of ``polysketch bench``.

The names of the former module ``polysketch.eval.bench`` are importable from here as before.
"""

from .attention import (
    DEFAULT_LENGTHS,
    DTYPES,
    METHODS,
    MODES,
    QUICK_LENGTHS,
    BenchConfig,
    parse_lengths,
    run_benchmark,
)
from .costs import chunked_flops, chunked_memory, sdpa_flops, sdpa_memory
from .model import (
    ModelBenchConfig,
    check_model_attentions,
    format_model_report,
    run_model_benchmark,
    write_model_outputs,
)
from .report import CSV_FIELDS, format_report, plot_results, write_csv
from .timing import MALLOC_TOP_PAD, Timing, peak_memory, set_malloc_top_pad, time_call

__all__ = [
    "BenchConfig",
    "CSV_FIELDS",
    "DEFAULT_LENGTHS",
    "DTYPES",
    "MALLOC_TOP_PAD",
    "METHODS",
    "MODES",
    "ModelBenchConfig",
    "QUICK_LENGTHS",
    "Timing",
    "chunked_flops",
    "chunked_memory",
    "format_model_report",
    "format_report",
    "parse_lengths",
    "peak_memory",
    "plot_results",
    "run_benchmark",
    "run_model_benchmark",
    "check_model_attentions",
    "sdpa_flops",
    "sdpa_memory",
    "set_malloc_top_pad",
    "time_call",
    "write_csv",
    "write_model_outputs",
]
