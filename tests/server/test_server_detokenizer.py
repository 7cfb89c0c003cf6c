"""IncrementalDetokenizer: UTF-8 hold-back, stop strings, special tokens, context."""

import pytest
from server_fakes import build_tokenizer, pieces_to_ids
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pdjax.detokenizer import IncrementalDetokenizer, TokenTexts


def run(detok, ids, chunk=1):
    deltas = []
    for i in range(0, len(ids), chunk):
        d = detok.add_tokens(ids[i:i + chunk])
        deltas.append(d.text)
        if d.stop_matched is not None:
            break
    deltas.append(detok.finish().text)
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_incremental_text_equals_full_decode(chunk):
    tok = build_tokenizer()
    text = "The capital of France is Paris. One two three, the lazy dog!"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = run(IncrementalDetokenizer(tok), ids, chunk)
    assert "".join(deltas) == text == tok.decode(ids)


def test_multibyte_characters_split_over_byte_tokens_are_held_back():
    tok = build_tokenizer()
    text = "Hello € and 😀 and é!"
    ids = tok.encode(text, add_special_tokens=False)
    # The euro sign (3 bytes) and the emoji (4 bytes) are not in the corpus: one token per byte.
    assert [tok.decode([i]) for i in tok.encode("€", add_special_tokens=False)] == ["\ufffd"] * 3
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add_tokens([i]).text for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish().text == text
    # Exactly the continuation bytes produced nothing: 2 for €, 3 for 😀, 1 for é.
    assert deltas.count("") == 2 + 3 + 1
    assert "€" in deltas and "😀" in deltas


def test_stop_string_split_across_tokens_is_never_released():
    tok = build_tokenizer()
    ids = pieces_to_ids(tok, ["Hello", " wor", "ld", " S", "T", "O", "P", " and", " more"])
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    released, result = "", None
    for n, i in enumerate(ids, 1):
        d = detok.add_tokens([i])
        released += d.text
        assert "S" not in released.replace("Hello world", "")
        if d.stop_matched:
            result = (n, d)
            break
    n, d = result
    assert d.stop_matched == "STOP" and d.num_tokens == 1
    assert tok.decode(ids[:n]).endswith("STOP")
    assert released == "Hello world " == detok.text
    assert detok.add_tokens([ids[-1]]).num_tokens == 0       # nothing after the stop
    assert detok.finish().text == ""


def test_stop_string_in_the_middle_of_one_chunk_counts_tokens_up_to_the_match():
    tok = build_tokenizer()
    ids = pieces_to_ids(tok, ["One", " two", " three", " four", " five"])
    detok = IncrementalDetokenizer(tok, stop=["three"])
    d = detok.add_tokens(ids)
    assert d.stop_matched == "three"
    assert d.text == "One two "
    assert d.num_tokens == len(pieces_to_ids(tok, ["One", " two", " three"]))


def test_stop_prefix_that_does_not_complete_is_released_later():
    tok = build_tokenizer()
    pieces = ["Hello", " S", "T", "ure", " thing"]
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = [detok.add_tokens(pieces_to_ids(tok, [p])).text for p in pieces]
    assert deltas[0] == "Hello"
    assert deltas[1] == " " and deltas[2] == ""          # "S", "ST" held back
    assert deltas[3] == "STure"
    assert "".join(deltas) + detok.finish().text == "Hello STure thing"


def test_earliest_of_several_stop_strings_wins_and_finish_flushes_prefix():
    tok = build_tokenizer()
    ids = pieces_to_ids(tok, ["a", "b", "c", "d", "e"])
    detok = IncrementalDetokenizer(tok, stop=["de", "bcd"])
    d = detok.add_tokens(ids)
    assert d.stop_matched == "bcd" and d.text == "a"
    # A held-back stop prefix is released when the request ends without a match.
    detok = IncrementalDetokenizer(tok, stop=["xyz"])
    d = detok.add_tokens(pieces_to_ids(tok, ["ab", "x", "y"]))
    assert d.text == "ab"
    assert detok.finish().text == "xy"


def test_stop_string_with_multibyte_character():
    tok = build_tokenizer()
    ids = pieces_to_ids(tok, ["price ", "5", "€", " net"])
    detok = IncrementalDetokenizer(tok, stop=["5€"])
    released = ""
    for i in ids:
        d = detok.add_tokens([i])
        released += d.text
        assert "5" not in released and "\ufffd" not in released
        if d.stop_matched:
            break
    assert d.stop_matched == "5€" and released == "price "


def test_finish_releases_an_unfinished_character_as_replacement():
    tok = build_tokenizer()
    euro = tok.encode("€", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert detok.add_tokens(tok.encode("ok", add_special_tokens=False) + euro[:2]).text == "ok"
    assert detok.finish().text == "\ufffd"


def test_skip_special_tokens():
    tok = build_tokenizer()
    ids = tok.encode("Hello world", add_special_tokens=False) + [tok.eos_token_id]
    assert "".join(run(IncrementalDetokenizer(tok), ids)) == "Hello world"
    shown = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(run(shown, ids)) == "Hello world<|im_end|>"


def test_prompt_context_keeps_sentencepiece_leading_space():
    vocab = {"▁Hello": 0, "▁world": 1, "▁again": 2, "[UNK]": 3}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    assert tok.decode([1]) == "world"                  # alone, the leading space is dropped
    with_ctx = IncrementalDetokenizer(tok, prompt_ids=[0])
    assert "".join(run(with_ctx, [1, 2])) == " world again"
    assert "".join(run(IncrementalDetokenizer(tok), [1, 2])) == "world again"


def test_token_texts_bytes():
    tok = build_tokenizer()
    texts = TokenTexts(tok)
    ids = tok.encode("Hi €", add_special_tokens=False)
    assert b"".join(bytes(texts.token_bytes(i)) for i in ids) == "Hi €".encode()
    assert texts.token_bytes(tok.eos_token_id) == list(b"<|im_end|>")
    assert texts.text(ids[-1]) == "\ufffd"


def test_bad_stop_rejected():
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(build_tokenizer(), stop=[""])


def test_stop_regex_cuts_at_the_first_match_and_holds_back_only_a_possible_match():
    tok = build_tokenizer()
    head = pieces_to_ids(tok, ["Hello", " wor", "ld", " "])
    ids = head + pieces_to_ids(tok, ["1", "2", "3", "4", " and", " 56", " more"])
    detok = IncrementalDetokenizer(tok, stop_regex=[r"\d{3}", "xyz"])
    released = "".join(detok.add_tokens([i]).text for i in head)
    assert released == "Hello world "          # nothing could start a match: all out at once
    result = None
    for n, i in enumerate(ids[len(head):], len(head) + 1):
        d = detok.add_tokens([i])
        released += d.text
        if d.stop_matched:
            result = (n, d)
            break
        assert released == "Hello world "      # "1", "12" may start a match: held back
    n, d = result
    assert d.stop_matched == r"\d{3}" and d.num_tokens == 1
    assert tok.decode(ids[:n]).endswith("123")
    assert detok.text == released == "Hello world "
    assert detok.finish().text == "" and detok.stop_matched == r"\d{3}"


def test_stop_regex_earliest_of_strings_and_patterns_wins_and_anchors_see_the_text_before():
    tok = build_tokenizer()
    ids = pieces_to_ids(tok, ["one", " two", " three", " four"])
    d = IncrementalDetokenizer(tok, stop=["four"], stop_regex=["t[a-z]+e"]).add_tokens(ids)
    assert (d.text, d.stop_matched) == ("one two ", "t[a-z]+e")
    # ^ anchors at the start of the output, not of the unreleased text.
    detok = IncrementalDetokenizer(tok, stop_regex=["^two"])
    assert "".join(run(detok, ids)) == "one two three four" and detok.stop_matched is None


def test_min_new_tokens_arms_stop_strings_and_regexes_only_past_it():
    tok = build_tokenizer()
    pieces = ["a", "STOP", "b", "c", "STOP", "d"]
    ids = pieces_to_ids(tok, pieces)
    first_stop = len(pieces_to_ids(tok, pieces[:2]))      # tokens up to the first STOP's end
    second_stop = len(pieces_to_ids(tok, pieces[:5]))
    for kw in ({"stop": ["STOP"]}, {"stop_regex": ["ST.P"]}):
        matched = kw.get("stop", kw.get("stop_regex"))[0]
        early = IncrementalDetokenizer(tok, **kw)
        assert "".join(run(early, ids)) == "a"
        # The first STOP completes on token first_stop, not past min_new_tokens: no stop.
        late = IncrementalDetokenizer(tok, min_new_tokens=first_stop, **kw)
        assert "".join(run(late, ids)) == "aSTOPbc"
        d = IncrementalDetokenizer(tok, min_new_tokens=first_stop, **kw).add_tokens(ids)
        assert (d.num_tokens, d.stop_matched) == (second_stop, matched)
        armed = IncrementalDetokenizer(tok, min_new_tokens=first_stop - 1, **kw)
        assert "".join(run(armed, ids)) == "a" and armed.stop_matched == matched
        never = IncrementalDetokenizer(tok, min_new_tokens=len(ids), **kw)
        assert "".join(run(never, ids)) == "aSTOPbcSTOPd" and never.stop_matched is None


def test_bad_stop_regex_names_the_field():
    with pytest.raises(ValueError, match=r"stop_regex: '\(a' is not a valid regular expression"):
        IncrementalDetokenizer(build_tokenizer(), stop_regex=["(a"])
