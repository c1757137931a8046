"""The Qwen3-VL layer: checkpoints, token-exact assembly, chat templates, the vocabulary and images
as the processor sees them.
"""
