# recipes/tiny.mk — the CPU recipes' common part: the toy world and a small random Qwen3-VL,
# minutes on 2 cores. `make demo` runs recipes/tiny-sees.mk, which includes this file and starts
# from a tiny VLM that already sees (recipes/tiny-vlm; levers g-ab below: what each bought).
#
# Departures from the paper (recipes/mars-8b.mk has its settings), each for the 10-minute CPU budget:
#  1. Policy: the 1.2 M-parameter random Qwen3-VL (`tiny-model --size tiny`) whose tokenizer is
#     trained on the toy world's text, instead of Qwen3-VL-8B/32B-Instruct. `--size small`
#     (5.6 M) trained 3.4x slower per SFT step, with about the same loss after 3 epochs (0.165
#     against 0.178): it does not fit the budget.
#  2. Data: the generated toy world instead of the MARS training mix, with perception questions
#     only (shape colour, shape or letter of a small logo in a 1024x1024 scene: zoom, then
#     answer). KINDS=perception,knowledge,both (the demo's default, recipes/tiny-sees.mk) adds
#     the search questions (knowledge: text search; both: image search, then text search) and
#     the two search tools.
#  3. Prompt: a 42-token system prompt (recipes/toy-system.txt) instead of the 160-token default,
#     and only the zoom tool's schema: with the default prompt and three schemas a trajectory
#     was ~700 tokens, 460 of them system prompt, and the tiny model's attention at the answer
#     stayed spread over all of them (it never learned to copy a word 4 tokens back).
#  4. Cold start: scripted expert trajectories replayed through the real tools, not a teacher
#     model; the expert zooms on the logo's cell of the 4x4 grid. (With `--zoom-cells 2` it zooms
#     on the quadrant: SFT reached 16.7% on the test split, and 5 RL iterations only 17.7%.)
#  5. Scale: PROMPTS_PER_ITER prompts x N samples per iteration, short replies (MAX_TURN_TOKENS),
#     at most MAX_TURNS turns, instead of 128 x 8 with 16k-token responses.
#  6. Optimiser: a learning rate of 1e-4 instead of 1e-6 (a random small model needs far larger
#     steps), AdamW's state carried across iterations (`update --keep-optimizer`, as verl's
#     trainer keeps it), 4 minibatches (4 optimiser steps) per iteration, and no KL term (the
#     paper's 1e-4 barely acts in a few iterations; the reference forward costs a third of an
#     update). Measured on the same SFT model, 4 iterations, test accuracy after SFT 9.4%:
#     fresh AdamW at 3e-4 collapsed the policy after one iteration (113 of 128 rollouts looped
#     to the turn limit); fresh at 1e-4 gave 14.6/13.5/13.5/14.6%; carried at 1e-4
#     14.6/11.5/15.6/19.8% (per-step approx. KL under 0.005, no clipping).
#  7. Reward: exact match only (format weight 0, where `reward`'s default is 0.5 and the paper
#     adds a format term). A format term pays a direct answer (which cannot break the format)
#     over a zoom whose call, sampled at temperature 1, sometimes does, so while zooming buys no
#     accuracy the policy learns to stop zooming: with 0.5 an earlier recipe did; with 0.2 and the
#     perception pre-training below, rollouts without a zoom went 15 -> 127 of 128 in 5
#     iterations. Same SFT model, one RL seed, 4 iterations: format weight 0.2 ended at 10.4%
#     test accuracy (SFT 15.6%), 0 at 17.7%.
#  8. Pixels: the tiny processor sees at most 224x224 per image (49 tokens).
#  9. Rollout correction off (`update --rollout-is off`; the paper's recipes truncate token
#     weights at 2): the HF engine samples in float32 from the trainer's own forward
#     (logprob_mismatch 1.9e-7), so there is no gap to correct, and off keeps the demo's numbers
#     bit-identical to those before the option existed.

# Why RL does not yet improve this agent much (issue 19): its accuracy is where it looks (zoom hit
# rate) times what it reads there, and the 1.2 M model learns neither well from 240 expert
# trajectories. Measured on 2 cores (test split, greedy; one seed each unless said):
#  a. It does not read the crop: after SFT, p(gold answer) on its own training trajectories was
#     0.152 with the true crop and 0.141 with another row's crop. The zoom box's digits (one
#     token each) carry 57% of the SFT loss and drown the one answer token.
#  b. It does not localise: zoom hit rate 9.4% after SFT (chance 1/16: 6.3%), and accuracy given a
#     hit (11%) no better than given a miss (16%).
#  c. More expert data did not help in budget: 960 rows x 3 epochs gave 6.2% (grid 4) and 12.5%
#     (grid 3), against 15.6% for 240 x 8. The quadrant zoom (--zoom-cells 2, 480 rows x 5 epochs)
#     broke the tool-call format at temperature 1 (37 of 128 rollouts without a valid zoom).
#  d. Stronger RL collapses the format: lr 1e-3 took rollout accuracy 9.4% -> 0.8% (format reward
#     0.167 -> 0.008) in one iteration; 3e-4 with 8 minibatches 9.4% -> 5.5%.
#  e. Perception pre-training (PERCEIVE=n: toy/perceive.py, the random model first reads crops and
#     names the logo's box, loss on the short answers only, as a pretrained VLM would have): on a
#     3x3 grid (WORLD_OPTS --grid 3, PERCEIVE=720) SFT reached about 21%, and reads the crop now
#     (accuracy 40% given a hit, 19% given a miss), but hits stay at chance (10%), so zooming buys
#     little and RL with a format weight of 0.2 unlearned it (see 7). Reading learns slowly: 360
#     steps gave colour 44%, shape 28%, letter 25% on held-out crops (a flat 60 px square's colour
#     takes 100 steps). Off by default (it adds ~2 minutes).
#  f. Seeing is a plateau with a late, random exit. The tiny model learns a global colour at once
#     but a small object only when it is about one merged vision token (32 px of the model's
#     view) and, even then, after a plateau at the answers' marginal whose length varies by seed:
#     `marscli sft` on the grounding rows alone of 480 quadrant scenes (toy-world --zoom-cells 2
#     --clutter 0, 256x256 view) for 300 steps still gave one box for 76 of 96 test scenes.
#     What got out of it: `make tiny-vlm` (below), each phase measured by
#     `scripts/perception_probe.py WORLD POLICY` on the demo's 96 held-out test scenes
#     (grounding = the exact quadrant, chance 25%; reading = the word from the expert's crop,
#     chance about 20%). Measured on the same commands run by hand (before the target existed):
#       1. all rows, 8 epochs (2000 steps, 12.5 min): grounding 97.9%, reading 24.0% (one word
#          per question: grounding's 13 loss tokens outweigh reading's 2);
#       2. the reading rows alone, 8 epochs (1000 steps, 5.3 min): reading 43.8%, grounding 0.0%
#          (forgotten: it answers "where" with a colour);
#       3. all rows with the reading rows twice more, 1 epoch (500 steps, 3.2 min): grounding
#          90.6%, reading 46.9% (colour 56.2, shape 46.9, letter 37.5);
#       4. the skill did not carry over into the agent's format: a cold start from model 3 on the
#          demo's trajectories (vision frozen, perception rows mixed in) zoomed on boxes that hit
#          31-38% of the time (chance 25%). Phase 4 (1000 expert trajectories in the agent's own
#          format + 1000 reading rows, vision frozen, 2 epochs, 2.4 min) fixed that: after the
#          same cold start (DIRECT=0.7) its sampled zooms hit 53-62% and read 56-88% given a hit.
#     About 27 minutes buy a model that sees: more than the 10-minute demo holds. RL from it
#     (one seed each, 6 iterations, the issue's note) raised the rollouts' accuracy (35.9 ->
#     42.2% with DIRECT=0.7, 33.6 -> 46.9% with 0.5) but by reading better from the whole scene,
#     not by zooming more: the greedy policy never zoomed, and its test accuracy went 37.5 ->
#     34.4% and 34.4 -> 31.2% after 6 iterations (one question is 1.04 points), because at the
#     256x256 view the scene's logo (25-41 px, about one vision token, the size this model learns
#     best) is legible without a zoom. At a 128x128 view only the zoom makes it that size:
#     `make tiny-vlm VLM_RUN=runs/vlm128 VLM_MODEL_OPTS='--size tiny --min-pixels 16384
#     --max-pixels 16384 --seed 0'` (12 min 50 s) gave after phase 3 grounding 83.3%, reading
#     87.5% (colour 90.6, shape 81.2, letter 90.6), after phase 4 reading 92.7%. But in the
#     agent's format (greedy, the test split: `marscli eval WORLD/test.jsonl --policy
#     runs/vlm128 --mode agent` with EVAL_OPTS) it zoomed on every question, hit the logo 30% of
#     the time and read 31% of its hits right: 17.7%. Two epochs of phase 4 teach the protocol,
#     not yet the skills inside it; after a cold start with DIRECT=0.7 (direct answers at chance
#     now, 13-20%) 4 RL iterations left the test accuracy at 19.8 -> 20.8%. Six epochs
#     (VLM_AGENT_EPOCHS=6, 4.1 min of phase 4): hits 44%, 50% of them read right, 32.3% in all,
#     and still rising; twelve (8.4 min): hits 85%, 88% of them read right, 82.3% in all. From
#     that model, recipes/tiny-sees.mk (cold start DIRECT=0.7, vision frozen) and 8 RL
#     iterations: the greedy SFT model never zooms (test 34.4%); RL raised the zoom share of the
#     rollouts from 19% to 55%, and ckpt-8 zooms on every question: test 73.6 +- 3.0% over 3 RL
#     seeds (72.9 / 75.0 / 72.9). That model is now committed and the demo's start (g).
# What made the demo learn (recipes/tiny-sees.mk, `make demo`), lever by lever, with what each
# bought (2 cores; greedy test accuracy on the 96 test questions unless said):
#  g. A policy that sees, committed (recipes/tiny-vlm, 4.7 MB): `make tiny-vlm` (above, ~17 min)
#     at a 128x128 view, phase 4 for 12 epochs. Bought: the zooms of the greedy agent hit the
#     logo 85% of the time and read 88% of their hits (82.3% in all), where the random model's
#     hit at chance. RL's job is then where and when to zoom, as in MARS from Qwen3-VL-Instruct.
#  h. The 128x128 view (the processor's max-pixels 16384): the scene's logo (12-20 px) is below
#     one vision token, the zoom's crop (25-41 px) about one. At 256x256 the logo was legible
#     without a zoom and RL improved direct answers instead (greedy never zoomed; 37.5 -> 34.4%).
#  i. Phase 4 in the agent's own format, 12 epochs instead of 2 (8.4 min instead of 2.4): the
#     greedy agent's accuracy 17.7% (2 epochs) -> 32.3% (6) -> 82.3% (12).
#  j. A cold start that under-uses the tool (`toy-world --direct 0.7`: 70% of the 240 expert rows
#     answer without a zoom) with the vision tower frozen (`sft --freeze-vision`; unfrozen at lr
#     2e-3 the reading was lost): the SFT model never zooms (test 34.4%: direct answers at the
#     answers' marginal), so what RL must learn is exactly when to zoom. With quadrant zoom
#     boxes (--zoom-cells 2) and no clutter (--clutter 0), the pre-training's world.
#  k. Twelve cheaper iterations instead of 4 (one iteration is ~20 s on 2 cores: 16 prompts x 8
#     samples, 4 optimiser steps), the test split every second checkpoint (DEMO_EVAL_EVERY): in
#     8-iteration runs two of three seeds were still at the SFT model's accuracy at iteration 4
#     and flipped to zooming by iteration 8; twelve leave a margin for slower seeds.
#  The result (`make demo SEEDS=3`, README): see recipes/tiny-sees.mk's header.
#  l. Search, and worlds never seen (issue 35; not reached). Measured on 2 cores, one RL seed:
#     `make demo KINDS=perception,knowledge,both` from the committed model: the cold start's 24
#     search rows per kind do not teach the protocol (iteration 0's rollouts: perception 18.8%,
#     knowledge 2.5%, both 2.5%; garbled search turns). `make tiny-vlm VLM_GENERAL=1` (44 min:
#     worlds disjoint from the demo's, 24 logos, three kinds, a tokenizer of no world's names):
#     phase 1 never left its plateau (loss 0.16 for 2000 steps), after phase 3 grounding 21.9%
#     (one box), reading 40.6%; after phase 4, greedy on its own world's test scenes, perception
#     37.5%, knowledge 25.0%, both 9.4%; the demo from it (VLM=runs/vlm35, 4 iterations) could
#     not copy names it never saw: rollouts 8.6 -> 3.9%, test per kind 21.9/6.2/6.2% (SFT) ->
#     12.5/6.2/3.1%.
#  m. The search protocol on top of the committed model (`make tiny-vlm-search`, 6 min 45 s:
#     1200 expert trajectories of the three kinds on world 1001, 8 companies, no logo of the
#     demo's worlds). Greedy on world 1001's test scenes: perception 62.5% (zoom hits 53%),
#     knowledge 62.5% (every query names the company), both 25.0% (the right company in 34%).
#     The demo from it (`make demo VLM=runs/tiny-vlm-search KINDS=perception,knowledge,both`,
#     9 min 11 s, one seed): greedy test per kind 40.6 / 6.2 / 6.2% (SFT) -> 21.9 / 9.4 / 15.6%
#     (iteration 12), no tool called greedily; the sampled searches name the wrong company
#     (found in 5% of the knowledge rollouts at iteration 0, 0-3% later): with 8 companies the
#     search world let the model memorise their names rather than copy the one asked, and the
#     demo's names are single tokens it had only seen in another role.
#  n. The same with 40 companies (`make tiny-vlm-search SEARCH_RUN=runs/s40 SEARCH_ENTITIES=40`,
#     measured when the target trained on one world and was measured on its test scenes): the
#     greedy queries name the asked company in 3 of 32 knowledge questions (knowledge 3.1%,
#     both 0.0%, perception 15.6%): the model does not learn to copy a name of several tokens
#     in 1200 trajectories x 6 epochs, so m's 62.5% was the 8 names memorised.
#  o. Copying is learned from many names, not from many examples of a few. The random 1.2 M
#     model with a tokenizer of syllables (every name 2 tokens), the knowledge kind only, 2000
#     expert trajectories x 6 epochs either way, greedy on the 96 questions of world 1999 (40
#     companies it never saw):
#       marscli toy-world runs/syl-world --entities 8 --train 1 --test 1 --sft 1 --seed 1000 \
#         --avoid-seeds 0,1,2 --avoid-entities 8
#       marscli tiny-model runs/syl --text runs/syl-world/syllables.txt --size tiny \
#         --min-pixels 16384 --max-pixels 16384 --seed 0
#       make tiny-vlm-search VLM=runs/syl SEARCH_RUN=runs/copy-many SEARCH_KINDS=knowledge \
#         SEARCH_WORLDS=50 SEARCH_PER_WORLD=40 SEARCH_ENTITIES=40 SEARCH_FROZEN=
#     50 worlds (1912 distinct companies): the query names the asked company in 100.0% of
#     the questions, 89.6% answered right. At the target's default for a model that sees
#     (no SEARCH_FROZEN=: cosine rate, vision frozen) 0.0% and 0.0%: copying comes after a
#     plateau (the constant rate's epoch loss fell 0.76 -> 0.065 over epochs 3-6; the cosine
#     rate's ended at 0.51, on it). By hand, the same commands with worlds
#     2000-2049 and test world 2999: 93.8% / 51.0%; one world of 40 companies x 2000 rows
#     (as SEARCH_WORLDS=1 SEARCH_PER_WORLD=2000 runs it): 0.0% / 0.0%, its queries naming the
#     40 companies it was trained on.
#  p. Not with the committed model's tokenizer, which splits other worlds' names into 3-4 pieces
#     of characters (it was trained on the demo world's text, whose names are single tokens).
#     Three kinds from the committed model, 100 worlds x 24 rows (788 distinct companies in the
#     knowledge rows), 6 epochs (`make tiny-vlm-search SEARCH_RUN=runs/p SEARCH_WORLDS=100
#     SEARCH_PER_WORLD=24 SEARCH_ENTITIES=40`, 42 min with another run beside it), greedy on
#     world 1999: perception 21.9% (zoom on every question, half of them on the logo),
#     knowledge 0.0% and both 0.0%, no query naming the company (it writes names of its own:
#     `Vika founder` for Verro, Dikvo and Vesbe). The knowledge kind alone, as o's 50 worlds
#     (`make tiny-vlm-search VLM=recipes/tiny-vlm SEARCH_RUN=runs/copy-committed
#     SEARCH_KINDS=knowledge SEARCH_WORLDS=50 SEARCH_PER_WORLD=40 SEARCH_ENTITIES=40
#     SEARCH_FROZEN=`):
#     queries naming the company 46.9%, answers 0.0% right (`Kerbu founder` found the page, then
#     answered Poror for Puvek): still on the plateau (epoch loss 0.38 against o's 0.065). The
#     three-kind run above was at the cosine rate, which did not leave it in o either.
#  q. Seeing, from the random model with the syllables tokenizer (`toy-world runs/g-world` with
#     VLM_GENERAL=1's VLM_WORLD_OPTS, `tiny-model runs/g-random --text runs/g-world/syllables.txt`
#     with VLM_MODEL_OPTS; `scripts/perception_probe.py runs/g-world POLICY`, 32 held-out scenes;
#     sft at --lr 1e-3 --batch-size 16 --schedule constant unless said): f's plateau, and no exit
#     in any of these. All rows, 8 epochs (2000 steps, 8.5 min): grounding 28.1% (one box for
#     every scene), reading 28.1%. The reading rows alone, 375 steps at lr 1e-3, 3e-3, 1e-2: 9.4,
#     25.0, 25.0% (one word per question); they leave it slowly: 37.5% after 1250 steps, 43.8%
#     after 2500 (loss 1.04 -> 0.87). From there all rows for 1000 steps: grounding 28.1% (one
#     box), reading 43.8%; then the grounding rows alone for 625 steps at 1e-3 or 3e-3: 18.8%
#     (one box; loss ln 4 over the box's tokens). The grounding rows alone from the random model,
#     1000 steps: 28.1% on 24 logos, and 29.2% (one box) on a world of 8 logos (seed 1000,
#     none of the demo's): at this budget the number of logos is not what kept the committed
#     model's phase 1 (8 logos, grounding 97.9% in 2000 steps) apart. The logo is a plate on a
#     gradient, plain to see at the 128x128 view: what the 1.3 M model lacks is a faster way off
#     the plateau, not a harder-to-see object.
#  r. The three kinds from many worlds (o's copying, with perception and image search beside it):
#     50 worlds (seeds 1001-1050) x 60 expert rows of the three kinds, 40 companies each, replayed
#     as SEARCH_REPLAY does, with 1000 of q's reading rows, by hand from q's model after its
#     all-rows phase (reading 43.8%), all weights at the constant rate, 250 steps an epoch (4 min
#     on 2 cores), probed as tiny-vlm-search probes (kind_probe.py) on world 1999:
#     the protocol after 3 epochs (perception zooms on every question, both searches the image
#     then the text), but the boxes at chance (zoom found 25.0, 25.0, 18.8% after 3, 6, 9
#     epochs) and no query naming the company asked (found 0.0% for knowledge and both after 9
#     epochs; epoch loss 3.50, 0.88, 0.54, 0.49, 0.46, 0.45, 0.45, 0.43, 0.42), where o's
#     knowledge rows alone left the plateau within 6 epochs. Its queries and picks name
#     companies of the training worlds (`Result 1 matches the logo: Kakro`, a name none of the
#     five results has).
#  s. Weights drawn at 0.08 instead of HF's 0.02 (`tiny-model --init-std 0.08`, about
#     1/sqrt(width) for widths of 64-128): a shorter plateau. By hand, 2026-12-06, one seed each,
#     `sft --lr 1e-3 --batch-size 16 --schedule constant` (q's), scripts/perception_probe.py on
#     32 held-out scenes. The grounding rows alone of the demo world's own 2000 scenes (seed 0,
#     VLM_WORLD_OPTS of the committed model): at 0.02 the loss left its plateau (0.07) after
#     ~1100-1300 steps with either tokenizer (grounding 43.8 and 31.2% after 1000 steps, 90.6
#     and 90.6% after 2000); at 0.08 after ~400 (100.0% after 1000). The reading rows alone on
#     world 1000's 24 logos: 43.8% after 500 steps, where q's 0.02 took 2500. rope_theta 1e4
#     instead of 5e6 (with 0.08) did not help (93.8% after 1000 steps, plateau left ~250 later).
#     But grounding on the 24 logos of world 1000 (q's) still stayed on the plateau: one box
#     after 2000 steps (18.8%), and 43.8% after 1000 on 8 logos of seed 1000.
#  t. Grounding at the zoom's scale first (toy-world writes perceive-zoomed.jsonl with
#     --zoom-cells 2: the expert's crop of the quadrant and "Where is the logo?" -> the logo's
#     quadrant of the crop, where the logo is 25-41 px: about one merged vision token, the size
#     f found learned first). From s's random model on world 1000 (24 logos), by hand: those
#     rows alone left the plateau in epochs 4-7 (loss 0.07 -> 0.0009 in 1000 steps, 2.5 min);
#     then whole scenes beside them were grounded at once (the first epoch's mean loss 0.004;
#     4 epochs, 1000 steps): grounding 100.0% on world 1000's held-out scenes and 100.0% on the
#     demo world's 32 (seed 0: logos it never saw); the rows trained on by hand are the 2000
#     of perceive-zoomed.jsonl, answer for answer. `make tiny-vlm VLM_GENERAL=1` runs these
#     phases now (1-2 above, then 3: both groundings with the reading rows twice, 2 epochs).
#     In the agent's format: from phase 3, the committed model's phase 4 on world 1001 (1000
#     expert trajectories of perception on its 24 logos, --sft 1000 --kinds perception, with
#     1000 reading rows; 12 epochs, vision frozen, 12 min), then greedy on the demo world's 32
#     perception test questions (`marscli eval` with GREEDY_OPTS, scripts/kind_probe.py): it
#     zooms on every question and 96.9% of its zooms are on the logo's quadrant (the
#     committed model, trained on that world, 85%), but only 15.6% are answered right (u).
#  u. Reading does not carry to logos never seen. After t's phase 3 (1000 steps, half of them
#     reading rows): reading 34.4% on world 1000's held-out crops (colour 54.5, letter 40.0,
#     shape 9.1), 0.0% on the demo world's ('green', 'square', 'L' for nearly every crop),
#     grounding still 100.0% on both. The pre-training worlds avoid every (shape, colour) of
#     the demo's worlds, so what it must read there are pairs it never saw: with 24 logos it
#     learns which logo it is rather than its colour, shape and letter apart. The reading rows
#     of a world of all 96 logos instead (`toy-world runs/all-world --entities 96 --seed 1002
#     --perceive 2000 --zoom-cells 2 --clutter 0`, no --avoid-seeds: every shape, colour and
#     plate, the demo's pairs with other letters among them), 1000 steps from that phase-3
#     model: reading on the demo world's crops 34.4% (colour 63.6, shape 36.4, letter 0.0; the
#     loss still falling, 1.16 -> 0.77), where it was 0.0% (grounding, not trained, forgotten).
#  v. Reading that composes: colour does, shape in part, the letter not at the crop's scale.
#     Four worlds of all 96 logos but the demo's whole logos (`toy-world runs/v-read/SEED
#     --avoid-by logo`, VLM_READ_OPTS, seeds 1002-1005: every shape-and-colour pair on both
#     plates with other letters), 1000 scenes each; from t's phase 2 (grounding 100% on the demo
#     world), by hand, 2026-12-06, one seed, q's constant rate; scripts/perception_probe.py on the
#     demo world's 32 held-out crops (seed 0, logos never seen whole):
#       their crops with the grounding rows, 2000 steps: 6.2% (one word a question, loss flat
#         at 0.10 from the second epoch); their crops alone, 750 steps: 21.9%;
#       world 1000's own 24 logos' crops alone, 750 steps: 28.1% (59.4% on world 1000);
#       their logo files first (perceive-logos.jsonl: the 128 px thumbnail, where the logo fills
#         the view; 1152 rows, 432 steps): the demo's own logo files read colour 100%, shape
#         100%, letter 12.5%; then their crops, 750 steps: crops 43.8% (colour 81.8, shape 36.4,
#         letter 10.0);
#       then crops, logo files and half the grounding rows, 1788 steps (`make tiny-vlm
#         VLM_GENERAL=1`'s phases 3-5; the recipe's rows equal these, checked): grounding 100.0%,
#         crops 43.8% (colour 100.0, shape 27.3, letter 0.0), logo files 45.8%.
#     The logo in the zoom's crop is ~28 px of the 128 px view, its letter ~7 px: under one
#     16 px patch. Colour composes at once, shape partly, and the letter is not read from a
#     crop in these budgets (a 7 px glyph in a 64-wide patch embedding).
#  w. Copying after seeing does not come. o's knowledge rows, the same 2000 (`make
#     tiny-vlm-search VLM=runs/v-3r SEARCH_RUN=runs/w SEARCH_KINDS=knowledge SEARCH_WORLDS=50
#     SEARCH_PER_WORLD=40 SEARCH_ENTITIES=40 SEARCH_FROZEN=`, by hand, 2026-12-06, one seed),
#     greedy on world 1999's 96 questions:
#       from the model that grounds (t's phase 2, then v's crops with the grounding rows,
#         3000 steps of message rows): the query names the company 0.0% after 6 epochs (epoch
#         loss 3.79 -> 0.73), 1.0% after 6 more (0.44); it writes names of its own shape
#         ("I need the city of Senlo", query "Vunlo city", for Teslo), and it no longer grounds
#         (0.0%: the message rows answered in the agent's format);
#       from s's random model at 0.08 (no message rows before): 96.9%, answered right 59.4%
#         (epoch loss 2.25 -> 0.079; o at 0.02: 100.0% and 89.6%).
#     So the order matters: copying first, then seeing beside it (x).
#  x. Copying first, then grounding beside it: one model does both. From w's random-model arm
#     (copies, 96.9%), by hand, the knowledge rows kept beside: t's zoomed rows (2000 + the 2000
#     trajectories, 4 epochs, 1000 steps; epoch loss 0.151 -> 0.007), then whole scenes
#     (ground.jsonl, 4000 + 2000, 1 epoch, 375 steps): grounding 100.0% on the demo world's 32
#     scenes (logos never seen), and on world 1999 the query names the company 100.0%,
#     answered right 83.3% (w's arm alone: 59.4%).
#  y. x's order in `make tiny-vlm VLM_GENERAL=1`, reading (v) and the agent's format on top: one
#     model copies in general and calls the paper's tools on every question; its seeing does not
#     carry into the agent's format. By hand, 2026-12-06, one seed, the recipe's commands (folder
#     names apart), sft at q's constant rate; perception_probe.py on the demo world's 32 held-out
#     scenes (seed 0, logos never seen), kind_probe.py on world 1999's 96 (no training seed):
#       1. copying, o's 2000 knowledge trajectories (750 steps, epoch loss 2.25 -> 0.079): the
#          query names the company 96.9%, answered right 58.3%;
#       2-3. zoomed rows, then whole scenes, the copying rows beside (1000 + 375 steps; 0.151 ->
#          0.0046, then 0.020): grounding 59.4% (71.9% on world 1000's own held-out scenes;
#          x, the same steps in another shuffle: 100.0%);
#       4. the reading worlds' logo files beside them (591 steps): grounding 0.0% (forgotten),
#          reading the demo's crops 15.6%;
#       5. their crops, logo files and half the grounding rows beside (1144 steps): grounding
#          65.6%, reading 31.2% (colour 27.3, shape 18.2, letter 50.0; v without the copying
#          rows: 100.0% and 43.8%);
#       6. the agent's format, 3000 expert trajectories of the three kinds from worlds 1101-1150
#          (564 steps, 0.315 -> 0.051), greedy:
#            world 1999 (held out): perception 6.2% (the zoom on the logo's quadrant 25.0%),
#              knowledge 90.6% (the search finds the page 100%), both 0.0% (the right
#              thumbnail 0.0%);
#            the demo's world (seed 0): 15.6% (18.8%), 100.0% (100%), 3.1% (3.1%).
#          Every perception question zooms, every knowledge question searches text, every "both"
#          question searches by image then text: the paper's pattern. Text search carries to
#          any world; the zoom's box and the thumbnail picked are at chance (1 in 4, 1 in 5).
#  z. The demo from y's model, three kinds, on worlds it never saw: RL learns text search at once
#     and image search in part; the zoom it unlearns (its boxes are at chance). By hand, 2026-12-06,
#     one RL seed each, `make demo VLM=runs/g KINDS=perception,knowledge,both [WORLD_SEED=s]`
#     (y's model as runs/g; the cold start DIRECT=0.7 under-uses every tool), greedy test
#     accuracy per kind, SFT -> iteration 12 (found: the tool reaches the target):
#       world 0: perception 21.9 -> 21.9% (no zoom after SFT or RL; rollouts that zoom 16.7 ->
#         5.0%), knowledge 0.0 -> 100.0% (text search 0 -> 100%, from iteration 2; rollouts
#         found 20.0 -> 97.9%), both 12.5 -> 37.5% (image then text search 0 -> 100%, the right
#         thumbnail 34.4%, chance 20%; rollouts found 12.5 -> 52.5% at iteration 10);
#       world 1: 25.0 -> 31.2% (no zoom), 3.1 -> 100.0%, 9.4 -> 62.5% (thumbnail 62.5%);
#       world 2: 40.6 -> 46.9% (zooms on every question from iteration 10, on the logo 31.2%;
#         rollouts that zoom 18.8 -> 57.5%), 12.5 -> 93.8%, 28.1 -> 40.6% (thumbnail 40.6%).
#     Knowledge and both gain 12.5-100.0 points on every world; perception 0.0-6.2.
#  aa. Seeing in the agent's format, from y's model: its 3000 agent trajectories (worlds
#     1101-1150) and half of world 1000's grounding rows (2000: the zoom's scale and whole
#     scenes), 2 epochs, the vision tower frozen, cosine from 1e-3 (t's agent phase; 626 steps,
#     loss 0.025, 14 min), greedy on world 1999: perception 12.5% (zooms on every question, on
#     the logo's quadrant 21.9%: chance), knowledge 84.4%, both 0.0% (thumbnail 0.0%). The
#     grounding rows beside do not carry into the tool call's box; not kept.
#  (Until lever ab, recipes/tiny-vlm was y's model: `make demo SEEDS=3` from it, 2026-12-06,
#  knowledge 0.0 -> 100.0 +- 0.0%, both 12.5 -> 34.4 +- 7.8%, perception 21.9 -> 19.8 +- 9.0%.)
#  ab. Grounding in the tool call itself: the zoom lands on the logo in worlds never seen; what a
#     zoom then reads does not pay. From y's model, by hand, 2026-12-06, one seed, VLM_SFT's
#     constant rate, greedy on world 1999 (kind_probe.py; y: perception 6.2%, zoom on the logo
#     25.0%, knowledge 90.6%, both 0.0%):
#       the agent rows' 1000 perception trajectories cut after the zoom call
#         (scripts/zoom_rows.py: the box's two deciding digits are 2 of 59 model tokens there,
#         of ~220 among the three kinds' rows), 4 epochs (252 steps, 2 min; loss 0.023 flat,
#         0.013 at the end): zoom on the logo 53.1%; 4 more: 96.9% (loss 0.0007), every answer
#         lost (0.0%: the rows end at the zoom);
#       then the 3000 trajectories with those rows twice beside them, 2 epochs (626 steps, 12
#         min): perception 31.2% (zoom on every question, on the logo 100.0%; colour 45.5%,
#         shape 45.5% = always "star", letter 0.0%), knowledge 84.4%, both 6.2%.
#     Phases 7-9 of `make tiny-vlm` (VLM_GENERAL=1) run these; it is the committed model. The
#     demo from it (README, `make demo SEEDS=3`, 2026-12-06): knowledge 3.1 -> 100.0 +- 0.0%,
#     both 18.8 -> 39.6 +- 17.9%, perception 37.5 -> 32.3 +- 19.5%. The sampled zooms land on
#     the logo (96.5-100%) but are no more often right than direct answers (21.1% of 399
#     against 21.7% of 1137 over the 3 seeds' 12 iterations), so RL has nothing to reinforce;
#     on worlds 1 and 2 (one seed each) it learns to zoom on every perception question anyway
#     (on the logo 100.0 and 93.8%), 31.2 -> 28.1% and 43.8 -> 50.0%. Reading logos never seen,
#     at the crop's scale, is what perception lacks (u, v).
#  ac. Reading at a larger scale: the base model reads colour, the demo does not gain; dropped.
#     The zoom's box the logo's own cell (--zoom-cells 1), where the crop shows the logo at
#     51-83 px of the 128 px view (25-41 in the quadrant's). From ab's model, by hand,
#     2026-12-06, one seed, VLM_SFT's constant rate, greedy on world 1999 at the cell's scale
#     (kind_probe.py): VLM_AGENT_SEEDS' worlds written again with --zoom-cells 1, replayed
#     (7 min), then ab's three phases on their rows (252 + 252 + 626 steps, 16 min):
#     perception 53.1% (ab: 31.2%; zoom on every question, on the logo's cell 100.0%; colour
#     100.0%, shape 45.5% = always "star", letter 10.0% = always "R"), knowledge 84.4%, both
#     6.2%. On the demo's world (seed 0, its --zoom-cells 1), before the cold start: perception
#     40.6% (colour 90.9%, shape "star", letter "R").
#     Beside it, the reading worlds' crops at the cell's scale (VLM_READ_OPTS with --zoom-cells
#     1, 4000 message rows) with the cell rows, 1 epoch (563 steps, 7 min): perception 28.1%
#     (shape always "cross", letter always "P"), knowledge 71.9%.
#     The demo from the cell model on the cell world (`make demo SEEDS=3` with WORLD_OPTS'
#     --zoom-cells 1, iterations 0 -> 12, seeds 0/1/2): perception 34.4 -> 37.5 / 21.9 / 21.9,
#     knowledge 3.1 -> 100.0 (each), both 12.5 -> 31.2 / 34.4 / 28.1 (ab's demo: 32.3 and 39.6
#     mean). The cold start (240 rows, 6 epochs) leaves the sampled reading at temperature 1
#     broken: colour questions are zoomed in 29 of 528 samples (the zoomed thinking drifts to
#     "I read the shape on it" and a shape word), so RL stops zooming (rollouts that zoom, seed
#     2: 15% -> 5%). Gentler cold starts from the cell model (2 epochs; 1; 6 at 3e-4), greedy
#     on the demo's test: no tool on any question, perception 15.6 / 15.6 / 34.4%. Only colour
#     reads at this scale, which caps perception through the zoom
#     near the base model's 40.6%: not the 10 points asked for.
#  ad. The RL side cannot buy what the crop does not show. From the committed model on the demo's
#     world (seed 0), one RL seed, by hand, 2026-12-06, two runs side by side at 1 thread each
#     (`make rl-eval` with the demo's settings but UPDATE_OPTS' --lr or ITERS), greedy test per
#     kind, SFT (perception 37.5, knowledge 3.1, both 18.8) -> iteration 12:
#       update lr 1e-3: every kind 0.0 (rollouts 0-4% right from iteration 7); 3e-4: the same
#         collapse at iterations 7-9 (test 0.0 on every kind at 8), then perception 0.0,
#         knowledge 100.0, both 18.8; 2e-4: perception 25.0 (zoom 65.6%) at 4, 40.6 (no zoom) at
#         12, knowledge 96.9, both 15.6;
#       24 iterations at 1e-4 (two passes over the training prompts): perception 40.6 at 12 and
#         21.9 at 24 (no zoom at either), knowledge 100.0, both 31.2; the rollouts that zoom on
#         perception 18.8% -> 5.0% by iteration 23.
#     Why, from those rollouts: the cold start's zoomed 30% were drawn over the kind, which on
#     world 0 gave colour 2 zoomed rows of 27 (shape 10 of 27, letter 12 of 26); the rollouts
#     zoom on 16 of 352 colour samples, the one attribute a zoom reads (zoomed colour 30-67%
#     right against 21-26% direct), and zoom on shape and letter, where it reads no better than
#     a guess (shape 21% against 26-32%, letter 3-16% against 15-17%). So RL learns not to zoom.
#  ae. A cold start that zooms on each attribute alike and otherwise answers blind: toy-world
#     drawing round(direct x n) of each attribute's rows, and a perception question answered
#     without a zoom with some logo's value of the world (the answers' marginal, as a search
#     question is answered with another company's fact). From ab's model, one RL seed on world
#     0, the demo's settings (`make demo`): SFT perception 34.4% (letter 60.0%: the greedy guess "M", the
#     initial of 2 of the 8 companies and of 6 of the 10 test letters), after RL no zoom at
#     greedy: perception 37.5, knowledge 6.2 -> 100.0, both 18.8 -> 40.6. The rollouts' zoomed
#     colour was right 36-48% against 19-24% direct, but 50 colour zooms in 12 iterations moved
#     nothing from that model; with ag's model below it is what RL needs, and the demo's.
#  af. A vision tower of 8-pixel patches reads shape a little better; the letter neither. From the
#     random model (VLM_MODEL_OPTS, its syllables tokenizer) and the same model with patch 8
#     (a 16x16 grid of patches at the 128 px view, 64 merged tokens), by hand, 2026-12-06, one
#     seed each, 1 thread each side by side, q's constant rate: v's reading worlds' logo files
#     (1152 rows, 6 epochs), then their crops (4000 rows at the zoom's scale);
#     scripts/perception_probe.py on the demo world's 32 held-out crops (seed 0, logos never
#     seen), reading % (colour / shape / letter):
#       after 3 epochs of crops: patch 16 37.5 (90.9 / 18.2 / 0.0), patch 8 53.1 (100.0 / 36.4 /
#         20.0); after 12: patch 16 40.6 (90.9 / 27.3 / 0.0; epoch loss 0.65), patch 8 50.0
#         (100.0 / 45.5 / 0.0; 0.64; 2x the time a step).
#     The loss stays near 0.65 on the training crops themselves: shape and letter are not fitted,
#     not merely not carried to new logos. Not taken further.
#  ag. Reading in the agent's format: the crops beside the trajectories. With a cold start that
#     zooms on each attribute alike (ae), RL learns the zoom where it pays. From the committed
#     model, by hand, 2026-12-06, one seed, VLM_SFT's constant rate, 2 epochs of VLM_AGENT_SEEDS'
#     3000 trajectories (replayed again, 7 min) with, beside them:
#       A. their 1000 perception trajectories twice, the zoom's turn made context so that only
#          the answer after it trains (626 steps, 15 min at 1 thread);
#       B. v's 4000 crops of the reading worlds ($(VR)/crops.jsonl, phase 5's message rows; 876
#          steps, 20 min at 1 thread): `make tiny-vlm`'s phase 10 (from phase 9's output),
#          committed as recipes/tiny-vlm.
#     Greedy (kind_probe.py), perception % (colour / shape / letter), knowledge %, both %:
#       committed: world 1999 31.2 (45.5 / 45.5 / 0.0), 84.4, 6.2; the demo's world (seed 0)
#         before its cold start 12.5 (9.1 / 27.3 / 0.0), 96.9, 15.6;
#       A: 1999 28.1 (63.6 / 18.2 / 0.0), 81.2, 6.2; the demo's world 25.0 (63.6 / 9.1 / 0.0),
#         96.9, 15.6;
#       B: 1999 34.4 (81.8 / 18.2 / 0.0), 84.4, 3.1; the demo's world 31.2 (72.7 / 9.1 / 10.0),
#         93.8, 3.1.
#     The demo from B with the cold start before ae (`make demo SEEDS=3` at commit 3e4857c; 24 m
#     50 s on 2 cores), SFT ->
#     iteration 12, seeds 0 / 1 / 2: perception 34.4 -> 62.5 / 21.9 / 21.9 (35.4 +- 58.3; seed 0
#     zooms on every question, on the logo 100%: colour 100.0, shape 27.3, letter 60.0; the others
#     on none), knowledge 3.1 -> 100.0 each, both 18.8 -> 44.8 +- 4.5 (43.8 / 46.9 / 43.8). A
#     zoom now reads colour (the rollouts' zoomed colour 62-100% right against 16-20% direct),
#     but this cold start zooms on 2 of its 27 colour rows (ad): seeds 0 / 1 / 2 sampled a
#     colour zoom 29 / 11 / 3 times in 176, and only seed 0 was shown that it pays. From A, one
#     seed at 1 thread: 25.0 -> 50.0, 3.1 -> 100.0, 18.8 -> 40.6.
#     B with ae's cold start (8 of 27 rows of each attribute zoomed, the direct ones blind): the
#     demo, `make demo SEEDS=3` (2026-12-07, 25 m 15 s on 2 cores), SFT -> iteration 12, seeds
#     0 / 1 / 2: perception 37.5 -> 62.5 each (zoom on every question from iteration 4, on the
#     logo 96.9-100%; colour 27.3 -> 100.0, shape 27.3 and letter 60.0 the SFT model's guesses),
#     knowledge 15.6 -> 100.0 each, both 12.5 -> 37.5 / 40.6 / 37.5; the rollouts zoomed on 130 /
#     109 / 123 of 176 colour samples, 82.3 / 88.1 / 87.0% right (direct 13-19%).
#     Worlds 1 and 2 (`make demo WORLD_SEED=1 SEEDS=3`, `WORLD_SEED=2 SEEDS=3`): perception
#     31.2 -> 46.9 each and 28.1 -> 59.4 / 59.4 / 34.4 (seed 2 never zooms: 20 colour zooms in
#     176 samples), knowledge 0.0 -> 100.0 each and 12.5 -> 90.6 / 87.5 / 87.5, both 9.4 -> 53.1
#     / 50.0 / 46.9 and 28.1 -> 50.0 / 53.1 / 50.0: issue 35's targets on the three worlds.
#  What would be next: shape and letter legible in the crop (a box fitted to the logo, so that
#  it fills the view as the logo files do, where shape reads 100%, lever v; 8-pixel patches, af)
#  and matching scene and thumbnail as a skill of its own (a row: scene + five thumbnails -> the
#  index), which the "both" kind waits on (its thumbnail right 38.5% on world 0, chance 20%).

# Same seeds, same numbers on another x86-64 machine: torch (ATen), oneDNN and MKL pick kernels by
# the CPU's instruction set and split reductions by thread count, and both change float
# rounding, which an RL run grows into other samples. Measured here: 30 SFT steps gave weights
# equal to the bit on a rerun, but 3e-6 apart with 1 thread instead of 2, 1.9e-5 with ATen's
# scalar kernels instead of AVX2 (an AVX-512 machine picks others again) and 3.7e-5 with
# MKL_CBWR=COMPATIBLE. So the CPU demo pins all three to AVX2 (every x86-64 CPU of the last
# decade has it) and 2 threads; constraints.txt pins the libraries. The GPU recipes do not.
export OMP_NUM_THREADS ?= 2
export MKL_NUM_THREADS ?= $(OMP_NUM_THREADS)
export ATEN_CPU_CAPABILITY ?= avx2
export MKL_CBWR ?= AVX2
export ONEDNN_MAX_CPU_ISA ?= AVX2

NAME ?= tiny
RUN ?= runs/$(NAME)
WORLD ?= $(RUN)/world
KINDS ?= perception
PERCEIVE ?= 0
# The world's seed: its scenes, logos, facts and splits (`make demo WORLD_SEED=s`: another world).
WORLD_SEED ?= 0
WORLD_OPTS ?= --entities 8 --grid 4 --kinds $(KINDS) --train 192 --test 96 --sft 240 \
  --perceive $(PERCEIVE) --seed $(WORLD_SEED)
PERCEIVE_OPTS ?= --epochs 4 --lr 1e-3 --batch-size 16 --schedule constant
MODEL_OPTS ?= --size tiny --min-pixels 16384 --max-pixels 50176 --seed 0
BASE ?= $(RUN)/base

PROMPTS ?= $(WORLD)/train.jsonl
TEST ?= $(WORLD)/test.jsonl
# The search tools only when the world asks knowledge questions (their schemas are ~300 tokens).
SEARCH_OPTS ?= $(if $(subst perception,,$(KINDS)),--text-search local:$(WORLD)/text.sqlite \
  --image-search data)
AGENT_OPTS ?= --system-prompt recipes/toy-system.txt $(SEARCH_OPTS)

PROMPTS_PER_ITER ?= 16
N ?= 8
MAX_TURNS ?= 5
MAX_TURN_TOKENS ?= 64
TEMPERATURE ?= 1.0
ROLLOUT_OPTS ?= -n $(N) --temperature $(TEMPERATURE) --max-turns $(MAX_TURNS) \
  --max-turn-tokens $(MAX_TURN_TOKENS) --max-response-tokens 4096 --batch-size 64 $(AGENT_OPTS)
REWARD_OPTS ?= --judge exact --format-weight 0
ESTIMATOR ?= bn-gspo
ADV_OPTS ?= --estimator $(ESTIMATOR) --minibatches 4
LOSS ?= gspo
# The demo trains with plain torch on one process. DEEPSPEED=recipes/ds_zero2_bf16.json NPROC=2
# runs the same update under DeepSpeed ZeRO-2 with bf16 on 2 ranks (CI runs one iteration so;
# its numbers are not the demo's).
KEEP_OPTIMIZER ?= --keep-optimizer
DEEPSPEED ?=
UPDATE_OPTS ?= --loss $(LOSS) --lr 1e-4 --clip-low 0.2 --clip-high 0.28 --grad-clip 1.0 \
  --rollout-is off $(KEEP_OPTIMIZER) $(if $(DEEPSPEED),--deepspeed $(DEEPSPEED))
SFT_DATA ?= $(RUN)/sft/trajectories.jsonl
SFT_OPTS ?= --epochs 8 --lr 2e-3 --batch-size 4 --schedule cosine
# The greedy agent: the test split's settings, and tiny-vlm-search's probe with its own tools.
GREEDY_OPTS = --mode agent --temperature 0 --max-turns $(MAX_TURNS) \
  --max-turn-tokens $(MAX_TURN_TOKENS)
EVAL_OPTS ?= $(GREEDY_OPTS) $(AGENT_OPTS)

# The toy world, the tokenizer-aware tiny model, the text index and the expert trajectories;
# each target is the sidecar its command writes last (WORLD.meta.json beside the folder), so
# a kill between a folder and its sidecar redoes it. The world's files need the sidecar to
# exist (order-only: it is always newer than they are).
$(WORLD).meta.json:
	$(MARSCLI) toy-world $(WORLD) $(WORLD_OPTS) --force

$(WORLD)/train.jsonl $(WORLD)/test.jsonl $(WORLD)/sft.jsonl: | $(WORLD).meta.json ;

$(WORLD)/text.sqlite.meta.json: $(WORLD).meta.json
	$(MARSCLI) index text $(WORLD)/corpus.jsonl -o $(WORLD)/text.sqlite --force

# VLM=FOLDER (recipes/tiny-sees.mk): BASE is a link to a model that already sees instead.
ifeq ($(VLM),)
$(BASE).meta.json: $(WORLD).meta.json
	$(MARSCLI) tiny-model $(BASE) --text $(WORLD)/vocab.txt $(MODEL_OPTS) --force
else
$(BASE).meta.json: $(VLM)/config.json
	mkdir -p $(dir $(BASE)) && ln -sfn $(abspath $(VLM)) $(BASE) && cp $(VLM)/marscli.meta.json $@
endif

$(SFT_DATA).meta.json: $(BASE).meta.json $(WORLD)/text.sqlite.meta.json
	stages/rollout.sh $(WORLD)/sft.jsonl $(BASE) $(SFT_DATA) --engine replay -n 1 $(AGENT_OPTS)

# Perception pre-training (toy/perceive.py): the random model learns to read a logo's crop and
# to give the logo's box from short message rows, as Qwen3-VL did in its own pre-training, before
# the cold start teaches it the agent protocol. Beside BASE, so RL seeds and ablations share it.
PERCEIVED ?= $(BASE)-perceive
$(PERCEIVED)/config.json: $(BASE).meta.json
	$(call single,SFT,stages/sft.sh,$(WORLD)/perceive.jsonl $(BASE) $(PERCEIVED) $(PERCEIVE_OPTS) --force --metrics $(PERCEIVED).metrics.jsonl,$(TRAIN_ENV))
ifneq ($(PERCEIVE),0)
SFT_FROM = $(PERCEIVED)
SFT_FROM_TARGET = $(PERCEIVED)/config.json
endif

# `make tiny-vlm`: a tiny Qwen3-VL that sees, copies and calls the three tools, from nothing, on
# worlds disjoint from the demo's (issue 35, levers l-ag below) — world 1000 (perception rows), 50
# copying worlds (seeds 1001-1050), four reading worlds (1002-1005, all 96 logos but the demo's
# whole ones) and 50 agent worlds (1101-1150), none of which shares a seed or a logo with the
# worlds of seeds 0-2 (8 entities) — with a tokenizer trained on no world's names (syllables.txt:
# every world's names are token sequences alike); then the greedy agent on world 1999's three
# kinds (VLM_RUN-probe.json); about 95 minutes on 2 cores before phase 10, which took 20 more (at 1
# thread, beside another run). recipes/tiny-vlm is this target's VLM_RUN (levers y, ab and ag:
# their phases run by hand with these commands, folders named otherwise);
# `make demo VLM=runs/tiny-vlm` starts the demo from a rebuilt one.
#
# VLM_GENERAL=0: the model committed before issue 35 (levers f-k; ~17 minutes at the 128x128
# view, 27 at 256x256 with 2 agent epochs): its own world (seed 0, the demo's: every question
# kind, so that its tokenizer knows every word a recipe uses; VLM_SCENES scenes of perception
# rows), three SFT phases on the perception rows — all rows; the reading rows alone (odd lines);
# all rows with the reading rows twice more — then a fourth in the agent's own format, the vision
# tower frozen: the expert's trajectories (zoom on the quadrant, read) on VLM_AGENT scenes of the
# demo's world, with as many reading rows; the probe after phase 3 and after phase 4. It reads
# and localises the demo world's own eight logos, not logos in general (the issue's why).
VLM_RUN ?= runs/tiny-vlm
VLM_SCENES ?= 2000
VLM_GENERAL ?= 1
ifeq ($(VLM_GENERAL),1)
VLM_AVOID ?= --avoid-seeds 0,1,2 --avoid-entities 8
VLM_WORLD_OPTS ?= --entities 24 --grid 4 --zoom-cells 2 --clutter 0 \
  --kinds perception,knowledge,both --train 16 --test 96 --sft 0 --perceive $(VLM_SCENES) \
  --seed 1000 $(VLM_AVOID)
VLM_TEXT = syllables.txt
VLM_MODEL_OPTS ?= --size tiny --min-pixels 16384 --max-pixels 16384 --seed 0 --init-std 0.08
# The expert's worlds (levers o, r): 40 companies each, every one's trajectories in VX.
VLM_EXPERT_OPTS ?= --entities 40 --grid 4 --zoom-cells 2 --clutter 0 --train 1 $(VLM_AVOID)
VLM_COPY_SEEDS ?= $(shell seq 1001 1050)
VLM_AGENT_SEEDS ?= $(shell seq 1101 1150)
VLM_AGENT_EPOCHS ?= 3
# A variable, since a comma in $(call)'s arguments would split them.
VLM_KINDS = perception,knowledge,both
VLM_READ_SEEDS ?= 1002 1003 1004 1005
VLM_READ_OPTS ?= --entities 96 --grid 4 --zoom-cells 2 --clutter 0 --kinds perception \
  --train 1 --test 1 --sft 0 --perceive 1000 $(VLM_AVOID) --avoid-by logo
VR = $(VLM_RUN)-read
VX = $(VLM_RUN)-experts
# The rows of world folder $(1) in file $(2), their image paths made absolute (files are joined).
ABS_ROWS = sed "s\#\"images\":\[\"\([a-z]*\)/\#\"images\":[\"$(abspath $(1))/\1/\#" $(2)
# Each skill in the order it comes, every later phase with the copying rows beside it (levers
# w, x: copying comes from the random model, not after seeing): 1. copying, o's 2000 knowledge
# trajectories of 50 worlds; 2. grounding at the zoom's scale (t), then 3. on whole scenes;
# reading that composes (v): 4. the reading worlds' logo files, 5. their crops, the logo files
# and half the grounding rows.
define VLM_SEE
	rm -rf $(VX)
	$(call EXPERTS,$(VX),$(VLM_COPY_SEEDS),$(VLM_EXPERT_OPTS) --kinds knowledge --sft 40,$(VLM_RUN)-random,knows)
	$(call VLM_SFT,$(VX)/knows.jsonl,$(VLM_RUN)-random,$(VLM_RUN)-1,6)
	sed -n '2~2p' $(VW)/perceive.jsonl | cat - $(VW)/perceive-zoomed.jsonl > $(VW)/ground.jsonl
	$(call ABS_ROWS,$(VW),$(VW)/perceive-zoomed.jsonl) | cat $(VX)/knows.jsonl - > $(VX)/zoomed.jsonl
	$(call ABS_ROWS,$(VW),$(VW)/ground.jsonl) | cat $(VX)/knows.jsonl - > $(VX)/ground.jsonl
	$(call VLM_SFT,$(VX)/zoomed.jsonl,$(VLM_RUN)-1,$(VLM_RUN)-2,4)
	$(call VLM_SFT,$(VX)/ground.jsonl,$(VLM_RUN)-2,$(VLM_RUN)-3,1)
	$(foreach s,$(VLM_READ_SEEDS),$(MARSCLI) toy-world $(VR)/$(s) $(VLM_READ_OPTS) --seed $(s) --force
	)
	for s in $(VLM_READ_SEEDS); do $(call ABS_ROWS,$(VR)/$$s,$(VR)/$$s/perceive-logos.jsonl); \
	  done > $(VR)/logos.jsonl
	for s in $(VLM_READ_SEEDS); do sed -n '1~2p' $(VR)/$$s/perceive.jsonl | $(call ABS_ROWS,$(VR)/$$s); \
	  done > $(VR)/crops.jsonl
	$(call ABS_ROWS,$(VW),$(VW)/ground.jsonl) | sed -n '1~2p' \
	  | cat $(VR)/crops.jsonl $(VR)/logos.jsonl - > $(VR)/mix.jsonl
	cat $(VR)/logos.jsonl $(VX)/knows.jsonl > $(VX)/logos.jsonl
	cat $(VR)/mix.jsonl $(VX)/knows.jsonl > $(VX)/read.jsonl
	$(call VLM_SFT,$(VX)/logos.jsonl,$(VLM_RUN)-3,$(VLM_RUN)-4,3)
	$(call VLM_SFT,$(VX)/read.jsonl,$(VLM_RUN)-4,$(VLM_RUN)-5,2)
endef
# 6. The agent's format (lever r's data, from a model that copies now): 60 expert trajectories of
# the three kinds in each of 50 more worlds. 7-8. Grounding in the tool call itself (lever ab):
# the perception trajectories cut after their zoom call (scripts/zoom_rows.py), 4 epochs twice
# (as measured: two runs, AdamW restarted between them); 9. the trajectories again with the zoom
# rows twice beside them, which brings back the turns after the zoom. 10. Reading in the agent's
# format (lever ag): the trajectories again with the reading worlds' crops beside them (phase 5's
# message rows), so that what the zoom's crop shows is read there. Then the greedy agent on world
# 1999 (KIND_PROBE).
VLM_ZOOM_EPOCHS ?= 4
define VLM_AGENT_PHASE
	$(call EXPERTS,$(VX),$(VLM_AGENT_SEEDS),$(VLM_EXPERT_OPTS) --kinds $(VLM_KINDS) --sft 60,$(VLM_RUN)-random,agent)
	$(call VLM_SFT,$(VX)/agent.jsonl,$(VLM_RUN)-5,$(VLM_RUN)-6,$(VLM_AGENT_EPOCHS))
	$(PY) scripts/zoom_rows.py $(VX)/agent.jsonl > $(VX)/zoom.jsonl
	cat $(VX)/zoom.jsonl $(VX)/zoom.jsonl $(VX)/agent.jsonl > $(VX)/agent-zoom.jsonl
	$(call VLM_SFT,$(VX)/zoom.jsonl,$(VLM_RUN)-6,$(VLM_RUN)-7,$(VLM_ZOOM_EPOCHS))
	$(call VLM_SFT,$(VX)/zoom.jsonl,$(VLM_RUN)-7,$(VLM_RUN)-8,$(VLM_ZOOM_EPOCHS))
	$(call VLM_SFT,$(VX)/agent-zoom.jsonl,$(VLM_RUN)-8,$(VLM_RUN)-9,2)
	cat $(VR)/crops.jsonl $(VX)/agent.jsonl > $(VX)/agent-crops.jsonl
	$(call VLM_SFT,$(VX)/agent-crops.jsonl,$(VLM_RUN)-9,$(VLM_RUN),2)
	$(call KIND_PROBE,$(VX),1999,$(VLM_EXPERT_OPTS) --kinds $(VLM_KINDS),$(VLM_RUN))
endef
else
VLM_AGENT ?= 1000
VLM_AGENT_EPOCHS ?= 12
VLM_WORLD_OPTS ?= --entities 8 --grid 4 --zoom-cells 2 --clutter 0 \
  --kinds perception,knowledge,both --train 192 --test 96 --sft 240 --perceive $(VLM_SCENES) \
  --seed 0
VLM_AGENT_OPTS ?= --entities 8 --grid 4 --zoom-cells 2 --clutter 0 --kinds perception \
  --train 16 --test 96 --sft $(VLM_AGENT) --seed 0
VLM_TEXT = vocab.txt
# f's three phases: all rows; the reading rows alone; all rows with the reading rows twice more.
define VLM_SEE
	sed -n '1~2p' $(VW)/perceive.jsonl > $(VW)/read.jsonl
	cat $(VW)/perceive.jsonl $(VW)/read.jsonl $(VW)/read.jsonl > $(VW)/mix.jsonl
	$(call VLM_SFT,$(VW)/perceive.jsonl,$(VLM_RUN)-random,$(VLM_RUN)-1,8)
	$(call VLM_SFT,$(VW)/read.jsonl,$(VLM_RUN)-1,$(VLM_RUN)-2,8)
	$(call VLM_SFT,$(VW)/mix.jsonl,$(VLM_RUN)-2,$(VLM_RUN)-3,1)
endef
# 4. The agent's format: the expert's trajectories of the demo's world, as many reading rows.
define VLM_AGENT_PHASE
	$(MARSCLI) toy-world $(VA) $(VLM_AGENT_OPTS) --force
	$(MARSCLI) index text $(VA)/corpus.jsonl -o $(VA)/text.sqlite --force
	$(PY) scripts/perception_probe.py $(VA) $(VLM_RUN)-3
	$(MARSCLI) rollout $(VA)/sft.jsonl --policy $(VLM_RUN)-3 -o $(VA)/trajectories.jsonl --force \
	  --engine replay -n 1 --system-prompt recipes/toy-system.txt
	head -n $(VLM_AGENT) $(VW)/read.jsonl | sed 's#"images":\["images/#"images":["$(abspath $(VW))/images/#' \
	  | cat $(VA)/trajectories.jsonl - > $(VA)/mix.jsonl
	$(call VLM_SFT,$(VA)/mix.jsonl,$(VLM_RUN)-3,$(VLM_RUN),$(VLM_AGENT_EPOCHS),frozen)
	$(PY) scripts/perception_probe.py $(VA) $(VLM_RUN)
endef
endif
VLM_MODEL_OPTS ?= --size tiny --min-pixels 16384 --max-pixels 16384 --seed 0
VLM_SFT = $(MARSCLI) sft $(1) --policy $(2) --out $(3) --epochs $(4) --lr 1e-3 --batch-size 16 \
  --schedule $(if $(5),cosine --freeze-vision,constant) --seed 0 --force \
  --metrics $(3).metrics.jsonl
VW = $(VLM_RUN)-world
VA = $(VLM_RUN)-agent
# Expert worlds in the agent's format (tiny-vlm-search, VLM_GENERAL=1), through the toy world's
# three tools: world $(1)/$(2) of seed $(2) and options $(3), written, its text indexed.
SEARCH_TOOLS = --system-prompt recipes/toy-system.txt --image-search data
define EXPERT_WORLD
	$(MARSCLI) toy-world $(1)/$(2) $(3) --seed $(2) --force
	$(MARSCLI) index text $(1)/$(2)/corpus.jsonl -o $(1)/$(2)/text.sqlite --force
endef
# The worlds of seeds $(2) (options $(3), --sft rows among them) in folder $(1), each expert
# replayed by policy $(4) through the three tools into $(1)/SEED.jsonl, all joined into
# $(1)/$(5).jsonl: every world beside the others, so their image paths (relative to the folder)
# stay valid when they are joined.
define EXPERT_REPLAY
$(call EXPERT_WORLD,$(1),$(2),$(3) --test 1)
	$(MARSCLI) rollout $(1)/$(2)/sft.jsonl --policy $(4) -o $(1)/$(2).jsonl --force \
	  --engine replay -n 1 $(SEARCH_TOOLS) --text-search local:$(1)/$(2)/text.sqlite

endef
define EXPERTS
	mkdir -p $(1)
	$(foreach s,$(2),$(call EXPERT_REPLAY,$(1),$(s),$(3),$(4)))
	cat $(foreach s,$(2),$(1)/$(s).jsonl) > $(1)/$(5).jsonl
endef
# The greedy agent $(4) on the 96 test questions of world $(1)/$(2) (options $(3)), none of whose
# seeds it was trained on: per kind accuracy, tool use and found (scripts/kind_probe.py), i.e.
# whether its skills carry to companies and logos it never saw; into $(4)-probe.json.
define KIND_PROBE
$(call EXPERT_WORLD,$(1),$(2),$(3) --sft 1 --test 96)
	$(MARSCLI) eval $(1)/$(2)/test.jsonl --policy $(4) -o $(4)-probe.jsonl --judge exact \
	  $(GREEDY_OPTS) $(SEARCH_TOOLS) --text-search local:$(1)/$(2)/text.sqlite
	$(PY) scripts/kind_probe.py $(4)-probe.jsonl --out $(4)-probe.json
endef
.PHONY: tiny-vlm
tiny-vlm: setup
	$(MARSCLI) toy-world $(VW) $(VLM_WORLD_OPTS) --force
	$(MARSCLI) tiny-model $(VLM_RUN)-random --text $(VW)/$(VLM_TEXT) $(VLM_MODEL_OPTS) --force
	$(VLM_SEE)
	$(VLM_AGENT_PHASE)

# `make tiny-vlm-search` (issue 35, levers m-p): the search protocol in the agent's own format on
# top of a policy (VLM, default the committed model that sees): SEARCH_PER_WORLD expert
# trajectories of SEARCH_KINDS in each of SEARCH_WORLDS worlds (seeds 1001, 1002, ...), none of
# which shares a seed or a logo with the demo's worlds (seeds 0-2, 8 entities), so no fact or
# name of theirs is learned; replayed through the three tools (each world's trajectories beside
# the others', so their image paths stay valid when they are joined), then SEARCH_EPOCHS epochs
# (SEARCH_FROZEN). Then the greedy agent on the test scenes of world SEARCH_TEST
# (of no training seed): per kind accuracy, tool use and found (scripts/kind_probe.py), i.e.
# whether the skills carry to companies it never saw. Defaults: lever m (~7 minutes). Then
#   make demo VLM=runs/tiny-vlm-search KINDS=perception,knowledge,both
SEARCH_RUN ?= runs/tiny-vlm-search
SEARCH_WORLDS ?= 1
SEARCH_PER_WORLD ?= 1200
SEARCH_ENTITIES ?= 8
SEARCH_KINDS ?= perception,knowledge,both
SEARCH_EPOCHS ?= 6
SEARCH_TEST ?= 1999
# frozen: the vision tower frozen, a cosine schedule (a model that sees); empty: all weights at a
# constant rate (lever o, from a random model).
SEARCH_FROZEN ?= frozen
SEARCH_WORLD_OPTS ?= --entities $(SEARCH_ENTITIES) --grid 4 --zoom-cells 2 --clutter 0 \
  --kinds $(SEARCH_KINDS) --train 1 --avoid-seeds 0,1,2 --avoid-entities 8
SEARCH_FROM = $(or $(VLM),recipes/tiny-vlm)
SEARCH_SEEDS = $(shell seq 1001 $$((1000 + $(SEARCH_WORLDS))))
SW = $(SEARCH_RUN)-world
.PHONY: tiny-vlm-search
tiny-vlm-search: setup
	rm -rf $(SW)
	$(call EXPERTS,$(SW),$(SEARCH_SEEDS),$(SEARCH_WORLD_OPTS) --sft $(SEARCH_PER_WORLD),$(SEARCH_FROM),trajectories)
	$(call VLM_SFT,$(SW)/trajectories.jsonl,$(SEARCH_FROM),$(SEARCH_RUN),$(SEARCH_EPOCHS),$(SEARCH_FROZEN))
	$(call KIND_PROBE,$(SW),$(SEARCH_TEST),$(SEARCH_WORLD_OPTS),$(SEARCH_RUN))

RECIPE_INPUTS = $(WORLD)/text.sqlite.meta.json
