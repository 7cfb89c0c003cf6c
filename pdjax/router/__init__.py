"""``python -m pdjax.router``: a minimal PD router (DESIGN.md §4, the router).

    python -m pdjax.router --prefill http://127.0.0.1:30001 8998 --decode http://127.0.0.1:30002 \\
        [--prefill URL [BOOTSTRAP_PORT] ...] [--decode URL ...] --host 127.0.0.1 --port 30000

The same arguments as sglang-router's PD mode. For every generation request
(``/generate``, ``/v1/completions``, ``/v1/chat/completions``) it picks a prefill and a decode
server (``--policy load_aware``, the default: the one with the fewest requests this router has
outstanding on it, ties broken by the lowest ``kv_usage`` its ``/get_load`` reported in the
last poll, then round robin; ``--policy round_robin``: round robin), adds ``bootstrap_host``
(the prefill URL's host), ``bootstrap_port`` (the prefill's bootstrap port, or null: the
server's default) and ``bootstrap_room`` (a random room in [1, 2**63); a list of one room per
sample for batches and ``n > 1``), POSTs the same body to both at once, and returns the
decode server's answer, streaming included:

    client --> router --body + bootstrap fields--> prefill  (computes the prompt, sends the KV)
                      '-------- same body ------->  decode  (receives the KV, generates) --> client

Errors: a 4xx from either server reaches the client as that 4xx with its body (a decode that
failed because the prefill refused the request gives way to the prefill's 4xx); a server that
failed (5xx) or could not be reached gives 502 ``router_error``; the other half is cancelled.
Before anything is drawn, a body is refused with 400 when it is not JSON (or nested deeper than
the parser allows), or asks for more than ``MAX_SAMPLES`` samples (``MAX_BATCH_SIZE`` prompts,
``n`` up to ``MAX_N``), the limits the servers apply. With
``return_logprob`` on ``/generate``, the prompt logprobs computed by the prefill are put in
front of the decode's ``meta_info.input_token_logprobs`` (and ``input_top_logprobs``), per
sample and per stream event. ``/health`` is 200 only when every worker is healthy.
``/tokenize``, ``/detokenize``, ``/separate_reasoning`` and ``/parse_function_call`` are
answered by the first prefill server (``handle_utility``).

Modules: ``pd_router`` (``PDRouter``: the worker pairing and answer merging), ``pool`` (the
worker choice and the room draw), ``handlers`` (the HTTP side, ``create_router_app``,
``serve_router``), ``cli`` (the arguments, ``main``).
"""

from pdjax.router.cli import main, parse_prefill_args  # noqa: F401
from pdjax.router.handlers import create_router_app, serve_router  # noqa: F401
from pdjax.router.pd_router import PDRouter  # noqa: F401
