"""Weights kept in GGML's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
and their products on the CPU: the formats as data (`formats`), blocks decoded (`blocks`),
the few-row product from the blocks (`dots`, `vectors`), a layer's weight (`weight`), and the
quantizer for float checkpoints (`quantize`)."""
