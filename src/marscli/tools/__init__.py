"""Tools the agent can call, registered by their protocol name.

A tool is a class with a `name`, an OpenAI-style function `schema`, and
`__call__(args, ctx) -> ToolResult`. It never raises on the model's mistakes: bad arguments give
`ToolResult(ok=False, text="error: ...")`, an observation the model sees and the format reward
counts. Backends (search) are configured when the tool is built, by `build_tools`.

A tool with a backend says how the backend did in `ToolResult.health`, counts of `HEALTH_KEYS`
for this one call; the agent adds them up per tool into the trajectory's `tool_health`, which
eval's summary reads (docs/evaluation.md "Tool health").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from PIL import Image

from marscli.registry import Registry


@dataclass
class ConvImage:
    """An image of the conversation. Crops keep the box in their root image's pixels, so a
    crop of a crop is still cut from the full-resolution source."""

    image: Image.Image  # what the model sees (already resized for crops)
    ref: dict  # the trajectory's `images[i]` entry: path, sha256, from, bbox_2d, title...
    root: int = 0  # index of the full-resolution source image this one was cut from
    box: tuple[float, float, float, float] | None = None  # in root pixels; None: whole root
    source: Image.Image | None = None  # full-resolution pixels (roots only)


@dataclass
class ToolContext:
    images: list[ConvImage]
    row: dict = field(default_factory=dict)  # the prompt row (data-driven image search reads it)


@dataclass
class NewImage:
    image: Image.Image
    meta: dict  # provenance written into the trajectory's images entry (from, bbox_2d, title)
    root: int | None = None
    box: tuple[float, float, float, float] | None = None


# What `ToolResult.health` may count, for one call:
# - `backend_error`, `timeout`: the backend failed after its retries (the last attempt timed
#   out, or anything else); `empty`: it answered with nothing. One of the three per call at
#   most; the first two are also `failed` (no format-reward cost), `empty` is not.
# - `cache_hits`: answered from stored results (the search cache; for image search also the
#   row's precomputed results, the release's image-search cache) rather than a live search.
# - `pages_fetched`, `pages_ok`: pages a search tried to read, and read (serper +pages).
# - `summarizer_failures`: the summariser failed (the call then fails too).
HEALTH_KEYS = ("backend_error", "timeout", "empty", "cache_hits", "pages_fetched", "pages_ok",
               "summarizer_failures")
FAILURE_KINDS = HEALTH_KEYS[:3]


@dataclass
class ToolResult:
    text: str
    images: list[NewImage] = field(default_factory=list)
    ok: bool = True
    # With ok=False: True when a backend failed (network, server) rather than the model
    # erring. Backend failures are recorded and counted but cost no format reward.
    failed: bool = False
    health: dict[str, int] = field(default_factory=dict)  # HEALTH_KEYS counts of this call
    # Interleaving: text may contain "<image>" markers, one per entry of `images`, to place
    # each image; without markers images follow the text.


class Tool(Protocol):
    name: str
    schema: dict

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult: ...


def function_schema(name: str, description: str, properties: dict | None = None,
                    required: tuple[str, ...] = ()) -> dict:
    """A tool's OpenAI-style function schema, as the `# Tools` block and chat templates list it."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties or {},
                       "required": list(required)}}}


# The paper's three tools, in the order the system prompt lists them.
TOOL_NAMES = ("image_zoom_in_tool", "text_search_tool", "image_search_tool")
TOOLS: Registry[type] = Registry("tool", lazy={
    "image_zoom_in_tool": "marscli.tools.zoom",
    "text_search_tool": "marscli.tools.search",
    "image_search_tool": "marscli.tools.search",
})


def error(msg: str) -> ToolResult:
    """The model's mistake, as an observation."""
    return ToolResult(text=f"error: {msg}", ok=False)


def failure(msg: str) -> ToolResult:
    """A backend's failure (after bounded retries), as an observation."""
    return ToolResult(text=f"search failed: {msg}", ok=False, failed=True,
                      health={"backend_error": 1})


def build_tools(text_search: str | None = None, image_search: str | None = None,
                **backend_opts: Any) -> list[Tool]:
    """The tools offered to the model: zoom-in always; search tools when a backend is set."""
    tools: list[Tool] = [TOOLS.get("image_zoom_in_tool")()]
    if text_search:
        tools.append(TOOLS.get("text_search_tool")(text_search, **backend_opts))
    if image_search:
        tools.append(TOOLS.get("image_search_tool")(image_search, **backend_opts))
    return tools
