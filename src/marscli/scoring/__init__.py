"""Scoring: answer primitives, judges, the release's exact match, and the protocol registry that
says how each benchmark and the reward score.
"""
