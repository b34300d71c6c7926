"""One fit's engine: the module hooks that drive the manager, parameters read outside their owner, the automatic chunk
size."""
