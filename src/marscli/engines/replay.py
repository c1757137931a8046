"""The `replay` engine: replays scripted replies stored in each prompt row (`"replies": [...]`,
one string per assistant turn), tokenised with the policy's tokenizer.

Through the real agent loop and tools this turns scripted expert demonstrations (the toy
world's, or any teacher's text) into token-exact trajectories for `sft`, and it lets tests
drive the loop deterministically. Log-probs are not known: they are recorded as `null`
(`logprobs_mode` null too), never as 0, which would claim probability 1.
"""

from __future__ import annotations

from typing import Any

from marscli.engines import ENGINES, Generation, GenRequest, SamplingParams, check_policy
from marscli.errors import BadInput
from marscli.qwen.policy import check_checkpoint, load_processor
from marscli.qwen.tokens import special_ids


@ENGINES.register("replay")
class ReplayEngine:
    options: tuple[str, ...] = ()  # no options of its own
    logprobs_mode = None  # scripted text: no distribution behind it
    check_options = staticmethod(check_policy)

    def __init__(self, policy: str, **_: Any) -> None:
        self.processor = load_processor(check_checkpoint(policy))
        self.ids = special_ids(self.processor.tokenizer)

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        out = []
        for r in requests:
            replies = (r.row or {}).get("replies")
            if not isinstance(replies, list) or not all(isinstance(x, str) for x in replies):
                raise BadInput("--engine replay: every prompt row needs `replies`, a list of "
                               "strings (one per assistant turn)")
            text = replies[min(r.turn, len(replies) - 1)]
            toks = self.processor.tokenizer.encode(text, add_special_tokens=False)
            cap = r.max_new_tokens or params.max_new_tokens
            if len(toks) + 1 > cap:
                out.append(Generation(toks[:cap], None, "length"))
            else:
                out.append(Generation(toks + [self.ids.im_end], None, "stop"))
        return out
