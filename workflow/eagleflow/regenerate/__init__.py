"""Response regeneration: the target's own greedy replies, through vLLM, replace the dataset's
assistant turns. The dataset split into content-addressed source shards, the replies in
rounds, one source shard's job (chunks committed, resumed after a kill), and the generate
engine server the jobs share."""
