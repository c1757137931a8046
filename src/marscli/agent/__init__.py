"""The agent: the turn protocol, the loop that runs trajectories with tools, and the resumable
runner that rollout, eval and ask share.
"""
