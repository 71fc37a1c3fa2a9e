"""What the kernels are checked against: float64 references, the same-precision references with
FlashAttention's rounding points, and the seeded fuzzer."""
