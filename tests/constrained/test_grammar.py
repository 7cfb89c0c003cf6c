"""Host-side grammars (llguidance): every walk through a masked random-logit sampler yields
text that parses and validates, invalid specs are ValueErrors naming the field, and the numpy
bitmask application matches the bit layout."""

import json
import re

import jsonschema
import numpy as np
import pytest

from grammar_cases import SCHEMAS
from pdjax.constrained.grammar import GrammarBackend, GrammarSpec, apply_bitmask, bitmask_words
from pdjax.models.loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)          # SmolLM2's 49,152-token vocabulary


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, 49152, eos_token_ids=[tokenizer.eos_token_id])


def _walk(backend, tokenizer, spec, seed, max_tokens=120):
    """Greedy over seeded random logits, masked by the grammar: the text and whether the
    grammar finished (EOS chosen, or nothing more admitted)."""
    rng = np.random.default_rng(seed)
    m = backend.matcher(spec)
    out = []
    for _ in range(max_tokens):
        logits = rng.standard_normal(backend.vocab_size).astype(np.float32)
        # Nudge towards the end so that every walk terminates well inside max_tokens.
        logits[tokenizer.eos_token_id] += 3.0
        t = int(np.argmax(apply_bitmask(logits, m.bitmask())))
        if t == tokenizer.eos_token_id:
            assert m.is_accepting
            return tokenizer.decode(out), True
        assert m.accept(t), m.error
        out.append(t)
        if m.is_terminated:
            return tokenizer.decode(out), True
    return tokenizer.decode(out), False


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_walks_validate(backend, tokenizer, i):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[i]), "response_format")
    for seed in range(3):
        text, done = _walk(backend, tokenizer, spec, seed)
        assert done, text
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_json_object_walk_is_an_object(backend, tokenizer):
    text, done = _walk(backend, tokenizer, GrammarSpec("json_object", field="response_format"), 1)
    assert done and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("regex", [r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?", r"[a-z]{1,8}@[a-z]{1,8}\.com"])
def test_regex_walks_match(backend, tokenizer, regex):
    for seed in range(3):
        text, done = _walk(backend, tokenizer, GrammarSpec("regex", regex, "regex"), seed, 60)
        assert done and re.fullmatch(regex, text), text


def test_ebnf_walk_is_in_the_language(backend, tokenizer):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(3):
        text, done = _walk(backend, tokenizer, GrammarSpec("ebnf", grammar, "ebnf"), seed, 60)
        assert done and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


@pytest.mark.parametrize("spec,msg", [
    (GrammarSpec("json_schema", "{not json", "response_format"), "response_format: the JSON schema is not valid JSON"),
    (GrammarSpec("json_schema", "[1, 2]", "json_schema"), "json_schema: a JSON schema must be an object"),
    (GrammarSpec("json_schema", json.dumps({"type": "nonsense"}), "response_format"), "response_format: "),
    (GrammarSpec("regex", "(unclosed", "regex"), "regex: "),
    (GrammarSpec("ebnf", "root ::= missing_rule", "ebnf"), "ebnf: "),
    # Valid, but admitting no text: the request failed at its first token with a 500.
    (GrammarSpec("json_schema", '{"$ref": "#"}', "response_format"),
     "response_format: the json schema admits no text"),
    (GrammarSpec("ebnf", "root ::= root", "ebnf"), "ebnf: the ebnf admits no text"),
    # Nested past Python's recursion limit (the parser) or within it (the schema compiler):
    # a RecursionError was an HTTP 500.
    (GrammarSpec("json_schema", "[" * 5000 + "]" * 5000, "json_schema"),
     "json_schema: the JSON schema is nested too deeply"),
    (GrammarSpec("json_schema", '{"type": "object", "properties": {"a": ' * 900
                 + '{"type": "string"}' + "}}" * 900, "json_schema"), "json_schema: "),
])
def test_invalid_specs_name_the_field(backend, spec, msg):
    with pytest.raises(ValueError) as e:
        backend.compile(spec)
    assert str(e.value).startswith(msg), str(e.value)


def test_spec_checks_its_fields():
    with pytest.raises(ValueError, match="grammar kind must be one of"):
        GrammarSpec("yaml", "x", "response_format")
    with pytest.raises(ValueError, match="regex: longer than"):
        GrammarSpec("regex", "a" * (256 * 1024 + 1), "regex")


def test_compile_is_cached(backend):
    spec = GrammarSpec("regex", "[xyz]{2}", "regex")
    backend.compile(spec)
    hits = backend.cache_info().hits
    backend.compile(GrammarSpec("regex", "[xyz]{2}", "regex"))
    assert backend.cache_info().hits == hits + 1


def test_bitmask_layout_and_rejection(backend, tokenizer):
    m = backend.matcher(GrammarSpec("regex", "ab", "regex"))
    mask = m.bitmask()
    assert mask.shape == (bitmask_words(49152),) and mask.dtype == np.int32
    allowed = [t for t in range(49152) if (mask[t // 32] >> (t % 32)) & 1]
    assert allowed and all("ab".startswith(tokenizer.decode([t])) for t in allowed)
    logits = np.zeros((2, 49152), np.float32)
    masked = apply_bitmask(logits, np.stack([mask, mask]))
    assert sorted(np.flatnonzero(np.isfinite(masked[0]))) == allowed
    bad = tokenizer.encode("zz")[0]
    assert not m.accept(bad) and m.error is not None


def test_rollback_restores_the_state(backend, tokenizer):
    m = backend.matcher(GrammarSpec("regex", "(abc|abd)", "regex"))
    first = m.bitmask().copy()
    tok = tokenizer.encode("a")[0]
    assert m.accept(tok)
    assert not np.array_equal(m.bitmask(), first)
    m.rollback(1)
    np.testing.assert_array_equal(m.bitmask(), first)
