"""Collectives between ranks: the chunk all-gathers and reduce-scatters, the checks that ranks issue the same ones,
module buffers from rank 0."""
