"""Executes a Plan inside Lightning: the cluster environment, process groups, pipeline stages and FSDP2 shards."""
