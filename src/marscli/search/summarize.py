"""Condensing search results before the model reads them.

With an OpenAI-compatible chat endpoint, as the paper does: each page is summarised to at most
five sentences for the query, then those summaries are condensed into one. Without one, an
extractive summary: the sentences that share most words with the query, in page order, up to
a character budget (Google's snippets are already that short and pass through unchanged).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

from marscli.search import Hit, SearchOptions
from marscli.search.errors import SearchError
from marscli.search.text_index import STOPWORDS, WORD

_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_THINK = re.compile(r"<think(?:ing)?>.*?</think(?:ing)?>", re.DOTALL)


def _terms(text: str) -> set[str]:
    return {w.lower() for w in WORD.findall(text)} - STOPWORDS


def extractive(query: str, text: str, max_chars: int) -> str:
    """The query's best sentences of `text`, in order, within `max_chars` (' … ' marks gaps)."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    sents = [s.strip() for s in _SENTENCE.split(text) if s.strip()]
    q = _terms(query)
    ranked = sorted(range(len(sents)), key=lambda i: (-len(q & _terms(sents[i])), i))
    keep, used = [], 0
    for i in ranked:
        if used + len(sents[i]) + 3 > max_chars:
            continue
        keep.append(i)
        used += len(sents[i]) + 3
    if not keep:  # one sentence longer than the budget
        return sents[ranked[0]][: max_chars - 1] + "…"
    keep.sort()
    out = sents[keep[0]]
    for a, b in pairwise(keep):
        out += (" " if b == a + 1 else " … ") + sents[b]
    return out


PAGE_PROMPT = """Question or search query: {query}

Search result title: {title}
Content:
{text}

Summarise what this result says that helps answer the query, in at most five sentences. Keep \
names, dates and numbers exactly. If nothing is relevant, reply: No relevant information."""

CONDENSE_PROMPT = """Question or search query: {query}

Summaries of the search results:
{summaries}

Condense these into at most five sentences stating the facts that answer the query, citing \
results as [n]. If none is relevant, say so."""


class SummarizerError(SearchError):
    """The summariser failed (after its retries): the search call fails with it, and the tool
    counts it as a summariser failure."""


class LlmSummarizer:
    def __init__(self, url: str, model: str, opts: SearchOptions) -> None:
        url = url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model = model
        # Optional: a local vLLM server wants no key.
        key = os.environ.get("SUMMARIZER_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = opts.client()

    def chat(self, prompt: str) -> str:
        data = self.client.post_json(self.url, {
            "model": self.model, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0, "max_tokens": 512}, headers=self._headers)
        try:
            text = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise SearchError(f"summarizer: unexpected reply shape ({type(e).__name__}: {e})"
                              ) from None
        return _THINK.sub("", text or "").strip()

    def summarize(self, query: str, hits: list[Hit]) -> tuple[str, list[Hit]]:
        """(condensed summary, hits with each text replaced by its page summary);
        `SummarizerError` when the endpoint fails."""
        if not hits:
            return "", hits
        try:
            with ThreadPoolExecutor(len(hits)) as pool:
                pages = list(pool.map(lambda h: self.chat(PAGE_PROMPT.format(
                    query=query, title=h.title, text=h.text)), hits))
            summaries = "\n".join(f"[{i}] {s}" for i, s in enumerate(pages, 1))
            final = self.chat(CONDENSE_PROMPT.format(query=query, summaries=summaries))
        except SearchError as e:
            raise SummarizerError(str(e), e.reason, e.attempts, e.transient,
                                  timed_out=e.timed_out) from None
        return final, [Hit(h.title, s, h.url, h.score, h.fetched) for h, s in zip(hits, pages)]
