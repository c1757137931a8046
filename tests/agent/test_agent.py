"""The agent loop's token-exact contract: concatenated segment tokens equal the processor's
own tokenisation of the rendered conversation, and the loss mask equals the chat template's
assistant mask, token by token — including multi-image turns with crops of different sizes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from marscli.agent.loop import Agent, AgentConfig
from marscli.engines import SamplingParams
from marscli.qwen.tokens import assemble, compact, expand, image_features, special_ids
from marscli.records.schema import Prompt
from marscli.tools import build_tools

from helpers import REPLIES, big_scene, messages_of, recorded_vs_forward
from scripted import ScriptedEngine


@pytest.fixture(scope="module")
def scripted_run(tiny_model, tmp_path_factory):
    from marscli.qwen.policy import load_processor

    tmp = tmp_path_factory.mktemp("agent")
    big_scene(tmp / "scene.png")
    proc = load_processor(str(tiny_model))
    engine = ScriptedEngine(proc, REPLIES)
    cfg = AgentConfig(max_turns=10, sampling=SamplingParams())
    agent = Agent(engine, build_tools(), cfg, media_dir=tmp / "crops", rel_to=tmp)
    prompt = Prompt(id="q/../1", question="What year is on the sign?", images=["scene.png"],
                    answer=["1997"], base=tmp)
    rec = next(agent.run([(prompt, 0)]))
    return rec, proc, tmp


def test_scripted_trajectory_shape(scripted_run):
    rec, _, tmp = scripted_run
    roles = [s["role"] for s in rec["segments"]]
    assert roles == ["prompt"] + ["model", "tool"] * 6 + ["model"]
    assert rec["stop"] == "answer" and rec["final_answer"] == "1997" and rec["turns"] == 7
    assert rec["tool_calls"] == {"image_zoom_in_tool": 4, "no_such_tool": 1}
    assert rec["tool_errors"] == {"image_zoom_in_tool": 2, "no_such_tool": 1}
    assert rec["format_errors"] == 1
    oks = [s["ok"] for s in rec["segments"] if s["role"] == "tool"]
    assert oks == [True, True, False, False, False, False]
    assert len(rec["images"]) == 3 and rec["images"][2]["from"] == 1
    # crops are written inside the media folder whatever the id says
    for im in rec["images"][1:]:
        p = (tmp / im["path"]).resolve()
        assert p.parent == (tmp / "crops").resolve() and p.is_file()


def test_crop_of_crop_is_cut_from_source(scripted_run):
    rec, _, tmp = scripted_run
    crop2 = np.asarray(Image.open(tmp / rec["images"][2]["path"]).convert("RGB"))
    # image 1 = bottom-right quadrant; its top-left [0..500]x[0..250] is the green block
    assert crop2.shape[0] * crop2.shape[1] >= 65_536
    assert crop2.shape[0] % 32 == 0 and crop2.shape[1] % 32 == 0
    green = (crop2[..., 1] > 150) & (crop2[..., 0] < 100)
    assert green.mean() > 0.95


def test_token_exact_against_processor(scripted_run):
    rec, proc, tmp = scripted_run
    rec = {**rec, "_base": str(tmp)}
    ids = special_ids(proc.tokenizer)
    ours = assemble(rec["segments"], ids.image_pad)
    msgs, images = messages_of(rec, proc)
    text = proc.apply_chat_template(msgs, tokenize=False)
    theirs = proc(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    # the template closes the last message with "\n"; a trajectory ends at <|im_end|>
    newline = proc.tokenizer.encode("\n", add_special_tokens=False)
    assert theirs[-1:] == newline
    assert ours.input_ids == theirs[:-1]
    # the loss mask equals the template's assistant mask (placeholders collapsed to one)
    tmpl = proc.tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
    collapsed = [1 if t < 0 else 0 for t in compact(ours.input_ids, ids.image_pad)]
    mask_c = [m for m, t in zip(ours.loss_mask, ours.input_ids) if t != ids.image_pad]
    ids_c = [t if t >= 0 else ids.image_pad for t in compact(ours.input_ids, ids.image_pad)]
    assert ids_c == tmpl["input_ids"][:-1]
    assert len(mask_c) + sum(collapsed) == len(ids_c)  # one placeholder per image remains
    mask_full = []
    it = iter(mask_c)
    for t in ids_c:
        mask_full.append(0 if t == ids.image_pad else next(it))
    assert mask_full == tmpl["assistant_masks"][:-1]
    # model segments end in <|im_end|> and are exactly the masked tokens
    model_toks = [t for s in rec["segments"] if s["role"] == "model" for t in s["tokens"]]
    assert [t for t, m in zip(ours.input_ids, ours.loss_mask) if m] == model_toks


def test_tiny_model_rollout_logprobs_match_forward(tiny_model, tmp_path):
    """Log-probs recorded while sampling equal a teacher-forced forward over the same tokens,
    so rollout and training agree on Qwen's 3-D positions with several images."""

    from marscli.engines import make_engine

    img = big_scene(tmp_path / "scene.png")
    eng = make_engine("hf", str(tiny_model))
    cfg = AgentConfig(max_turns=2, max_turn_tokens=24, sampling=SamplingParams(seed=3))
    agent = Agent(eng, build_tools(), cfg, media_dir=tmp_path / "crops", rel_to=tmp_path)
    prompts = [Prompt(id=f"p{i}", question="Where is the green box?", images=[img.name],
                      answer=["x"], base=tmp_path) for i in range(2)]
    recs = list(agent.run([(p, s) for p in prompts for s in range(2)]))
    assert len(recs) == 4 and len({r["id"] for r in recs}) == 4
    ids = special_ids(eng.processor.tokenizer)
    for rec in recs:
        got, want = recorded_vs_forward(eng.model, eng.processor, rec, tmp_path)
        assert len(got) == len(want) > 0
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
        feats = [image_features(eng.processor,
                                Image.open(tmp_path / rec["images"][0]["path"]).convert("RGB"))]
        for s in rec["segments"]:
            assert min(s["tokens"]) >= -100_000 and max(s["tokens"]) < len(eng.processor.tokenizer)
        prompt_ids = expand(rec["segments"][0]["tokens"], ids.image_pad)
        assert prompt_ids.count(ids.image_pad) == feats[0].n_tokens
