"""HiCache's host tier (L2) behind the device prefix cache, as a KV connection (DESIGN.md §3,
"Host tier"; SGLang's ``--enable-hierarchical-cache``).

    page_hash.py   the chained page hashes that key the tier
    host_pool.py   the host page pool (numpy, the transfer path's page format) and its LRU index
    connector.py   the ``KVConnector`` the scheduler calls: what hits, what to load and write
    worker.py      the ``KVTransferWorker`` the engine polls: the jitted gathers and scatters;
                   ``build_host_tier`` (what ``transfer.factory`` calls)

The package sits in the transfer layer (its worker moves KV through the runner, as
``transfer/local_kv.py`` does); ``connector``, ``host_pool`` and ``page_hash`` are pure
Python and numpy.
"""
