"""Low-rank KV compression (Palu): per-group projection bases, rank search, Hadamard transform."""
