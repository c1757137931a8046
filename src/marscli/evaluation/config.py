"""`marscli eval`'s own options, each declared once (light: the CLI imports it for --help);
the generation, job and judge options are `GenerationOptions`', `JobOptions`' and
`JudgeConfig`'s."""

from __future__ import annotations

from dataclasses import dataclass

from marscli.options import option


@dataclass
class EvalConfig:
    fmt: str = option(
        "auto", "auto (detected from the files) or a layout's name: the loaders' own list, in "
                "the error an unknown one gets and docs/evaluation.md.", decls=("--format",))
    split: str | None = option(
        None, "The split to read when BENCH's files hold several (default: test); never mixed.")
    benchmark: str | None = option(
        None, "Benchmark name to record (default: inferred from the format or file name).")
    mode: str = option("agent", "agent (the tool loop) or direct (no tools, one answer turn).")
    samples: int = option(
        1, "Samples per item, averaged (the paper uses 8 for V* and HR-Bench).")
    protocol: str | None = option(
        None, "mars (marscli's scoring; default), official (each benchmark's own: MMSearch "
              "token F1, HR-Bench rotations, InfoSeek ranges + split harmonic mean), release "
              "(the released code's validation scoring) or release-inference (its "
              "inference/eval.py: untagged answers go to the judge whole).")
