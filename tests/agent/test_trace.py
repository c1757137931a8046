"""What people watch: `ask`'s live trace and record (run in-process through the replay engine),
the hub check that makes an offline `ask` fail in seconds, and the progress bar of rollout and
eval (fed synthetic agent events, rendered to a forced terminal)."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image
from rich.console import Console

from marscli.agent.generation import GenerationOptions
from marscli.agent.protocol import parse_turn
from marscli.errors import BadInput, RuntimeFailure
from marscli.records.provenance import sha256_file
from marscli.view.trace import LiveTrace, inline_image, inline_protocol, summary

from helpers import REPLIES, ZOOM_THEN_ANSWER, scene


def console(terminal: bool = False) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=120, highlight=False,
                   color_system=None), buf


def replay(tiny_model: Path, **kw) -> GenerationOptions:
    return GenerationOptions(engine="replay", policy=str(tiny_model), temperature=0.0, **kw)


# ----------------------------------------------------------------------------- ask's record


def test_ask_record_holds_absolute_image_paths(tiny_model, tmp_path, monkeypatch):
    """The crops folder is often a temporary one: a record whose paths are relative to it
    shows no images anywhere else. Paths are absolute (from any working directory), or
    relative to the folder the record is written into."""
    from marscli.stages.ask import ask

    img = scene(tmp_path / "scene.png")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rec = ask("../scene.png", "What colour?", replay(tiny_model, max_turns=3),
              crops_dir="crops", live=False, replies=ZOOM_THEN_ANSWER)
    paths = [Path(r["path"]) for r in rec["images"]]
    assert len(paths) == 2 and all(p.is_absolute() for p in paths)
    assert paths[0] == img.resolve()
    assert paths[1].parent == (tmp_path / "elsewhere" / "crops").resolve()
    assert [sha256_file(p) for p in paths] == [r["sha256"] for r in rec["images"]]

    out = tmp_path / "saved"
    rec = ask(str(img), "What colour?", replay(tiny_model, max_turns=3), crops_dir="crops",
              live=False, replies=ZOOM_THEN_ANSWER, rel_to=out)
    assert [(out / r["path"]).resolve() for r in rec["images"]] == \
        [img.resolve(), (tmp_path / "elsewhere" / "crops" / "ask#0-1.png").resolve()]


# ----------------------------------------------------------------------------- the live trace


def test_ask_trace_shows_header_turns_crop_and_answer(tiny_model, tmp_path):
    from marscli.stages.ask import ask

    img = scene(tmp_path / "scene.png", (640, 480))
    c, buf = console()
    rec = ask(str(img), "What colour is the corner?", replay(tiny_model, max_turns=3),
              crops_dir=str(tmp_path / "crops"), replies=ZOOM_THEN_ANSWER,
              trace=LiveTrace(c, inline=None))
    out = buf.getvalue()
    for want in (str(img), "640×480 px", "What colour is the corner?", str(tiny_model),
                 "engine replay", "turn 1", "→ image_zoom_in_tool", "tool response · "
                 "image_zoom_in_tool", str(tmp_path / "crops" / "ask#0-1.png"), "turn 2",
                 "answer"):
        assert want in out, (want, out)
    order = [out.index(s) for s in ("640×480", "turn 1", "Look closer.", "tool response",
                                    "ask#0-1.png", "turn 2", "<answer>red</answer>", "╭─ answer")]
    assert order == sorted(order), out
    assert out.count("turn ") == rec["turns"] == 2
    assert rec["final_answer"] == "red"


def traj(tid: str = "q#0", **kw) -> SimpleNamespace:
    """A stand-in for `agent.trajectory.Traj`: the fields the trace and the progress bar read."""
    kw = {"turns": 0, "files": [], "error": None, "gen_tokens": 0, "tool_calls": Counter(),
          "tool_errors": Counter(), "tool_failures": Counter(), "format_errors": 0, **kw}
    return SimpleNamespace(id=tid, **kw)


def model_event(trace, t, text: str) -> None:
    t.turns += 1
    trace("model", t, {"text": text, "action": parse_turn(text)})


def test_streamed_reply_is_shown_once_as_it_comes():
    """`text` deltas appear as they arrive, under the turn's number; the end-of-turn event
    then adds the parsed call, not the reply a second time."""
    c, buf = console()
    trace, t = LiveTrace(c, inline=None), traj()
    reply = ZOOM_THEN_ANSWER[0]
    trace("text", t, {"delta": reply[:20]})
    assert "turn 1" in buf.getvalue() and reply[:20] in buf.getvalue()
    trace("text", t, {"delta": reply[20:] + "<|im_end|>"})
    model_event(trace, t, reply)
    out = buf.getvalue()
    assert out.count("Look closer.") == 1 and out.count("turn ") == 1
    assert "<|im_end|>" not in out and "→ image_zoom_in_tool" in out
    # the next turn streams under its own number
    trace("text", t, {"delta": "<thinking>Red."})
    assert "turn 2" in buf.getvalue()


def test_format_error_label_sits_under_its_reply():
    """Every format error gets one label, right under the reply that made it (a cut-off
    answer too, which the parser does not see), and its error observation no panel."""
    c, buf = console()
    trace, t = LiveTrace(c, inline=None), traj()
    bad = REPLIES[2]  # unclosed JSON
    model_event(trace, t, bad)
    trace("tool", t, {"name": None, "args": None, "text": "error: bad JSON", "ok": False,
                      "images": []})
    cut = "<thinking>x</thinking><answer>red</answer>"  # stopped by the token cap
    model_event(trace, t, cut)
    trace("tool", t, {"name": None, "args": None, "text": "error: reply cut off before "
                      "<|im_end|>", "ok": False, "images": []})
    trace("stop", t, {"stop": "max_turns", "answer": None})
    out = buf.getvalue()
    assert out.count("format error:") == 2 and "tool response" not in out
    assert out.index(bad) < out.index("format error:") < out.index("turn 2")
    assert out.index(cut) < out.index("reply cut off") < out.index("stopped without an answer")


def test_tool_panel_summarises_and_names_the_crop(tmp_path):
    crop = tmp_path / "q#0-1.png"
    Image.new("RGB", (96, 64), (200, 30, 30)).save(crop)
    c, buf = console()
    trace, t = LiveTrace(c, inline=None), traj(files=[tmp_path / "in.png", crop])
    long = "\n".join(f"result {i}: " + "x" * 50 for i in range(30))
    trace("tool", t, {"name": "text_search_tool", "args": {}, "text": long, "ok": True,
                      "images": []})
    trace("tool", t, {"name": "image_zoom_in_tool", "args": {}, "text": "Zoomed.\n<image>",
                      "ok": True, "images": ["q#0-1.png"]})
    out = buf.getvalue()
    assert "result 7:" in out and "result 8:" not in out and "more characters" in out
    assert f"{crop}  96×64 px" in out and "<image>" not in out
    assert len(summary(long)) < 700


@pytest.mark.parametrize("env,terminal,want", [
    ({"TERM": "xterm-kitty"}, True, "kitty"),
    ({"TERM": "xterm-256color", "TERM_PROGRAM": "ghostty"}, True, "kitty"),
    ({"TERM_PROGRAM": "iTerm.app"}, True, "iterm"),
    ({"TERM_PROGRAM": "WezTerm"}, True, "iterm"),
    ({"TERM": "xterm-256color"}, True, None),
    ({"TERM": "screen", "TERM_PROGRAM": "tmux"}, True, None),
    ({"TERM": "xterm-kitty"}, False, None),  # piped or redirected: never escape codes
])
def test_inline_images_only_where_the_terminal_draws_them(env, terminal, want):
    assert inline_protocol(env, terminal) == want


def test_inline_image_sequences_carry_the_picture(tmp_path):
    """kitty: a=T,f=100 then base64 PNG in chunks of at most 4096 with m=1 on all but the
    last; iTerm2: one OSC 1337 File sequence with the byte size. Both decode to the picture,
    scaled to fit."""
    import random

    p = tmp_path / "crop.png"
    rng = random.Random(0)  # noise: the PNG spans several kitty chunks
    Image.frombytes("RGB", (600, 300), bytes(rng.randrange(256) for _ in range(540_000))).save(p)
    seq = inline_image(p, "kitty")
    chunks = seq.strip().split("\x1b\\")[:-1]
    assert chunks[0].startswith("\x1b_Ga=T,f=100,m=1;") and len(chunks) > 1
    assert all(c.startswith("\x1b_Gm=1;") for c in chunks[1:-1])
    assert chunks[-1].startswith("\x1b_Gm=0;")
    payload = [c.split(";", 1)[1] for c in chunks]
    assert all(len(x) <= 4096 for x in payload)
    im = Image.open(io.BytesIO(base64.b64decode("".join(payload))))
    assert im.size == (384, 192)
    it = inline_image(p, "iterm")
    head, data = it.removeprefix("\x1b]1337;File=").rstrip("\x07\n").split(":", 1)
    png = base64.b64decode(data)
    assert f"size={len(png)}" in head and "inline=1" in head
    assert Image.open(io.BytesIO(png)).size == (384, 192)


def test_trace_draws_crops_inline_when_told(tmp_path):
    crop = tmp_path / "c.png"
    Image.new("RGB", (50, 40)).save(crop)
    for inline, want in (("kitty", "\x1b_G"), ("iterm", "\x1b]1337;"), (None, None)):
        c, buf = console(terminal=True)
        LiveTrace(c, inline=inline)("tool", traj(files=[crop]), {
            "name": "image_zoom_in_tool", "args": {}, "text": "z", "ok": True, "images": ["c"]})
        assert (want in buf.getvalue()) if want else "\x1b_G" not in buf.getvalue()

def test_auto_inline_is_off_when_not_a_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-kitty")
    assert LiveTrace(console(terminal=False)[0]).inline is None
    assert LiveTrace(console(terminal=True)[0]).inline == "kitty"


# ----------------------------------------------------------------------------- hub policies


def test_hub_policy_unreachable_fails_in_seconds(monkeypatch, tmp_path):
    import huggingface_hub.constants as hc

    from marscli.qwen.hub import check_hub_policy

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as e:
        check_hub_policy("sensenova/SenseNova-MARS-8B")
    assert time.monotonic() - t0 < 4
    msg = str(e.value)
    assert "\n" not in msg and "not in the local cache" in msg and "http://127.0.0.1:9" in msg
    assert "--policy /path/to/checkpoint" in msg and "HF_HUB_OFFLINE=1" in msg
    # in the cache: no probe needed; HF_HUB_OFFLINE=1: transformers reads the cache itself
    snap = tmp_path / "hub" / "models--sensenova--SenseNova-MARS-8B"
    (snap / "snapshots" / "abc").mkdir(parents=True)
    (snap / "snapshots" / "abc" / "config.json").write_text("{}")
    (snap / "refs").mkdir()
    (snap / "refs" / "main").write_text("abc")
    check_hub_policy("sensenova/SenseNova-MARS-8B")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_hub_policy("other/not-cached")


def test_hub_probe_is_bounded_even_when_the_host_never_answers(monkeypatch):
    """A host that accepts and never replies (or a DNS lookup that hangs) still costs at most
    the timeout."""
    import socket

    from marscli.qwen.hub import hub_reachable

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        t0 = time.monotonic()
        assert not hub_reachable(f"http://127.0.0.1:{srv.getsockname()[1]}", 0.5)
        assert time.monotonic() - t0 < 1.5
    finally:
        srv.close()


def test_ask_with_the_default_policy_offline_fails_in_seconds(tmp_path):
    """The real command, default policy, no network and no HF_HUB_OFFLINE: one line, exit 1,
    well before the minutes of download retries (and before torch is imported)."""
    img = scene(tmp_path / "s.png")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), NO_COLOR="1")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "marscli", "ask", str(img), "What?"],
                         capture_output=True, text=True, env=env, timeout=60)
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "not in the local cache and the hub" in lines[0], res.stderr
    assert res.stdout == "" and took < 15, took


# ----------------------------------------------------------------------------- progress bars


def feed(on_event) -> None:
    """Four trajectories, three finished: 40 generated tokens, three tool calls (one an invalid
    call, one a backend failure), a format error and an engine error."""
    a, b, c, d = (traj(f"p#{i}") for i in range(4))
    for t, toks in ((a, 10), (b, 20), (c, 0), (d, 10)):
        t.gen_tokens += toks
        on_event("text", t, {"delta": "x"})  # streamed pieces carry no numbers
        on_event("model", t, {"text": "", "action": None})
    a.tool_calls["image_zoom_in_tool"] += 1
    on_event("tool", a, {"name": "image_zoom_in_tool", "ok": True, "images": []})
    b.tool_calls["image_zoom_in_tool"] += 1
    b.tool_errors["image_zoom_in_tool"] += 1
    on_event("tool", b, {"name": "image_zoom_in_tool", "ok": False, "images": []})
    b.tool_calls["text_search_tool"] += 1
    b.tool_failures["text_search_tool"] += 1
    on_event("tool", b, {"name": "text_search_tool", "ok": False, "images": []})
    d.format_errors += 1
    on_event("tool", d, {"name": None, "ok": False, "images": []})
    a.stop, b.stop, c.stop = "answer", "max_turns", "engine_error"
    for t in (a, b, c):
        on_event("stop", t, {"stop": t.stop, "answer": None})


def test_progress_bar_counts_what_the_events_say():
    from marscli.agent.progress import progress_bar

    c, buf = console(terminal=True)
    with progress_bar("rollout", 4, show=True, console=c) as on_event:
        feed(on_event)
    last = buf.getvalue().replace("\r", "\n").splitlines()[-2:]
    final = " ".join(last)
    assert "rollout" in final and "3/4" in final, final
    assert "3 calls" in final and "errors 2 model · 1 tool · 1 engine" in final
    assert "tok/s" in final and "eta" in final


def test_progress_bar_is_silent_off_a_terminal_or_when_not_shown():
    from marscli.agent.progress import progress_bar

    for terminal, show in ((False, True), (True, False)):
        c, buf = console(terminal=terminal)
        with progress_bar("eval", 4, show=show, console=c) as on_event:
            feed(on_event)
        assert buf.getvalue() == "", (terminal, show)


# ----------------------------------------------------------------------------- the demo


def test_ask_demo_zooms_on_the_sign_and_answers(tiny_model, tmp_path):
    """`make ask-demo`: the scene and expert replies of scripts/demo_image.py, replayed
    through the real zoom tool: the crop is the sign (its cream fill fills the middle) and
    the answer is what the sign says."""
    from marscli.stages.ask import ask, load_replies

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "scripts" / "demo_image.py"),
                          str(tmp_path / "scene.png"), "--replies", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    c, buf = console()
    rec = ask(str(tmp_path / "scene.png"), "What is written on the small sign?",
              replay(tiny_model), crops_dir=str(tmp_path / "crops"),
              replies=load_replies(str(tmp_path / "r.json")), trace=LiveTrace(c, inline=None))
    assert rec["final_answer"] == "EST. 1997" and rec["tool_calls"] == {"image_zoom_in_tool": 1}
    assert rec["format_errors"] == 0 and rec["stop"] == "answer"
    crop = Image.open(rec["images"][1]["path"]).convert("RGB")
    w, h = crop.size
    cream = sum(crop.getpixel((x, y)) == (240, 230, 200)
                for x in range(w // 4, 3 * w // 4, 4) for y in range(h // 4, 3 * h // 4, 4))
    assert cream > 0.5 * (w // 8) * (h // 8)
    out = buf.getvalue()
    assert "3840×2160 px" in out and "→ image_zoom_in_tool" in out and "EST. 1997" in out


@pytest.mark.parametrize("content,msg", [
    (None, "no such file"), ("{not json", "not a JSON file"), ('{"a": 1}', "JSON list of "
     "strings"), ("[]", "non-empty"), ('["ok", 3]', "JSON list of strings")])
def test_replies_file_errors_are_one_line(tmp_path, content, msg):
    from marscli.stages.ask import load_replies

    p = tmp_path / "r.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(BadInput, match=rf"^--replies: {re.escape(str(p))}: .*{msg}") as e:
        load_replies(str(p))
    assert "\n" not in str(e.value)


def test_replies_go_with_the_replay_engine_only(tiny_model, tmp_path):
    from marscli.stages.ask import ask

    img = scene(tmp_path / "s.png")
    with pytest.raises(BadInput, match=r"^--replies: required with --engine replay"):
        ask(str(img), "q", replay(tiny_model), live=False)
    with pytest.raises(BadInput, match=r"^--replies: scripted turns are for --engine "
                                       r"replay, not hf"):
        ask(str(img), "q", GenerationOptions(policy=str(tiny_model)), live=False,
            replies=["<answer>x</answer>"])
