"""Every kernel's arguments as `launchers.Kernel` packs them: `SIGNATURES[name]`, one letter per argument in the
kernel's parameter order (p a pointer, i an int32, f a float32; tests/core/test_launchers.py checks them against
kernels_cu/)."""

SIGNATURES = {  # argument kinds in order: p pointer, i int32, f float32
    "table_act": "pp",
    "table_bf16": "ppppp",
    "norm_modulate_bf16": "ppppppifii",
    "norm_modulate_rowwise_bf16": "ppppppifii",
    "norm_modulate_warp_bf16": "ppppppifii",
    "norm_modulate_bwd_bf16": "ppppppppiiii",
    "norm_modulate_bwd_sorted_bf16": "pppppppppiiii",
    "norm_modulate_bwd_residual_sorted_bf16": "ppppppppppiiii",
    "reduce_partials_bf16": "pppppppiii",
    "reduce_partials_sorted_bf16": "ppppppppiiii",
    "row_order": "pppi",
    "row_order_count": "ppiii",
    "row_order_scan": "ppii",
    "row_order_scatter": "pppiii",
    "table_bwd_bf16": "pppppp",
    "table_bwd_d_weight_bf16": "pppppp",
    "table_bwd_dact_bf16": "pppppp",
    "table_bwd_mma_terms": "pppp",
    "table_bwd_mma_d_weight": "pp",
    "table_bwd_mma_dact": "ppp",
    "table_bwd_reduce": "pppi",
    "gated_residual_fwd_bf16": "pppppiii",
    "gated_residual_bwd_sorted_bf16": "pppppppiiii",
    "gated_residual_reduce_sorted": "pppiii",
    "gated_residual_norm_bf16": "pppppppppiifi",
    "exact_sums_bf16": "pppppppiii",
    "exact_carry": "pi",
    "norm_modulate_bwd_exact_bf16": "pppppppppiiii",
}
