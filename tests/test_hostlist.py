"""expand_hostlist against outputs of `scontrol show hostnames` from Slurm 22.05.8."""
import tracemalloc

import pytest

from torchmn.environments import expand_hostlist

# Expected values were taken from `scontrol show hostnames EXPR` (Slurm 22.05.8, Debian 12).
CASES = [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[001-5]", ["node001", "node002", "node003", "node004", "node005"]),
    ("node[01-02]", ["node01", "node02"]),
    ("n[08-011]", ["n08", "n09", "n10", "n11"]),
    ("n[1-010]", ["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10"]),
    ("tux2,tux1,tux2", ["tux2", "tux1", "tux2"]),
    ("n[1-3,7,10-11]", ["n1", "n2", "n3", "n7", "n10", "n11"]),
    ("n[1-2],m[3-4]", ["n1", "n2", "m3", "m4"]),
    ("n[1-2],n[1-2]", ["n1", "n2", "n1", "n2"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("node[1-3]-ib[1-2]",
     ["node1-ib1", "node1-ib2", "node2-ib1", "node2-ib2", "node3-ib1", "node3-ib2"]),
    ("a[1-2]b[3-4]c[5-6]",
     ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
    ("a[1-2]b[1-2]c[1-2]d[1-2]",
     ["a1b1c1d1", "a1b1c1d2", "a2b1c1d1", "a2b1c1d2", "a1b2c1d1", "a1b2c1d2", "a2b2c1d1", "a2b2c1d2",
      "a1b1c2d1", "a1b1c2d2", "a2b1c2d1", "a2b1c2d2", "a1b2c2d1", "a1b2c2d2", "a2b2c2d1", "a2b2c2d2"]),
    ("a[1-2][3-4]", ["a13", "a14", "a23", "a24"]),
    ("n[1-2]x[3]", ["n1x3", "n2x3"]),
    ("n[1-]", ["n1"]),
    ("a, b", ["a", "b"]),
    ("  a ,b  ", ["a", "b"]),
    ("a,,b", ["a", "b"]),
    ("a b", ["a", "b"]),
    ("c1-[001-2],login", ["c1-001", "c1-002", "login"]),
    ("node[7]", ["node7"]),
    ("host.example.com", ["host.example.com"]),
]


@pytest.mark.parametrize("expr, expected", CASES)
def test_expand_hostlist_matches_scontrol(expr, expected):
    assert expand_hostlist(expr) == expected


ERRORS = [
    ("node[3-1]", "goes downwards"),
    ("node[010-8]", "write it as '008-010'"),  # the width of its first number, as Slurm pads
    ("node[]", "empty brackets"),
    ("node[1-2", "unbalanced"),
    ("node[1,,2]", "empty range"),
    ("n[1,]", "empty range"),
    ("node[a-b]", "invalid range 'a-b'"),
    ("n[-1]", "invalid range '-1'"),
    ("", "empty hostlist"),
    ("   ", "empty hostlist"),
    (",", "no host names"),
    ("node[1-2]-ib", "after the last ']'"),
    ("a]b", "without a matching '['"),
    ("a[1-[2]]", "nested"),
    ("x[1, 2]", "whitespace inside"),
    ("n[1-100000]", "more than"),
]


@pytest.mark.parametrize("expr, fragment", ERRORS)
def test_expand_hostlist_errors_name_the_problem_and_quote_the_expression(expr, fragment):
    with pytest.raises(ValueError) as info:
        expand_hostlist(expr)
    message = str(info.value)
    assert fragment in message
    assert repr(expr) in message


def test_expand_hostlist_rejects_non_strings():
    with pytest.raises(TypeError):
        expand_hostlist(["node1"])


def test_expressions_that_multiply_past_the_limit_fail_quickly():
    """Each range is within Slurm's 65536, but the groups multiply (scontrol refuses these too). They
    are refused before any name is made: the refusal's memory, not its time, is what a loaded
    machine cannot blur (a million names would take some 60 MB)."""
    for expr in ("a[1-60000]b[1-60000]", "n[" + ",".join(["1-60000"] * 40) + "]"):
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match="more than 1048576"):
                expand_hostlist(expr)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (expr[:30], peak)
    assert len(expand_hostlist("r[1-100]n[1-100]")) == 10000
