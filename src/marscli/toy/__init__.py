"""A toy world: a small synthetic, offline replica of the MARS task family for CPU demos.

Made-up companies (`entities`) with a founder, a city, a year and a logo (`render`); large
cluttered scenes with one small logo; a text corpus about them (`corpus`); prompt rows of the
three MARS kinds, perception, knowledge and both (`prompts`), and scripted expert replies for
cold-start SFT (`expert`), all written by `world.build_world` from one seed.

How it departs from the paper's data, and why:
1. Entities, logos and facts are invented and every answer is one short word, so that a tiny
   model (about 1 M parameters, a tokenizer trained on `vocab.txt`) can learn the task on CPU in
   minutes (docs/demo.md "Can the tiny model learn a visual task on CPU?").
2. Logos sit inside the cells of a coarse grid and the expert zooms on the whole cell, so the box
   to predict takes few values; `grid` is the dial.
3. Image search is precomputed per row (the `data` backend) from the world itself, not from a
   search engine: the true logo is always among the 5 results, at a seeded rank.
"""
