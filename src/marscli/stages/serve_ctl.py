"""`marscli serve-ctl URL sleep|wake|health`: sleep, wake or ask a `marscli serve` its health
(the client: engines/server.py's `ServeClient` and `control`); the reply as one JSON line."""

from __future__ import annotations

import sys

import orjson

from marscli.engines.server import CTL_ACTIONS, ServeClient, control
from marscli.errors import BadInput, check_range
from marscli.secrets import redact


def serve_ctl(url: str, action: str, policy: str | None = None, level: int | None = None,
              timeout: float = 600.0, retries: int = 8, if_awake: bool = False) -> dict:
    """`marscli serve-ctl URL sleep|wake|health`: the server's reply, also printed as one JSON
    line on stdout (for scripts: `make rl`'s loop); a server gone for good or refusing (4xx:
    asleep already, another architecture) is a RuntimeFailure, exit 1. Bounded: `timeout` is
    the total, retries included (a line on stderr per retry); a connect waits at most 10 s, and
    a refused one (nothing listens at that port) fails at once; `if_awake`: see `control`."""
    if not url.startswith(("http://", "https://")):
        raise BadInput(f"{redact(url)}: expected the server's http:// or https:// URL")
    if action not in CTL_ACTIONS:
        raise BadInput(f"unknown action {action!r} — choose one of: {', '.join(CTL_ACTIONS)}")
    if policy is not None and action != "wake":
        raise BadInput("--policy: only with wake (a rollout's --policy reloads an awake server)")
    if level is not None and action != "sleep":
        raise BadInput("--level: only with sleep")
    if if_awake and action != "sleep":
        raise BadInput("--if-awake: only with sleep")
    check_range("--timeout", timeout, 0, lo_open=True)
    check_range("--retries", retries, 0)
    client = ServeClient(url, timeout=timeout, retries=retries, refused_final=True,
                         progress="serve-ctl")
    reply = control(client, action, policy=policy, level=level, if_awake=if_awake)
    sys.stdout.write(orjson.dumps(reply).decode() + "\n")
    return reply
