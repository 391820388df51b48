"""A shape mismatch between two arguments names both, with their shapes, and says which one fixes the size: H is
x's last dimension, S its second-to-last, D temb's, N weight's rows (the block ops and modulation_table; the
final_adaln_out cases are in test_final_adaln_out_bad_inputs.py)."""

import re

import pytest
import torch

from adaln_lab import gated_residual, gated_residual_norm, modulated_rms_norm, modulation_table

S, H, R = 5, 16, 6


def _rows(h=H, s=S):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, s, h, generator=g).to(torch.bfloat16)
    norm_weight = torch.ones(H, dtype=torch.bfloat16)
    shift, scale, gate = torch.randn(3, R, H, generator=g).to(torch.bfloat16).unbind(0)
    return x, norm_weight, shift, scale, gate, torch.arange(S) % R


def _raises(match, fn, *args):
    with pytest.raises(ValueError, match=f"^{re.escape(match)}$"):
        fn(*args)


def test_x_with_the_wrong_last_dimension_names_x_and_the_table():
    x, norm_weight, shift, scale, gate, row_index = _rows(h=H - 1)
    _raises(f"modulated_rms_norm needs shift of shape (R, H), H = {H - 1} being x's last dimension (x has shape "
            f"(2, {S}, {H - 1})), got shift ({R}, {H})", modulated_rms_norm, x, norm_weight, shift, scale, row_index)
    _raises(f"gated_residual needs gate of shape (R, H), H = {H - 1} being x's last dimension (x has shape "
            f"(2, {S}, {H - 1})), got gate ({R}, {H})", gated_residual, x, gate, x, row_index)


def test_norm_weight_and_row_index_say_where_h_and_s_come_from():
    x, norm_weight, shift, scale, gate, row_index = _rows()
    _raises(f"modulated_rms_norm needs norm_weight of shape (H,) = ({H},), H = {H} being x's last dimension (x has "
            f"shape (2, {S}, {H})), got ({H - 1},)", modulated_rms_norm, x, norm_weight[:-1], shift, scale, row_index)
    _raises(f"modulated_rms_norm needs row_index of shape (S,) = ({S},), S = {S} being x's second-to-last dimension "
            f"(x has shape (2, {S}, {H})), got ({S - 1},)", modulated_rms_norm, x, norm_weight, shift, scale,
            row_index[:-1])


def test_tables_of_different_rows_are_all_named_with_their_shapes():
    x, norm_weight, shift, scale, gate, row_index = _rows()
    _raises(f"modulated_rms_norm needs shift, scale of one shape (R, H), got shift ({R}, {H}), scale ({R - 1}, {H})",
            modulated_rms_norm, x, norm_weight, shift, scale[:-1], row_index)
    _raises(f"gated_residual_norm needs gate, shift, scale of one shape (R, H), got gate ({R - 1}, {H}), shift "
            f"({R}, {H}), scale ({R}, {H})", gated_residual_norm, x, gate[:-1], x, norm_weight, shift, scale,
            row_index)


def test_modulation_table_names_the_two_arguments_that_disagree():
    temb, weight, bias = torch.randn(3, 8), torch.randn(12, 8), torch.randn(12)
    _raises("modulation_table: temb has D = 7 (shape (3, 7)) but weight has D = 8 (shape (12, 8)): temb (T, D) and "
            "weight (N, D) disagree", modulation_table, temb[:, :-1], weight, bias)
    _raises("modulation_table: bias has N = 11 (shape (11,)) but weight has N = 12 rows (shape (12, 8)): bias (N,) "
            "and weight (N, D) disagree", modulation_table, temb, weight, bias[:-1])
