"""The optimizer over shards: the binding to a torch optimizer, the host Adam, stepping in backward, gradient passes,
the loss scaler, EMA."""
