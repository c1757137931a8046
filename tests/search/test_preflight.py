"""`marscli preflight` (issue 52): one real request to each remote search and judge endpoint,
local backends opened, one line per endpoint, exit 1 naming those that failed, no secret
printed; and `make rl` runs it before the first iteration, where the stages run."""

from __future__ import annotations

import socket

from fakes import always, chat_reply, retrieve_reply
from helpers import dry_run, invoke


def dead_url() -> str:
    """A URL nothing listens on (a port bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_live_endpoints_pass_with_one_request_each(fake_server):
    search = fake_server({"/retrieve": always(200, retrieve_reply("Red Corp"))})
    judge = fake_server({"/chat/completions": always(200, chat_reply("OK"))})
    code, out, err = invoke(["preflight", "--text-search", f"retriever:{search.url}",
                             "--image-search", "data", "--judge", f"openai:judge-m@{judge.url}/v1"])
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 3 and all(line.endswith(": ok") for line in lines), out
    assert [r["path"] for r in search.log] == ["/retrieve"]
    (ask,) = judge.log
    assert ask["body"]["model"] == "judge-m" and ask["body"]["max_tokens"] == 1


def test_a_dead_endpoint_fails_naming_it_without_its_secret(fake_server):
    search = fake_server({"/retrieve": always(200, retrieve_reply("Red Corp"))})
    dead = dead_url().replace("http://", "http://user:hunter2@")
    code, out, err = invoke(["preflight", "--text-search", f"retriever:{search.url}",
                             "--judge", f"openai:m@{dead}/v1", "--judge-timeout", "5"])
    assert code == 1
    assert out.splitlines()[0].endswith(": ok")
    assert "judge openai:m@" in out.splitlines()[1] and ": failed: " in out.splitlines()[1]
    (line,) = err.strip().splitlines()
    assert line.startswith("error: 1 of 2 endpoints failed (judge openai:m@")
    assert "PREFLIGHT=0" in line
    assert "hunter2" not in out + err


def test_a_failing_search_backend_and_a_missing_index_fail(fake_server, tmp_path):
    search = fake_server({"/retrieve": always(500, "backend down")})
    code, out, _ = invoke(["preflight", "--text-search", f"retriever:{search.url}"])
    assert code == 1 and "text search retriever:" in out and "failed: " in out
    code, out, _ = invoke(["preflight", "--image-search", f"local:{tmp_path}/none.sqlite",
                           "--judge", "exact"])
    assert code == 1
    assert "image search local:" in out and "failed: " in out and "judge exact: ok" in out


def test_make_rl_runs_the_preflight_before_the_first_iteration(tmp_path):
    """With the recipe's search backends and REWARD_OPTS' judge, where the stages run."""
    args = ["rl", "RECIPE=recipes/mars-8b.mk", f"RUN={tmp_path}/run", "ITERS=1"]
    for slurm, launch in (("0", ""), ("1", "sbatch --wait")):
        lines = dry_run(*args, f"SLURM={slurm}")
        first = next(i for i, x in enumerate(lines) if "stages/preflight.sh" in x)
        rollout = next(i for i, x in enumerate(lines) if "stages/rollout.sh" in x)
        assert first < rollout
        line = lines[first]
        assert launch in line
        assert "--text-search retriever:" in line and "--image-search data" in line
        assert "--judge openai:gpt-4o@https://api.openai.com/v1" in line
    lines = dry_run(*args, "PREFLIGHT=0")
    assert not any("stages/preflight.sh" in x for x in lines)


def test_the_judge_option_is_read_in_either_form(tmp_path):
    for opts in ("--judge exact --format-weight 0", "--format-weight 0 --judge=exact"):
        lines = dry_run("preflight", "RECIPE=recipes/tiny.mk", f"RUN={tmp_path}/run",
                        f"REWARD_OPTS={opts}")
        assert any(x.split()[-3:] == ["stages/preflight.sh", "--judge", "exact"]
                   for x in lines), lines
