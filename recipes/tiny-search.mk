# recipes/tiny-search.mk — the demo's recipe with the search questions too (issue 19, point 3):
# KINDS=perception,knowledge, so the world asks knowledge questions (image search, then text
# search, then answer) beside the perception ones, and the agent gets the two search tools.
NAME ?= search
KINDS ?= perception,knowledge
include recipes/tiny-sees.mk
