"""Training: the job skeleton, the trainer, batches, distributed set-up, DeepSpeed configs,
optimiser options, checkpoints and training state.
"""
