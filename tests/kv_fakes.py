"""A KV connector for scheduler tests: the PD decode's admission (the whole prompt arrives
from elsewhere, with its first token) without a transfer, and the two calls that drive it."""

from pdjax.sched.kv_connector import FirstToken, KVConnectorOutput, NullConnector


class WholePromptConnector(NullConnector):
    """Every prompt's KV (past the local prefix hit) comes from elsewhere. ``hold``: rids whose
    pages stay at their finish (``request_finished`` True), as a decode's quarantine."""

    def __init__(self, hold=()):
        self.hold = set(hold)

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        return req.num_prompt_tokens - num_computed_tokens

    def request_finished(self, req):
        return req.rid in self.hold


def admit_whole(sched, req) -> None:
    """Queue ``req`` on ``sched`` (whose connector answers with the whole prompt) and admit it:
    afterwards it is in ``waiting_remote`` with the pages of its prompt. ``AssertionError``
    when it was not admitted."""
    sched.add_request(req)
    sched.schedule()
    assert sched.waiting_remote.get(req.rid) is req, f"{req.rid} was not admitted"


def arrive(sched, req, first_token: int, stop_check=None, **first) -> list:
    """The worker reports ``req``'s KV in with ``first_token`` (``first``: the other
    ``FirstToken`` fields); returns ``update_from_kv_output``'s changed requests."""
    out = KVConnectorOutput(finished_recving={req.rid},
                            first_tokens={req.rid: FirstToken(first_token, **first)})
    return sched.update_from_kv_output(out, stop_check)
