"""Low-precision training (extension slice X1): exact FP8 / MXFP4 quantisers (kernels/quant/: the
reference naive.py and the fused Triton FP8 quantiser), an FP8 linear layer, MXFP4 QAT of
the routed experts, the precision recipe that selects them, and the FP4 QK path of the CSA indexer
(kernels/indexer/fp4.py). Applied from outside by `apply_precision_recipe(model, recipe)`."""
