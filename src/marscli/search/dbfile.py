"""A new SQLite index file, written the way every marscli output is.

`new_database(out)` refuses an output that is a folder or one of the stage's inputs (the
stage notes those it reads itself: `provenance.note_inputs`), holds the output's
lock (`locks.OutputLock`), builds the database at `OUT.tmp-PID` (in autocommit mode: the
caller opens its own transaction) and renames it onto OUT when the body ends well. On any
failure the temporary is removed; a full disk, which SQLite reports as `OperationalError`
rather than an `OSError`, becomes one line, and a read-only folder fails when the temporary is
created, as an `OSError` the CLI maps to one line.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from marscli.errors import RuntimeFailure
from marscli.records.locks import OutputLock
from marscli.records.outputs import check_writable, remove_stale_tmp, tmp_path
from marscli.records.provenance import check_not_input


@contextmanager
def new_database(out: Path) -> Iterator[sqlite3.Connection]:
    check_writable(out)
    check_not_input(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):
        tmp = tmp_path(out)
        remove_stale_tmp(out)  # what a killed run left
        tmp.unlink(missing_ok=True)
        tmp.touch()  # an unwritable folder fails here, as an OSError naming the file
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            yield db
            db.close()
            os.replace(tmp, out)
        except sqlite3.OperationalError as e:
            db.close()
            tmp.unlink(missing_ok=True)
            if "full" in str(e) or "disk I/O" in str(e):
                raise RuntimeFailure(f"{out}: no space left on the device — free space or pick "
                                     "another output folder") from None
            raise
        except BaseException:
            db.close()
            tmp.unlink(missing_ok=True)
            raise
