"""The one-rank model of benchmarks/bench_rank.py (what bench_layer holds a real mesh
against): the variant it names as the table's is the one the kernel path launches, and the
model adds that variant's NVLink transfer."""

import math

import pytest

from benchmarks import bench_rank
from jax_kimik3.config import KIMI_K3
from jax_kimik3.kernels import oproj


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_the_table_choice_is_timed_as_the_kernel_path_launches_it(tp):
    k = KIMI_K3.o_proj_in_features // tp
    for b in range(1, KIMI_K3.mailbox_capacity + 1):
        name = bench_rank.table_choice(b, k, tp)
        assert name in bench_rank.VARIANTS, (b, name)
        choice = oproj.choose(b, k, tp, ahead=False)
        assert bench_rank.tail_arguments(name) == (choice.variant, choice.two_shot), (b, name)


@pytest.mark.parametrize("table, want", [("split", 9.0 + 1.5), ("two_shot", 12.0 + 0.25),
                                         ("xla_two_shot", math.nan)])
def test_the_model_adds_the_table_variants_nvlink_time(table, want):
    row = dict(table=table, split_us=9.0, two_shot_us=12.0, nvlink_one_shot_us=1.5,
               nvlink_two_shot_us=0.25)
    assert bench_rank.model_us(row) == pytest.approx(want, nan_ok=True)
