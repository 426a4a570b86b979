"""Planning of a training run, torch-free: the trainer's settings, job resources, the
states' cost when streamed, progress."""
