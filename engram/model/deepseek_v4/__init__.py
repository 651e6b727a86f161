"""The DeepSeek-V4 backbone (shared-KV MQA with compressed sparse / heavily compressed attention, mHC streams, MoE in
every layer), single-device and plain, with Engram layers as in V4.1. Read in this order: config, rope, mhc, moe,
compressor, indexer, attention, cache, decoder, checkpoint."""
