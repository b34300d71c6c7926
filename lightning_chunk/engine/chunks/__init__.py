"""Chunks and their layout: the chunk and its tensors' states, packing parameters into chunks, repacking values into a
new layout, deferred initialisation."""
