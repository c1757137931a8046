"""`marscli state ACTION RUN K`: the RL loop's training state on node-local storage, as make
runs it (`make rl STATE_DIR=...`; docs/rl-loop.md). The work is train/persist.py's."""

from __future__ import annotations

from marscli.errors import unknown_name
from marscli.train import persist


def run_state(action: str, run: str, k: int, state: str | None = None, keep: int = 1,
              background: bool = False, lock_fd: int | None = None) -> None:
    """Check, redo-from, persist, settle, adopt or prune ckpt-K's state of RUN."""
    if action == "persist" and lock_fd is not None:  # the background copy's own process
        persist.persist_child(run, k, lock_fd)
        return
    actions = {"check": lambda: persist.check(run, k, state),
               "redo-from": lambda: print(persist.redo_from(run, k, state)),
               "persist": lambda: persist.persist(run, k, state, background),
               "settle": lambda: persist.settle(run, k, state),
               "adopt": lambda: persist.adopt(run, k, state),
               "prune": lambda: persist.prune(run, k, keep, state)}
    if action not in actions:
        raise unknown_name("state action", action, list(actions))
    actions[action]()
