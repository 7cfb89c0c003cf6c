"""Does a compiled step update the KV pool in place? (DESIGN.md §4, "Writes during a step")

A forward takes the KV buffers donated and returns them updated. XLA may do that in place, or
hold a whole updated copy of a buffer in a temporary and write it back at the end (seen on
XLA:CPU for a 1-row decode over GQA rows ``[L, N, ps, KVH * D]``, where ``[.., KVH, D]`` is
updated in place), or write the result to a new buffer. Either is slower, and for a PD decode
whose transfer engine writes pages into the live pool while steps run it is wrong: a page
written between the copy and the write-back comes back with its old bytes.

The compiler's buffer assignment tells, exactly: ``memory_analysis()`` carries it as a
serialized ``xla.BufferAssignmentProto``. A step updates the pool in place when no value of a
KV buffer's size lives in an allocation other than the entry parameters (the donated buffers
the outputs alias): such a value is a copy of a whole buffer, in a temporary or a fresh output.
"A KV buffer's size" counts the buffer in every element width (1, 2 and 4 bytes): XLA:CPU has no
8- or 16-bit float arithmetic, so it updates a float8 or bfloat16 pool by converting the whole
buffer to a wider type, writing the update there and converting it back over the pool; the
wide copy (2x or 4x the bytes) is as much a snapshot as a same-size one, and a page written
between the conversion and the write-back is lost just the same. Worse, once the pool is read
into the wide copy XLA may reuse the donated buffer's memory for other temporaries until the
write-back: a donated KV allocation that holds values of another size is scratch in mid-step,
so a peer reading pages from it (a prefill sending a chunk while the next chunk computes)
reads garbage, and a peer's writes are clobbered. Both count as "not in place".
XLA:CPU gives it; XLA:TPU and XLA:GPU give only sizes, so there outputs that alias less than
the KV buffers or temporaries as large as one count as a copy (sound at real pool sizes).
Only the few proto fields used here are decoded (protobuf wire format; field numbers from
XLA's ``xla/service/hlo.proto``)::

    BufferAssignmentProto   1: logical_buffers (repeated)   3: buffer_allocations (repeated)
    LogicalBufferProto      1: id                           2: size
    BufferAllocationProto   2: size   3: is_thread_local   5: is_entry_computation_parameter
                            9: assigned (repeated; 1: logical_buffer_id)   12: is_constant
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """``(field number, value)`` of one protobuf message: an int for varints, bytes for
    length-delimited and fixed-width fields. Raises ``ValueError`` on a malformed message."""
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            if wire == _VARINT:
                value, i = _varint(data, i)
            elif wire == _LEN:
                size, i = _varint(data, i)
                value, i = data[i:i + size], i + size
            elif wire in (_I64, _I32):
                width = 8 if wire == _I64 else 4
                value, i = data[i:i + width], i + width
            else:
                raise ValueError(f"wire type {wire}")
            yield number, value
    except IndexError as e:
        raise ValueError("truncated message") from e


def _allocations(buffer_assignment: bytes) -> Iterator[tuple[dict, list[int]]]:
    """``(flags, sizes of the values assigned)`` of each allocation of a serialized
    ``BufferAssignmentProto``; ``flags`` maps BufferAllocationProto field numbers to values."""
    size_of: dict[int, int] = {}
    allocations = []
    for number, value in _fields(buffer_assignment):
        if number == 1:
            fields = dict(_fields(value))
            size_of[fields.get(1, 0)] = fields.get(2, 0)
        elif number == 3:
            allocations.append(value)
    for allocation in allocations:
        flags, assigned = {}, []
        for number, value in _fields(allocation):
            if number == 9:
                assigned.append(dict(_fields(value)).get(1, 0))
            else:
                flags[number] = value
        yield flags, [size_of.get(b, 0) for b in assigned]


def copied_values(buffer_assignment: bytes, sizes: set[int]) -> list[int]:
    """Sizes (bytes) of the values of a size in ``sizes`` that live outside the entry
    parameters' allocations, per a serialized ``BufferAssignmentProto``."""
    found = []
    for flags, assigned in _allocations(buffer_assignment):
        if flags.get(5) or flags.get(3) or flags.get(12):   # parameter, thread-local, constant
            continue
        found += [n for n in assigned if n in sizes]
    return found


def scratch_values(buffer_assignment: bytes, kv_shard_bytes: set[int]) -> list[int]:
    """Sizes (bytes) of the values of another size that share an entry parameter's allocation
    of a KV buffer's size: XLA reused the donated pool's memory as scratch in mid-step (after
    the pool was read into a wide copy), so its bytes are not the pool's until the step ends.
    Read-only parameters (weights) never hold other values."""
    found = []
    for flags, assigned in _allocations(buffer_assignment):
        if flags.get(5) and flags.get(2) in kv_shard_bytes:
            found += [n for n in assigned if n != flags.get(2)]
    return found


ELEMENT_WIDTHS = (1, 2, 4)     # bytes per element a whole-buffer copy may be converted to


def copy_sizes(kv_shard_bytes: Sequence[int], kv_itemsizes: Sequence[int]) -> set[int]:
    """Sizes (bytes) of a whole copy of any KV buffer shard in any of ``ELEMENT_WIDTHS``:
    ``elements * width``. Raises ``ValueError`` when the two lists differ in length or a size
    is not a whole number of elements."""
    if len(kv_shard_bytes) != len(kv_itemsizes):
        raise ValueError(f"kv_itemsizes: {len(kv_itemsizes)} entries for "
                         f"{len(kv_shard_bytes)} KV buffers")
    sizes = set()
    for nbytes, itemsize in zip(kv_shard_bytes, kv_itemsizes):
        if itemsize < 1 or nbytes % itemsize:
            raise ValueError(f"kv_itemsizes: {nbytes} B is not a whole number of "
                             f"{itemsize}-byte elements")
        sizes |= {nbytes // itemsize * width for width in ELEMENT_WIDTHS}
    return sizes


def kv_pool_copy(compiled: Any, kv_shard_bytes: Sequence[int],
                 kv_itemsizes: Sequence[int]) -> str | None:
    """Why executable ``compiled`` does not update the KV buffers in place, or None when it
    does.

    ``compiled``: a ``jax.stages.Compiled`` whose donated arguments include the KV buffers;
    ``kv_shard_bytes``: bytes of one device's shard of each KV buffer (the assignment is the
    per-device program's); ``kv_itemsizes``: each buffer's bytes per element (a copy
    converted to another width counts, see the module docstring).
    """
    try:
        stats = compiled.memory_analysis()
    except Exception:       # a backend without the analysis: nothing to tell
        return None
    if stats is None or not kv_shard_bytes:
        return None
    proto = getattr(stats, "serialized_buffer_assignment_proto", b"")
    if not proto:
        return _from_sizes(stats, kv_shard_bytes)
    copies = copied_values(bytes(proto), copy_sizes(kv_shard_bytes, kv_itemsizes))
    if copies:
        return (f"{len(copies)} value(s) the size of a KV buffer ({sorted(set(copies))} B, in "
                f"some element width) live outside the donated buffers: XLA copies the pool "
                f"and writes it back")
    scratch = scratch_values(bytes(proto), {int(n) for n in kv_shard_bytes})
    if scratch:
        return (f"{len(scratch)} other value(s) ({sorted(set(scratch))} B) are held in a "
                f"donated KV buffer in mid-step: XLA uses the pool as scratch and rewrites "
                f"it at the end")
    return None


def _from_sizes(stats: Any, kv_shard_bytes: Sequence[int]) -> str | None:
    """Without a buffer assignment (XLA:TPU and XLA:GPU give none, only sizes): outputs that
    alias less than the KV buffers, or temporaries as large as one, are taken for a copy.
    Sound at real pool sizes (gigabytes against a step's megabytes); a tiny test pool can be
    smaller than a step's activations."""
    alias, temp = int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)
    if alias < sum(kv_shard_bytes):
        return (f"its outputs alias {alias} B, less than the {sum(kv_shard_bytes)} B of KV "
                f"buffers: the pool is written to a new buffer")
    if temp >= min(kv_shard_bytes):
        return (f"{temp} B of temporaries, as large as a KV buffer ({min(kv_shard_bytes)} B): "
                f"likely a copy of the pool (sizes only: no buffer assignment)")
    return None
