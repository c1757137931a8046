# recipes/tiny-search.mk — the demo's recipe with the search questions too (issue 19, point 3):
# KINDS=perception,knowledge, so the world asks knowledge questions (image search, then text
# search, then answer) beside the perception ones, and the agent gets the two search tools.
#   make rl-eval RECIPE=recipes/tiny-search.mk ITERS=12 EVAL_EVERY=4
# Measured (2 cores, one seed; NOT yet a recipe in which RL learns search): the cold-start model
# (from recipes/tiny-vlm, pre-trained on perception only) answers every knowledge question by
# image search then text search, greedy test accuracy knowledge 18.8%, perception 25.0% (it
# never zooms: DIRECT). Sampled at temperature 1 the three-step chain (pick the logo among five
# thumbnails, copy its name into the query, copy the fact) succeeds on 3.1% of the knowledge
# rollouts (0% in iterations 1-2), so almost every knowledge group is flat or punishes the
# search: in 6 BN-GSPO iterations the rollouts' accuracy fell 11.7 -> 6.3%, knowledge rollouts
# without any search rose from 5 to 40 of 64, and the perception rollouts' zoom share fell
# 17 -> 12% (11 of 16 groups flat at iteration 5). At TEMPERATURE=0.7 the sampled chains
# succeeded on 2-9% of the knowledge rollouts in iterations 0-5 (those that searched at all fell
# from 64 to 45 of 64), and at iteration 6 the policy collapsed into garbled turns in both
# kinds: rollout accuracy 14.8% (iteration 0), 18.0% (5), 3.1% (6), 0.8% (7).
# With the search chain pre-trained in the agent's own format first (by hand: 1000 expert
# trajectories, half knowledge, of another world, `toy-world --seed 1 --kinds
# perception,knowledge --sft 1000`, so that no fact of the test's companies is learned; SFT from
# recipes/tiny-vlm, vision frozen, 6 epochs, 2.5 min; then this recipe with VLM=that model,
# TEMPERATURE 1.0, 8 iterations): greedy test accuracy knowledge 22.9% -> 10.4% (iteration 4)
# -> 12.5% (8), perception 22.9% -> 75.0% (8); knowledge rollouts succeeded 2-6%. The tool use
# per question type ends as the paper describes — perception questions zoom (0 -> 1.0 calls),
# knowledge questions search (image 1.0, text 1.0) and never zoom — but only the zoom was
# learned by RL; the cold start already searched on every knowledge question. What it would
# take: a chain that sampled rollouts complete often enough to reinforce (the greedy chain is
# right on ~20% of the questions, about the chance of picking the logo among five thumbnails:
# the tiny model does not yet match the scene's logo to a thumbnail).
NAME ?= search
KINDS ?= perception,knowledge
include recipes/tiny-sees.mk
