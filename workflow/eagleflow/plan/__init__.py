"""Planning of a training run, torch-free: the trainer's settings, job resources, the
launch's commands, the states' cost when streamed, progress."""
