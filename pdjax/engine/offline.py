"""The offline ``Engine``, in the style of ``sglang.Engine`` / ``vllm.LLM``: drives an
``EngineCore`` on the caller's thread until every prompt has finished (DESIGN.md §3)."""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np

from pdjax.config import ServerArgs
from pdjax.engine.core import EngineCore
from pdjax.engine_io import GenerateRequest
from pdjax.output import OutputAccumulator, RequestOutput
from pdjax.request import SEED_LIMIT, SamplingParams


def _describe(value) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def _is_token_id(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _token_id_lists(input_ids, vocab_size: int) -> tuple[bool, list[list[int]]]:
    """``(single, token ids of each prompt)`` of the ``input_ids`` argument: a list of token
    ids in ``[0, vocab_size)`` (one prompt) or a list of such lists (a batch); numpy arrays are
    taken as lists. ``ValueError`` naming the position (``input_ids[i][j]``)."""
    if isinstance(input_ids, np.ndarray):
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError(f"input_ids: a list of token ids or a list of such lists, got "
                         f"{_describe(input_ids)}")
    single = not input_ids or not isinstance(input_ids[0], (list, tuple, np.ndarray))
    prompts = [input_ids] if single and input_ids else list(input_ids)
    out = []
    for i, ids in enumerate(prompts):
        where = "input_ids" if single else f"input_ids[{i}]"
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{where}: a list of token ids, got {_describe(ids)}")
        if not ids:
            raise ValueError(f"{where}: the prompt is empty")
        for j, t in enumerate(ids):
            if not _is_token_id(t):
                raise ValueError(f"{where}[{j}]: a token id must be an integer, got "
                                 f"{_describe(t)}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"{where}[{j}]: token id {t} is outside [0, {vocab_size})")
        out.append([int(t) for t in ids])
    return single, out


def _sampling_params(sp) -> SamplingParams:
    return sp if isinstance(sp, SamplingParams) else SamplingParams.from_dict(sp)


class Engine:
    """Offline engine in the style of ``sglang.Engine``: ``Engine(model_path=None,
    dtype="auto", **server_args)``; no path serves the default SmolLM2 model. Besides the
    ``ServerArgs`` fields: ``progress`` (warm-up progress bar), ``background_compile``
    (``EngineCore``; default False: every shape compiled before the constructor returns) and
    ``buckets`` (``EngineCore``: the shapes to compile, instead of the settings' own).

    ``generate(prompt | list of prompts, sampling_params, input_ids=...)`` returns a dict (one
    prompt) or a list of dicts with ``text``, ``output_ids`` and ``meta_info``
    (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``finish_reason``, and
    logprobs when asked). ``n > 1`` gives ``n`` results per prompt, prompt-major.
    """

    def __init__(self, model_path: str | None = None, dtype: str = "auto", **server_args):
        progress = server_args.pop("progress", True)
        background_compile = server_args.pop("background_compile", False)
        buckets = server_args.pop("buckets", None)
        self.args = ServerArgs(model_path=model_path, dtype=dtype, **server_args)
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
        Raises ``ValueError`` naming the field for a bad prompt or parameter; a refused
        prompt of a batch takes the batch's queued requests with it."""
        single, ids_list = self._prompt_ids(prompt, input_ids)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids_list)
        if len(sps) != len(ids_list):
            raise ValueError("sampling_params: list length differs from the number of prompts")
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
            return _token_id_lists(input_ids, self.core.model_cfg.vocab_size)
        if prompt is None:
            raise ValueError("prompt: no prompt given")
        single = isinstance(prompt, str)
        prompts = [prompt] if single else prompt
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompt: a string or a list of strings, got {_describe(prompt)} "
                             "(token ids go in input_ids)")
        ids_list = [self.tokenizer.encode(p) for p in prompts]
        for i, ids in enumerate(ids_list):
            if not ids:
                which = "prompt" if single else f"prompt[{i}]"
                raise ValueError(f"{which}: the text {prompts[i]!r} gives no tokens")
        return single, ids_list

    def _submit(self, ids_list, sps, return_logprob, logprob_start_len, top_logprobs_num
                ) -> dict[str, OutputAccumulator]:
        """Add one engine request per sample (``n`` per prompt; sample k of a seeded prompt
        gets seed + k); returns rid -> its accumulator, in submission order."""
        core = self.core
        accs: dict[str, OutputAccumulator] = {}
        try:
            for ids, sp in zip(ids_list, sps):
                sp = _sampling_params(sp or {})
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
        """Drop every request and free the device state."""
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
