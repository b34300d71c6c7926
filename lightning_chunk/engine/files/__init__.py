"""Weights files read a tensor at a time, and torch and safetensors files written a tensor at a time."""
