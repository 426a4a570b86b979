"""Training of the draft: data, states, sequence splitting, optimizers, checkpoints, the
memory plan, the job's preflight, one srun rank, and the trainer."""
