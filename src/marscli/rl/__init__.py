"""RL math: advantage estimators, policy losses and rollout correction.
"""
