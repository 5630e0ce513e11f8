"""dsv4: DeepSeek-V4 harness. Subpackages: dsv4.model, dsv4.kernels, dsv4.harness, dsv4.slices."""
