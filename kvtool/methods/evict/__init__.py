"""Token eviction: which (sequence, KV head) tokens the cache keeps (StreamingLLM, H2O, SnapKV, VATP, KNorm, FastGen, TOVA, ChunkKV, CAKE, PyramidInfer, RocketKV)."""
