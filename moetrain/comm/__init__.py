"""Expert-parallel communication: all-to-all (flat, hierarchical, node-deduplicating), chunking,
payload compression."""

from moetrain.comm.all_to_all import all_to_all, all_to_all_reverse, exchange_counts, regroup_chunks

__all__ = ["all_to_all", "all_to_all_reverse", "exchange_counts", "regroup_chunks"]
