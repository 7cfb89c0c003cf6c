"""HTTP serving (DESIGN.md §1, §4): the app and its run loop (``app``), the handlers
(``handlers``), the live requests (``registry``), what one sample produced (``results``), the
request parsers and renderers (``native_api``, ``openai_api``, ``openai_render``) over shared
field checks (``validation``) and the engine as the server sees it (``engine_client``); text
comes from ``pdjax.output.OutputAccumulator``."""
