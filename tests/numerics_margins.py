"""The margin of every ``assert_as_accurate`` comparison, under each BLAS branch and noise seed.

    python tests/numerics_margins.py [--seeds 1-8] [--branches default,COMPATIBLE,AVX2,AVX512]
                                     [--jobs 2] [pytest ids ...]

Runs the numerics tests (``test_numerics_portability.NUMERICS`` unless ids are given) once per
(MKL branch, ``BlasNoise`` seed) configuration, seed 0 meaning no noise, with
``POLYSKETCH_TEST_MARGINS`` set, and prints for each comparison site the smallest margin

    margin = (factor x err_ref + u) / err_got        (> 1: the comparison passes)

over the configurations, in the norm the test asserts, in sigma units where the test gives a
``sigma`` (its fallback: the comparison passes if either holds; the script makes every such
test compute it), and the effective margin (the larger of the two, per configuration), beside
the configuration that gave the smallest effective one. A site whose effective margin is close
to 1 under some branch depends on a lucky reference; one far above 1 everywhere holds on any
BLAS. MKL honours the AVX2 and AVX512
branches only on CPUs that have them (and, on some versions, only on Intel CPUs); the script
says which branches gave bit-identical products on this machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

U32 = 2.0**-24


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _product_digest(branch: str) -> str:
    from test_numerics_portability import _PROBE as code

    env = {**os.environ, **({"MKL_CBWR": branch} if branch != "default" else {})}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


def _run(branch: str, seed: int, ids: list[str], out: Path) -> int:
    env = {**os.environ, "POLYSKETCH_TEST_MARGINS": str(out),
           "POLYSKETCH_TEST_BLAS_NOISE": str(seed)}  # fmt: skip
    env.pop("PYTEST_XDIST_WORKER", None)
    if branch != "default":
        env["MKL_CBWR"] = branch
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-k", "not compile", *ids]  # fmt: skip
    return subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-4", help="BlasNoise seeds (0: no noise), e.g. 0-8")
    ap.add_argument("--branches", default="default,COMPATIBLE,AVX2,AVX512")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("ids", nargs="*", help="pytest ids (default: the NUMERICS list)")
    args = ap.parse_args()
    from test_numerics_portability import NUMERICS

    ids = args.ids or [f"tests/{t}" for t in NUMERICS]
    branches = args.branches.split(",")
    digests = {b: _product_digest(b) for b in branches}
    same = collections.defaultdict(list)
    for b, d in digests.items():
        same[d].append(b)
    print("branches with bit-identical products here:",
          "; ".join(", ".join(v) for v in same.values()))  # fmt: skip
    configs = [(b, s) for b in branches for s in _seeds(args.seeds)]
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as tmp:
        outs = {c: Path(tmp) / f"{c[0]}-{c[1]}.jsonl" for c in configs}
        with ThreadPoolExecutor(args.jobs) as pool:
            runs = pool.map(lambda c: _run(*c, ids, outs[c]), configs)
            codes = dict(zip(configs, tqdm(runs, total=len(configs), desc="configurations"),
                             strict=True))  # fmt: skip
        worst: dict[str, dict] = {}
        for c, path in outs.items():
            if not path.exists():
                continue
            counts: collections.Counter = collections.Counter()
            for line in path.read_text().splitlines():
                row = json.loads(line)
                counts[row["test"]] += 1
                site = f"{row['test']} #{counts[row['test']]}"
                m = {}
                for norm in ("max", "fro", "sigma"):
                    if norm in row["got"]:
                        got, ref = row["got"][norm], row["ref"][norm]
                        m[norm] = (row["factor"] * ref + (U32 if norm != "sigma" else 0)) / max(
                            got, 1e-300)
                asserted = m["sigma"] if row["norm"] == "sigma" else m[row["norm"]]
                effective = max(asserted, m.get("sigma", 0.0))
                for key, value in (("asserted", asserted), ("sigma", m.get("sigma")),
                                   ("effective", effective)):  # fmt: skip
                    if value is None:
                        continue
                    if (site, key) not in worst or value < worst[(site, key)][0]:
                        worst[(site, key)] = (value, c, row["norm"], row["refs"])
    failed = [c for c, rc in codes.items() if rc != 0]
    print(f"{len(configs)} configurations; pytest failed in {len(failed)}: {failed}")
    sites = sorted({k[0] for k in worst}, key=lambda s: worst[(s, "effective")][0])
    print(f"{'effective':>9} {'asserted (norm)':>16} {'sigma':>6}  refs  worst configuration  site")
    for site in sites:
        eff, asr = worst[(site, "effective")], worst[(site, "asserted")]
        sig = worst.get((site, "sigma"), (float("nan"),))[0]
        print(f"{eff[0]:9.2f} {asr[0]:9.2f} ({asr[2]:>4}) {sig:6.2f}  {eff[3]:>4}  "
              f"{eff[1][0]}, seed {eff[1][1]:<3}  {site}")


if __name__ == "__main__":
    main()
