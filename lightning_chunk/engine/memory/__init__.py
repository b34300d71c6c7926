"""The chunk manager (tiers, gathers, releases, reductions) and whole parameter values out of the shards and back."""
