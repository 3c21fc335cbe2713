"""The package layout (issues 23 §3, 40): experiments live beside the library, imports point
down the layers, matplotlib is optional, and no module of the package is a deprecation shim."""

import ast
import importlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "polysketch"
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__")


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
    return name.rsplit(".", 1)[0] + ".__init__" if path.name == "__init__.py" else name


def _imported_packages(source: str, module: str) -> set[str]:
    """The ``polysketch.<first part>`` names (and ``experiments``/``benchmarks``) that the
    source of ``module`` imports, absolutely or relatively."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
                names = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "polysketch" and len(parts) > 1:
                found.add(parts[1])
            elif parts[0] in ("experiments", "benchmarks"):
                found.add(parts[0])
    return found


# What each part of the package must never import (DESIGN.md: imports point down the layers;
# the package never imports experiments/ or benchmarks/).
NEVER = {
    "eval": {"cli", "commands", "experiments", "benchmarks"},
    "integrations": {"cli", "commands", "eval", "experiments", "benchmarks"},
    "train": {"cli", "commands", "eval", "integrations", "experiments", "benchmarks"},
    "nn": {"cli", "commands", "eval", "integrations", "train", "experiments", "benchmarks"},
    "distributed": {
        "cli",
        "commands",
        "eval",
        "integrations",
        "train",
        "nn",
        "experiments",
        "benchmarks",
    },
    "ops": {"cli", "commands", "eval", "integrations", "train", "nn", "distributed", "experiments"},
    "features": {
        "cli",
        "commands",
        "eval",
        "integrations",
        "train",
        "nn",
        "distributed",
        "ops",
        "experiments",
    },
}


@pytest.mark.parametrize("part", sorted(NEVER))
def test_imports_point_down_the_layers(part):
    files = sorted((SRC / part).rglob("*.py"))
    assert files
    wrong = {}
    for f in files:
        bad = _imported_packages(f.read_text(encoding="utf-8"), _module_name(f)) & NEVER[part]
        if bad:
            wrong[str(f.relative_to(SRC))] = sorted(bad)
    assert not wrong, f"imports running up the layers: {wrong}"


def test_the_package_never_imports_experiments_or_benchmarks():
    wrong = {}
    for f in sorted(SRC.rglob("*.py")):
        bad = _imported_packages(f.read_text(encoding="utf-8"), _module_name(f))
        if bad & {"experiments", "benchmarks"}:
            wrong[str(f.relative_to(SRC))] = sorted(bad & {"experiments", "benchmarks"})
    assert not wrong


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_imports(name):
    """``experiments/`` (outside the package) is importable as ``experiments`` in the tests."""
    module = importlib.import_module(f"experiments.{name}")
    assert module.__doc__ and Path(module.__file__).parent == ROOT / "experiments"


RUNNABLE = [n for n in EXPERIMENTS if "__main__" in (ROOT / "experiments" / f"{n}.py").read_text()]


@pytest.mark.parametrize("name", RUNNABLE)
def test_runnable_experiments_parse_their_command_line(name, capsys):
    """Every ``python -m experiments.NAME`` has a ``main(argv)`` whose ``--help`` works."""
    assert len(RUNNABLE) >= 5
    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"experiments.{name}").main(["--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_the_import_reader_sees_every_spelling():
    """The check above can fail: relative, absolute and in-function imports are all read."""
    source = (
        "from ...cli import main\n"
        "import experiments.quality\n"
        "def f():\n    from polysketch.commands import approx\n"
        "from .. import plots\n"
        "from ...features import create\n"
    )
    found = _imported_packages(source, "polysketch.eval.fidelity.evaluate")
    assert found == {"cli", "experiments", "commands", "eval", "features"}
    assert "features" in _imported_packages(
        (SRC / "eval" / "fidelity" / "evaluate.py").read_text(), "polysketch.eval.fidelity.evaluate"
    )


def test_core_and_cli_run_without_matplotlib(tmp_path):
    """matplotlib is the ``plot`` extra: with it blocked, the library computes, the CLI parses
    and trains, and drawing raises an ImportError that names the extra."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["matplotlib"] = None  # any import of it fails
        import torch
        import polysketch
        from polysketch import features
        from polysketch.cli import build_parser, main
        from polysketch.nn import TransformerConfig, TransformerLM
        import polysketch.eval.bench, polysketch.eval.fidelity, polysketch.eval.demo

        fm = features.create("polysketch", 8, degree=2, num_features=4, seed=0)
        q = k = v = torch.randn(1, 2, 20, 8)
        assert polysketch.kernel_attention(q, k, v, fm, causal=True).shape == (1, 2, 20, 8)
        model = TransformerLM(TransformerConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
        assert model(torch.zeros(1, 8, dtype=torch.long))[0].shape == (1, 8, 256)
        build_parser()
        from polysketch.eval.plots import pyplot
        try:
            pyplot()
        except ImportError as err:
            assert "polysketch[plot]" in str(err), err
        else:
            raise AssertionError("pyplot() without matplotlib did not raise")
        status = main(["approx", "--maps", "tensor_power", "--degrees", "2", "--dim", "4",
                       "--num", "8", "--out", {str(tmp_path / "approx")!r}, "--no-progress"])
        assert status == 2, status
        assert "matplotlib" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
    assert "polysketch approx: error: " in done.stderr and "polysketch[plot]" in done.stderr
    assert (tmp_path / "approx" / "results.csv").is_file()  # the numbers are written first


# The public names of the former modules polysketch.eval.bench and polysketch.eval.fidelity,
# now packages: importable as before, without a warning.
FORMER = {
    "polysketch.eval.bench": [
        "BenchConfig", "DEFAULT_LENGTHS", "QUICK_LENGTHS", "parse_lengths", "chunked_flops",
        "sdpa_flops", "time_call", "run_benchmark", "set_malloc_top_pad", "MALLOC_TOP_PAD",
        "write_csv", "plot_results", "format_report", "DTYPES", "METHODS", "MODES",
    ],
    "polysketch.eval.fidelity": [
        "polynomial_target", "kernel_matrices", "relative_frobenius_error", "rmae",
        "max_relative_error", "OptimalError", "optimal_rank_approximation",
        "optimal_rank_error_of", "optimal_rank_error", "optimal_curve", "fitted_optimum",
        "evaluate_map", "sweep",
    ],
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(FORMER))
def test_former_modules_are_packages_with_the_same_names(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        module = importlib.import_module(path)
    missing = [name for name in FORMER[path] if not hasattr(module, name)]
    assert not missing
    assert set(FORMER[path]) <= set(module.__all__)


def test_no_module_of_the_package_is_a_deprecation_shim():
    """0.1.0 has no users to keep old import paths for (issue 40): no module warns that it
    moved, and ``ops`` carries no pre-contract copies (the former ``ops/legacy.py``)."""
    shims = [
        str(f.relative_to(SRC))
        for f in sorted(SRC.rglob("*.py"))
        if "DeprecationWarning" in f.read_text(encoding="utf-8")
    ]
    assert not shims
    assert not (SRC / "ops" / "legacy.py").exists()
