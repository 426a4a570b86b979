"""The vLLM engine: settings, the one builder, fixes for the installed vLLM, worker extensions."""
