"""A tiny checkpoint whose MTP drafts are all accepted, and only with the right hidden states.

``write_repeater_checkpoint(src, dst)`` copies a tiny MTP checkpoint (``scripts/
make_tiny_checkpoint.py``) and sets its weights so that:

- the target repeats its last prompt token forever: every attention and MLP output projection
  is zero (the residual stream keeps the embedding), the final norm is ones and the LM head
  row of token ``t`` is ``rms_norm(embed[t])``, so the logits at a position are the dot
  products of its token's normed embedding with every normed embedding, largest for itself;
- the MTP layer passes only the hidden state it reads (``eh_proj = [0 | I]``, norms of ones,
  its decoder layer zeroed the same way), so its draft at position ``i`` is the target's own
  greedy token there: the token at ``i``, the repeated one.

So every draft is accepted when the MTP reads the target's hidden state of position
``L - 2``; a draft made from anything else (zeros: argmax 0) is rejected. In PD the first
decode step drafts from the prompt's hidden states, which only the prefill server computed.
"""

import os
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file


def write_repeater_checkpoint(src: str, dst: str) -> str:
    if os.path.exists(os.path.join(dst, "DONE")):
        return dst
    shutil.copytree(src, dst, dirs_exist_ok=True)
    files = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    tensors = {f: load_file(os.path.join(src, f)) for f in files}
    embed = tensors["model.safetensors"]["model.embed_tokens.weight"]
    head = embed / np.sqrt(np.mean(embed * embed, -1, keepdims=True) + 1e-6)
    for f, part in tensors.items():
        for name, value in part.items():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                part[name] = np.zeros_like(value)
            elif name.endswith(("model.norm.weight", "hnorm.weight", "shared_head.norm.weight")):
                part[name] = np.ones_like(value)
            elif name.endswith(("lm_head.weight", "shared_head.head.weight")):
                part[name] = head.astype(value.dtype)
            elif name.endswith("eh_proj.weight"):
                hd = value.shape[0]
                part[name] = np.concatenate([np.zeros((hd, hd)), np.eye(hd)], 1).astype(value.dtype)
        save_file(part, os.path.join(dst, f), metadata={"format": "pt"})
    with open(os.path.join(dst, "DONE"), "w") as fh:
        fh.write("repeater\n")
    return dst
