"""`data` reverse image search: the prompt row's precomputed results, as MARS trains.

marscli rows carry `image_search: [{"title", "thumbnail"}]`; MARS rows carry
`image_search_title_list` and `image_search_thumbnail_list`. Thumbnail paths are relative to
the row file's folder, which the agent puts in `row["_base"]`; URLs pass through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from marscli.errors import BadInput
from marscli.search import IMAGE_BACKENDS, ImageHit, SearchOptions, no_arg


def _resolve(thumb: str, base: Path) -> str:
    if thumb.startswith(("http://", "https://")):
        return thumb
    return str(base / thumb)  # an absolute `thumb` stays absolute


def row_results(row: dict) -> list[tuple[str, str]]:
    """(title, thumbnail as written) pairs of a row, either form; BadInput names the field."""
    if "image_search" in row:
        items = row["image_search"]
        if not isinstance(items, list) or not all(
                isinstance(i, dict) and isinstance(i.get("title"), str)
                and isinstance(i.get("thumbnail"), str) for i in items):
            raise BadInput("image_search: expected a list of {\"title\": str, \"thumbnail\": str}"
                           + (f" (row {row['id']})" if "id" in row else ""))
        return [(i["title"], i["thumbnail"]) for i in items]
    titles = row.get("image_search_title_list") or []
    thumbs = row.get("image_search_thumbnail_list") or []
    if not (isinstance(titles, list) and isinstance(thumbs, list)
            and all(isinstance(x, str) for x in titles + thumbs)):
        raise BadInput("image_search_title_list / image_search_thumbnail_list: expected lists "
                       "of strings")
    return list(zip(titles, thumbs))


class DataImageBackend:
    spec = "data"

    def find(self, ctx: Any, k: int) -> list[ImageHit]:
        row = ctx.row or {}
        base = Path(row.get("_base") or ".")
        # the row's results were searched before training: the release's image-search cache
        return [ImageHit(t, _resolve(th, base), cached=True) for t, th in row_results(row)[:k]]


@IMAGE_BACKENDS.register("data")
def _data(arg: str | None, opts: SearchOptions) -> DataImageBackend:
    no_arg("data", arg)
    return DataImageBackend()
