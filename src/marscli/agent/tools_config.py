"""Tool schemas from a file (`--tools-config FILE`): the release's tool YAML as it is, or JSON.

A released checkpoint answers best with the tool schemas it was trained on, rendered by its chat
template's `tools=`. `load_tool_schemas(path)` reads them:
- The release's verl tool config (its `config/tool_config/tools_train.yaml` / `tools_val.yaml`):
  `tools: [{class_name, config, tool_schema: {type: function, function: {name, description,
  parameters}}}]`. Only `tool_schema` is read; `class_name` and `config` (verl's backends, with
  OmegaConf `${oc.env:...}` strings) are ignored: marscli's own tools and backends run the calls.
- Each schema is reduced as verl reduces it before `apply_chat_template(tools=...)` (its pydantic
  `OpenAIFunctionToolSchema` then `model_dump(exclude_unset=True, exclude_none=True)`): a property
  keeps only `type`, `description`, `enum`; `items`, `minItems`, `maxItems` and any other key are
  dropped, null values are dropped, and keys come in verl's order (`type, function`; `name,
  description, parameters, strict`; `type, properties, required`). So the `# Tools` block marscli
  renders is byte for byte the one the released models saw. Missing `description`, `properties`
  or `required` are refused, as verl refuses them.
- A JSON list of OpenAI-style schemas (`[{"type": "function", "function": {...}}]`) is taken as
  written (checked, not reduced): the user chose every byte.
- Tool names must be marscli tools. The release uses `image_zoom_in_tool`, `text_search_tool`
  and `image_search_tool`, the same names as marscli's (`RELEASE_TOOLS` maps them); any other
  name, or a name listed twice, is refused with the list of known tools.
- Every problem is one BadInput line naming the file and the entry (`tools[1]
  (verl.tools.text_search_tool.TextSearchTool): tool_schema.function.description: ...`).
Reading YAML needs PyYAML (imported here only); JSON does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from marscli.errors import BadInput

# The release's tool names (its tools_*.yaml) -> marscli's registered tools.
RELEASE_TOOLS: dict[str, str] = {
    "image_zoom_in_tool": "image_zoom_in_tool",
    "text_search_tool": "text_search_tool",
    "image_search_tool": "image_search_tool",
}


class _Bad(Exception):
    """A problem at a dotted field path inside one entry."""

    def __init__(self, field: str, msg: str) -> None:
        super().__init__(f"{field}: {msg}")


def load_tool_schemas(path: str | Path) -> list[dict]:
    """The tool schemas of `path` (verl tool YAML or a JSON list), in file order."""
    doc = _read(Path(path))
    if isinstance(doc, dict) and "tools" in doc:
        entries, verl = doc["tools"], True
        if not isinstance(entries, list):
            raise BadInput(f"{path}: tools: expected a list of tool entries")
    elif isinstance(doc, list):
        entries, verl = doc, False
    else:
        raise BadInput(f"{path}: expected a verl tool config (a `tools:` list) or a JSON list "
                       "of OpenAI-style function schemas")
    labels = [_label(i, e, verl) for i, e in enumerate(entries)]
    schemas = [_entry(path, lab, e, verl) for lab, e in zip(labels, entries, strict=True)]
    _check_names(path, labels, schemas)
    return schemas


def _read(path: Path) -> Any:
    if not path.is_file():
        raise BadInput(f"--tools-config: {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"--tools-config: {path}: not UTF-8 text") from None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:
        import yaml
    except ImportError:
        raise BadInput(f"{path}: not JSON, and reading YAML needs PyYAML — pip install pyyaml"
                       ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise BadInput(f"{path}{where}: neither JSON nor YAML "
                       f"({getattr(e, 'problem', None) or e})") from None


def _label(i: int, entry: Any, verl: bool) -> str:
    """How messages name an entry: `tools[1] (verl.tools....TextSearchTool)` or `[1]`."""
    if not verl:
        return f"[{i}]"
    cls = entry.get("class_name") if isinstance(entry, dict) else None
    return f"tools[{i}] ({cls})" if isinstance(cls, str) else f"tools[{i}]"


def _entry(path: str | Path, label: str, entry: Any, verl: bool) -> dict:
    """One checked schema; verl entries reduced as verl reduces them."""
    try:
        if not verl:
            _check_tool(entry, "")
            return entry
        if not isinstance(entry, dict) or "tool_schema" not in entry:
            raise _Bad("tool_schema", "missing — each entry needs class_name, config, tool_schema")
        return _reduce_tool(entry["tool_schema"], "tool_schema.")
    except _Bad as e:
        raise BadInput(f"{path}: {label}: {e}") from None


def _mapping(x: Any, field: str) -> dict:
    if not isinstance(x, dict):
        raise _Bad(field, f"expected a mapping, got {type(x).__name__}")
    return x


def _string(x: Any, field: str) -> str:
    if not isinstance(x, str):
        raise _Bad(field, f"expected a string, got {x!r:.60}")
    return x


def _check_tool(tool: Any, at: str) -> None:
    """An OpenAI-style function schema: type "function", function.name, parameters an object."""
    tool = _mapping(tool, at.rstrip(".") or "entry")
    if tool.get("type") != "function":
        raise _Bad(f"{at}type", f'expected "function", got {tool.get("type")!r:.40}')
    fn = _mapping(tool.get("function"), f"{at}function")
    _string(fn.get("name"), f"{at}function.name")
    if "description" in fn:
        _string(fn["description"], f"{at}function.description")
    if "parameters" in fn:
        params = _mapping(fn["parameters"], f"{at}function.parameters")
        _mapping(params.get("properties", {}), f"{at}function.parameters.properties")


def _reduce_tool(tool: Any, at: str) -> dict:
    """verl's `OpenAIFunctionToolSchema(...).model_dump(exclude_unset=True, exclude_none=True)`."""
    tool = _mapping(tool, at.rstrip("."))
    fn = _mapping(tool.get("function"), f"{at}function")
    out_fn: dict[str, Any] = {"name": _string(fn.get("name"), f"{at}function.name"),
                              "description": _string(fn.get("description"),
                                                     f"{at}function.description")}
    if fn.get("parameters") is not None:
        out_fn["parameters"] = _reduce_parameters(fn["parameters"], f"{at}function.parameters")
    if fn.get("strict") is not None:
        if not isinstance(fn["strict"], bool):
            raise _Bad(f"{at}function.strict", "expected true or false")
        out_fn["strict"] = fn["strict"]
    return {"type": _string(tool.get("type"), f"{at}type"), "function": out_fn}


def _reduce_parameters(params: Any, at: str) -> dict:
    params = _mapping(params, at)
    props = _mapping(params.get("properties"), f"{at}.properties")
    required = params.get("required")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _Bad(f"{at}.required", f"expected a list of strings, got {required!r:.60}")
    props = {k: _reduce_property(v, f"{at}.properties.{k}") for k, v in props.items()}
    return {"type": _string(params.get("type"), f"{at}.type"), "properties": props,
            "required": required}


def _reduce_property(prop: Any, at: str) -> dict:
    """Only the fields verl's `OpenAIFunctionPropertySchema` has survive."""
    prop = _mapping(prop, at)
    out: dict[str, Any] = {"type": _string(prop.get("type"), f"{at}.type")}
    if prop.get("description") is not None:
        out["description"] = _string(prop["description"], f"{at}.description")
    if prop.get("enum") is not None:
        enum = prop["enum"]
        if not isinstance(enum, list) or not all(isinstance(v, str) for v in enum):
            raise _Bad(f"{at}.enum", "expected a list of strings")
        out["enum"] = enum
    return out


def _check_names(path: str | Path, labels: list[str], schemas: list[dict]) -> None:
    """Every tool is one marscli runs, listed once."""
    from marscli.tools import TOOLS

    known = TOOLS.names()
    seen: set[str] = set()
    for label, s in zip(labels, schemas, strict=True):
        name = s["function"]["name"]
        if RELEASE_TOOLS.get(name, name) not in known:
            raise BadInput(f"{path}: {label}: unknown tool {name!r} — marscli runs only: "
                           f"{', '.join(known)}")
        if name in seen:
            raise BadInput(f"{path}: {label}: tool {name!r} is listed twice — keep one")
        seen.add(name)
