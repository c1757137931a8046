"""`marscli inspect`'s and `marscli report`'s options, each declared once (light: the CLI
imports it for --help)."""

from __future__ import annotations

from dataclasses import dataclass

from marscli.options import option


@dataclass
class InspectConfig:
    ids: list[str] | None = option(
        None, "Only this trajectory id; repeatable.", decls=("--id",), metavar="ID")
    where: list[str] | None = option(
        None, "FIELD OP VALUE filter, dotted paths, OP in == != >= <= > <, e.g. "
              "reward.accuracy==0, turns>3, tool_calls.image_zoom_in_tool>=1; repeatable "
              "(ANDed); a missing field never matches.", metavar="EXPR")
    limit: int | None = option(None, "Stop after N matches.")
    as_json: bool = option(
        False, "Print the matching records as JSONL (pipe them to another stage).",
        decls=("--json",))
    as_ids: bool = option(False, "Print the matching ids, one a line.", decls=("--ids",))


@dataclass
class ReportConfig:
    max_trajectories: int = option(
        200, "Trajectories shown at most, split evenly over the iterations.")
    image_px: int = option(
        512, "Embedded images are downscaled to this many pixels on their longer side.")
    page_title: str | None = option(
        None, "Page title (default: the run's name).", decls=("--title",))
