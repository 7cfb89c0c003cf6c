"""The GGUF reader behind ``read_gguf`` (an ndarray view of the memory map, for a faster header
parse) reads the same fields and tensor bytes as the ``gguf`` package's own reader."""

import gguf
import numpy as np

from pdjax.models.checkpoint import _open_gguf, default_model_path, read_gguf_config


def test_plain_view_reader_matches_gguf_reader():
    path = default_model_path()
    ours, theirs = _open_gguf(path), gguf.GGUFReader(path)
    assert not isinstance(ours.data, np.memmap) and not ours.data.flags.writeable
    assert list(ours.fields) == list(theirs.fields)
    for name in ("general.architecture", "llama.block_count", "tokenizer.ggml.tokens",
                 "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
        a, b = ours.fields[name], theirs.fields[name]
        assert a.types == b.types and len(a.data) == len(b.data)
        assert [bytes(a.parts[i]) for i in a.data[:50]] == [bytes(b.parts[i]) for i in b.data[:50]]
    assert len(ours.fields["tokenizer.ggml.tokens"].data) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(np.asarray(a.data), np.asarray(b.data))
    cfg = read_gguf_config(path)
    assert (cfg.num_layers, cfg.vocab_size) == (30, 49152)
