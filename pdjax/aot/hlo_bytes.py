"""Bytes the collectives of a compiled XLA executable move, per device per run, read from its
post-optimization HLO text (``compiled.as_text()``); BENCHMARKS.md "The mixed
step's collective bytes".

Every collective instruction is counted once per execution of its computation: a ``while``
body ``known_trip_count`` times (XLA's ``backend_config``; a scan over layers is one), an
``async-start`` / fusion / call body once, a ``conditional`` as the largest of its branches (an
upper bound: only one runs). Asynchronous pairs count at their ``-start``. Two figures per
instruction, ``n`` being its group size (``replica_groups``, any of XLA's three spellings):

    kind                buffer bytes (what the seed's tables count)   sent bytes (ring / direct)
    all-gather          the gathered result, n x operand              operand x (n - 1)
    reduce-scatter      the operand reduced                            operand x (n - 1) / n
    all-reduce          the operand                                    2 x operand x (n - 1) / n
    all-to-all          the operand                                    operand x (n - 1) / n
    ragged-all-to-all   the send buffer (operand 0; its capacity,      operand 0 x (n - 1) / n
                        the rows sent are known only at run time)      (an upper bound)
    collective-permute  the operand                                    the operand

Bytes are the arrays' shapes times their dtype's size (``DTYPE_BYTES``; sub-byte types
rounded up per array). Sources: XLA's HLO text grammar (``hlo_instruction.cc`` printing) and
its operation semantics page for the collectives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
         "collective-permute")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "s2": 0.25, "u2": 0.25, "f4e2m1fn": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
    "token": 0,
}

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}])([a-z][a-z0-9\-]*)\((.*)$")
_CALLEE = re.compile(r"\b(body|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9, ]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (``bf16[8,256]{1,0}``, tuples summed);
    ``ValueError`` naming the dtype when it is not in ``DTYPE_BYTES``."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: {dtype!r} is not a known HLO element type")
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += math.ceil(n * DTYPE_BYTES[dtype])
    return total


def _result_shape(rest: str) -> tuple[str, str, str]:
    """``(shape text, opcode, text after the opening parenthesis)`` of an instruction's
    right-hand side, e.g. ``(bf16[1,4], bf16[8,4]) all-gather-start(%x), ...``."""
    depth, i = 0, 0
    if rest.startswith("("):                 # a tuple shape: skip to its closing parenthesis
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        i += 1
    m = _OPCODE.search(rest, i)
    if m is None:
        return rest, "", ""
    return rest[:m.start(1)], m.group(1), m.group(2)


def _operands(args: str) -> list[str]:
    """Operand names of an instruction (the text after its opcode's parenthesis)."""
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += ch in "({"
        depth -= ch in ")}"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", args[:end]) or [
        a.strip().split()[-1] for a in args[:end].split(",") if a.strip()]


def group_size(line: str, num_partitions: int) -> int:
    """Devices in each group of a collective's ``replica_groups``: ``{{0,1,2,3}}``,
    ``[G,S]<=[N]`` (iota: S) or ``mesh['a'=1,'b'=8] {'b'}`` (the product of the named axes);
    ``num_partitions`` when the groups are empty or absent (every device)."""
    m = _GROUPS_LIST.search(line)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()])
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _GROUPS_MESH.search(line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(int(sizes[a]) for a in axes) if axes else num_partitions
    return num_partitions


@dataclasses.dataclass
class Collective:
    """One collective instruction: ``kind`` (in ``KINDS``), ``name``, ``group`` (devices per
    group), ``operand_bytes`` (what one device passes in), ``buffer_bytes`` and ``sent_bytes``
    (the module docstring's table), ``op_name`` (jax's source path from the metadata)."""

    kind: str
    name: str
    group: int
    operand_bytes: int
    buffer_bytes: int
    sent_bytes: int
    op_name: str


def _collective(kind: str, name: str, line: str, operand_bytes: list[int],
                num_partitions: int) -> Collective:
    n = group_size(line, num_partitions)
    total = sum(operand_bytes)
    if kind == "ragged-all-to-all":
        total = operand_bytes[0]
    buffer = total * n if kind == "all-gather" else total
    sent = {"all-gather": total * (n - 1),
            "reduce-scatter": total * (n - 1) // n,
            "all-reduce": 2 * total * (n - 1) // n,
            "all-to-all": total * (n - 1) // n,
            "ragged-all-to-all": total * (n - 1) // n,
            "collective-permute": total}[kind]
    op = _OP_NAME.search(line)
    return Collective(kind, name, n, total, buffer, sent, op.group(1) if op else "")


@dataclasses.dataclass
class _Computation:
    collectives: list = dataclasses.field(default_factory=list)
    calls: list = dataclasses.field(default_factory=list)     # (callee, factor, while name)
    branches: list = dataclasses.field(default_factory=list)  # [callee, ...] per conditional


def parse_module(text: str) -> tuple[dict[str, _Computation], str, int]:
    """``(computations by name, the entry's name, num_partitions)`` of an HLO module's text;
    ``ValueError`` when it has no ENTRY computation."""
    m = _PARTITIONS.search(text[:4000])
    num_partitions = int(m.group(1)) if m else 1
    shapes: dict[str, str] = {}
    comps: dict[str, _Computation] = {}
    entry, current = None, None
    pending = []                                      # (computation, kind, name, line, operands)
    for line in text.splitlines():
        if not line.startswith(" "):
            hm = _COMPUTATION.match(line)
            if hm:
                current = comps.setdefault(hm.group(1), _Computation())
                if line.startswith("ENTRY"):
                    entry = hm.group(1)
            continue
        im = _INSTRUCTION.match(line)
        if im is None or current is None:
            continue
        name, rest = im.groups()
        shape, opcode, args = _result_shape(rest)
        shapes[name] = shape
        base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
        if base in KINDS:
            pending.append((current, base, name, line, _operands(args)))
        if opcode in ("async-done", "async-update"):
            continue
        if opcode == "conditional":
            bm = _BRANCHES.search(line)
            names = (re.findall(r"%?([\w.\-]+)", bm.group(1)) if bm else
                     [c for k, c in _CALLEE.findall(line) if k.endswith("_computation")])
            current.branches.append(names)
            continue
        for key, callee in _CALLEE.findall(line):
            trip = 1
            if key == "body":
                tm = _TRIP.search(line)
                trip = int(tm.group(1)) if tm else 1
            current.calls.append((callee, trip, name if key == "body" else None,
                                  key == "body" and not tm))
    if entry is None:
        raise ValueError("hlo: the text has no ENTRY computation")
    for comp, kind, name, line, operands in pending:
        comp.collectives.append(_collective(
            kind, name, line, [shape_bytes(shapes.get(o, "")) for o in operands],
            num_partitions))
    return comps, entry, num_partitions


def _zero() -> dict:
    return {k: {"count": 0, "buffer_bytes": 0, "sent_bytes": 0} for k in KINDS}


def _add(into: dict, other: dict, factor: int = 1) -> None:
    for k in KINDS:
        for f in ("count", "buffer_bytes", "sent_bytes"):
            into[k][f] += other[k][f] * factor


def collective_bytes(text: str) -> dict:
    """Per-device bytes of every collective one run of the module ``text`` executes.

    Returns a JSON-ready dict: ``total`` (per kind: ``count``, ``buffer_bytes``,
    ``sent_bytes``; each instruction times how often it runs), ``loops`` (every ``while``
    whose body holds a collective: ``name``, ``trip_count``, ``op_name``, ``per_iteration``
    per kind as ``total``; nested loops appear in their parent's figures too),
    ``num_partitions`` and ``unknown_trip_counts`` (loops counted once for want of a
    ``known_trip_count``: the totals are then a lower bound). ``ValueError`` for a text with
    no ENTRY computation or an unknown dtype."""
    comps, entry, num_partitions = parse_module(text)
    memo: dict[str, dict] = {}
    loops, unknown = [], []

    def total(name: str, stack=()) -> dict:
        if name in memo:
            return memo[name]
        out = _zero()
        comp = comps.get(name)
        if comp is None or name in stack:
            return out
        for c in comp.collectives:
            out[c.kind]["count"] += 1
            out[c.kind]["buffer_bytes"] += c.buffer_bytes
            out[c.kind]["sent_bytes"] += c.sent_bytes
        for callee, trip, while_name, unknown_trip in comp.calls:
            inner = total(callee, stack + (name,))
            _add(out, inner, trip)
            if while_name and any(inner[k]["count"] for k in KINDS):
                loops.append({"name": while_name, "trip_count": trip,
                              "op_name": _first_op_name(comps, callee),
                              "per_iteration": inner})
                if unknown_trip:
                    unknown.append(while_name)
        for branch in comp.branches:
            best = _zero()
            for callee in branch:
                inner = total(callee, stack + (name,))
                for k in KINDS:
                    if inner[k]["buffer_bytes"] > best[k]["buffer_bytes"]:
                        best[k] = dict(inner[k])
            _add(out, best)
        memo[name] = out
        return out

    result = total(entry)
    return {"total": result, "loops": loops, "num_partitions": num_partitions,
            "unknown_trip_counts": sorted(set(unknown))}


def _first_op_name(comps, name) -> str:
    for c in comps[name].collectives:
        if c.op_name:
            return c.op_name
    return ""


def collectives(text: str) -> list[Collective]:
    """Every collective instruction of the module, each once (no trip counts)."""
    comps, _, _ = parse_module(text)
    return [c for comp in comps.values() for c in comp.collectives]


def format_bytes(n: float) -> str:
    """``n`` bytes as the seed's tables write them (decimal units: MB, GB)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


if __name__ == "__main__":          # python -m pdjax.aot.hlo_bytes FILE.hlo: the JSON
    import sys

    with open(sys.argv[1]) as f:
        print(json.dumps(collective_bytes(f.read()), indent=1))
