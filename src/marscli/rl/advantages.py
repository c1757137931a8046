"""Advantages: one scalar per trajectory from the rewards of its group (pure numpy, no torch).

BN-GSPO (the paper's estimator) normalises twice. Group step, within the G samples of a prompt:
Ā_i = (r_i − mean_g) / (std_g + 1e-6), std unbiased (ddof=1). Batch step, over the batch:
Ã_i = (Ā_i − mean_B Ā) / (std_B Ā + 1e-9), std population (ddof=0). Every estimator in
`ESTIMATORS` shares one signature and works on one minibatch; `compute` runs it per minibatch and
`run` turns scored rows into advantage rows (stages/advantages.py reads and writes them).

Rows that `reward` left unscored (a judge failure it tolerated under `--max-unscored`) are
left out: they are not in the output, their groups are the scored rows only, and the sidecar
and the stderr line count them (`unscored_rows`). Every row unscored is bad input. Rows that
rollout refused (`stop: "prompt_too_long"`: no generation; `reward` scored them 0) are left out
the same way (`prompt_too_long_rows`): they have no token to train on, and as every sample of
a prompt shares its prompt, their whole group goes.

`--mask-truncated` (off by default, as Mini-o3's over-turn masking): a trajectory that the turn
limit or the response-token budget stopped (`stop` "max_turns" or "max_tokens", agent.py) was cut
off, not finished, and its reward says nothing about the policy's answer. It keeps its reward in
its group's statistics (mean, std, RLOO's leave-one-out mean: its siblings are still compared
with all G samples), takes no part in the batch step (bn-gspo normalises over the rows that
train), and gets advantage 0 and `"masked": "truncated"`; `update` leaves such rows out of the
loss and of its token and sequence counts (DAPO's overlong filtering), so the finished rows of
a batch are not diluted by the long cut-off ones. The sidecar counts them.

Where marscli departs from the paper or the released code (verl `core_algos.py`), and why:
1. A group of one sample gets advantage 0 under every estimator. The released code gives it
   mean 0 and std 1, so its advantage is its raw reward: a sample with no siblings has no
   baseline, and a raw reward of a different scale would dominate the batch step.
2. Scope of the batch step. The released code applies it once to the whole training batch,
   before that batch is cut into PPO minibatches. marscli applies it to the input file
   (`--minibatches 1`, the default, which reproduces the released code when one file is one
   batch), or, with `--minibatches M`, within each of M minibatches of whole groups, assigned by
   a seeded shuffle and recorded in the `minibatch` field so that `update` uses the same split.
3. Statistics are computed in float64 (the released code uses float32 or the reward dtype).
4. `--filter-zero-std` (off by default) drops groups whose rewards are all equal, groups of one
   included, before the batch step, as DAPO's dynamic sampling does but without resampling.
   Such groups carry no learning signal yet would shift the batch mean and shrink its std.
5. A flat group (every reward equal, a group of one included) gets advantage exactly 0 under
   every estimator, also after the batch step. In exact arithmetic it is 0 anyway (the group
   step's values of a batch sum to 0); in floating point the batch mean is ~1e-17, which would
   give every flat row a tiny advantage that `update` trains on. With `--mask-truncated` the
   batch mean is not 0 even in exact arithmetic; flat groups still get 0 (no signal).
6. The advantage is one number per trajectory. Broadcasting it over tokens with the loss mask
   (model tokens 1, prompt and tool tokens 0) happens in `update`, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from marscli.errors import BadInput, check_range
from marscli.records.jsonl import get_field
from marscli.registry import Registry

# fn(rewards [N], group_index [N] in 0..n_groups-1, n_groups, eps_group, eps_batch, live [N])
# -> [N]. Every row takes part in the group statistics; a batch step uses the `live` rows only
# (the others are masked: their values are ignored and written as 0).
Estimator = Callable[[np.ndarray, np.ndarray, int, float, float, np.ndarray], np.ndarray]
ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")
TRUNCATED_STOPS = ("max_turns", "max_tokens")  # agent.py: the turn limit, the token budget
PROMPT_TOO_LONG = "prompt_too_long"  # a row rollout refused: no tokens generated, left out
MAX_MINIBATCHES = 1 << 20  # --minibatches
EPS_GROUP, EPS_BATCH = 1e-6, 1e-9  # the group step's and the batch step's std epsilon
# The largest |reward.total| taken: squared deviations (4e300) summed over any batch stay
# finite in float64. marscli's rewards are 0 to 1.5; an external scorer's may be larger.
MAX_REWARD = 1e150


def group_stats(r: np.ndarray, g: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Per-group size, sum, mean and unbiased std; each [n]. A group whose rewards are all equal
    (a group of one included) gets exactly that reward as mean and exactly 0 as std, where
    sum / size would be off by rounding (3 × 0.1)."""
    size = np.bincount(g, minlength=n)  # [n]
    total = np.bincount(g, weights=r, minlength=n)  # [n]
    lo, hi = np.full(n, np.inf), np.full(n, -np.inf)  # [n]
    np.minimum.at(lo, g, r)
    np.maximum.at(hi, g, r)
    mean = np.where(lo == hi, lo, total / np.maximum(size, 1))  # [n]
    dev = r - mean[g]  # [N], two passes: stable where E[x²] − E[x]² is not
    ss = np.bincount(g, weights=dev * dev, minlength=n)  # [n]
    std = np.sqrt(ss / np.maximum(size - 1, 1))  # [n]
    return size, total, mean, std


@ESTIMATORS.register("bn-gspo")
def bn_gspo(r: np.ndarray, g: np.ndarray, n: int, eps_group: float, eps_batch: float,
            live: np.ndarray) -> np.ndarray:
    a = grpo(r, g, n, eps_group, eps_batch, live)  # [N] group step, every row
    if not live.any():
        return a
    b = a[live]  # [L] batch step over the rows that train, population std
    return (a - b.mean()) / (b.std() + eps_batch)


@ESTIMATORS.register("grpo")
def grpo(r: np.ndarray, g: np.ndarray, n: int, eps_group: float, eps_batch: float,
         live: np.ndarray) -> np.ndarray:
    _, _, mean, std = group_stats(r, g, n)
    return (r - mean[g]) / (std[g] + eps_group)  # a group of one: (r − r) / eps = 0


@ESTIMATORS.register("dr-grpo")
def dr_grpo(r: np.ndarray, g: np.ndarray, n: int, eps_group: float, eps_batch: float,
            live: np.ndarray) -> np.ndarray:
    _, _, mean, _ = group_stats(r, g, n)
    return r - mean[g]


@ESTIMATORS.register("rloo")
def rloo(r: np.ndarray, g: np.ndarray, n: int, eps_group: float, eps_batch: float,
         live: np.ndarray) -> np.ndarray:
    size, total, _, _ = group_stats(r, g, n)
    k = size[g]  # [N]
    others = (total[g] - r) / np.maximum(k - 1, 1)  # mean of the other k − 1 samples
    return np.where(k > 1, r - others, 0.0)


def codes(ids: Sequence[Hashable] | np.ndarray) -> tuple[np.ndarray, int]:
    """Dense indices 0..n-1 for arbitrary hashable ids: sorted order for a numeric array,
    order of first appearance otherwise."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iub":
        uniq, idx = np.unique(ids, return_inverse=True)
        return idx.reshape(-1).astype(np.int64), len(uniq)
    seen: dict[Hashable, int] = {}
    items = ids.tolist() if isinstance(ids, np.ndarray) else ids
    idx = np.fromiter((seen.setdefault(x, len(seen)) for x in items), np.int64, len(items))
    return idx, len(seen)


def compute(rewards: Sequence[float] | np.ndarray, group_ids: Sequence[Hashable] | np.ndarray,
            estimator: str = "bn-gspo",
            minibatch_ids: Sequence[Hashable] | np.ndarray | None = None,
            eps_group: float = EPS_GROUP, eps_batch: float = EPS_BATCH,
            masked: Sequence[bool] | np.ndarray | None = None) -> np.ndarray:
    """Advantages [N] (float64, input order); the estimator runs within each minibatch.
    `masked` [N]: rows that keep their reward in the group statistics but get advantage 0.
    A flat group (all rewards equal, a group of one included) gets exactly 0: it carries no
    signal, where the batch step's mean, 0 in exact arithmetic, would leave ~1e-17."""
    fn = ESTIMATORS.get(estimator)
    r = np.asarray(rewards, dtype=np.float64)  # [N]
    if len(group_ids) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(group_ids)} group ids")
    live = np.ones(len(r), bool) if masked is None else ~np.asarray(masked, bool)  # [N]
    if len(live) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(live)} masked flags")
    gid, n = codes(group_ids)  # [N]
    signal = live & (group_stats(r, gid, n)[3] > 0)[gid]  # [N] live rows of groups not flat
    if minibatch_ids is None:
        return np.where(signal, fn(r, gid, n, eps_group, eps_batch, live), 0.0)
    mb, _ = codes(minibatch_ids)  # [N]
    if len(mb) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(mb)} minibatch ids")
    order = np.argsort(mb, kind="stable")  # rows grouped by minibatch
    cuts = np.flatnonzero(np.diff(mb[order])) + 1
    out = np.empty_like(r)
    for rows in np.split(order, cuts):  # a loop over minibatches, not rows
        _, g = np.unique(gid[rows], return_inverse=True)
        out[rows] = fn(r[rows], g.reshape(-1), int(g.max()) + 1, eps_group, eps_batch, live[rows])
    return np.where(signal, out, 0.0)


def assign_minibatches(prompt_ids: Sequence[Hashable] | np.ndarray, m: int,
                       seed: int) -> np.ndarray:
    """Minibatch index [N] in 0..m-1, keeping each prompt's group whole.

    Groups are shuffled (numpy Generator, `seed`), stably sorted by size, largest first, and dealt
    out in snake order (0..m-1, m-1..0, ...): group counts differ by at most one, and row counts
    are equal when groups are and close otherwise.
    """
    g, n = codes(prompt_ids)
    if not 1 <= m <= n:
        raise BadInput(f"--minibatches: {m} is out of range — must be between 1 and the "
                       f"number of groups ({n})")
    size = np.bincount(g, minlength=n)  # [n]
    perm = np.random.default_rng(seed).permutation(n)  # [n] groups in shuffled order
    perm = perm[np.argsort(-size[perm], kind="stable")]
    k = np.arange(n) % (2 * m)
    slot = np.where(k < m, k, 2 * m - 1 - k)  # snake: 0,1,..,m-1,m-1,..,0
    of_group = np.empty(n, np.int64)
    of_group[perm] = slot
    return of_group[g]


def _validate(rows: list[tuple[int, dict]], src: str,
              stops: bool = False) -> tuple[list[str], np.ndarray, list[str | None]]:
    first: dict[str, int] = {}
    pids: list[str] = []
    stop: list[str | None] = []
    rewards = np.empty(len(rows), np.float64)
    for i, (line, row) in enumerate(rows):
        rid, pid, reward = row.get("id"), row.get("prompt_id"), row.get("reward")
        total = reward.get("total") if type(reward) is dict else None
        if (type(rid) is str and type(pid) is str and type(total) in (float, int)
                and -MAX_REWARD <= total <= MAX_REWARD and not stops
                and rid not in first):  # the common row, without get_field's walk
            first[rid] = line
            pids.append(pid)
            rewards[i] = total
            stop.append(None)
            continue
        rid = get_field(row, "id", str, src, line)
        if rid in first:
            raise BadInput(f"{src}:{line}: id: duplicate id {rid!r} (first at line {first[rid]}) "
                           f"— each trajectory must appear once")
        first[rid] = line
        pids.append(get_field(row, "prompt_id", str, src, line))
        rewards[i] = _reward(get_field(row, "reward.total", (int, float), src, line), src, line)
        stop.append(get_field(row, "stop", str, src, line) if stops else None)
    return pids, rewards, stop


def _reward(total: float, src: str, line: int) -> float:
    """A reward the group statistics can square: (r - mean)^2 of ±1e308 overflows float64
    to inf, and every advantage of the group (and, through the batch step, of the batch)
    would come out nan or 0."""
    if not -MAX_REWARD <= total <= MAX_REWARD:
        raise BadInput(f"{src}:{line}: reward.total: {total!r} is beyond ±{MAX_REWARD:g} — "
                       "group statistics overflow; check the reward that wrote it")
    return total


def _canonical(rows: list[tuple[int, dict]], pids: list[str], r: np.ndarray,
               stop: list[str | None]) -> tuple[list, list[str], np.ndarray, list]:
    """Rows by (prompt_id, sample, id). A rollout appends trajectories as its engine finishes
    them, and a concurrent engine (vLLM, servers, shards merged) finishes them in an order that
    changes from run to run: ordered here, the minibatch split and the update that follows
    depend on the seed alone. A single-process rollout's file is already in this order."""
    def key(i: int) -> tuple:
        sample = rows[i][1].get("sample")
        return pids[i], sample if isinstance(sample, int) else -1, rows[i][1]["id"]
    order = sorted(range(len(rows)), key=key)
    return [rows[i] for i in order], [pids[i] for i in order], r[order], [stop[i] for i in order]


def is_unscored(row: dict) -> bool:
    """`reward` left the row unscored (its judge failed, within `--max-unscored`)."""
    reward = row.get("reward")
    return isinstance(reward, dict) and reward.get("status") == "unscored"


def check_options(estimator: str, minibatches: int) -> None:
    """BadInput naming the option: M in 1..MAX_MINIBATCHES (at most the number of groups:
    `assign_minibatches`), a registered estimator."""
    check_range("--minibatches", minibatches, 1, MAX_MINIBATCHES)
    ESTIMATORS.get(estimator)


def _trainable(rows: list[tuple[int, dict]], src: str) -> tuple[list[tuple[int, dict]], int, int]:
    """The rows that can train: neither unscored nor refused by rollout (`PROMPT_TOO_LONG`),
    with how many of each were left out. BadInput when none is left, naming which kind took
    them all, so that the fix it suggests is the right one."""
    scored = [(line, row) for line, row in rows if not is_unscored(row)]
    unscored = len(rows) - len(scored)
    if not scored:
        raise BadInput(f"{src}: all {len(rows)} rows are unscored — re-run `marscli reward` "
                       "once the judge works")
    rows = scored
    too_long = sum(row.get("stop") == PROMPT_TOO_LONG for _, row in rows)
    if too_long == len(rows):
        raise BadInput(f"{src}: all {len(rows)} scored rows are stop {PROMPT_TOO_LONG} (rollout "
                       "refused their prompts) — nothing to train on: raise --max-prompt-tokens "
                       "or shorten the prompts")
    rows = [(line, row) for line, row in rows if row.get("stop") != PROMPT_TOO_LONG]
    return rows, unscored, too_long


def _annotate(row: dict, advantage: float, group: dict, minibatch: int | None,
              truncated: bool) -> dict:
    """`row` with its advantage, its group's statistics, its minibatch and its mask. Fields
    that an earlier run of this stage wrote and this one does not are removed: the row may
    come from a file that stage already annotated."""
    row["advantage"] = advantage
    row["group"] = group
    if minibatch is not None:
        row["minibatch"] = minibatch
    else:
        row.pop("minibatch", None)  # a stale split from an earlier run would mislead update
    if truncated:
        row["masked"] = "truncated"
    elif row.get("masked") == "truncated":
        row.pop("masked")  # stale, from an earlier run with --mask-truncated
    return row


def _pooled_std(r: np.ndarray, g: np.ndarray, mean: np.ndarray, std: np.ndarray,
                kept: np.ndarray, cut: np.ndarray) -> float | None:
    """The std of the group step's advantages over the rows that train (None: no such row).
    BN-GSPO's mechanism, measured: the batch step divides the group-normalised advantages by
    their pooled std, which flat groups (all zeros) pull below 1."""
    group_step = np.where(std[g] > 0, (r - mean[g]) / (std[g] + EPS_GROUP), 0.0)[kept]  # [K]
    train = group_step[~cut[kept]]
    return float(train.std()) if train.size else None


def run(rows: list[tuple[int, dict]], src: str, estimator: str = "bn-gspo", minibatches: int = 1,
        filter_zero_std: bool = False, seed: int = 0,
        mask_truncated: bool = False) -> tuple[list[dict], dict]:
    """Scored rows → the same rows (dicts updated in place, in `_canonical` order) with `advantage`,
    `group`, when M > 1 `minibatch`, and with `mask_truncated` `"masked": "truncated"` on rows
    the turn limit or the token budget stopped; also the stage statistics for the sidecar.
    Unscored rows are left out (and counted): groups are made of the scored rows only."""
    check_options(estimator, minibatches)  # before looking at the data
    rows, unscored, too_long = _trainable(rows, src)
    pids, r, stop = _validate(rows, src, stops=mask_truncated)
    rows, pids, r, stop = _canonical(rows, pids, r, stop)
    cut = np.array([s in TRUNCATED_STOPS for s in stop], bool)  # [N] all False without the flag
    g, n = codes(pids)
    size, _, mean, std = group_stats(r, g, n)
    flat = std == 0  # [n] all rewards equal (groups of one included), exactly: see group_stats
    keep = ~flat[g] if filter_zero_std else np.ones(len(r), bool)  # [N]
    if not keep.any():
        raise BadInput(f"{src}: all {n} groups have equal rewards, so --filter-zero-std dropped "
                       f"every row — drop the flag or sample more per prompt")
    kept = np.flatnonzero(keep)
    mb = assign_minibatches(g[kept], minibatches, seed) if minibatches > 1 else None
    adv = compute(r[kept], g[kept], estimator, mb, masked=cut[kept])  # [K]
    out: list[dict] = []
    for j, i in enumerate(kept.tolist()):
        gi = g[i]
        group = {"mean": float(mean[gi]), "std": float(std[gi]), "size": int(size[gi])}
        out.append(_annotate(rows[i][1], float(adv[j]), group,
                             int(mb[j]) if mb is not None else None, bool(cut[i])))
    n_kept = int(np.unique(g[kept]).size)
    pooled_std = _pooled_std(r, g, mean, std, kept, cut)
    stats = {
        "estimator": estimator,
        "groups": n_kept,
        "rows": len(out),
        "unscored_rows": unscored,
        "prompt_too_long_rows": too_long,
        "dropped_groups": n - n_kept,
        "dropped_rows": len(r) - len(out),
        "zero_std_groups": int(flat.sum()),
        "pooled_std": pooled_std,
        "masked_truncated": int(cut[kept].sum()),
        "truncated_stops": {s: sum(1 for i in kept.tolist() if stop[i] == s)
                            for s in TRUNCATED_STOPS} if mask_truncated else {},
        "reward_mean": float(r[kept].mean()),
        "advantage_mean": float(adv.mean()),
        "advantage_std": float(adv.std()),
        "minibatch_rows": np.bincount(mb, minlength=minibatches).tolist() if mb is not None
        else [len(out)],
    }
    return out, stats
