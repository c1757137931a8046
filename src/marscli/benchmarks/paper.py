"""The numbers SenseNova-MARS reports, to print beside ours. Percent, as published.

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

SOURCE = ("arXiv 2512.24330 main results tables (search-oriented; high-resolution), as in the "
          "release README")

_BENCHES = ("mmsearch", "hr-mmsearch", "fvqa", "infoseek", "simplevqa", "livevqa", "mat-search")
_HIGHRES = ("vstar", "hrbench-4k", "hrbench-8k", "mme-realworld")


def _row(names: tuple[str, ...], values: tuple[float | None, ...]) -> dict[str, float | None]:
    return dict(zip(names, values, strict=True))


# Search-oriented table, "Agentic Model" rows.
_MARS_SEARCH = {
    "SenseNova-MARS-8B": _row(_BENCHES, (67.84, 41.64, 67.11, 61.70, 70.19, 56.22, 84.67)),
    "SenseNova-MARS-32B": _row(_BENCHES, (74.27, 54.43, 72.61, 65.25, 74.14, 60.83, 86.67)),
}
# High-resolution table, "Agentic Model" rows.
_MARS_HIGHRES = {
    "SenseNova-MARS-8B": _row(_HIGHRES, (92.2, 83.1, 78.4, 67.9)),
    "SenseNova-MARS-32B": _row(_HIGHRES, (94.2, 90.2, 86.6, 72.7)),
}
# Baselines: setting -> model -> benchmark.
_BASELINES = {
    "direct": {
        "Qwen3-VL-8B-Instruct": {
            **_row(_BENCHES, (11.70, 12.13, 24.22, 23.15, 42.94, 23.18, 67.33)),
            **_row(_HIGHRES, (86.4, 78.9, 74.6, 61.9))},
        "Qwen3-VL-32B-Instruct": {
            **_row(_BENCHES, (16.96, 19.02, 32.17, 28.95, 45.90, 31.59, 72.67)),
            **_row(_HIGHRES, (None, None, None, None))},
    },
    "agent": {  # search table: zero-shot agentic rows; high-res table: its agentic rows
        "Qwen3-VL-8B-Instruct": {
            **_row(_BENCHES, (47.37, 27.87, 53.61, 46.15, 62.29, 39.37, 84.00)),
            **_row(_HIGHRES, (None, None, None, None))},
        "Qwen3-VL-32B-Instruct": {
            **_row(_BENCHES, (49.12, 34.43, 54.28, 49.85, 64.17, 42.87, 82.00)),
            **_row(_HIGHRES, (91.1, 84.6, 81.6, None))},
    },
}

# Items per benchmark in the paper's evaluation (the release's test_all.json `length`).
PAPER_ITEMS = {"mmsearch": 171, "hr-mmsearch": 305, "fvqa": 1800, "infoseek": 2000,
               "simplevqa": 1013, "livevqa": 3602, "mat-search": 150, "vstar": 191,
               "hrbench-4k": 800, "hrbench-8k": 800, "mme-realworld": None}

MODELS = ("SenseNova-MARS-8B", "SenseNova-MARS-32B")


def reported(bench: str, mode: str) -> dict:
    """The paper's numbers for `bench` in `mode` (agent | direct): the two MARS models (None
    where unreported) and the Qwen3-VL baselines."""
    mars = dict.fromkeys(MODELS)
    if mode == "agent":
        for m in MODELS:
            mars[m] = _MARS_SEARCH[m].get(bench, _MARS_HIGHRES[m].get(bench))
    base = {m: row.get(bench) for m, row in _BASELINES.get(mode, {}).items()}
    out = {**mars, "baselines": base, "items": PAPER_ITEMS.get(bench), "source": SOURCE}
    if mode == "direct":
        out["note"] = "the paper reports no direct-answer score for SenseNova-MARS"
    return out
