"""Keeping secrets out of everything marscli records or prints.

`redact(obj)` drops secret-looking config values (`api_key`, `password`, ...) and the value of
any known API key variable wherever it appears, in nested dicts, lists and strings.
"""

from __future__ import annotations

import os
import re
from typing import Any

# Names of config keys holding credentials (`api_key`, `x-api-key`, `password`...), but not
# `max_new_tokens` or `num_key_value_heads`.
_SECRET_KEY = re.compile(r"(api[_-]?key|secret|password|passwd|authorization|bearer|"
                         r"access[_-]?token|auth[_-]?token|^token$|^key$)", re.I)
_SECRET_ENV = ("SERPER_API_KEY", "OPENAI_API_KEY", "JUDGE_API_KEY", "SUMMARIZER_API_KEY")


def redact(obj: Any) -> Any:
    """Drop secret-looking config values and any known API key's value, wherever it appears."""
    secrets = [os.environ[k] for k in _SECRET_ENV if os.environ.get(k)]
    if isinstance(obj, dict):
        return {k: ("<redacted>" if _SECRET_KEY.search(str(k)) and v else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        for s in secrets:
            obj = obj.replace(s, "<redacted>")
    return obj
