"""Shared test configs for the pipeline planner."""

# DeepSeek-V4.1-Flash sharing fields (40 decoder layers), as published.
V41_FLASH = {
    "num_hidden_layers": 40,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "engram_layer_ids": [1, 14],
}
