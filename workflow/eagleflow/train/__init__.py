"""Training of the draft: data, states, sequence splitting, optimizers, checkpoints, the
memory plan, the launcher and the trainer."""
