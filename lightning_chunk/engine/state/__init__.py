"""Checkpoints: sharded saves streamed through DCP, and a checkpoint's chunks read back whole or by a rank's span."""
