"""The shared engine server: one loaded engine serves many jobs (docs/engine-reuse.md). The
generic part only: the spec, the client, the serving loop. Each engine kind lives with its
stage (`eagleflow.extract.capture_server`, `eagleflow.regenerate.generate_server`)."""
