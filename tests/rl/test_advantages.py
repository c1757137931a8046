"""Advantages: golden numerics by hand, a plain-Python reference, and the CLI boundary."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from marscli.errors import BadInput
from marscli.rl import advantages as A

EPS_G = 1e-6


def approx(x, rel=1e-6, abs=1e-9):
    return pytest.approx(x, rel=rel, abs=abs)


# ---------------------------------------------------------------------------- golden numerics


def test_grpo_group_step_by_hand():
    # mean 0.5, unbiased std sqrt((4 · 0.25) / 3) = 0.57735, so ±0.5 / 0.57735 = ±0.8660
    a = A.compute([1, 0, 0, 1], ["p"] * 4, "grpo")
    assert a.dtype == np.float64
    assert a.tolist() == approx([0.8660, -0.8660, -0.8660, 0.8660], rel=1e-4)


def test_bn_gspo_batch_step_over_uneven_groups_by_hand():
    # Group step. A = [1, 0, 0]: mean 1/3, unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3.
    # B = [2, 0]: mean 1, unbiased var (1 + 1) / 1 = 2. C = [5]: a group of one → 0.
    sa, sb = math.sqrt(1 / 3), math.sqrt(2)
    bar = [(2 / 3) / (sa + EPS_G), (-1 / 3) / (sa + EPS_G), (-1 / 3) / (sa + EPS_G),
           1 / (sb + EPS_G), -1 / (sb + EPS_G), 0.0]
    # Batch step with the population std: mean 0, std sqrt((4/3 + 1/3 + 1/3 + 1/2 + 1/2) / 6).
    mean = sum(bar) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in bar) / 6)
    want = [(x - mean) / (std + 1e-9) for x in bar]
    assert want == approx([2 * math.sqrt(2 / 3), -math.sqrt(2 / 3), -math.sqrt(2 / 3), 1, -1, 0],
                          rel=1e-5, abs=1e-6)  # ±1.63299, ∓0.81650, ±1: the arithmetic above
    got = A.compute([1, 0, 0, 2, 0, 5], ["A", "A", "A", "B", "B", "C"])
    assert got.tolist() == approx(want)


def test_two_minibatches_are_normalised_separately():
    # minibatch 0: A = [1, 0, 0] and C = [5] → group step (1.1547, −0.5774, −0.5774, 0), batch std
    # sqrt((4/3 + 1/3 + 1/3) / 4) = sqrt(1/2). minibatch 1: D = [0, 1, 0, 1] → ∓0.8660, std 0.8660.
    r = [1, 0, 1, 0, 0, 0, 5, 1]
    g = ["A", "D", "D", "A", "A", "D", "C", "D"]
    mb = [0, 1, 1, 0, 0, 1, 0, 1]
    k = math.sqrt(2 / 3)
    want = [2 * k, -1, 1, -k, -k, -1, 0, 1]
    assert A.compute(r, g, "bn-gspo", mb).tolist() == approx(want, rel=1e-5, abs=1e-6)
    # over the whole batch the std differs, and so do the advantages
    assert A.compute(r, g, "bn-gspo")[1] != approx(-1, rel=1e-3)


def test_rloo_by_hand():
    # r − mean of the other samples: [1, 0, 0, 1] → 1 − 1/3, 0 − 2/3; [2, 4] → −2, +2; [3] → 0
    a = A.compute([1, 0, 0, 1, 2, 4, 3], list("ppppqqs"), "rloo")
    assert a.tolist() == approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2, 2, 0])


def test_dr_grpo_by_hand():
    a = A.compute([1, 0, 0, 1, 3, 7, 2], list("ppppqqs"), "dr-grpo")
    assert a.tolist() == approx([0.5, -0.5, -0.5, 0.5, -2, 2, 0])


@pytest.mark.parametrize("est", ["bn-gspo", "grpo", "dr-grpo", "rloo"])
def test_group_of_one_gets_zero(est):
    assert A.compute([3.0, -2.0, 7.5], ["a", "b", "c"], est).tolist() == [0.0, 0.0, 0.0]
    a = A.compute([3.0, 1.0, 0.0], ["a", "b", "b"], est)
    assert a[1] > 0 > a[2]
    if est != "bn-gspo":  # the batch step shifts by the batch mean, which is 0 here anyway
        assert a[0] == 0.0
    assert a[0] == approx(0.0)


def test_group_ids_may_be_any_hashable():
    a = A.compute([1, 0, 0, 1], [("x", 1), ("x", 1), 7, 7], "dr-grpo")
    assert a.tolist() == approx([0.5, -0.5, -0.5, 0.5])


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(BadInput, match="bn-gspo, dr-grpo, grpo, rloo"):
        A.compute([1.0], ["a"], "ppo")


# ----------------------------------------------------------------- vectorised vs plain Python


def _reference(r: list[float], g: list[int], est: str) -> list[float]:
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(g):
        groups.setdefault(k, []).append(i)
    out = [0.0] * len(r)
    for idx in groups.values():
        vals = [r[i] for i in idx]
        mu = sum(vals) / len(vals)
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        for i in idx:
            if est in ("grpo", "bn-gspo"):
                out[i] = (r[i] - mu) / (sd + EPS_G)
            elif est == "dr-grpo":
                out[i] = r[i] - mu
            else:
                out[i] = 0.0 if len(vals) == 1 else r[i] - (sum(vals) - r[i]) / (len(vals) - 1)
    if est == "bn-gspo":
        mu, sd = statistics.fmean(out), statistics.pstdev(out)
        out = [(x - mu) / (sd + 1e-9) for x in out]
    return out


@pytest.mark.parametrize("est", ["bn-gspo", "grpo", "dr-grpo", "rloo"])
def test_vectorised_equals_python_loop(est):
    rng = np.random.default_rng(5)
    n = 10_000
    g = rng.integers(0, 1_500, n)  # ~6.7 per group, some groups of one
    r = rng.choice([0.0, 0.5, 1.0, 1.5], n) + rng.normal(0, 0.01, n) * (g % 3 == 0)
    got = A.compute(r, g.astype(str), est)
    want = _reference(r.tolist(), g.tolist(), est)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    # and per minibatch: the same reference run on each slice
    mb = A.assign_minibatches(g, 4, seed=1)
    got = A.compute(r, g, est, mb)
    for k in range(4):
        rows = np.flatnonzero(mb == k)
        np.testing.assert_allclose(got[rows], _reference(r[rows].tolist(), g[rows].tolist(), est),
                                   rtol=1e-9, atol=1e-9)


def test_one_million_rows():
    rng = np.random.default_rng(0)
    n = 1_000_000
    a = A.compute(rng.integers(0, 2, n).astype(float), rng.integers(0, n // 8, n))
    assert a.shape == (n,) and np.isfinite(a).all()
    assert abs(a.mean()) < 1e-9 and a.std() == approx(1.0, rel=1e-6)


# ------------------------------------------------------------------------ minibatch assignment


def test_assign_minibatches_keeps_groups_whole_balanced_and_seeded():
    pids = [f"p{i // 8}" for i in range(40 * 8)]  # 40 groups of 8
    mb = A.assign_minibatches(pids, 4, seed=3)
    assert np.bincount(mb).tolist() == [80, 80, 80, 80]
    for p in set(pids):
        assert len({int(mb[i]) for i, q in enumerate(pids) if q == p}) == 1
    assert (A.assign_minibatches(pids, 4, seed=3) == mb).all()
    assert not (A.assign_minibatches(pids, 4, seed=4) == mb).all()


def test_assign_minibatches_uneven_groups():
    rng = np.random.default_rng(2)
    g = np.repeat(np.arange(101), rng.integers(1, 9, 101))
    mb = A.assign_minibatches(g, 3, seed=0)
    per_group = [set(mb[g == k].tolist()) for k in range(101)]
    assert all(len(s) == 1 for s in per_group)
    groups_per_mb = np.bincount([s.pop() for s in per_group])
    assert groups_per_mb.max() - groups_per_mb.min() <= 1
    rows = np.bincount(mb)
    assert rows.max() - rows.min() <= 8  # at most one group's worth apart


def test_assign_minibatches_more_than_groups():
    with pytest.raises(BadInput, match="--minibatches"):
        A.assign_minibatches(["a", "a", "b"], 3, seed=0)


# ------------------------------------------------------------------------------------ run()


def _rows(*specs) -> list[tuple[int, dict]]:
    return [(i + 1, {"v": 1, "id": f"{p}#{i}", "prompt_id": p, "reward": {"total": r}})
            for i, (p, r) in enumerate(specs)]


def test_run_carries_fields_and_appends_keys():
    rows = _rows(("a", 1), ("a", 0), ("b", 0.5))
    rows[0][1]["extra"] = {"nested": [1, 2]}
    out, stats = A.run(rows, "s.jsonl", "grpo")
    assert list(out[0]) == ["v", "id", "prompt_id", "reward", "extra", "advantage", "group"]
    assert out[0]["extra"] == {"nested": [1, 2]}
    assert out[0]["group"] == {"mean": 0.5, "std": approx(math.sqrt(0.5)), "size": 2}
    assert out[2]["group"] == {"mean": 0.5, "std": 0.0, "size": 1} and out[2]["advantage"] == 0.0
    assert "minibatch" not in out[0]
    assert stats["groups"] == 2 and stats["rows"] == 3 and stats["zero_std_groups"] == 1


def test_pooled_std_is_what_the_batch_step_divides_by():
    # group step: a → ±0.7071, the flat b → 0, 0; pooled (population) std sqrt(1/4) = 0.5,
    # so BN-GSPO doubles the group-normalised advantages: ±1.4142
    rows = _rows(("a", 1), ("a", 0), ("b", 1), ("b", 1))
    out, stats = A.run(rows, "s", "bn-gspo")
    assert stats["pooled_std"] == approx(0.5, rel=1e-5)
    assert [r["advantage"] for r in out] == approx([math.sqrt(2), -math.sqrt(2), 0, 0], rel=1e-5)
    _, stats = A.run(_rows(("a", 1), ("a", 0)), "s", "grpo")
    assert stats["pooled_std"] == approx(math.sqrt(0.5), rel=1e-5)  # no flat group: (k-1)/k


def test_filter_zero_std_drops_flat_groups_before_batch_step():
    rows = _rows(("a", 1), ("b", 1), ("a", 1), ("b", 0), ("c", 0.5))
    # no filter: group step a → 0, 0; b → ±0.7071; c → 0; batch std sqrt(1/5) → ±1.5811
    out, _ = A.run([(n, dict(r)) for n, r in rows], "s", "bn-gspo")
    assert [r["id"] for r in out] == ["a#0", "a#2", "b#1", "b#3", "c#4"]  # by prompt, sample
    assert [r["advantage"] for r in out] == approx([0, 0, 1.5811388, -1.5811388, 0], rel=1e-5)
    out, stats = A.run(rows, "s", "bn-gspo", filter_zero_std=True)
    assert [r["id"] for r in out] == ["b#1", "b#3"]
    assert [r["advantage"] for r in out] == approx([1, -1], rel=1e-5)
    assert (stats["groups"], stats["dropped_groups"], stats["dropped_rows"]) == (1, 2, 3)


def test_rows_come_out_by_prompt_and_sample_whatever_order_the_engine_finished_them():
    """A concurrent engine appends trajectories in completion order, which changes from run
    to run: the split into minibatches and the rows update reads must not."""
    rows = [(i + 1, dict(r)) for i, (_, r) in enumerate(
        _rows(*[(p, float(k % 2)) for p in "abcdef" for k in range(4)]))]
    for r in (r for _, r in rows):
        r["sample"] = int(r["id"].split("#")[1]) % 4
    shuffled = [rows[i] for i in np.random.default_rng(1).permutation(len(rows))]
    a, _ = A.run([(n, dict(r)) for n, r in rows], "s", "bn-gspo", minibatches=3, seed=7)
    b, _ = A.run([(n, dict(r)) for n, r in shuffled], "s", "bn-gspo", minibatches=3, seed=7)
    assert a == b
    assert [(r["prompt_id"], r["sample"]) for r in a] == [(p, k) for p in "abcdef"
                                                          for k in range(4)]


def test_equal_rewards_are_flat_despite_rounding():
    # 3 × 0.1 sums to 0.30000000000000004: the group must still count as flat, exactly
    rows = _rows(("a", 0.1), ("a", 0.1), ("a", 0.1), ("b", 1), ("b", 0))
    out, stats = A.run([(n, dict(r)) for n, r in rows], "s", "grpo")
    assert [r["advantage"] for r in out[:3]] == [0.0, 0.0, 0.0]
    assert out[0]["group"] == {"mean": 0.1, "std": 0.0, "size": 3}
    out, stats = A.run(rows, "s", "grpo", filter_zero_std=True)
    assert [r["prompt_id"] for r in out] == ["b", "b"] and stats["dropped_groups"] == 1


def test_filter_zero_std_all_flat_is_bad_input():
    with pytest.raises(BadInput, match="dropped every row"):
        A.run(_rows(("a", 1), ("a", 1)), "s", filter_zero_std=True)


def test_run_minibatches_field_and_stats():
    rows = _rows(*[(f"p{i // 4}", float(i % 3)) for i in range(24)])
    out, stats = A.run(rows, "s", minibatches=3, seed=7)
    assert stats["minibatch_rows"] == [8, 8, 8]
    by_prompt: dict[str, set[int]] = {}
    for r in out:
        by_prompt.setdefault(r["prompt_id"], set()).add(r["minibatch"])
    assert all(len(s) == 1 for s in by_prompt.values())
    for k in range(3):  # each minibatch is normalised on its own
        adv = np.array([r["advantage"] for r in out if r["minibatch"] == k])
        assert abs(adv.mean()) < 1e-9 and adv.std() == approx(1.0, rel=1e-6)


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.pop("reward"), r"s\.jsonl:2: reward\.total: missing required field"),
    (lambda r: r["reward"].pop("total"), r"s\.jsonl:2: reward\.total: missing required field"),
    (lambda r: r["reward"].update(total=True), r"s\.jsonl:2: reward\.total: expected"),
    (lambda r: r["reward"].update(total="1"), r"s\.jsonl:2: reward\.total: expected"),
    (lambda r: r.pop("prompt_id"), r"s\.jsonl:2: prompt_id: missing"),
    (lambda r: r.update(id=5), r"s\.jsonl:2: id: expected str"),
    (lambda r: r.update(id="a#0"), r"s\.jsonl:2: id: duplicate id 'a#0' \(first at line 1\)"),
    # (r - mean)^2 overflows float64: the group's advantages would be nan, written as null
    (lambda r: r["reward"].update(total=1e308), r"s\.jsonl:2: reward\.total: 1e\+308 is beyond"),
    (lambda r: r["reward"].update(total=-1e200), r"s\.jsonl:2: reward\.total: -1e\+200 is "),
])
def test_run_bad_rows(mutate, match):
    rows = _rows(("a", 1), ("a", 0), ("b", 1))
    mutate(rows[1][1])
    with pytest.raises(BadInput, match=match):
        A.run(rows, "s.jsonl")


def test_run_more_minibatches_than_groups():
    with pytest.raises(BadInput, match=r"--minibatches: 3 .*number of groups \(2\)"):
        A.run(_rows(("a", 1), ("b", 0)), "s", minibatches=3)


# ---------------------------------------------------------------------- --mask-truncated


def _stopped(*specs) -> list[tuple[int, dict]]:
    """Rows (prompt, reward, stop)."""
    rows = _rows(*[(p, r) for p, r, _ in specs])
    for (_, row), (_, _, stop) in zip(rows, specs):
        row["stop"] = stop
    return rows


def test_mask_truncated_keeps_the_reward_in_the_group_and_zeroes_the_advantage():
    rows = _stopped(("a", 1, "answer"), ("a", 0, "answer"), ("a", 0, "max_turns"),
                    ("a", 1, "answer"))
    out, stats = A.run(rows, "s", "grpo", mask_truncated=True)
    # group a over all four rewards: mean 0.5, unbiased std sqrt(1/3) (without the cut row the
    # mean would be 2/3); the cut row gets 0
    sd = math.sqrt(1 / 3)
    e = sd + 1e-6  # eps_group
    assert [r["advantage"] for r in out] == approx([0.5 / e, -0.5 / e, 0.0, 0.5 / e], rel=1e-12)
    assert out[0]["group"] == {"mean": 0.5, "std": approx(sd), "size": 4}
    assert [r.get("masked") for r in out] == [None, None, "truncated", None]
    assert stats["masked_truncated"] == 1
    assert stats["truncated_stops"] == {"max_turns": 1, "max_tokens": 0}


def test_mask_truncated_leaves_masked_rows_out_of_the_batch_step():
    rows = _stopped(("a", 1, "answer"), ("a", 0, "answer"), ("a", 0, "max_tokens"),
                    ("b", 1, "answer"), ("b", 0, "engine_error"))
    out, stats = A.run(rows, "s", "bn-gspo", mask_truncated=True)
    # group step: a mean 1/3, std sqrt(1/3); b mean 1/2, std sqrt(1/2)
    sa, sb = math.sqrt(1 / 3) + 1e-6, math.sqrt(1 / 2) + 1e-6  # + eps_group
    group = [(2 / 3) / sa, (-1 / 3) / sa, (0.5) / sb, (-0.5) / sb]  # the four rows that train
    mu = sum(group) / 4
    sd = math.sqrt(sum((x - mu) ** 2 for x in group) / 4)  # population std
    want = [(x - mu) / (sd + 1e-9) for x in group]
    got = [r["advantage"] for r in out]
    assert got[:2] + got[3:] == approx(want, rel=1e-9) and got[2] == 0.0
    assert out[2]["masked"] == "truncated"
    assert "masked" not in out[4]  # an engine error is not a cut
    assert stats["masked_truncated"] == 1 and stats["truncated_stops"]["max_tokens"] == 1


def test_without_the_flag_nothing_is_masked_and_stale_marks_go():
    rows = _stopped(("a", 1, "answer"), ("a", 0, "max_turns"))
    rows[1][1]["masked"] = "truncated"  # from an earlier run with the flag
    out, stats = A.run(rows, "s", "grpo")
    assert [r["advantage"] for r in out] == approx([0.7071068, -0.7071068], rel=1e-5)
    assert "masked" not in out[1] and stats["masked_truncated"] == 0
    # the vectorised core: `masked` rows keep their reward in the statistics, get 0
    a = A.compute([1, 0, 0, 1], ["p"] * 4, "rloo", masked=[False, False, True, False])
    assert a.tolist() == approx([1 - 1 / 3, 0 - 2 / 3, 0.0, 1 - 1 / 3])


def test_mask_truncated_needs_the_stop_field():
    rows = _stopped(("a", 1, "answer"), ("a", 0, "answer"))
    rows[1][1].pop("stop")
    with pytest.raises(BadInput, match=r"s\.jsonl:2: stop: missing required field"):
        A.run(rows, "s.jsonl", mask_truncated=True)
    A.run(rows, "s.jsonl")  # not needed without the flag


# ------------------------------------------------------------------------------ CLI boundary


def _cli(*args: str, stdin: bytes | None = None, cwd: Path | None = None):
    return subprocess.run([sys.executable, "-m", "marscli", "advantages", *args], input=stdin,
                          check=False, capture_output=True, cwd=cwd, timeout=120)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


SCORED = [
    {"v": 1, "id": "q1#0", "prompt_id": "q1", "reward": {"total": 1.0, "judge": "exact"},
     "segments": [{"role": "model", "tokens": [1, 2]}], "zz_unknown": {"k": [None, 1.5, "é"]}},
    {"v": 1, "id": "q1#1", "prompt_id": "q1", "reward": {"total": 0.0}, "a_first": True},
    {"v": 1, "id": "q2#0", "prompt_id": "q2", "reward": {"total": 0.5}},
    {"v": 1, "id": "q2#1", "prompt_id": "q2", "reward": {"total": 1.5}},
]


def test_cli_writes_rows_and_sidecar(tmp_path):
    src = _write(tmp_path / "scored.jsonl", SCORED)
    out = tmp_path / "adv.jsonl"
    p = _cli(str(src), "-o", str(out), "--estimator", "grpo")
    assert p.returncode == 0, p.stderr
    assert p.stdout == b"" and b"4 rows in 2 groups" in p.stderr
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    for got, orig in zip(rows, SCORED):
        assert {k: got[k] for k in orig} == orig  # untouched
        assert list(got)[: len(orig)] == list(orig)  # key order kept
    assert [r["advantage"] for r in rows] == approx([0.7071, -0.7071, -0.7071, 0.7071], rel=1e-4)
    meta = orjson.loads((tmp_path / "adv.jsonl.meta.json").read_bytes())
    assert meta["stage"] == "advantages" and meta["stats"]["rows"] == 4
    assert meta["config"]["estimator"] == "grpo" and str(src) in meta["inputs"]


def test_cli_pipes_stdin_to_stdout(tmp_path):
    data = b"".join(orjson.dumps(r) + b"\n" for r in SCORED)
    p = _cli("-", "--minibatches", "2", stdin=data, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = [orjson.loads(line) for line in p.stdout.splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in SCORED]
    assert sorted(r["minibatch"] for r in rows) == [0, 0, 1, 1]
    assert list(tmp_path.iterdir()) == []  # no sidecar for stdout


def test_cli_missing_reward_exit_2_no_output(tmp_path):
    bad = [dict(r) for r in SCORED]
    bad[2] = {"v": 1, "id": "q2#0", "prompt_id": "q2", "reward": {"judge": "exact"}}
    src = _write(tmp_path / "scored.jsonl", bad)
    out = tmp_path / "adv.jsonl"
    p = _cli(str(src), "-o", str(out))
    assert p.returncode == 2 and p.stdout == b""
    err = p.stderr.decode().strip().splitlines()
    assert len(err) == 1 and f"{src}:3: reward.total" in err[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["scored.jsonl"]
    out.write_text("previous\n")  # a pre-existing output stays as it was
    assert _cli(str(src), "-o", str(out)).returncode == 2
    assert out.read_text() == "previous\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["adv.jsonl", "scored.jsonl"]


def test_cli_unknown_estimator_and_bad_minibatches(tmp_path):
    src = _write(tmp_path / "scored.jsonl", SCORED)
    p = _cli(str(src), "--estimator", "ppo")
    assert p.returncode == 2 and b"bn-gspo, dr-grpo, grpo, rloo" in p.stderr
    p = _cli(str(src), "--minibatches", "0")
    assert p.returncode == 2 and b"--minibatches" in p.stderr
    p = _cli(str(src), "--minibatches", "3")
    assert p.returncode == 2 and b"number of groups (2)" in p.stderr


def test_options_are_checked_by_the_library_before_reading(tmp_path):
    """A Python caller meets the CLI's checks, and the stage's come before the input is read
    (a bad option with a missing file names the option)."""
    from marscli.stages.advantages import main

    with pytest.raises(BadInput, match=r"^--minibatches: 0 is out of range — must be >= 1 and "
                                       r"<= 1048576$"):
        A.run(_rows(("a", 1), ("a", 0)), "s", minibatches=0)
    with pytest.raises(BadInput, match=r"^--minibatches: 2000000 is out of range"):
        main(str(tmp_path / "missing.jsonl"), minibatches=2_000_000)
    with pytest.raises(BadInput, match="unknown advantage estimator 'ppo'"):
        main(str(tmp_path / "missing.jsonl"), estimator="ppo")
    assert not list(tmp_path.iterdir())


def test_cli_path_never_imports_torch(tmp_path):
    src = _write(tmp_path / "scored.jsonl", SCORED)
    code = (
        "import sys\n"
        "import marscli.rl.advantages, marscli.cli\n"
        f"sys.argv = ['marscli', 'advantages', {str(src)!r}, '-o', {str(tmp_path / 'o.jsonl')!r}]\n"
        "try:\n    marscli.cli.main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == b"ok", p.stderr
    assert (tmp_path / "o.jsonl").exists()


def test_cli_mask_truncated_counts_in_the_sidecar(tmp_path):
    rows = [dict(r, stop=stop) for r, stop in zip(SCORED, ["answer", "max_turns", "max_tokens",
                                                           "answer"])]
    src = _write(tmp_path / "scored.jsonl", rows)
    out = tmp_path / "adv.jsonl"
    p = _cli(str(src), "-o", str(out), "--estimator", "grpo", "--mask-truncated")
    assert p.returncode == 0, p.stderr
    assert b"masked 2 truncated" in p.stderr
    got = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r.get("masked") for r in got] == [None, "truncated", "truncated", None]
    assert [r["advantage"] for r in got] == approx([0.7071, 0.0, 0.0, 0.7071], rel=1e-4)
    meta = orjson.loads((tmp_path / "adv.jsonl.meta.json").read_bytes())
    assert meta["config"]["mask_truncated"] is True
    assert meta["stats"]["masked_truncated"] == 2
    assert meta["stats"]["truncated_stops"] == {"max_turns": 1, "max_tokens": 1}
