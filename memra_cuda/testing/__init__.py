"""What users test their own kernels against and the demo decodes with: the kernels' contracts as
numpy (reference, reference_tree), Philox, and the toy model (testing.toy)."""
