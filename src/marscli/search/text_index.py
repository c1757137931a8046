"""`local:PATH` text search: a SQLite FTS5 index with BM25 ranking, no server, no new dependency.

The corpus is JSONL rows `{id, title, text}`; Search-R1's `{id, contents: "\"Title\"\\ntext"}`
(wiki-18) is accepted as it is. The build streams rows in batches inside one transaction (a
21M-passage corpus never sits in memory) into `OUT.tmp-PID`, then renames, so a bad row at
line 9,000,000 leaves no index behind.

Queries are never passed to FTS5's query language: the user's words are cut into tokens, each
quoted, and OR-ed, so quotes, AND, *, ( and : are just text. BM25 then ranks documents that
match more (and rarer) terms first. Common English stop words are dropped when the query has
other words: on a Wikipedia-sized index, "the" alone would make every query scan millions of rows.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path

from marscli.errors import BadInput
from marscli.records.jsonl import get_field, iter_rows
from marscli.records.provenance import note_inputs, stage_inputs
from marscli.search import TEXT_BACKENDS, Hit, SearchOptions, need_arg
from marscli.search.dbfile import new_database

FORMAT = "marscli-text-index-1"
BATCH = 2000
MAX_TERMS = 32
WORD = re.compile(r"\w+", re.UNICODE)
STOPWORDS = frozenset(
    ["a", "an", "and", "are", "as", "at", "be", "by", "for", "from",
     "has", "have", "in", "is", "it", "its", "of", "on", "or", "that",
     "the", "this", "to", "was", "were", "what", "when", "where", "which", "who",
     "whom", "whose", "why", "how", "with", "did", "does", "do"])


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1's `"Title"\\ntext` → (title, text)."""
    first, _, rest = contents.partition("\n")
    return first.strip().strip('"'), rest.strip()


def _doc(row: dict, src: str, line: int) -> tuple[str, str, str]:
    doc_id = get_field(row, "id", (str, int), src, line)
    if "text" not in row and isinstance(row.get("contents"), str):
        title, text = split_contents(row["contents"])
    else:
        text = get_field(row, "text", str, src, line)
        title = get_field(row, "title", str, src, line, default="")
    return str(doc_id), title, text


@stage_inputs()
def build_text_index(corpus: str, out: str | Path, *, progress: bool = True) -> int:
    """Index a JSONL corpus into an FTS5 database at `out` (atomically); return the row count."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    out = Path(out)
    console = Console(stderr=True)
    n = 0
    note_inputs(corpus)  # read inside the database's body: refused as the output before that
    with new_database(out) as db:
        # A fresh file renamed at the end: no journal needed; a crash leaves only the tmp.
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)")
        db.execute("CREATE VIRTUAL TABLE docs USING fts5(title, text, doc_id UNINDEXED, "
                   "tokenize='porter unicode61 remove_diacritics 2')")
        db.execute("BEGIN")
        batch: list[tuple[str, str, str]] = []
        with Progress(SpinnerColumn(), TextColumn("indexing {task.completed:,} rows"),
                      TimeElapsedColumn(), console=console, transient=True,
                      disable=not (progress and console.is_terminal)) as bar:
            task = bar.add_task("index", total=None)
            for line, row in iter_rows(corpus):
                doc_id, title, text = _doc(row, corpus, line)
                batch.append((title, text, doc_id))
                if len(batch) >= BATCH:
                    db.executemany("INSERT INTO docs(title, text, doc_id) VALUES (?,?,?)", batch)
                    n += len(batch)
                    bar.update(task, completed=n)
                    batch.clear()
            db.executemany("INSERT INTO docs(title, text, doc_id) VALUES (?,?,?)", batch)
            n += len(batch)
        if n == 0:
            raise BadInput(f"{corpus}: empty corpus — expected rows {{id, title, text}}")
        db.executemany("INSERT INTO meta VALUES (?,?)", [("format", FORMAT), ("rows", str(n))])
        db.execute("COMMIT")
        db.execute("INSERT INTO docs(docs) VALUES ('optimize')")  # merge b-trees: faster queries
    return n


def fts_query(query: str) -> str | None:
    """The user's words as a safe FTS5 expression: `"w1" OR "w2" ...`; None if no words."""
    words = [w.lower() for w in WORD.findall(query)]
    content = [w for w in words if w not in STOPWORDS] or words
    terms = list(dict.fromkeys(content))[:MAX_TERMS]  # dedupe, keep order
    # \w tokens hold no double quote, so quoting cannot be broken out of.
    return " OR ".join(f'"{t}"' for t in terms) or None


class LocalTextBackend:
    cacheable = False

    def __init__(self, path: str, title_weight: float = 2.0) -> None:
        p = Path(path)
        if not p.is_file():
            raise BadInput(f"{path}: text index not found — build it with "
                           f"`marscli index text CORPUS.jsonl -o {path}`")
        self.path = p.resolve()
        self.spec = f"local:{path}"
        self.title_weight = title_weight
        self._local = threading.local()  # sqlite connections are per thread
        try:
            fmt = self._db().execute("SELECT value FROM meta WHERE key='format'").fetchone()
        except sqlite3.DatabaseError:
            fmt = None
        if not fmt or fmt[0] != FORMAT:
            raise BadInput(f"{path}: not a marscli text index — build one with "
                           "`marscli index text CORPUS.jsonl -o INDEX`")

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True,
                                                  check_same_thread=False)
        return db

    def search(self, query: str, k: int) -> list[Hit]:
        expr = fts_query(query)
        if expr is None:
            return []
        rows = self._db().execute(
            "SELECT title, snippet(docs, 1, '', '', ' … ', 48), text, bm25(docs, ?, 1.0) AS s "
            "FROM docs WHERE docs MATCH ? ORDER BY s LIMIT ?",
            (self.title_weight, expr, k)).fetchall()
        # snippet() is empty when only the title matched: fall back to the passage's start.
        return [Hit(title=t, text=snip.strip() or text[:300], score=-s)
                for t, snip, text, s in rows]


@TEXT_BACKENDS.register("local")
def _local(arg: str | None, opts: SearchOptions) -> LocalTextBackend:
    return LocalTextBackend(need_arg("local", arg, "path"))
