"""`make rl-job` under a time limit (slurm): Slurm signals the job RL_JOB_GRACE seconds before
its limit (--signal=B:USR1@...), stages/rl-job.sh stops make, the job requeues itself, and its
next run resumes at the first missing file. Here the signal is sent by hand (`scancel
--signal=USR1 --batch`, what Slurm sends at the limit) to a loop of two stand-in stages: a
recipe of this test's own, so that it takes seconds, not an RL iteration's minutes."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from helpers import ROOT, idle_nodes

# Two stages as the Makefile's: each writes its file atomically; the second is slow on the
# job's first run only (it would reach the limit), quick on the requeued run.
RECIPE = """\
NAME = rq
RUN ?= {run}
$(RUN)/stage-1:
\tmkdir -p $(RUN) && echo "1 $$SLURM_RESTART_COUNT" >> $(RUN)/runs.log
\ttouch $@.tmp && mv $@.tmp $@
$(RUN)/stage-2: $(RUN)/stage-1
\techo "2 $$SLURM_RESTART_COUNT" >> $(RUN)/runs.log
\t[ "$${{SLURM_RESTART_COUNT:-0}}" != 0 ] || sleep 300
\ttouch $@.tmp && mv $@.tmp $@
rq-loop: $(RUN)/stage-2
"""


def _squeue(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True,
                          text=True, check=False).stdout.strip()


def _until(what, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if what():
            return True
        time.sleep(1)
    return False


@pytest.mark.slurm
def test_a_time_limit_requeues_the_loop_which_resumes_where_it_stopped(tmp_path):
    if not idle_nodes():
        pytest.skip("needs a Slurm cluster: scripts/slurm-local.sh start")
    run = tmp_path / "run"
    recipe = tmp_path / "rq.mk"
    recipe.write_text(RECIPE.format(run=run))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "SLURM", "RUN") and not k.startswith(("SBATCH_", "SLURM_"))}
    r = subprocess.run(["make", "--no-print-directory", "rl-job", f"RECIPE={recipe}",
                        "RL_JOB=rq-loop", "SBATCH_JOB=--nodes=1 --cpus-per-task=1"],
                       cwd=ROOT, env=env, text=True, capture_output=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "--requeue" in r.stdout and "--signal=B:USR1@600" in r.stdout, r.stdout
    job = r.stdout.strip().split()[-1]  # "Submitted batch job N"
    try:
        runs = run / "runs.log"
        assert _until(lambda: runs.exists() and "2 " in runs.read_text(), 60), _squeue(job)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
        # requeued: pending until Slurm's requeue delay, which the test skips
        assert _until(lambda: _squeue(job).startswith("PENDING"), 60), _squeue(job)
        assert not (run / "stage-2").exists()
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        assert _until(lambda: (run / "stage-2").exists() and not _squeue(job), 90), _squeue(job)
    finally:
        subprocess.run(["scancel", job], check=False)
    # stage 1 ran once; stage 2 was stopped on the first run and done on the requeued one
    assert runs.read_text().split("\n")[:3] == ["1 ", "2 ", "2 1"], runs.read_text()
    log = (run / "logs" / f"rl-job-{job}.out").read_text()
    assert "stopping make" in log and f"requeueing job {job}" in log, log
    assert "requeued 1 times" in log, log
