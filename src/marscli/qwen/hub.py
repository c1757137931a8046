"""Whether a policy named by its hub id can be had: a local folder or the local Hugging Face
cache answers at once, else the hub must answer within `HUB_PROBE_S` seconds, so an offline
machine fails in seconds rather than after the download's own retries (`marscli ask`)."""

from __future__ import annotations

import os
from pathlib import Path

from marscli.errors import RuntimeFailure

HUB_PROBE_S = 3.0  # how long an unreachable hub may keep `ask` waiting


def check_hub_policy(policy: str, timeout: float = HUB_PROBE_S) -> None:
    """A policy that is neither a local folder nor in the local HF cache needs the hub: fail
    in seconds when it cannot be reached (RuntimeFailure, one line), rather than after the
    download's own retries. A bad local path fails here too (`check_checkpoint`)."""
    from marscli.qwen.policy import check_checkpoint

    check_checkpoint(policy)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if Path(policy).exists() or offline or _in_hf_cache(policy):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    if not hub_reachable(endpoint, timeout):
        raise RuntimeFailure(
            f"--policy {policy}: not in the local cache and the hub ({endpoint}) is "
            "unreachable — pass --policy /path/to/checkpoint or set HF_HUB_OFFLINE=1")


def _in_hf_cache(repo_id: str) -> bool:
    """Whether the checkpoint's config is in the local Hugging Face cache (HF_HOME)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # without huggingface_hub transformers loads local folders only
        return False
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id: transformers gives its own error
        return True
    return isinstance(found, str)


def hub_reachable(endpoint: str, timeout: float) -> bool:
    """Any HTTP answer from the endpoint within `timeout` seconds, name lookup included (a
    401 or 404 is an answer: the hub is there, and the download will say what is wrong). The
    request runs in a daemon thread because socket timeouts do not bound DNS lookups."""
    import threading

    answered: list[bool] = []
    probe = threading.Thread(target=lambda: answered.append(_head(endpoint, timeout)),
                             daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(answered and answered[0])


def _head(endpoint: str, timeout: float) -> bool:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{endpoint}/api/models", method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):  # URLError, refused, timeout, DNS; a malformed endpoint
        return False
