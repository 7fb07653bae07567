"""FP8 matmuls: the formats and _scaled_mm's rules (formats.py), which matmuls may run in FP8 (sites.py), and
the variants a matmul's strategy may take with their costs (variants.py). The passes use them through
passes/fp8_variants.py; codegen lowers an FP8 variant in autopar/codegen/fp8.py."""
