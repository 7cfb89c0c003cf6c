"""HTTP serving: the aiohttp app (``http``), request/response schemas (``openai_protocol``) and
incremental detokenization (``detokenizer``). DESIGN.md §1, issue 4."""
