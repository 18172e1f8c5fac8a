"""The store core: the embedded :class:`~tierkv.core.store.Store` and the parts it owns.

Blocks and their holds (``blocks``, ``holds``), where a block lives and what is evicted
(``placement``, ``eviction``, ``policy*``, ``priority``, ``tier_limits``), the write path
(``ingest``), the read path (``leasing``, ``promotion``, ``read_through``, ``matching``),
the store's own operations (``operations``), counters (``stats``) and named fault points
(``faults``). Everything outside this package reaches a store through
:class:`tierkv.api.StoreAPI`; docs/architecture.md draws the whole.
"""
