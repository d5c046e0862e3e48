"""Paged KV cache: layout, pool and allocator."""
from engine.kvcache.layout import KVComponent, KVLayout
from engine.kvcache.pool import KVPool, PageAllocator, PageError, PoolExhausted, PoolStats

__all__ = ["KVComponent", "KVLayout", "KVPool", "PageAllocator", "PageError", "PoolExhausted", "PoolStats"]
