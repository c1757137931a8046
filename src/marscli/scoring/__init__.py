"""Scoring: how an answer is scored, for `marscli eval` and `marscli reward` alike.

- `protocols.py`: the one `--protocol` registry; each protocol and how it scores, and what
  scoring knows of each benchmark. Start here.
- `answers.py`: marscli's answer primitives (normalisation, option letters, exact match, the
  trajectory's answer and format, the judge asked per gold answer).
- `release.py`: the released code's exact match and letter extraction, re-implemented.
- `judge.py`: the LLM judges (`--judge`) and their verdict cache.
"""
