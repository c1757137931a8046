"""Keeping secrets out of everything marscli records or prints.

- `redact(obj)` drops secret-looking config values (`api_key`, `password`, ...) and, in every
  string of nested dicts and lists: the value of any known API key variable, the userinfo of a
  URL (`http://user:PW@host` -> `http://<redacted>@host`) and the value of a secret query
  parameter (`?key=`, `api_key=`, `token=`, `access_token=`, `secret=`, `password=`, `sig=`).
  It is applied to sidecars, to every HTTP error text, and to what the search tools show the
  model, so a password written into a URL on the command line is never recorded or echoed.
- `strip_userinfo(url)` drops the userinfo altogether, and `public(text)` does that and
  redacts the rest (cache keys: the same server answers the same whoever asks);
  `split_userinfo(url)` gives the URL without it and the (user, password) that the HTTP client
  sends as Basic auth instead.
- A userinfo is everything between `SCHEME://` and the last `@` before the host ends (`/`, `?`,
  `#` or whitespace), so a raw `@` inside a password is covered too.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote

# Names of config keys holding credentials (`api_key`, `x-api-key`, `password`...), but not
# `max_new_tokens` or `num_key_value_heads`.
_SECRET_KEY = re.compile(r"(api[_-]?key|secret|password|passwd|authorization|bearer|"
                         r"access[_-]?token|auth[_-]?token|^token$|^key$)", re.I)
_SECRET_ENV = ("SERPER_API_KEY", "OPENAI_API_KEY", "JUDGE_API_KEY", "SUMMARIZER_API_KEY")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/?#\s]*)@")
# `max_tokens=` and `tokens=` are not secrets: the name must end at `key`/`token`/...
_QUERY_SECRET = re.compile(r"(?i)([?&](?:key|sig|signature|[\w.-]*?(?:api[_-]?key|token|secret|"
                           r"passw(?:or)?d))=)[^&\s#\"'<>]*")
REDACTED = "<redacted>"


def redact(obj: Any) -> Any:
    """Drop secret-looking config values, known API keys' values, URL userinfo and secret query
    parameters, wherever they appear."""
    secrets = [os.environ[k] for k in _SECRET_ENV if os.environ.get(k)]
    return _redact(obj, secrets)


def _redact(obj: Any, secrets: list[str]) -> Any:
    if isinstance(obj, dict):
        return {k: (REDACTED if _SECRET_KEY.search(str(k)) and v else _redact(v, secrets))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact(v, secrets) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_redact(v, secrets) for v in obj)
    if isinstance(obj, str):
        for s in secrets:
            obj = obj.replace(s, REDACTED)
        if "@" in obj:
            obj = _USERINFO.sub(rf"\1{REDACTED}@", obj)
        if "=" in obj:
            obj = _QUERY_SECRET.sub(rf"\1{REDACTED}", obj)
    return obj


def public(text: str) -> str:
    """`text` as cache keys and sidecars may hold it: no userinfo at all, no secret query
    parameter, no known key."""
    return redact(strip_userinfo(text))


def strip_userinfo(text: str) -> str:
    """`text` with the userinfo of every URL in it removed (`http://u:p@h/` -> `http://h/`)."""
    return _USERINFO.sub(r"\1", text) if "@" in text else text


def split_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """(url without userinfo, (user, password) percent-decoded, or None if it had none)."""
    m = _USERINFO.match(url.strip())
    if m is None:
        return url, None
    user, _, password = m.group(2).partition(":")
    return m.group(1) + url.strip()[m.end():], (unquote(user), unquote(password))
