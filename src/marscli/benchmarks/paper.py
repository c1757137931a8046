"""The numbers SenseNova-MARS reports, to print beside ours. Percent, as published; each
benchmark's are in its loader module's declaration (`facts.Paper`).

Source: arXiv 2512.24330 (SenseNova-MARS), its two main results tables — "Search-oriented
benchmarks" and "High-resolution Benchmarks" — as reproduced in the release README
(github.com/OpenSenseNova/SenseNova-MARS, section "Benchmark Performance"), read 2026. The
8B MMSearch and HR-MMSearch scores (67.84, 41.64) are also in the v1 abstract; the 32B
scores (74.3, 54.4 rounded) in the README's abstract. The table numbers themselves were
copied from the README, not re-read from the PDF: check them against the version of the
paper you cite.

- SenseNova-MARS rows exist for the agentic setting only: the paper reports no
  direct-answer score for SenseNova-MARS, so `--mode direct` shows null for them.
- Baselines (Qwen3-VL-8B/32B-Instruct, the models MARS starts from) are listed for context:
  "direct" rows of both tables, and the search table's "Agentic Model (zero-shot)" rows.
  The high-resolution table has a Qwen3-VL-8B direct row and a Qwen3-VL-32B agentic row only;
  its Qwen3-VL-32B MME-RealWorld cell is "-". Unreported cells are None.
- MME-RealWorld: which release / subset the paper used, and how many items, is not stated
  in what was read: its item count is None.
- The search benchmarks are scored by the release's protocol (exact match, then a GPT-4o
  judge; letters for multiple choice): compare them with `--protocol release` (the release's
  scoring as its code has it; recipes/eval-release.mk has its other settings) or `mars`.
"""

from __future__ import annotations

from marscli.benchmarks.facts import BENCHMARKS, Paper

SOURCE = ("arXiv 2512.24330 main results tables (search-oriented; high-resolution), as in the "
          "release README")

MODELS = ("SenseNova-MARS-8B", "SenseNova-MARS-32B")
BASELINES = ("Qwen3-VL-8B-Instruct", "Qwen3-VL-32B-Instruct")


def reported(bench: str, mode: str) -> dict:
    """The paper's numbers for `bench` in `mode` (agent | direct): the two MARS models (None
    where unreported) and the Qwen3-VL baselines."""
    b = BENCHMARKS.get(bench)
    paper = b.paper if b is not None else Paper()
    mars = dict(zip(MODELS, paper.mars if mode == "agent" else (None, None), strict=True))
    base = dict(zip(BASELINES, getattr(paper, mode), strict=True)) \
        if mode in ("direct", "agent") else {}
    out = {**mars, "baselines": base, "items": paper.items, "source": SOURCE}
    if mode == "direct":
        out["note"] = "the paper reports no direct-answer score for SenseNova-MARS"
    return out
