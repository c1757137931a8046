"""`eval rescore`: every record of a results file re-scored (under a protocol, with a
judge) and the file rewritten atomically; the settings file then names the new judge and
protocol, so that a resume with them is not refused."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from marscli.records.jsonl import iter_rows
from marscli.records.outputs import AtomicFile, AtomicJsonl
from marscli.scoring.judge import JudgeOptions, make_judge
from marscli.scoring.protocols import ScoreContext, make_protocol


def settings_of(results: str) -> dict | None:
    """The settings RESULTS was generated with (None: no settings file), read before
    rescoring: a bad one is BadInput before any judge call is paid or RESULTS rewritten."""
    from marscli.agent.runner import read_settings, settings_path

    try:
        return read_settings(settings_path(results), "remove it (it only guards a resume of "
                                                     "the eval) and re-run")
    except FileNotFoundError:
        return None


def rescored_settings(results: str, settings: dict | None, protocol: str | None,
                       judge_spec: str) -> None:
    """After `--rescore`, the settings file names the judge (and protocol) the records now
    carry, so that a resume with them is not refused."""
    from marscli.agent.runner import settings_path
    from marscli.secrets import redact

    if settings is None:
        return
    settings.update(redact({"judge": judge_spec}))
    if protocol is not None:
        settings["protocol"] = protocol
    with AtomicFile(settings_path(results)) as fh:
        fh.write(orjson.dumps({"v": 1, "settings": settings}, option=orjson.OPT_INDENT_2))


def rescore_file(results: str, protocol: str | None, judge_spec: str,
             judge_opts: JudgeOptions | None) -> None:
    from concurrent.futures import ThreadPoolExecutor

    rows = [r for _, r in iter_rows(results)]
    judge = make_judge(judge_spec, judge_opts)
    try:
        ctx = ScoreContext(judge=judge, base=Path(results).parent)

        def one(r: dict) -> dict:
            name = protocol or str((r.get("score") or {}).get("protocol") or "mars")
            return make_protocol(name).score(r, ctx)

        workers = judge_opts.concurrency if judge_opts else 8
        with ThreadPoolExecutor(max_workers=workers) as pool:
            scores = list(pool.map(one, rows))
    finally:
        judge.close()
    # rewriting the results in place (atomically) is what --rescore is for
    with AtomicJsonl(results, replaces_input=True) as w:
        for r, s in zip(rows, scores):
            ends = {**(r.get("endpoints") or {}), "judge": judge.address}
            w.write({**r, "score": s, "endpoints": ends})
    print(f"eval: re-scored {len(rows)} records in {results}", file=sys.stderr)
