"""The memory and FLOP models of paper 000 App. E against the paper's numbers and hand counts."""

import pytest

from dpsgd.cost import flop_model, memory_model


def test_flop_ratios_quoted_in_the_paper():
    b, t, d, p, k = 2, 4096, 2048, 2048, 32
    rc = flop_model("rc", b, t, d, p, k)["total"]
    assert flop_model("gc", b, t, d, p, k)["total"] / rc == pytest.approx(128, rel=0.01)
    assert flop_model("fgc", b, t, d, p, k)["total"] / rc == pytest.approx(32, rel=0.01)


def test_flop_totals_are_sums_of_the_table_columns():
    for method in ("fgc", "gc", "rc"):
        f = flop_model(method, 3, 17, 5, 7, 4)
        assert f["total"] == f["mul"] + f["add"]
    # FGC and GC match the table's exact column; RC's exact column drops a factor 2 on Bk(d - T)
    b, t, d, p, k = 3, 17, 5, 7, 4
    assert flop_model("fgc", b, t, d, p, k)["total"] == b * p * d * (2 * t - 1)
    assert flop_model("gc", b, t, d, p, k)["total"] == 2 * b * t * t * (p + d) - b
    assert flop_model("rc", b, t, d, p, k)["total"] == 2 * b * t * k * (p + d) + 2 * b * k * (d - t) - b


def test_hand_count_of_hutchinson_flops():
    """G P: BT x p x k mults; A^T (GP): B x d x T x k mults; the squared norm: Bdk mults."""
    b, t, d, p, k = 2, 5, 3, 4, 2
    assert flop_model("rc", b, t, d, p, k)["mul"] == b * t * p * k + b * d * t * k + b * d * k


def test_memory_table_regimes():
    # Table 7 regime A-I (p = 8192, d = 2048, B = 2, k = 32): RC wins over the best of FGC and GC for 379 < T < 8192
    def winner(t):
        rc = memory_model("rc", 2, t, 2048, 8192)["overhead"]
        mixed = min(memory_model("fgc", 2, t, 2048, 8192)["overhead"], memory_model("gc", 2, t, 2048, 8192)["overhead"])
        return rc < mixed
    assert not winner(256) and winner(512) and winner(4096)
    assert memory_model("gc", 2, 10, 3, 4, delete_backprops=False)["overhead"] == 2 * 2 * 100
    assert memory_model("fgc", 2, 10, 3, 4)["overhead"] == 2 * 3 * 4


@pytest.mark.parametrize("args, match", [(("jl", 1, 1, 1, 1), "method"), (("rc", 0, 1, 1, 1), "batch"),
                                         (("gc", 1, 1, 1, 1.5), "p must be")])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        memory_model(*args)
