"""The offline ``Engine``, in the style of ``sglang.Engine`` / ``vllm.LLM``: drives an
``EngineCore`` on the caller's thread until every prompt has finished (DESIGN.md §3)."""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np

from pdjax.config import ServerArgs
from pdjax.engine.core import EngineCore
from pdjax.engine.settings import check_checkpoint_paths
from pdjax.engine_io import GenerateRequest
from pdjax.input_checks import (check_bool, check_logprob_fields, check_max_new_tokens,
                                check_prompt_length, check_token_ids, default_max_new_tokens,
                                describe)
from pdjax.output import OutputAccumulator, RequestOutput
from pdjax.request import SEED_LIMIT, SamplingParams
from pdjax.sched.buckets import Buckets


def _token_id_lists(input_ids, vocab_size: int) -> tuple[bool, list[list[int]]]:
    """``(single, token ids of each prompt)`` of the ``input_ids`` argument: a list of token
    ids in ``[0, vocab_size)`` (one prompt) or a non-empty list of such lists (a batch); numpy
    arrays are taken as lists. ``ValueError`` naming the position (``input_ids[i][j]``)."""
    if isinstance(input_ids, np.ndarray):
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError(f"input_ids: a list of token ids or a list of such lists, got "
                         f"{describe(input_ids)}")
    if not input_ids:
        raise ValueError("input_ids: empty; give a list of token ids or a non-empty list of "
                         "such lists")
    single = not isinstance(input_ids[0], (list, tuple, np.ndarray))
    prompts = [input_ids] if single else list(input_ids)
    out = []
    for i, ids in enumerate(prompts):
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        out.append(check_token_ids("input_ids" if single else f"input_ids[{i}]", ids,
                                   vocab_size))
    return single, out


def _sampling_params(sp) -> tuple[SamplingParams, bool]:
    """``(SamplingParams, whether max_new_tokens was given)``: a dict names it when it holds
    the key (None: up to the context length); a ``SamplingParams`` when its value is not the
    class default (the default is cut to the context instead of refused)."""
    if isinstance(sp, SamplingParams):
        return sp, sp.max_new_tokens != SamplingParams.max_new_tokens
    params = SamplingParams.from_dict(sp)
    return params, "max_new_tokens" in sp


class Engine:
    """Offline engine in the style of ``sglang.Engine``: ``Engine(model_path=None,
    dtype="auto", **server_args)``; no path serves the default SmolLM2 model. Besides the
    ``ServerArgs`` fields: ``progress`` (warm-up progress bar), ``background_compile``
    (``EngineCore``; default False: every shape compiled before the constructor returns) and
    ``buckets`` (``EngineCore``: the shapes to compile, instead of the settings' own). A
    setting of the wrong type or range is a ``ValueError`` naming it (``ServerArgs``' checks,
    the serve flags' too); an unknown name a ``TypeError``.

    ``generate(prompt | list of prompts, sampling_params, input_ids=...)`` returns a dict (one
    prompt) or a list of dicts with ``text``, ``output_ids`` and ``meta_info``
    (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``finish_reason``, and
    logprobs when asked). ``n > 1`` gives ``n`` results per prompt, prompt-major.
    """

    def __init__(self, model_path: str | None = None, dtype: str = "auto", **server_args):
        progress = check_bool("progress", server_args.pop("progress", True))
        background_compile = check_bool("background_compile",
                                        server_args.pop("background_compile", False))
        buckets = server_args.pop("buckets", None)
        if buckets is not None and not isinstance(buckets, Buckets):
            raise ValueError(f"buckets: a pdjax.sched.buckets.Buckets or None, got "
                             f"{describe(buckets)}")
        self.args = ServerArgs(model_path=model_path, dtype=dtype, **server_args)
        check_checkpoint_paths(self.args)      # serve's parse-time check: names the path's field
        self.core = EngineCore(self.args, progress=progress, background_compile=background_compile,
                               buckets=buckets)
        self.tokenizer = self.core.tokenizer

    def generate(self, prompt=None, sampling_params=None, input_ids=None,
                 return_logprob: bool = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int = 0):
        """Generate for one prompt or a batch, SGLang's offline ``Engine.generate``.

        ``prompt``: a string or a list of strings; or ``input_ids``: a list of token ids or a
        list of such lists (not both). ``sampling_params``: one dict (SGLang's names) or one
        per prompt. Returns one dict (``text``, ``output_ids``, ``meta_info``) for a single
        prompt and one sample, else a list: every sample of prompt 0, then of prompt 1, ...
        Raises ``ValueError`` naming the field for a bad prompt or parameter (the HTTP
        server's checks, ``pdjax.input_checks``: an empty batch, token ids outside the
        tokenizer's vocabulary, a prompt at the context length, an explicit ``max_new_tokens``
        that does not fit after the prompt, logprob arguments of the wrong type or range),
        before anything is queued; ``RuntimeError`` after ``shutdown()``. The engine keeps
        serving after an error."""
        if self.core is None:
            raise RuntimeError("this Engine was shut down (shutdown()); make a new Engine")
        single, ids_list = self._prompt_ids(prompt, input_ids)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids_list)
        if len(sps) != len(ids_list):
            raise ValueError("sampling_params: list length differs from the number of prompts")
        field = "prompt" if input_ids is None else "input_ids"
        names = [field] if single else [f"{field}[{i}]" for i in range(len(ids_list))]
        sps = self._checked(ids_list, names, sps, return_logprob, logprob_start_len,
                            top_logprobs_num)
        accs = self._submit(ids_list, sps, return_logprob, logprob_start_len, top_logprobs_num)
        self._run_until_done(accs)
        results = [self._result(acc.result, return_logprob) for acc in accs.values()]
        return results[0] if single and len(results) == 1 else results

    def _prompt_ids(self, prompt, input_ids) -> tuple[bool, list[list[int]]]:
        """``(single, token ids of each prompt)``; texts are tokenized here. ``ValueError``
        naming the field (``prompt``, ``input_ids[i][j]``) for a prompt of the wrong type."""
        if prompt is not None and input_ids is not None:
            raise ValueError("pass either prompt or input_ids, not both")
        if input_ids is not None:
            return _token_id_lists(input_ids, self.vocab_size)
        if prompt is None:
            raise ValueError("prompt: no prompt given")
        single = isinstance(prompt, str)
        prompts = [prompt] if single else prompt
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompt: a string or a list of strings, got {describe(prompt)} "
                             "(token ids go in input_ids)")
        if not prompts:
            raise ValueError("prompt: an empty list; give a string or a non-empty list of "
                             "strings")
        ids_list = []
        for i, p in enumerate(prompts):
            which = "prompt" if single else f"prompt[{i}]"
            try:
                ids = self.tokenizer.encode(p)
            except Exception as e:  # a lone UTF-16 surrogate: tokenizers' TypeError (as HTTP)
                raise ValueError(f"{which}: the text cannot be tokenized ({type(e).__name__}: "
                                 f"{e})") from None
            if not ids:
                raise ValueError(f"{which}: the text {p!r} gives no tokens")
            ids_list.append(ids)
        return single, ids_list

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: ``[0, vocab_size)``, the tokenizer's vocabulary, as the
        HTTP server checks them (ids past it, up to the model's embedding size, have no
        text)."""
        return min(len(self.tokenizer), self.core.model_cfg.vocab_size)

    def _checked(self, ids_list, names, sps, return_logprob, logprob_start_len,
                 top_logprobs_num) -> list[SamplingParams]:
        """Every prompt's ``SamplingParams``, checked as the HTTP server checks them
        (``pdjax.input_checks``) before anything is queued: the prompt fits the context, an
        explicit ``max_new_tokens`` fits after it (the default is cut to fit), the logprob
        arguments have their types and ranges (``stop_token_ids`` and ``logit_bias`` are
        checked by ``EngineCore.add_request`` against the model's vocabulary: the model may
        sample ids past the tokenizer's). ``ValueError`` naming the field."""
        context = self.core.context_length
        out = []
        for ids, name, raw in zip(ids_list, names, sps):
            sp, explicit = _sampling_params(raw if raw is not None else {})
            check_prompt_length(name, len(ids), context)
            if explicit:
                check_max_new_tokens("max_new_tokens", sp.max_new_tokens, len(ids), context)
            else:
                sp = dataclasses.replace(sp, max_new_tokens=default_max_new_tokens(
                    sp.max_new_tokens, len(ids), context))
            check_logprob_fields(return_logprob, top_logprobs_num,
                                 -1 if logprob_start_len is None else logprob_start_len, len(ids))
            out.append(sp)
        return out

    def _submit(self, ids_list, sps, return_logprob, logprob_start_len, top_logprobs_num
                ) -> dict[str, OutputAccumulator]:
        """Add one engine request per sample (``n`` per prompt; sample k of a seeded prompt
        gets seed + k); returns rid -> its accumulator, in submission order."""
        core = self.core
        accs: dict[str, OutputAccumulator] = {}
        try:
            for ids, sp in zip(ids_list, sps):
                for k in range(sp.n):
                    rid = uuid.uuid4().hex
                    one = dataclasses.replace(sp, n=1)
                    if sp.n > 1 and sp.seed is not None:
                        one = dataclasses.replace(one, seed=(sp.seed + k) % SEED_LIMIT)
                    g = GenerateRequest(rid, list(ids), one, return_logprob=return_logprob,
                                        top_logprobs_num=top_logprobs_num,
                                        logprob_start_len=-1 if logprob_start_len is None
                                        else logprob_start_len)
                    core.add_request(g)
                    accs[rid] = OutputAccumulator(self.tokenizer, one,
                                                  RequestOutput(rid, list(ids)))
        except Exception:
            for rid in accs:        # a bad prompt of a batch: the ones queued before it go too
                core.abort_request(rid, "another prompt of the batch was refused")
            raise
        return accs

    def _run_until_done(self, accs: dict[str, OutputAccumulator]) -> None:
        """Step the engine until every request of ``accs`` finished (a stop string aborts its
        request); a failed step aborts them all and re-raises."""
        core = self.core
        pending = set(accs)
        try:
            while pending:
                for out in core.step():
                    acc = accs.get(out.rid)
                    if acc is None or out.rid not in pending:
                        continue
                    if acc.add(out).stop_string_hit:
                        core.abort_request(out.rid)
                    if acc.finished:
                        pending.discard(out.rid)
        except Exception as e:      # a failed step: its requests go, and what it shared
            for rid in pending:
                core.abort_request(rid, f"internal error: {e}")
            core.scheduler.evict_unlocked()
            raise
        core.drain()      # the step in flight holds only rows of finished requests

    @staticmethod
    def _result(r: RequestOutput, return_logprob: bool) -> dict:
        meta = {"id": r.rid, "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
                "finish_reason": r.finish_reason.to_dict(), **r.spec_meta_info()}
        if return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None)
                                             for lp, t in zip(r.output_logprobs, r.output_ids)]
            meta["output_top_logprobs"] = [[(lp, t, None) for t, lp in top]
                                           for top in r.output_top_logprobs]
            if r.prompt_logprobs is not None:
                meta["input_token_logprobs"] = r.prompt_logprobs
                meta["input_top_logprobs"] = r.prompt_top_logprobs
        return {"text": r.text, "output_ids": r.output_ids, "meta_info": meta}

    def shutdown(self) -> None:
        """Drop every request and free the device state; ``generate`` then raises
        ``RuntimeError``. A second call does nothing."""
        if self.core is None:
            return
        for rid in list(self.core.scheduler.requests):
            self.core.abort_request(rid)
        self.core.runner.caches = {}
        if self.core.cluster is not None:
            self.core.cluster.close()
        self.core = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.core is not None:
            self.shutdown()
