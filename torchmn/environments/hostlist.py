"""Slurm hostlist expressions (``node[01-04,07]``), expanded the way ``scontrol show hostnames`` does."""
from __future__ import annotations

import math
import re
from typing import List, Tuple

from torchmn.errors import TorchmnTypeError, TorchmnValueError

# Slurm refuses a single range of more hosts than this; so do we, so that a typo such as
# node[1-1000000000] fails quickly instead of exhausting memory.
MAX_RANGE = 64 * 1024
# And a whole expression of more names than this (several groups multiply: a[1-60000]b[1-60000]
# would be 3.6e9 names), which scontrol refuses too.
MAX_HOSTS = 1024 * 1024

_NUMBER = re.compile(r"[0-9]+")

# A bracket group after parsing: its ranges as (lo, hi, width), kept unexpanded so that an
# expression naming too many hosts is refused before a single name is made.
_Group = List[Tuple[int, int, int]]


def _count(group: _Group) -> int:
    return sum(hi - lo + 1 for lo, hi, _ in group)


def _numbers(group: _Group) -> List[str]:
    """The group's numbers, each zero-padded to the width of its range's first number."""
    return [f"{n:0{width}d}" for lo, hi, width in group for n in range(lo, hi + 1)]


def expand_hostlist(expr: str) -> List[str]:
    """Expand a Slurm hostlist expression into host names, in ``scontrol show hostnames`` order.

    Items are separated by commas (or whitespace) outside brackets; duplicates are kept. A bracket
    holds comma-separated numbers and ``lo-hi`` ranges; a range is zero-padded to the width of its
    first number (``[001-5]``, ``[08-011]`` -> 08..11). A name may hold several bracket groups but
    must end with one. The last group varies fastest, then the others from left to right, the order
    Slurm produces (its parser peels the last group off, then recurses into the rest of the name
    from the right)::

        a[1-2]b[3-4]c[5-6] -> a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5 a1b4c6 a2b4c5 a2b4c6

    Where Slurm 22.05 quietly accepts a malformed expression (a missing ']', a stray ']', spaces
    inside brackets) this raises instead, since what it would give is surely not what was meant.

    Example::

        >>> expand_hostlist("node[001-3],login1")
        ['node001', 'node002', 'node003', 'login1']
        >>> expand_hostlist("a[1-2]b[3-4]")
        ['a1b3', 'a1b4', 'a2b3', 'a2b4']

    Args:
        expr: the expression, e.g. ``SLURM_STEP_NODELIST``'s value.

    Returns:
        The host names.

    Raises:
        TypeError: ``expr`` is not a string.
        ValueError: the expression cannot be parsed, or names too many hosts (quoting it).
    """
    if not isinstance(expr, str):
        raise TorchmnTypeError(f"hostlist expression must be a string, not {type(expr).__name__}")
    if not expr.strip():
        raise TorchmnValueError(f"empty hostlist expression {expr!r}")
    items = _split_items(expr)
    if not items:
        raise TorchmnValueError(f"no host names in hostlist expression {expr!r}")
    parsed = [(item, _parse_name(item, expr)) for item in items]
    total = sum(math.prod(_count(group) for group in groups) for _, (_, groups) in parsed)
    if total > MAX_HOSTS:
        raise TorchmnValueError(f"hostlist {expr!r} expands to {total} host names, more than {MAX_HOSTS}; "
                                f"check the ranges (several bracket groups in one name multiply)")
    hosts: List[str] = []
    for item, (texts, groups) in parsed:
        hosts.extend(_expand_item(item, expr, texts, groups))
    return hosts


def _split_items(expr: str) -> List[str]:
    """Split at commas and whitespace that are outside brackets."""
    items: List[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise TorchmnValueError(f"nested '[' at position {i} in hostlist {expr!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise TorchmnValueError(f"']' without a matching '[' at position {i} in hostlist {expr!r}")
        elif depth == 0 and (ch == "," or ch.isspace()):
            items.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise TorchmnValueError(f"unbalanced '[' (no closing ']') in hostlist {expr!r}")
    items.append(expr[start:])
    stripped = [item.strip() for item in items]
    # Slurm skips repeated separators ("a,,b" or "a, b"): only a list with no name at all is an error,
    # and that was caught by the caller.
    return [item for item in stripped if item]


def _expand_item(item: str, expr: str, texts: List[str], groups: List[_Group]) -> List[str]:
    """Expand one name, parsed into its texts and bracket groups (it may hold several)."""
    if not groups:
        return [item]
    if texts[-1]:
        # Slurm 22.05 rejects this too ("Invalid hostlist"); a name may only end in its last group.
        raise TorchmnValueError(f"text {texts[-1]!r} after the last ']' in {item!r} of hostlist {expr!r}: "
                                f"a name with brackets must end with ']' (Slurm rejects this too)")
    # texts[i] precedes groups[i]; texts[-1] follows the last group.
    last = _numbers(groups[-1])
    rest = [_numbers(group) for group in groups[:-1]]
    hosts: List[str] = []
    for combo in _outer_combinations(rest):
        head = "".join(t + n for t, n in zip(texts, combo))
        for number in last:
            hosts.append(head + texts[len(rest)] + number + texts[-1])
    return hosts


def _outer_combinations(groups: List[List[str]]) -> List[List[str]]:
    """All choices from ``groups`` with the left-most group varying fastest (Slurm's order)."""
    combos: List[List[str]] = [[]]
    for group in groups:
        # Each new group to the right becomes the slower, outer loop.
        combos = [combo + [number] for number in group for combo in combos]
    return combos


def _parse_name(item: str, expr: str) -> Tuple[List[str], List[_Group]]:
    texts: List[str] = []
    groups: List[_Group] = []
    pos = 0
    while True:
        open_at = item.find("[", pos)
        if open_at < 0:
            texts.append(item[pos:])
            return texts, groups
        close_at = item.find("]", open_at)
        # _split_items already checked the brackets balance, so close_at is found.
        texts.append(item[pos:open_at])
        groups.append(_parse_group(item[open_at + 1:close_at], item, expr))
        pos = close_at + 1


def _parse_group(body: str, item: str, expr: str) -> _Group:
    if not body.strip():
        raise TorchmnValueError(f"empty brackets '[]' in {item!r} of hostlist {expr!r}")
    if any(ch.isspace() for ch in body):
        # Slurm mis-reads these ("[1, 2]" gives "1" and "02"), so refuse rather than guess.
        raise TorchmnValueError(f"whitespace inside '[{body}]' of hostlist {expr!r}; write '[1,2]', not '[1, 2]'")
    ranges: _Group = []
    count = 0
    for part in body.split(","):
        if not part:
            raise TorchmnValueError(f"empty range (two commas in a row, or a trailing comma) in '[{body}]' "
                                    f"of hostlist {expr!r}")
        lo_text, _, hi_text = part.partition("-")
        # "3-" means just 3, as in Slurm.
        if not _NUMBER.fullmatch(lo_text) or (hi_text and not _NUMBER.fullmatch(hi_text)):
            raise TorchmnValueError(f"invalid range {part!r} in '[{body}]' of hostlist {expr!r}: "
                                    f"expected a number or 'lo-hi' with non-negative integers")
        lo = int(lo_text)
        hi = int(hi_text) if hi_text else lo
        if lo > hi:
            raise TorchmnValueError(f"range {part!r} in hostlist {expr!r} goes downwards "
                                    f"({lo} > {hi}); write it as '{hi:0{len(lo_text)}d}-{lo_text}'")
        if hi - lo + 1 > MAX_RANGE:
            raise TorchmnValueError(f"range {part!r} in hostlist {expr!r} has {hi - lo + 1} hosts, "
                                    f"more than the {MAX_RANGE} Slurm allows")
        count += hi - lo + 1
        if count > MAX_HOSTS:
            raise TorchmnValueError(f"'[{body}]' in hostlist {expr!r} holds more than {MAX_HOSTS} numbers")
        ranges.append((lo, hi, len(lo_text)))
    return ranges
