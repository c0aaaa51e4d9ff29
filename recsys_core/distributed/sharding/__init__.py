"""One module per sharding strategy, each implementing :class:`common.PooledSharding`."""
