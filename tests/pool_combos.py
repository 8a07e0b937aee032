"""Every (pool kind, layout, IO backend) the host pools support, for the CPU and CUDA round-trip tests."""

COMBOS = [
    ("asym", "page_first", "kernel"),
    ("asym", "page_first_direct", "direct"),
    ("sym", "layer_first", "kernel"),
    ("sym", "layer_first", "direct"),
    ("sym", "page_first", "kernel"),
    ("sym", "page_first_direct", "direct"),
]
