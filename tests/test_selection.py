"""Per neuron, the k inputs with the largest |w| are selected, deterministically and compactly."""

from __future__ import annotations

import torch

from peft_neuroada.selection import index_dtype, select_top_magnitude


def test_selects_the_k_largest_magnitudes_of_each_row_in_ascending_column_order():
    weight = torch.tensor([[0.1, -5.0, 3.0, 0.2], [4.0, 0.0, -0.5, -4.5]])
    assert select_top_magnitude(weight, 2).tolist() == [[1, 2], [0, 3]]


def test_ties_are_broken_towards_the_lower_column_index():
    weight = torch.tensor([[1.0, -2.0, 2.0, 2.0, -2.0, 0.5]])
    assert select_top_magnitude(weight, 2).tolist() == [[1, 2]]
    assert select_top_magnitude(weight.to(torch.bfloat16), 3).tolist() == [[1, 2, 3]]


def test_selection_matches_a_full_sort_on_a_real_sized_matrix():
    torch.manual_seed(0)
    weight = torch.randn(1536, 576).to(torch.bfloat16)
    selected = select_top_magnitude(weight, 20)
    full_sort = weight.abs().sort(dim=1, descending=True, stable=True).indices[:, :20].sort(dim=1).values
    assert torch.equal(selected.long(), full_sort)


def test_indices_use_int16_when_every_column_fits_else_int32():
    assert index_dtype(32768) == torch.int16
    assert index_dtype(32769) == torch.int32
    assert select_top_magnitude(torch.randn(3, 40000), 1).dtype == torch.int32
