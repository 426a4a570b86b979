"""How hidden states are captured: the checked plan, the worker hooks, vLLM's connector,
the reference."""
