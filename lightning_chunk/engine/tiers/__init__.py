"""Where a shard's bytes live: device and host storage, the disk tier and its files, the host's payload pool, gradient
copies to the host."""
