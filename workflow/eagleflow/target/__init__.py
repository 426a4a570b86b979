"""Target facts read from files: config, weights, head, layer ids."""
