"""GPU verifier worker: target model, tree attention, CUDA tree-verify kernels (torch reference on CPU)."""
