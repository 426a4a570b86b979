"""Chat data: reading, templating, held-out split, tokenized shards."""
