"""A fake engine client and a small byte-level BPE tokenizer for the HTTP server tests.

``FakeEngine`` has the interface of ``pdjax.engine.AsyncEngine``: a worker thread produces
deterministic tokens and pushes ``GenerateOutput`` increments into each caller's asyncio queue
with ``call_soon_threadsafe`` (the way the real engine loop does). It never aborts a request by
itself when its consumer goes away, so the tests see whether the server calls ``abort``.

Run as a script, it serves the fake engine with ``run_server`` (the SIGTERM drain tests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
from typing import Callable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.metrics import Metrics
from pdjax.output import token_finish_reason
from pdjax.request import FinishReason

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Please STOP here and there, then continue with the story.",
    "One two three four five six seven eight nine ten.",
    "user assistant system: answer briefly and clearly.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
# A Qwen2.5-style template that renders tools, assistant tool calls and tool results.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_TOKENIZERS: dict[str, PreTrainedTokenizerFast] = {}
_BACKEND = None


def build_tokenizer(chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE (vocab 400) trained on ``CORPUS``; EOS is ``<|im_end|>``.
    Characters outside the corpus (é, €, emoji) split into one token per UTF-8 byte.
    ``chat_template``: ``CHAT_TEMPLATE`` (no tools) or ``TOOLS_CHAT_TEMPLATE``."""
    global _BACKEND
    if _BACKEND is None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(CORPUS * 4, trainer=trainer)
        _BACKEND = tok
    if chat_template not in _TOKENIZERS:
        t = PreTrainedTokenizerFast(tokenizer_object=_BACKEND, eos_token="<|im_end|>",
                                    pad_token="<|endoftext|>")
        t.chat_template = chat_template
        _TOKENIZERS[chat_template] = t
    return _TOKENIZERS[chat_template]


def pieces_to_ids(tokenizer, pieces: list[str]) -> list[int]:
    """Token ids whose boundaries fall at least at the given piece boundaries (byte-level BPE
    decodes concatenated ids to the concatenated text)."""
    ids: list[int] = []
    for p in pieces:
        ids.extend(tokenizer.encode(p, add_special_tokens=False))
    return ids


class _Live:
    def __init__(self, req: GenerateRequest, loop: asyncio.AbstractEventLoop, plan: list[int]):
        self.req = req
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.plan = plan
        self.num_out = 0
        self.sent_first = False


class FakeEngine:
    """Deterministic engine client. ``reply_ids(req)`` gives the tokens a request produces (the
    default cycles ``encode(reply) + [eos]``); EOS, ``stop_token_ids``, ``max_new_tokens`` and
    the context length end a request as the real engine does.

    Logprobs are synthetic: output token ``i`` has logprob ``-0.5 - 0.01 * i``; its top list is
    ``[(tok, lp), (tok + 1, lp - 1), ...]``; prompt position ``p`` has ``-1 - 0.001 * p``.
    Knobs: ``step_s`` (seconds per engine step), ``tokens_per_step``, ``fail_after`` (emit an
    error after that many tokens: ``fail_with``'s abort reason, or a 500 "injected engine
    failure"), ``reject`` (exception raised by ``generate``).

    ``script``: a scripted model, the texts the successive requests answer (``script[k]`` for
    the ``k``-th request, the last one repeated), each then EOS, cut into the byte-level tokens
    the tokenizer gives it (tool calls, ``<think>`` blocks, ...). ``prompts`` decodes the
    prompts the engine received. Grammars are compiled (so a bad one is a 400, as with the real
    engine) but not enforced: the fake answers what it was told to.
    """

    def compile_grammar(self, spec) -> None:
        from pdjax.constrained.grammar import GrammarBackend

        with self._lock:
            if self._grammar_backend is None:
                self._grammar_backend = GrammarBackend(self.tokenizer, len(self.tokenizer),
                                                       [self.tokenizer.eos_token_id])
        self._grammar_backend.compile(spec)

    def __init__(self, tokenizer=None, *, reply: str = "Hello world, the quick brown fox.",
                 reply_ids: Callable[[GenerateRequest], list[int]] | None = None,
                 step_s: float = 0.001, tokens_per_step: int = 1, context_length: int = 256,
                 num_total_pages: int = 128, page_size: int = 4, ready: bool = True,
                 disaggregation_mode: str = "null", script: list[str] | None = None) -> None:
        self.tokenizer = tokenizer or build_tokenizer()
        self.model_path = "fake-org/fake-model"
        self.served_model_name = "fake-model"
        self.context_length = context_length
        self.is_ready = ready
        self.unhealthy_reason = None
        self.metrics = Metrics()
        self.reply = reply
        self._reply_ids = reply_ids
        self.script = list(script) if script else None
        self.step_s = step_s
        self.tokens_per_step = tokens_per_step
        self.num_total_pages = num_total_pages
        self.page_size = page_size
        self.disaggregation_mode = disaggregation_mode
        self.fail_after: int | None = None
        self.fail_with: FinishReason | None = None
        self.reject: Exception | None = None
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.profile_dir: str | None = None
        self._lock = threading.Lock()
        self._grammar_backend = None
        self._live: dict[str, _Live] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._thread.start()

    # -- engine client interface -------------------------------------------------------------
    def plan_for(self, req: GenerateRequest) -> list[int]:
        if self._reply_ids is not None:
            return list(self._reply_ids(req))
        reply = self.reply
        if self.script is not None:
            # plan_for runs before the request is recorded in ``submitted``.
            reply = self.script[min(len(self.submitted), len(self.script) - 1)]
        return self.tokenizer.encode(reply, add_special_tokens=False) + [
            self.tokenizer.eos_token_id]

    @property
    def prompts(self) -> list[str]:
        return [self.tokenizer.decode(r.input_ids) for r in self.submitted]

    async def generate(self, req: GenerateRequest):
        if self.reject is not None:
            raise self.reject
        live = _Live(req, asyncio.get_running_loop(), self.plan_for(req))
        with self._lock:
            if req.rid in self._live:
                raise ValueError(f"duplicate rid {req.rid}")
            self.submitted.append(req)
            self._live[req.rid] = live
        while True:
            out = await live.queue.get()
            yield out
            if out.finished:
                return

    def abort(self, rid: str) -> None:
        with self._lock:
            self.aborted.append(rid)
            live = self._live.pop(rid, None)
        if live is not None:
            self._push(live, GenerateOutput(rid=rid, new_token_ids=[], finished=True,
                                            finish_reason=FinishReason.abort("aborted"),
                                            prompt_tokens=len(live.req.input_ids),
                                            completion_tokens=live.num_out))

    def flush_cache(self) -> bool:
        with self._lock:
            return not self._live

    def get_load(self) -> dict:
        with self._lock:
            used = sum(math.ceil((len(lv.req.input_ids) + lv.num_out) / self.page_size)
                       for lv in self._live.values())
            running = len(self._live)
        return {"num_running_reqs": running, "num_waiting_reqs": 0, "num_used_pages": used,
                "num_total_pages": self.num_total_pages, "kv_usage": used / self.num_total_pages}

    def server_info(self) -> dict:
        return {"version": "0.0-test", "model_path": self.model_path, "tp_size": 1,
                "dp_size": 1, "disaggregation_mode": self.disaggregation_mode,
                "load_balance_method": "round_robin", "page_size": self.page_size}

    def start_profile(self, output_dir: str | None, num_steps: int | None) -> str:
        if self.profile_dir is not None:
            raise RuntimeError("a profile is already running")
        output_dir = output_dir or tempfile.mkdtemp(prefix="fake_profile_")
        self.profile_dir = os.path.join(output_dir, "fake_trace")
        os.makedirs(self.profile_dir, exist_ok=True)
        return self.profile_dir

    def stop_profile(self) -> str:
        if self.profile_dir is None:
            raise RuntimeError("no profile is running")
        path, self.profile_dir = self.profile_dir, None
        with open(os.path.join(path, "trace.json"), "w") as f:
            f.write('{"traceEvents": []}')
        return path

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    # -- the engine thread ---------------------------------------------------------------------
    def _push(self, live: _Live, out: GenerateOutput) -> None:
        try:
            live.loop.call_soon_threadsafe(live.queue.put_nowait, out)
        except RuntimeError:       # the caller's loop is gone
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                lives = list(self._live.values())
            for live in lives:
                out = self._step(live)
                if out is None:
                    continue
                with self._lock:
                    if self._live.get(live.req.rid) is not live:
                        continue          # aborted meanwhile: its final output was pushed
                    if out.finished:
                        del self._live[live.req.rid]
                self._push(live, out)
            time.sleep(self.step_s)

    def _step(self, live: _Live) -> GenerateOutput | None:
        req, sp = live.req, live.req.sampling_params
        eos = self.tokenizer.eos_token_id
        new, lps, tops = [], [], []
        finish = None
        error = None
        if sp.max_new_tokens == 0:
            finish = FinishReason.of_length(0)
        while finish is None and len(new) < self.tokens_per_step:
            if self.fail_after is not None and live.num_out >= self.fail_after:
                error = self.fail_with.message if self.fail_with else "injected engine failure"
                finish = self.fail_with
                break
            i = live.num_out
            tok = live.plan[i % len(live.plan)]
            lp = -0.5 - 0.01 * i
            new.append(tok)
            lps.append(lp)
            tops.append([((tok + r) % len(self.tokenizer), lp - r)
                         for r in range(req.top_logprobs_num)])
            live.num_out += 1
            finish = token_finish_reason(sp, tok, live.num_out, (eos,))
            if finish is None and len(req.input_ids) + live.num_out >= self.context_length:
                finish = FinishReason.of_length(live.num_out)
        out = GenerateOutput(rid=req.rid, new_token_ids=new,
                             finished=finish is not None or error is not None,
                             finish_reason=finish, prompt_tokens=len(req.input_ids),
                             completion_tokens=live.num_out,
                             cached_tokens=min(4, len(req.input_ids) - 1), error=error)
        if req.return_logprob:
            out.new_logprobs, out.new_top_logprobs = lps, tops
            if not live.sent_first and req.logprob_start_len >= 0:
                positions = range(req.logprob_start_len, len(req.input_ids))
                out.prompt_logprobs = [None if p == 0 else -1.0 - 0.001 * p for p in positions]
                out.prompt_top_logprobs = [
                    None if p == 0
                    else [(req.input_ids[p], -1.0 - 0.001 * p)][:req.top_logprobs_num]
                    for p in positions]
        live.sent_first = True
        return out


def parse_sse(raw: str) -> list:
    """``data:`` payloads of an SSE body, JSON-decoded; ``[DONE]`` stays a string."""
    events = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def main(argv: list[str] | None = None) -> int:
    """Serve a FakeEngine with ``run_server`` (used by the SIGTERM drain tests)."""
    from pdjax.server.app import create_app, run_server

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--drain-timeout", type=float, default=5.0)
    ap.add_argument("--step-s", type=float, default=0.01)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    engine = FakeEngine(step_s=args.step_s, context_length=100000)

    def on_shutdown():
        engine.close()
        print(f"SHUTDOWN_HOOK live={engine.num_live} aborted={len(engine.aborted)}", flush=True)

    app = create_app(engine)
    return run_server(app, "127.0.0.1", args.port, on_shutdown=on_shutdown,
                      drain_timeout_s=args.drain_timeout)


if __name__ == "__main__":
    sys.exit(main())
