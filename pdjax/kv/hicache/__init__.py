"""HiCache's host tier (L2) and storage tier (L3) behind the device prefix cache, as a KV
connection (DESIGN.md §3, "Host tier" and "Storage tier"; SGLang's
``--enable-hierarchical-cache`` and ``--hicache-storage-backend``).

    page_hash.py         the chained page hashes that key the tiers
    host_pool.py         the host page pool (numpy, the transfer path's page format) and its
                         LRU index
    connector.py         the ``KVConnector`` the scheduler calls: what hits, what to load and
                         write, what to prefetch from the store
    worker.py            the ``KVTransferWorker`` the engine polls: the jitted gathers and
                         scatters; ``build_host_tier`` (what ``transfer.factory`` calls)
    metrics.py           the tiers' Prometheus metrics
    storage.py           the stored page record (header, fingerprint, checksum) and the
                         backend interface
    storage_tier.py      the storage thread: write-through to the store, prefetches from it
    storage_file.py      the ``file`` backend (one file a page, atomic writes)
    storage_mooncake.py  the ``mooncake`` backend (a Mooncake store client)
    pd.py                the tiers paired with a PD prefill role

The package sits in the transfer layer (its worker moves KV through the runner, as
``transfer/local_kv.py`` does); the parse-time check of the storage settings is
``pdjax.kv.hicache_config`` (control layer). All but ``worker`` (JAX) and
``storage_mooncake`` (the Mooncake client) are pure Python and numpy.
"""
