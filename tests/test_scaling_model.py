"""The alpha-beta scaling model of bench/multinode/model.py: its fit recovers a known synthetic
table, and its predictions have the shape the formulas promise."""
import sys

import pytest
from jobs import REPO

sys.path.insert(0, str(REPO / "bench" / "multinode"))
import model  # noqa: E402

SIZES = [0.1e6, 1e6, 7.2e6, 64e6]


@pytest.mark.parametrize("alpha,beta", [(40e-6, 8 / 100e6), (25e-6, 8 / 1e9), (15e-6, 8 / 10e9)],
                         ids=["100mbit", "1gbit", "10gbit"])
def test_fit_recovers_a_synthetic_alpha_beta_table(alpha, beta):
    truth = model.Link(alpha, beta)
    rows = [(n, nodes, 1, model.ring(n, nodes, 1, truth)) for n in SIZES for nodes in (2, 3, 4)]
    fitted = model.fit(rows)
    assert fitted.alpha == pytest.approx(alpha, rel=1e-9) and fitted.beta == pytest.approx(beta, rel=1e-9), fitted


def test_fit_recovers_the_memory_term_of_hierarchical_rows():
    link = model.Link(30e-6, 8 / 1e9)
    rows = [(n, 2, k, model.hierarchical(n, 2, k, link, mu=0.25e-9)) for n in SIZES for k in (2, 4)]
    assert model.fit_memory(rows, link) == pytest.approx(0.25e-9, rel=1e-9)


def test_fit_refuses_rows_that_cannot_tell_alpha_from_beta():
    with pytest.raises(ValueError, match="at least two rows of different message sizes"):
        model.fit([(1e6, 2, 1, 0.01), (1e6, 2, 1, 0.011)])


def test_a_flat_ring_pays_latency_per_rank_and_hierarchical_per_node():
    """At 1,024 nodes of 8 ranks both send the same bytes over each link, but the flat ring waits
    for 2(p-1) messages in turn: hierarchical keeps a small model's averaging far cheaper."""
    link = model.Link(model.ALPHA_AT_SCALE, 8 / 25e9)
    n = 7.2e6
    flat, hier = (model.ALGORITHMS[a](n, 1024, 8, link, 1e-11) for a in ("ring", "hierarchical"))
    assert flat > 5 * hier, (flat, hier)
    table = model.predictions([25.0])
    for name in model.WORKLOADS:
        effs = table[(name, 25.0, "hierarchical")]
        assert all(0 < e <= 1 for e in effs) and all(b <= a + 1e-12 for a, b in zip(effs, effs[1:])), (name, effs)
