"""Export of a trained draft: the weights and config that vLLM and speculators load."""
